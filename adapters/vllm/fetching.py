"""One chunk of a load (``kdn.chunk.Chunk``): fetched, verified, checked against the plan, then decoded (or
received) into the load's staging (``stage.py``) while the other chunks are still on the wire. The worker side
(``worker.py``) starts a load's chunks here (``ChunkLoader``) and waits for them, writes what they staged into
vLLM's cache, and keeps the accounts.

A chunk is fetched into a reused arena buffer and verified against the digest of its record, its header
checked against what the plan expects (address, model, namespace, span, tensor shapes), and decoded into the
staging on a few threads of its own; its receive buffer goes back to the arena at once. A raw chunk wholly
inside the load is received straight into its place instead (``kdn.wire.scatter``). A chunk the machine's host
tier holds (``KDNClient(host=)``, the connector's ``host`` setting) is leased instead: no socket body, no hash
(the host verified it once, against the same signed digest). A raw one is copied into the staging by one
strided copy of its whole K/V region (on the CPU the staging is laid out in the objects' tensor order for that),
its lease ended once the copy is done; each layer is then one write for the whole load. With the connector's
``host_write: "in_place"`` (the CPU only) it is not copied at all here: its lease is kept by the load (``Holds``)
and each layer's write reads its K/V from the read-only mapping straight into vLLM's paged blocks (one pass
over the bytes, but one write per chunk and layer).
Every chunk of a hybrid load but its last moves only its K/V, by verified range requests
(``kdn.client.parts.fetch_kept``): the conv/recurrent states each object carries are those of its end, and
only the last chunk's are kept.
Every failure is a ``LoadFailed`` with its reason: bytes from the network never fail the engine's step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kdn.format.objects import raw_region, torch_dtype
from kdn.chunk import Chunk
from kdn.format.address import ModelId
from kdn.wire.arena import ArenaFull
from kdn.wire.bodyget import Tally
from kdn.errors import KDNError
from kdn.format.pieces import Pieces

from kdn.adapters.vllm.meta import LoadJob
from kdn.adapters.vllm.stage import Staging, StagingClosed, lanes


class LoadFailed(KDNError):
    def __init__(self, reason: str, chunk: Chunk | None, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.chunk = chunk


@dataclass(frozen=True)
class AttnLayer:
    name: str
    index: int  # transformers' layer index: names L{index}.k / .v in objects
    module: Any
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StateLayer:
    name: str
    index: int
    group: int
    module: Any


@dataclass
class Staged:
    """What one chunk left behind once decoded into the staging: where it came from, and its states."""

    source: str
    encoding: str
    nbytes: int
    states: dict[str, torch.Tensor] = field(default_factory=dict)  # the last chunk of a hybrid load
    # A chunk read in place (the host tier's mapping, its lease kept by the load's ``Holds``): per attention
    # layer in the staging's order, its K and V as ``[n, H, D]`` views of the mapping; None: it is in the staging.
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    start: int = 0  # the token ``kv`` starts at (its chunk's)
    # ``kv``'s lease still held the bytes its writes read (``kdn.client.leased.Leased.intact``): asked after them.
    intact: Callable[[], bool] | None = None


class Holds:
    """The host-tier leases a load keeps while its layers are written straight from the mapping: released
    together when the load ends (``close``), never before; one kept after that is refused (released at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[contextlib.AsyncExitStack] = []
        self._closed = False

    def keep(self, lease: contextlib.AsyncExitStack) -> bool:
        with self._lock:
            if not self._closed:
                self._open.append(lease)
            return not self._closed

    def close(self) -> list[contextlib.AsyncExitStack]:
        """No more leases; those kept, for the caller to release (on the client's loop)."""
        with self._lock:
            self._closed = True
            out, self._open = self._open, []
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


class Loading(Protocol):
    """What a chunk needs of its load (``worker``'s running load): the staging it lands in (None once the
    load ended), the tally its body bytes are counted in, and the job with its plan."""

    staging: Staging | None
    tally: Tally
    job: LoadJob
    holds: Holds
    host_batch: asyncio.Future[HostBatch] | None  # what the host holds of its chunks, and leased (``_held``)


@dataclass(frozen=True)
class HostBatch:
    """A load's chunks the host tier holds (``(address, encoding)``), and those leased in one go: per chunk index
    its ``kdn.client.leased.Leased`` (kept by the load's ``Holds``), or the ``HostError`` that lease met."""

    have: frozenset[tuple[str, str]]
    granted: dict[int, Any]





@dataclass(frozen=True)
class _Leased:
    """A chunk's bytes in the host tier's mapping, shaped as a fetched body for ``_stage``."""

    blob: memoryview
    source: str
    encoding: str


class ChunkLoader:
    """How one worker loads the chunks of its loads: its client, its model's layers (as ``WorkerSide.register``
    indexed them), and the threads that decode arrived compressed chunks into the staging."""

    def __init__(self, *, client: Any, model_id: ModelId, namespace: str, stager: concurrent.futures.Executor,
                 attn: dict[str, AttnLayer], order: list[AttnLayer], states: list[StateLayer],
                 in_place: bool = False) -> None:
        """``in_place``: host-tier raw chunks are written into the cache from the mapping (the cache is in host
        memory: the CPU; one write per chunk and layer), not copied into the staging first (one region copy
        per chunk, then one write per layer: the connector's ``host_write`` setting chooses)."""
        self.client, self.model_id, self.namespace, self.stager = client, model_id, namespace, stager
        self.in_place = in_place
        self.attn, self.order, self.states = attn, order, states  # order: the staging's, the forward's
        self.kv_names = {f"L{a.index}.{x}" for a in order for x in ("k", "v")}
        self._names = tuple(sorted(self.kv_names))  # the order an object stores them in (kdn.format.objects)
        at = {nm: q for q, nm in enumerate(self._names)}
        self._kv_at = [(at[f"L{a.index}.k"], at[f"L{a.index}.v"]) for a in order]  # per layer: its K and V there
        # The layers in the objects' order (each one's K then V, side by side there): a staging laid out so
        # (``Staging(order=)``, on the CPU) takes a raw chunk's whole K/V region in one copy (``_copy_region``).
        adjacent = all(v == k + 1 and k % 2 == 0 for k, v in self._kv_at)
        self.stack_order = tuple(sorted(range(len(order)), key=lambda j: self._kv_at[j][0])) if adjacent else None
        # What a chunk's K/V shapes are checked against: a layout that fitted once fits again (Layout.derived).
        self._fit_key = tuple((a.index, a.kv_heads, a.head_dim) for a in self.attn.values())

    def max_decoded(self, n_tokens: int) -> int:
        """The most an object of ``n_tokens`` for this model can decode to (fp32 at worst, aligned)."""
        per_token = sum(2 * a.kv_heads * a.head_dim * 4 for a in self.attn.values())
        states = sum(4 * t.numel() // max(t.shape[0], 1) for s in self.states for t in s.module.kv_cache)
        return per_token * n_tokens + 2 * states + 64 * (2 * len(self.attn) + 2 * len(self.states))

    async def fetch_and_stage(self, run: Loading, i: int, p: Chunk) -> Staged:
        """Chunk ``i``: fetched into an arena buffer, verified, checked, decoded into the staging (a worker
        thread, while other chunks are still on the wire); the buffer goes back at once. A kvtc object's
        model basis is fetched, verified and registered first (once per basis). A raw chunk is received
        straight into its place instead (``_fetch_placed``)."""
        host = self.client.host if run.job.host else None
        if host is not None and (p.address, p.encoding) in (batch := await self._held(run)).have:
            staged = await self._from_host(run, i, p, batch.granted.get(i))
            if staged is not None:
                return staged
        elif host is not None:  # from the edge now; asked of the host behind it, for the next load on this machine
            self.client.host_stats.misses += 1
            try:
                return await self._from_edge(run, i, p)
            finally:
                self.client.behind.start(host, [p.address], p.encoding, self.client.host_stats)
        return await self._from_edge(run, i, p)

    async def _from_edge(self, run: Loading, i: int, p: Chunk) -> Staged:
        if self.states and i != len(run.job.plan.chunks) - 1 and p.pieces is not None:
            return await self._fetch_kept(run, i, p, p.pieces)
        if self._placeable(run, i, p):
            return await self._fetch_placed(run, i, p)
        f = await self.client.fetch(p.address, encoding=p.encoding, digest=p.digest, size=p.size, pooled=True,
                                    pieces=p.pieces, tally=run.tally)
        try:
            cap = await self.client.prepare(f, p.end - p.start)
        except BaseException:
            f.release()
            raise
        # The decode cannot be stopped once started: if this load is cancelled (a timeout), the thread
        # runs on, and its receive buffer goes back only when it is done reading it.
        work = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(self.stager, self._stage, run, i, p,
                                                                                f, cap))
        work.add_done_callback(lambda _: f.release())
        return await asyncio.shield(work)

    async def _fetch_kept(self, run: Loading, i: int, p: Chunk, pieces: Pieces) -> Staged:
        """Chunk ``i`` of a hybrid load, not its last: only its K/V (``kv_names``), by verified range requests,
        then staged as any chunk is (a view that decodes nothing else). Its states would be dead weight: an
        8k load of a Qwen3.5-A3B-like shape moved ~2.1 GiB for ~222 MiB used (bench/hybrid_bytes.py)."""
        from kdn.client.parts import fetch_kept

        kept = await fetch_kept(self.client, p.address, encoding=p.encoding, digest=p.digest, size=p.size,
                                pieces=pieces, keep=self.kv_names, tally=run.tally)
        assert kept is not None  # (the chunk has piece digests)
        cap = await self.client.prepare(kept.fetched, p.end - p.start)
        # The decode cannot be stopped once started (as ``_from_edge``'s); the buffer is the thread's till then.
        staged = await asyncio.shield(asyncio.get_running_loop().run_in_executor(
            self.stager, self._stage, run, i, p, kept.fetched, cap, kept.held))
        staged.nbytes = kept.moved
        return staged

    async def _held(self, run: Loading) -> HostBatch:
        """What the host tier holds of this load's chunks, and those leased at once: asked once per load (the
        first chunk asks; the answer lives on the load itself, never shared with another one)."""
        batch = getattr(run, "host_batch", None)
        if batch is None:
            batch = run.host_batch = asyncio.ensure_future(self._ask_host(run))
        return await asyncio.shield(batch)

    async def _ask_host(self, run: Loading) -> HostBatch:
        """Which chunks the host holds (nothing if it does not answer at once), then those leased in one round
        trip per ``MAX_LEASE_MANY`` (not one per chunk), their leases kept by the load (``run.holds``) until it
        ends. A host without the batch op (an older one) leases chunk by chunk, as before."""
        from kdn.client.hosted import LOOKUP_S, held
        from kdn.client.leased import Leased
        from kdn.wire.host import HostError

        host, stats, chunks = self.client.host, self.client.host_stats, run.job.plan.chunks
        if host.gone:  # asked anew (``held`` connects to a restarted host, and maps its new segment)
            got = await held(host, [p.address for p in chunks], stats)
            have = frozenset((p.address, e) for p, encs in zip(chunks, got.encodings) for e in encs)
        else:  # what the host held at the lookup, the plan says (``Chunk.host``): no second question
            have = frozenset((p.address, p.encoding) for p in chunks if p.host)
        want = [i for i, p in enumerate(chunks) if (p.address, p.encoding) in have]
        granted: dict[int, Any] = {}
        for enc in sorted({chunks[i].encoding for i in want}):
            idx = [i for i in want if chunks[i].encoding == enc]
            try:
                async with asyncio.timeout(LOOKUP_S + 0.01 * len(idx)):
                    granted.update(zip(idx, await host.lease_many([chunks[i].address for i in idx], enc)))
            except (HostError, TimeoutError) as e:
                stats.note(f"lease_many: {e}")
        ids = [x.lease for x in granted.values() if isinstance(x, Leased)]
        if ids:
            leases = contextlib.AsyncExitStack()
            leases.push_async_callback(self._release_many, ids)
            if not run.holds.keep(leases):  # the load ended meanwhile: nothing of it reads them
                await leases.aclose()
                granted = {}
        return HostBatch(have, granted)

    async def _release_many(self, ids: list[int]) -> None:
        from kdn.wire.host import HostError

        try:
            await self.client.host.release_many(ids)
        except HostError as e:  # (a refusal of one: the others ended; a host gone ended them all)
            self.client.host_stats.note(f"release_many: {e}")

    async def _from_host(self, run: Loading, i: int, p: Chunk, granted: Any = None) -> Staged | None:
        """Chunk ``i`` leased from the host tier, or None (fetch it as ever): the host failed, or its copy is not
        the one the plan's signed digest names. On the CPU a raw chunk is read in place: its lease is kept by
        the load (``run.holds``, released when the load ends) and its K/V are views of the mapping, written
        into the paged blocks layer by layer (``_in_place``), where ``in_place``. Otherwise it is copied from
        the mapping into the staging (a stager thread: a raw one in the staging's order by one region copy,
        ``_copy_region``), and the lease ends once the copy has: a cancelled load waits for its thread.
        ``granted``: its lease from the load's batch (``_ask_host``: kept by the load already), or the error that
        lease met; None: leased here."""
        from kdn.wire.host import HostError

        stats = self.client.host_stats
        lease = contextlib.AsyncExitStack()
        kept = granted is not None  # a batch's lease ends with the load, not here
        try:
            if isinstance(granted, HostError):
                raise granted
            leased = granted if granted is not None else await lease.enter_async_context(
                self.client.host.lease(p.address, p.encoding))
            if leased.record.get("encodings", {}).get(p.encoding, {}).get("digest") != p.digest:
                stats.fallbacks += 1
                stats.note(f"{p.address[:16]}.{p.encoding}: the host's record names another digest")
                return None
            f = _Leased(leased.view, "host", p.encoding)
            if self.in_place and p.encoding == "raw" and not (self.states and i == len(run.job.plan.chunks) - 1):
                if not kept and not run.holds.keep(lease):
                    raise LoadFailed("decode", p, "the load ended before this chunk arrived")
                kept = True  # from here the load's end releases it (the thread only reads the mapping)
                staged = await asyncio.get_running_loop().run_in_executor(self.stager, self._in_place, run, i, p, f)
                staged.intact = leased.intact  # read once its layers are written (``WorkerSide.end_step``)
            else:
                work = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                    self.stager, self._stage, run, i, p, f, None))
                try:
                    staged = await asyncio.shield(work)
                except asyncio.CancelledError:
                    await asyncio.wait({work})  # the thread reads the mapping: the lease holds until it is done
                    raise
                except LoadFailed:
                    if leased.intact():  # (bytes that changed under the check are not the object's fault)
                        raise
                if not leased.intact():  # its lease ended early (a dropped connection) and the block was reused:
                    raise HostError("unavailable", "its block in the host tier changed while it was copied")
        except HostError as e:
            stats.fallbacks += 1
            stats.note(f"{p.address[:16]}.{p.encoding}: {e}")
            return None
        finally:
            if not kept:
                await lease.aclose()
        stats.hits += 1
        return staged

    def _in_place(self, run: Loading, i: int, p: Chunk, f: _Leased) -> Staged:
        """A held chunk's K/V as views of the mapping, per layer ``[n, H, D]`` (checked as any chunk's header
        is); one whose tensors are not raw in the cache's dtype is copied into the staging instead."""
        from kdn.format.objects import ObjectView

        staging = run.staging
        if staging is None:
            raise LoadFailed("decode", p, "the load ended before this chunk arrived")
        try:
            view = ObjectView(f.blob, max_decoded=self.max_decoded(p.end - p.start))
        except KDNError as e:
            raise LoadFailed("decode", p, str(e)) from None
        self._check_header(view.layout, p)
        kv = raw_region(view, self._names, staging.dtype, p.end - p.start)  # [2 x layers, H, n, D] or None
        if kv is None:  # not raw in the cache's dtype (or not one shape): decoded into the staging as ever
            return self._stage(run, i, p, f, None)
        kt = kv.transpose(1, 2)  # [2 x layers, n, H, D]: the token-major view a backend's cache write takes
        return Staged("host", f.encoding, len(f.blob), start=p.start, kv=[(kt[k], kt[v]) for k, v in self._kv_at])

    def _placeable(self, run: Loading, i: int, p: Chunk) -> bool:
        """A raw chunk wholly inside the load, whose states are not kept (only a hybrid load's last chunk has
        them): its K/V bytes are the staging's as they are."""
        plan = run.job.plan
        return (p.encoding == "raw" and run.staging is not None and plan.first <= p.start and p.end <= plan.end
                and not (self.states and i == len(plan.chunks) - 1))

    async def _fetch_placed(self, run: Loading, i: int, p: Chunk) -> Staged:
        """Chunk ``i`` received straight into its place in the staging (``kdn.wire.scatter``): no receive buffer and
        no copy after it, the bytes verified as they land (the worker uses the staging only for chunks whose
        fetch returned). Its header is checked before a byte is placed; a refusal keeps its reason.

        Measured (bench/datapath.py, SmolLM2 at 8k tokens): the copy from the receive buffer into the staging
        was a second pass over every byte on the one stager thread, ~28 ms of CPU beside the receive."""
        staging = run.staging
        if staging is None:
            raise LoadFailed("decode", p, "the load ended before this chunk arrived")
        refused: list[LoadFailed] = []

        def place(layout: Any) -> dict[str, list[memoryview]]:
            h = layout.header
            try:
                self._check_header(layout, p)
                bad = next((n for n, t in h.tensors.items() if n in self.kv_names and
                            (t.codec != "raw" or torch_dtype(t.dtype) != staging.dtype)), None)
                if bad is not None:
                    raise LoadFailed("mismatch", p, f"{bad} is not raw {staging.dtype}: it cannot land in place")
            except LoadFailed as e:
                refused.append(e)
                raise
            runs: dict[str, list[memoryview]] = {}
            for j, a in enumerate(self.order):
                runs[f"L{a.index}.k"], runs[f"L{a.index}.v"] = staging.runs(j, p.start, p.end)
            return runs

        try:
            with staging.writing():  # held until the last byte has landed: a given-up load's memory waits for it
                f, _ = await self.client.fetch_placed(
                    p.address, digest=p.digest, size=p.size, tally=run.tally, place=place,
                    pieces=p.pieces)
        except StagingClosed as e:
            raise LoadFailed("decode", p, str(e)) from None
        except ArenaFull as e:
            raise LoadFailed("arena", p, str(e)) from None
        except KDNError:
            if refused:  # every source sent a header this load cannot take: say why, not "missing"
                raise refused[-1] from None
            raise
        return Staged(f.source.split("/")[-1].split(":")[0], f.encoding, p.size)

    def _check_header(self, layout: Any, p: Chunk) -> None:
        """An object's header is the chunk's (address, model, namespace, span) with this model's K/V shapes (found
        once per layout and chunk length: ``Layout.derived``)."""
        h, n = layout.header, p.end - p.start
        bad = layout.derived(("vllm-kv", self._fit_key, n), lambda: self._misfit(h, n))
        if bad is not None:
            raise LoadFailed("mismatch", p, f"{bad} is missing or not this model's shape")
        if (h.address, h.model_id, h.namespace, h.start, h.end) != (p.address, self.model_id, self.namespace,
                                                                    p.start, p.end):
            raise LoadFailed("mismatch", p, f"object {h.address[:16]} [{h.start}, {h.end}) of "
                             f"{h.model_id[:12]}/{h.namespace} is not the one asked for")

    def _misfit(self, h: Any, n: int) -> str | None:
        """The first of this model's K/V tensors ``h`` lacks or holds in another shape for ``n`` tokens."""
        return next((f"L{a.index}.{x}" for a in self.attn.values() for x in ("k", "v")
                     if getattr(h.tensors.get(f"L{a.index}.{x}"), "shape", None) != (a.kv_heads, n, a.head_dim)),
                    None)

    def _stage(self, run: Loading, i: int, p: Chunk, f: Any, cap: int | None,
               held: frozenset[str] | None = None) -> Staged:
        """Open and check one verified object, then decode its K/V (and, for the last chunk of a hybrid
        load, its states) into place. Raises ``LoadFailed``; bytes from the network never fail the step."""
        staging = run.staging
        if staging is None:
            raise LoadFailed("decode", p, "the load ended before this chunk arrived")
        try:
            with staging.writing():
                return self._stage_into(staging, run, i, p, f, cap, held)
        except StagingClosed as e:
            raise LoadFailed("decode", p, str(e)) from None
        except ArenaFull as e:  # a lazy staging found no room when its first chunk came: the rest computes
            raise LoadFailed("arena", p, str(e)) from None

    def _stage_into(self, staging: Staging, run: Loading, i: int, p: Chunk, f: Any, cap: int | None,
                    held: frozenset[str] | None = None) -> Staged:
        from kdn.client.parts import part_view
        from kdn.format.objects import ObjectView, to_torch

        try:
            # Bounded before a byte is decoded: at most what this model's chunk of that length holds. ``held``:
            # only those tensors arrived (``_fetch_kept``), and the view decodes no other.
            bound = max(self.max_decoded(p.end - p.start), cap or 0)
            view = ObjectView(f.blob, max_decoded=bound) if held is None else part_view(f.blob, held, max_decoded=bound)
        except KDNError as e:
            raise LoadFailed("decode", p, str(e)) from None
        self._check_header(view.layout, p)
        lo, hi = max(p.start, run.job.plan.first), min(p.end, run.job.plan.end)
        out = Staged(f.source.split("/")[-1].split(":")[0], f.encoding, len(f.blob))
        try:
            t0 = time.perf_counter()
            if held is not None or not self._copy_region(staging, view, p, lo, hi):
                for j, a in enumerate(self.order):
                    staging.put(j, view, (f"L{a.index}.k", f"L{a.index}.v"), lo, hi, p.start)
            # What decoding this encoding into the staging costs here: the scheduler's choice of encoding
            # reads it (the same process's ``DecodeSpeeds`` when the two share one).
            self.client.decode_speeds.observe(f.encoding, staging.nbytes_of(lo, hi), time.perf_counter() - t0)
            if self.states and i == len(run.job.plan.chunks) - 1:
                names = [n for st in self.states for n in (f"L{st.index}.conv", f"L{st.index}.ssm")]
                out.states = {k: t.clone() for k, t in to_torch(view.decode(names)).items()}  # the blob goes back
        except Exception as e:  # noqa: BLE001 -- a codec or shape error in bytes that came over the network
            raise LoadFailed("decode", p, f"{type(e).__name__}: {e}") from None
        return out

    def _copy_region(self, staging: Staging, view: Any, p: Chunk, lo: int, hi: int) -> bool:
        """Tokens ``[lo, hi)`` of a raw chunk in the cache's dtype, its K/V one stack in the objects' order
        (``raw_region``), into a staging laid out in that order (``stack_order``): ONE strided copy of the whole
        region, every layer's K and V, by numpy (the interpreter lock released: the stager threads copy side by
        side). False, nothing copied: another codec or dtype, layers of different shapes, or a staging in
        another order; the caller decodes layer by layer (``Staging.put``)."""
        if self.stack_order is None or staging.order != self.stack_order:
            return False
        kv = raw_region(view, self._names, staging.dtype, p.end - p.start)  # [2 x layers, H, n, D] or None
        dst = staging.stack(lo, hi) if kv is not None else None
        if kv is None or dst is None:
            return False
        np.copyto(dst, lanes(kv)[:, :, lo - p.start:hi - p.start, :])
        return True
