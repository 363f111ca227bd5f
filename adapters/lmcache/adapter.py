"""``KDNL2Adapter``: LMCache's L2 (``L2AdapterInterface``, multiprocess mode) on the KDN.

LMCache loads it with ``--l2-adapter '{"type": "plugin", "module_path": "kdn.adapters.lmcache", "class_name":
"KDNL2Adapter", "adapter_params": {...}}'`` (settings: ``config.py``); its store and prefetch controllers call
it from their threads. Every task runs on one asyncio loop of the adapter's own (``LoopThread``), bounded by the
``timeout`` setting; on completion its result is kept and the task's event fd signalled, as the interface asks.

Rules:

1. An ``ObjectKey`` becomes an address in the writing tenant's namespace (``keys.chunk_address``), never an
   address itself.
2. Writes go to the origin's authenticated ingest (``PUT /v1/objects/{address}``, ``kdn.origin.ingest``) with
   the tenant's token and the address's preimage: the origin checks the token's ``publish`` grant on the
   namespace and that the address is that key's, stores the blob and signs its record. A chunk is one KDN object
   whose tensors are the memory object's groups as LMCache laid them out, named by LMCache's memory format.
3. Reads go through the region's edges with ``KDNClient``: the record first (its digest), then the body,
   verified against it; then the object's own header must name this address, model and namespace, and its
   tensors the destination's names, shapes and dtypes. Anything else -- no record, no source, a digest or header
   that does not match, a timeout -- is a miss (a 0 in the task's bitmap), counted in ``counts``: LMCache
   recomputes, it never loads a wrong byte.
4. Lookup takes no lock: the origin keeps what it was given (an edge that evicted a chunk fills it again), so
   a chunk found stays loadable. ``delete`` is refused (logged, counted): KDN's capacity is the edges' eviction
   and the origin operator's, not one engine's; LMCache's global eviction is off for this adapter (no capacity
   is declared).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kdn.adapters.ingest import KEPT
from kdn.adapters.keyed import MISSES, engine_version
from kdn.adapters.lmcache.config import AdapterSettings
from kdn.adapters.lmcache.keys import SCHEME, derived_model_id, key_text, shard_of
from kdn.adapters.keyed import keyed_address
from kdn.adapters.vllm.bridge import LoopThread
from kdn.errors import InvalidInput, KDNError
from kdn.format.address import Address, ModelId
from kdn.format.objects import ObjectView, encode_object, from_torch, to_torch

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import ObjectRecord

log = logging.getLogger("kdn.adapters.lmcache")


def tensors_of(obj: MemoryObj) -> dict[str, torch.Tensor]:
    """A memory object's tensors as LMCache laid them out (views, no copy), named by its memory format:
    ``kv_2ltd`` for one group, ``kv_2ltd.0``, ``kv_2ltd.1``, ... for several."""
    fmt = obj.get_memory_format().name.lower()
    shapes = getattr(obj.metadata, "shapes", None)
    if shapes:
        ts = [obj.get_tensor(i) for i in range(len(shapes))]
    else:
        ts = [obj.tensor]
    if any(t is None for t in ts):
        raise InvalidInput("an invalidated LMCache memory object")
    if len(ts) == 1:
        return {fmt: ts[0]}
    return {f"{fmt}.{i}": t for i, t in enumerate(ts)}


def _tokens(obj: MemoryObj) -> int:
    try:
        return max(1, int(obj.get_num_tokens()))
    except Exception:  # noqa: BLE001 -- a format without a token dimension: one chunk, its span in LMCache's key
        return 1


class KDNL2Adapter(L2AdapterInterface):
    """LMCache's L2 on KDN edges (reads) and an origin's ingest (writes)."""

    def __init__(self, params: dict[str, Any] | None = None, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)  # no global eviction: KDN's capacity is the edges'
        self.cfg = AdapterSettings.from_params(params)
        self.counts: Counter[str] = Counter()  # hits, misses, refused, stored, store_failed, ... (this process)
        self.engine = engine_version("lmcache")
        self._ids = 0
        self._lock = threading.Lock()
        self._stored: dict[L2TaskId, L2StoreResult] = {}
        self._looked: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        self._model_ids: dict[str, ModelId] = {}
        self._store_fd, self._lookup_fd, self._load_fd = (create_event_notifier() for _ in range(3))
        self.loop = LoopThread("kdn-lmcache")
        self.client, self.ingest = self.loop.run(self._open(), self.cfg.timeout)

    async def _open(self):
        from kdn.adapters.ingest import IngestClient
        from kdn.auth import read_token
        from kdn.client import KDNClient

        token = read_token(self.cfg.token_file)
        client = KDNClient(edges=list(self.cfg.edges), origin=self.cfg.origin, token=token, ca=self.cfg.ca,
                           trusted_keys=self.cfg.trusted_keys, timeout=self.cfg.timeout)
        ingest = None
        if self.cfg.ingest:
            ingest = IngestClient(self.cfg.ingest, token, engine=self.engine, ca=self.cfg.ca, timeout=self.cfg.timeout,
                                  log=log)
        return client, ingest

    def close(self) -> None:
        async def cleanup() -> None:
            await self.client.close()
            if self.ingest is not None:
                await self.ingest.close()

        self.loop.close(cleanup)
        for fd in (self._store_fd, self._lookup_fd, self._load_fd):
            fd.close()

    # --- the interface's bookkeeping -------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_fd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_fd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_fd.fileno()

    def _next_id(self) -> L2TaskId:
        with self._lock:
            self._ids += 1
            return self._ids

    def _start(self, coro, done) -> None:
        """Run ``coro`` on the adapter's loop within the timeout; ``done(result or None)`` when it ends."""
        async def task() -> None:
            try:
                result = await asyncio.wait_for(coro, self.cfg.timeout)
            except (TimeoutError, asyncio.TimeoutError):
                self.counts["timeouts"] += 1
                result = None
            except Exception as e:  # noqa: BLE001 -- a task that fails is a failed store or all misses, said once
                self.counts["errors"] += 1
                log.warning("KDN L2 task failed: %s", str(e) or type(e).__name__)
                result = None
            done(result)

        self.loop.submit(task())

    def report_status(self) -> dict:
        return {"is_healthy": True, "type": "KDNL2Adapter", "namespace": self.cfg.namespace,
                "writes": bool(self.cfg.ingest), **{f"kdn_{k}": v for k, v in sorted(self.counts.items())}}

    # --- keys ----------------------------------------------------------------------------------------------

    def model_id_of(self, key: ObjectKey) -> ModelId:
        if self.cfg.model_id:
            return ModelId(self.cfg.model_id)
        mid = self._model_ids.get(key.model_name)
        if mid is None:
            mid = self._model_ids[key.model_name] = derived_model_id(key.model_name)
        return mid

    def _preimage(self, key: ObjectKey) -> tuple[ModelId, str, str, Address]:
        mid = self.model_id_of(key)
        shard, text = shard_of(key.kv_rank, key.object_group_id), key_text(key.chunk_hash, key.cache_salt)
        return mid, shard, text, keyed_address(SCHEME, mid, self.cfg.namespace, shard, text)

    def address_of(self, key: ObjectKey) -> Address:
        return self._preimage(key)[3]

    # --- store: the origin's ingest ---------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._next_id()
        assert len(keys) == len(objects), "one memory object per key"

        def done(result: tuple[list[ObjectKey], list[int]] | None) -> None:
            ok = result is not None and len(result[0]) == len(keys)
            if not ok:
                self.counts["store_failed"] += len(keys) - (len(result[0]) if result else 0)
            with self._lock:
                self._stored[task_id] = L2StoreResult(ok, sum(result[1]) if result else 0)
            if result and result[0]:
                self._notify_keys_stored(*result)
            self._store_fd.notify()

        self._start(self._store(keys, objects), done)
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            out, self._stored = self._stored, {}
        return out

    async def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> tuple[list[ObjectKey], list[int]]:
        if self.ingest is None:
            if not self.counts["read_only"]:
                log.warning("the KDN L2 adapter has no 'ingest' origin: it only reads, and LMCache's stores fail")
            self.counts["read_only"] += len(keys)
            return [], []
        sent = await asyncio.gather(*(self._put(k, o) for k, o in zip(keys, objects)))
        kept = [(k, obj.get_size()) for k, obj, ok in zip(keys, objects, sent) if ok]
        return [k for k, _ in kept], [n for _, n in kept]

    def _encode(self, key: ObjectKey, obj: MemoryObj) -> tuple[tuple[ModelId, str, str, Address], bytes]:
        pre = self._preimage(key)
        mid, _, _, address = pre
        raw = from_torch({n: t.contiguous() for n, t in tensors_of(obj).items()})
        blob = encode_object(kind="kv", address=address, model_id=mid, namespace=self.cfg.namespace, start=0,
                             end=_tokens(obj), position=0, parent=None, tensors=raw, encoding=self.cfg.encoding)
        return pre, blob

    async def _put(self, key: ObjectKey, obj: MemoryObj) -> bool:
        assert self.ingest is not None
        try:
            (_, shard, text, address), blob = await asyncio.to_thread(self._encode, key, obj)
        except KDNError as e:
            self.counts["refused"] += 1
            log.warning("LMCache chunk not stored: %s", e)
            return False
        outcome = await self.ingest.put(address, self.cfg.encoding, blob, scheme=SCHEME, shard=shard, key=text)
        self.counts[outcome] += 1
        return outcome in KEPT

    # --- lookup: a record through the edges --------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc] | None = None) -> L2TaskId:
        task_id = self._next_id()

        def done(found: list[bool] | None) -> None:
            bitmap = Bitmap(len(keys))
            for i, hit in enumerate(found or ()):
                if hit:
                    bitmap.set(i)
            with self._lock:
                self._looked[task_id] = bitmap
            self._lookup_fd.notify()

        self._start(self._lookup(keys), done)
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None  # nothing was locked: the origin keeps what it was given

    async def _record(self, address: Address) -> ObjectRecord | None:
        try:
            return await self.client.record(address)
        except MISSES as e:
            self.counts["errors"] += 1
            log.info("KDN record of %s: %s", address[:16], str(e) or type(e).__name__)
            return None

    async def _lookup(self, keys: list[ObjectKey]) -> list[bool]:
        addrs = [self.address_of(k) for k in keys]
        recs = await asyncio.gather(*(self._record(a) for a in addrs))
        return [bool(r and r.encodings) for r in recs]

    # --- load: record, verified body, checked header, copy -------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = self._next_id()
        assert len(keys) == len(objects), "one memory object per key"

        def done(loaded: list[bool] | None) -> None:
            bitmap = Bitmap(len(keys))
            got = loaded or [False] * len(keys)
            for i, hit in enumerate(got):
                if hit:
                    bitmap.set(i)
            self.counts["hits"] += sum(got)
            self.counts["misses"] += len(keys) - sum(got)
            hits = [k for k, hit in zip(keys, got) if hit]
            if hits:
                self._notify_keys_accessed(hits)
            with self._lock:
                self._loaded[task_id] = bitmap
            self._load_fd.notify()

        self._start(self._load(keys, objects), done)
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    async def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> list[bool]:
        return list(await asyncio.gather(*(self._load_one(k, o) for k, o in zip(keys, objects))))

    async def _load_one(self, key: ObjectKey, obj: MemoryObj) -> bool:
        mid, address = self.model_id_of(key), self.address_of(key)
        rec = await self._record(address)
        encs = rec.encodings if rec is not None else {}
        enc = self.cfg.encoding if self.cfg.encoding in encs else next((e for e in ("raw", "zstd") if e in encs), None)
        if enc is None:
            return False
        e = encs[enc]
        try:
            blob = (await self.client.fetch(address, encoding=enc, digest=e.digest, size=e.size,
                                            pieces=e.piece_list)).blob
        except MISSES as err:
            self.counts["errors"] += 1
            log.info("KDN fetch of %s: %s", address[:16], str(err) or type(err).__name__)
            return False
        return await asyncio.to_thread(self._place, mid, address, blob, obj)

    def _place(self, mid: ModelId, address: Address, blob, obj: MemoryObj) -> bool:
        """Copy the chunk in ``blob`` into ``obj`` if its header names this chunk of this model in this namespace
        and its tensors are the destination's names, shapes and dtypes; else False (counted as ``refused``)."""
        dst = tensors_of(obj)
        try:
            view = ObjectView(blob, max_decoded=sum(t.numel() * t.element_size() for t in dst.values()))
            h = view.header
            if (h.address, h.model_id, h.namespace, h.kind) != (address, mid, self.cfg.namespace, "kv"):
                raise InvalidInput("its header names another chunk")
            src = to_torch(view.decode())
        except KDNError as e:
            self.counts["refused"] += 1
            log.warning("KDN chunk %s refused: %s", address[:16], e)
            return False
        if set(src) != set(dst) or any(src[n].dtype != t.dtype or src[n].shape != t.shape for n, t in dst.items()):
            self.counts["refused"] += 1
            log.warning("KDN chunk %s refused: its tensors %s are not this memory object's %s", address[:16],
                        {n: (str(t.dtype), list(t.shape)) for n, t in src.items()},
                        {n: (str(t.dtype), list(t.shape)) for n, t in dst.items()})
            return False
        for n, t in dst.items():
            t.copy_(src[n])
        return True

    # --- delete: refused -----------------------------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Refused: the origin keeps what it was given, and edges evict by their own policies. Logged and
        counted (``delete_refused``); the chunks stay readable."""
        if not self.counts["delete_refused"]:
            log.warning("the KDN L2 adapter does not delete (LMCache asked for %d chunks): KDN's capacity is the "
                        "edges' eviction and the origin operator's; the chunks stay", len(keys))
        self.counts["delete_refused"] += len(keys)
