"""``KDNHiCacheStorage``: SGLang HiCache's L3 (``HiCacheStorage``) on the KDN.

SGLang loads it with ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "kdn", "module_path": "kdn.adapters.sglang", "class_name": "KDNHiCacheStorage",
"interface_v1": 1, "edges": [...], ...}'`` (settings: ``config.py``) and calls it from its prefetch and backup
threads. Each call runs its network part on one asyncio loop of the backend's own (``LoopThread``) and waits for
it with the ``timeout`` setting; copies into and out of the host pool run on SGLang's thread.

Rules:

1. A page key becomes an address in the writing tenant's namespace (``keys.page_address``), never an address
   itself.
2. Reads go through the region's edges with ``KDNClient``: the record first (its digest), then the body,
   verified against it; then the object's own header must name this address, model, namespace and the pool's
   page geometry. Anything else -- no record, no source, a digest or header that does not match, a timeout --
   is a miss (``False``/``None``), counted in ``counts``: SGLang recomputes the page, it never loads a wrong byte.
3. Writes go, with ``ingest`` (recommended), to the origin's authenticated ingest (``PUT /v1/objects/{address}``,
   ``kdn.adapters.ingest``, the LMCache adapter's path) with the tenant's token and the address's preimage: the
   origin checks the token's ``publish`` grant on the namespace and that the address is that key's, stores the
   page and signs its record with who sent it. A page the origin refuses (a token without ``publish`` there, no
   answer in time) is not written (``False``), counted and logged, never raised; a page whose address already
   holds other bytes (a 409: never rewritten) counts as written, as the stored one is there. With ``store`` and
   ``registry`` instead (existing deployments), the page's object goes into the origin's store folder, blob
   first, then its record into the registry (signed with ``signing_key``): the path of vLLM's producer
   (``kdn.adapters.vllm.save``); the origin serves the blob once its bytes match that record. A blob already
   stored is never rewritten (edges may hold its digest). MLA ranks other than SGLang's writer store nothing.
4. Pages are stored layout-free (``pages.py``), so any host layout reads what any other wrote.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kdn.adapters.ingest import KEPT
from kdn.adapters.keyed import MISSES as _MISSES
from kdn.adapters.keyed import engine_version
from kdn.adapters.sglang.config import StorageSettings
from kdn.adapters.sglang.keys import SCHEME, derived_model_id, page_address, shard_of
from kdn.adapters.sglang.pages import PageGeometry, block_at, block_of_flat, geometry_of, tensors_of
from kdn.adapters.vllm.bridge import LoopThread
from kdn.errors import InvalidInput, KDNError
from kdn.format.address import Address, ModelId, blob_digest
from kdn.format.objects import ObjectView, encode_object, from_torch, to_torch
from kdn.format.pieces import PIECE_BYTES, piece_digests

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import ObjectRecord

log = logging.getLogger("kdn.adapters.sglang")

async def _each(fn, addrs: list[Address]) -> list:
    """``fn`` of every address at once (gathered on the backend's loop, where the coroutines must be made)."""
    return await asyncio.gather(*(fn(a) for a in addrs))


class KDNHiCacheStorage(HiCacheStorage):
    """HiCache's storage tier on KDN edges (reads) and an origin's ingest or store (writes)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.cfg = StorageSettings.from_extra(storage_config.extra_config)
        if storage_config.dcp_size > 1 or storage_config.should_split_heads:
            raise InvalidInput("the KDN storage backend does not split pages across DCP or heterogeneous TP ranks")
        self.sc = storage_config
        self.shard = shard_of(mla=storage_config.is_mla_model, tp_rank=storage_config.tp_rank,
                              tp_size=storage_config.tp_size, pp_rank=storage_config.pp_rank,
                              pp_size=storage_config.pp_size)
        self.geometry: PageGeometry | None = None
        self.model_id: ModelId | None = None
        self.counts: Counter[str] = Counter()  # hits, misses, refused, written, ... (one process, one backend)
        self.engine = engine_version("sglang")
        self.loop = LoopThread("kdn-sglang")
        self.client, self.ingest, self.registry = self.loop.run(self._open(), self.cfg.timeout)
        if self.registry is not None:
            from kdn.format.store import BlobDir

            assert self.cfg.store is not None
            self.store = BlobDir(self.cfg.store, fsync=True)

    async def _open(self):
        from kdn.auth import read_token
        from kdn.client import KDNClient

        token = read_token(self.cfg.token_file)
        client = KDNClient(edges=list(self.cfg.edges), origin=self.cfg.origin, token=token, ca=self.cfg.ca,
                           trusted_keys=self.cfg.trusted_keys, timeout=self.cfg.timeout)
        ingest = registry = None
        if self.cfg.ingest:
            from kdn.adapters.ingest import IngestClient

            ingest = IngestClient(self.cfg.ingest, token, engine=self.engine, ca=self.cfg.ca, timeout=self.cfg.timeout,
                                  log=log)
        elif self.cfg.writes:
            from kdn.registry import open_registry

            registry = open_registry(self.cfg.registry)
            if self.cfg.signing_key:
                from kdn.registry.signing import Signer

                registry.signer = Signer.load(self.cfg.signing_key)
        return client, ingest, registry

    def close(self) -> None:
        async def cleanup() -> None:
            await self.client.close()
            if self.ingest is not None:
                await self.ingest.close()
            if self.registry is not None:
                await self.registry.close()

        self.loop.close(cleanup)

    # --- the pool: its geometry names the pages ---------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        g = geometry_of(mem_pool_host, mla=self.sc.is_mla_model)
        dtype = str(g.dtype).removeprefix("torch.")
        self.geometry = g
        self.model_id = (ModelId(self.cfg.model_id) if self.cfg.model_id
                         else derived_model_id(self.sc.model_name, dtype, g.describe()))

    def _address(self, key: str) -> Address:
        assert self.model_id is not None, "register_mem_pool_host first: the pool's geometry names the pages"
        return page_address(self.model_id, self.cfg.namespace, self.shard, key)

    def _geometry(self) -> PageGeometry:
        assert self.geometry is not None, "register_mem_pool_host first"
        return self.geometry

    # --- reads ------------------------------------------------------------------------------------------------

    async def _record(self, address: Address) -> ObjectRecord | None:
        try:
            return await self.client.record(address)
        except _MISSES as e:
            self.counts["errors"] += 1
            log.info("KDN record of %s: %s", address[:16], str(e) or type(e).__name__)
            return None

    async def _body(self, address: Address) -> bytes | bytearray | memoryview | None:
        rec = await self._record(address)
        encs = rec.encodings if rec is not None else {}
        enc = self.cfg.encoding if self.cfg.encoding in encs else next((e for e in ("raw", "zstd") if e in encs), None)
        if enc is None:
            return None
        e = encs[enc]
        try:
            return (await self.client.fetch(address, encoding=enc, digest=e.digest, size=e.size,
                                            pieces=e.piece_list)).blob
        except _MISSES as err:
            self.counts["errors"] += 1
            log.info("KDN fetch of %s: %s", address[:16], str(err) or type(err).__name__)
            return None

    def _fetch(self, keys: list[str]) -> list[dict[str, torch.Tensor] | None]:
        """Each key's page tensors (``[L, P, H, D]`` each, on the CPU), checked; None for a miss."""
        g = self._geometry()
        addrs = [self._address(k) for k in keys]
        try:
            blobs = self.loop.run(_each(self._body, addrs), self.cfg.timeout)
        except TimeoutError:
            self.counts["timeouts"] += 1
            blobs = [None] * len(keys)
        out = [self._checked(g, a, b) if b is not None else None for a, b in zip(addrs, blobs)]
        self.counts["hits"] += sum(t is not None for t in out)
        self.counts["misses"] += sum(t is None for t in out)
        return out

    def _checked(self, g: PageGeometry, address: Address, blob) -> dict[str, torch.Tensor] | None:
        """The page in ``blob`` if its header names this page of this model in this namespace, in this
        geometry; else None (counted as ``refused``)."""
        per = g.layers * g.page_size * g.heads * g.width * g.dtype.itemsize
        try:
            view = ObjectView(blob, max_decoded=per * len(g.names))
            h = view.header
            if (h.address, h.model_id, h.namespace, h.kind) != (address, self.model_id, self.cfg.namespace, "kv"):
                raise InvalidInput("its header names another page")
            ts = to_torch(view.decode())
        except KDNError as e:
            self.counts["refused"] += 1
            log.warning("KDN page %s refused: %s", address[:16], e)
            return None
        if set(ts) != set(g.names) or any(t.dtype != g.dtype or tuple(t.shape) != g.shape for t in ts.values()):
            self.counts["refused"] += 1
            log.warning("KDN page %s refused: its tensors are not this pool's page geometry", address[:16])
            return None
        return ts

    @staticmethod
    def _place(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
        for name, t in src.items():
            dst[name].copy_(t)  # a strided copy into the pool's own order

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        g = self._geometry()
        assert host_indices.numel() == len(keys) * g.page_size, "one page of host indices per key"
        pages = self._fetch(keys)
        for i, page in enumerate(pages):
            if page is not None:
                self._place(tensors_of(g, block_at(self.mem_pool_host, g, int(host_indices[i * g.page_size]))), page)
        return [p is not None for p in pages]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """SGLang's copying path: each page into its flat ``target_location`` (the pool's order)."""
        g = self._geometry()
        out: list[torch.Tensor | None] = []
        for page, flat in zip(self._fetch(keys), target_locations):
            if page is not None:
                self._place(tensors_of(g, block_of_flat(g, flat)), page)
            out.append(flat if page is not None else None)
        return out

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys have a record (read through the edges, which cache records)."""
        addrs = [self._address(k) for k in keys]
        try:
            recs = self.loop.run(_each(self._record, addrs), self.cfg.timeout)
        except TimeoutError:
            self.counts["timeouts"] += 1
            return 0
        return next((i for i, r in enumerate(recs) if r is None), len(keys))

    # --- writes -----------------------------------------------------------------------------------------------

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        g = self._geometry()
        assert host_indices.numel() == len(keys) * g.page_size, "one page of host indices per key"
        pages = [tensors_of(g, block_at(self.mem_pool_host, g, int(host_indices[i * g.page_size])))
                 for i in range(len(keys))]
        return self._write(keys, pages)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """SGLang's copying path: each value a flat page in the pool's order (``get_data_page``)."""
        g = self._geometry()
        return all(self._write(keys, [tensors_of(g, block_of_flat(g, v.contiguous())) for v in values]))

    def _write(self, keys: list[str], pages: list[dict[str, torch.Tensor]]) -> list[bool]:
        if not self.cfg.writes:
            self.counts["read_only"] += len(keys)
            return [False] * len(keys)
        if not self.sc.is_storage_writer:
            return [True] * len(keys)  # an MLA replica: SGLang's writer rank stores the same bytes
        if self.ingest is not None:
            return self._send(keys, pages)
        return self._store(keys, pages)

    def _object(self, a: Address, page: dict[str, torch.Tensor]) -> bytes:
        """Page ``page`` as the KDN object at ``a``: its own span, ``start..end`` 0..page size (where it sits in its
        sequence is in SGLang's key, not here)."""
        assert self.model_id is not None
        raw = from_torch({n: t.contiguous() for n, t in page.items()})  # [L, P, H, D] each
        return encode_object(kind="kv", address=a, model_id=self.model_id, namespace=self.cfg.namespace, start=0,
                             end=self._geometry().page_size, position=0, parent=None, tensors=raw,
                             encoding=self.cfg.encoding)

    def _send(self, keys: list[str], pages: list[dict[str, torch.Tensor]]) -> list[bool]:
        """Each page through the origin's ingest, all at once; True for a page the origin holds now."""
        ingest = self.ingest
        assert ingest is not None
        addrs = [self._address(k) for k in keys]
        blobs = [self._object(a, p) for a, p in zip(addrs, pages)]

        async def send() -> list[str]:
            return list(await asyncio.gather(*(ingest.put(a, self.cfg.encoding, b, scheme=SCHEME, shard=self.shard,
                                                          key=k) for a, b, k in zip(addrs, blobs, keys))))
        try:
            outcomes = self.loop.run(send(), self.cfg.timeout)
        except TimeoutError:
            self.counts["timeouts"] += 1
            self.counts["write_errors"] += len(keys)
            log.warning("KDN ingest of %d pages: no answer within %g s", len(keys), self.cfg.timeout)
            return [False] * len(keys)
        self.counts.update(outcomes)
        ok = [o in KEPT or o == "store_conflict" for o in outcomes]  # a conflict: the stored page is there
        self.counts["written"] += sum(ok)
        self.counts["write_errors"] += len(ok) - sum(ok)
        return ok

    def _store(self, keys: list[str], pages: list[dict[str, torch.Tensor]]) -> list[bool]:
        """Each page's blob into the origin's store folder, then all their records into the registry."""
        from kdn.registry import Encoding, ObjectRecord

        g, enc = self._geometry(), self.cfg.encoding
        assert self.model_id is not None
        records = []
        for key, page in zip(keys, pages):
            a = self._address(key)
            blob = self.store.read(a, enc)
            if blob is None:  # never rewrite a stored blob: edges may hold its digest
                blob = self._object(a, page)
                self.store.put(a, enc, blob, digest=blob_digest(blob))
            pieces = piece_digests(blob)
            encoding = Encoding(enc, len(blob), blob_digest(blob), PIECE_BYTES if pieces else 0, pieces)
            records.append(ObjectRecord(address=a, model_id=self.model_id, namespace=self.cfg.namespace, kind="kv",
                                        start=0, end=g.page_size, parent=None, standalone=False,
                                        encodings={enc: encoding}, origin=self.cfg.node_id, engine=self.engine))
        assert self.registry is not None
        try:
            self.loop.run(self.registry.put_objects(records), self.cfg.timeout)
        except _MISSES as e:
            self.counts["write_errors"] += len(keys)
            log.warning("KDN records of %d pages not written: %s", len(keys), str(e) or type(e).__name__)
            return [False] * len(keys)
        self.counts["written"] += len(keys)
        return [True] * len(keys)
