"""The connector's worker side: fetch, verify, decode and write KDN states into vLLM's cache.

Every object of a load is fetched into a reused arena buffer, verified against
the digest of its record, its header checked against what the plan expects
(address, model, namespace, span, tensor shapes), and then at once decoded into
the load's per-layer staging (``stage.py``) while the other objects are still
on the wire; its receive buffer goes back to the arena (that is the chunk loader,
``fetching.py``; this module starts it, waits for it, writes and accounts). Two ways to write, chosen
per model by the connector (``load`` setting):

- **inside the forward** (attention-only models, the default): ``start_load_kv``
  starts every fetch of the step; each attention layer's ``wait_for_layer_load``
  waits for them once (bounded by ``load_timeout``, or the planner's tighter
  deadline for this load, and given up sooner once the load's own progress
  shows it would overrun that: ``kdn.planner.overruns``), then writes only
  that layer's staged K/V with one backend call. A chunk that fails marks its blocks
  (and every later block of the request) in ``get_block_ids_with_load_errors``;
  vLLM recomputes from there.
- **between steps** (hybrid models, always: vLLM refuses block-level errors
  with several KV cache groups, and a state written during the forward would
  be copied over first): a background thread fetches, writes every layer and
  the state at the load point, then reports the request finished, or failed
  (vLLM then recomputes it whole), in ``get_transfer_results``. A request
  aborted meanwhile is still reported when its load ends, so that vLLM frees
  its blocks then and never earlier.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.format.address import ModelId
from kdn.wire.arena import ArenaFull
from kdn.wire.bodyget import Tally
from kdn.kernels.pinned import host_arena
from kdn.errors import DigestMismatch, KDNError, SourceError
from kdn.chunk import Chunk
from kdn.planner import OVERRUN_AFTER, overruns

from kdn.adapters.vllm import compat, paged
from kdn.adapters.vllm.ahead import WriteAhead
from kdn.adapters.vllm.fetching import AttnLayer, ChunkLoader, Holds, LoadFailed, Staged, StateLayer
from kdn.adapters.vllm.meta import KDNMetadata, LoadJob
from kdn.adapters.vllm.plan import blocks_of
from kdn.adapters.vllm.stage import Staging, reap
from kdn.adapters.vllm.stats import KDNStats

log = logging.getLogger("kdn.adapters.vllm")


@dataclass
class _Running:
    """One load: its fetches (each ends staged), then its layers written as the forward asks for them."""

    job: LoadJob
    staging: Staging | None = None
    fetches: list[concurrent.futures.Future] = field(default_factory=list)  # -> Staged, in plan order
    staged: list[Staged] | None = None  # the chunks that arrived intact, in plan order (a prefix)
    error: LoadFailed | None = None
    upto: int = -1  # tokens [plan.first, upto) are still being written; a failure lowers it
    started: float = field(default_factory=time.perf_counter)
    tally: Tally = field(default_factory=Tally)  # the body bytes its own fetches landed (a give-up's measure)
    ready: float = 0.0  # when its last chunk was staged (or it was given up)
    stall: float = 0.0  # seconds the forward waited for its chunks (at the first attention layer)
    write: float = 0.0  # seconds of its layers' backend writes
    moved: int = -1  # a complete load's wire bytes: the planner's sample, taken once its writes are timed too
    from_host: bool = False  # ... every one of them from the machine's host tier (the sample is the host's speed)
    slots: tuple[int, torch.Tensor] | None = None  # (upto, its cache slots on the device): see _slots
    holds: Holds = field(default_factory=Holds)  # host-tier leases of the chunks its writes read in place
    host_batch: Any = None  # (fetching.ChunkLoader._held: what the host holds of it, asked once, leased at once)
    segments: tuple[int, list[tuple[int, int, Staged | None]]] | None = None  # (upto, what _segments said)

    def __post_init__(self) -> None:
        if self.upto < 0:
            self.upto = self.job.plan.end

    def spans(self) -> list[tuple[int, Chunk, int, int]]:
        """``(i, chunk, lo, hi)`` of the chunks that still write tokens."""
        return [(i, p, lo, min(hi, self.upto)) for i, (p, lo, hi) in enumerate(self.job.plan.spans()) if lo < self.upto]


def _release(run: _Running, bridge: Any) -> None:
    """Hand the load's staging back (deferred while a chunk is still being decoded into it: Staging.writing),
    and end the host-tier leases its writes read in place (on the client's loop, ``bridge``)."""
    staging, run.staging = run.staging, None
    if staging is not None:
        staging.release()
    for lease in run.holds.close():
        try:
            bridge.submit(lease.aclose())
        except RuntimeError:  # the connector's loop is closed: its host connection, and every lease, with it
            pass


def segments(run: _Running) -> list[tuple[int, int, Staged | None]]:
    """A load's tokens ``[plan.first, upto)`` as ``(lo, hi, held)``: a run of chunks in the staging (held None;
    consecutive ones merged into one write), or one chunk read in place (its ``Staged``). Made once per load."""
    if run.segments is None or run.segments[0] != run.upto:
        staged = run.staged or []
        out: list[tuple[int, int, Staged | None]] = []
        for i, _, lo, hi in run.spans():
            if lo >= hi:
                continue
            held = staged[i] if i < len(staged) and staged[i].kv is not None else None
            if held is None and out and out[-1][2] is None and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi, None)
            else:
                out.append((lo, hi, held))
        run.segments = (run.upto, out)
    return run.segments[1]


class WorkerSide:
    def __init__(self, *, cfg, model_id: ModelId, groups: list, bridge, client, device: torch.device) -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.groups = groups
        self.bridge = bridge
        self.client = client
        if device.type == "cuda" and device.index is None:  # vLLM names "cuda": this rank's is the current one
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.attn: dict[str, AttnLayer] = {}
        self.states: list[StateLayer] = []
        self.attn_group = next((g.id for g in groups if g.kind == "attention"), None)
        self.block_size = groups[self.attn_group].block_size if self.attn_group is not None else 0
        self.stats = KDNStats()  # since vLLM last took them (its logger and /metrics)
        self.totals = KDNStats()  # since start (tests, health reports)
        self._lock = threading.Lock()
        self._running: list[_Running] = []
        self._bad_blocks: set[int] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-load")
        # A few threads decode arrived compressed objects into the staging (``decode_threads``, default 2): more
        # compete with the engine's own threads, which hold the cores during a step. Raw ones need none.
        self._stager = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.decode_threads,
                                                             thread_name_prefix="kdn-stage")
        # Receive buffers and every load's staging come from one budgeted arena (the client's).
        self.arena = getattr(client, "arena", None) or host_arena(cfg.arena)
        self.blender: Any = None  # blend_run.BlendRunner, with the connector's ``blend`` setting
        # On the CPU a step's loads are written by a thread of their own, ahead of the forward (``ahead``).
        self._ahead = WriteAhead(cfg.write_threads) if device.type == "cpu" and cfg.write_threads else None
        import kdn.kernels  # noqa: F401  (registers the lossy codecs a quality budget may pick)

    def register(self, layers: dict[str, Any]) -> None:
        """Index the model's attention and state layers by the names objects use."""
        for g in self.groups:
            for name in g.layers:
                mod = layers[name]
                idx = compat.layer_index(name)
                if g.kind == "attention":
                    self.attn[name] = AttnLayer(name, idx, mod, *compat.attention_dims(mod))
                else:
                    if not compat.is_gdn(mod):
                        raise compat.ModelMismatch(f"layer {name} is a {type(mod).__name__}: the KDN connector "
                                                   "loads gated-delta-net states only")
                    self.states.append(StateLayer(name, idx, g.id, mod))
        self._order = sorted(self.attn.values(), key=lambda a: a.index)  # staging order: the forward's
        self._index = {a.name: j for j, a in enumerate(self._order)}
        # On the CPU the cache is host memory: the host tier's raw chunks may be written into it from the mapping
        # (``host_write: "in_place"``: no copy, one write per chunk and layer), or (the default) each copied into
        # the staging by one region copy, the staging laid out in the objects' tensor order for it (``stack``).
        self.loader = ChunkLoader(client=self.client, model_id=self.model_id, namespace=self.cfg.namespace,
                                  stager=self._stager, attn=self.attn, order=self._order, states=self.states,
                                  in_place=self.device.type == "cpu" and self.cfg.host_write == "in_place")
        self._stack_order = self.loader.stack_order if self.device.type == "cpu" else None

    # --- load --------------------------------------------------------------------------------

    def start(self, meta: KDNMetadata) -> None:
        for blend in meta.blends:
            self._blend(blend)
        for job in meta.loads:
            if job.background:
                self._pool.submit(self._load_in_background, job)
            else:
                self._running.append(self._begin(job))
        if self._ahead is not None and self._running:
            self._ahead.start(self._running, self._order, self._collect_once, self._write_ahead)

    def _begin(self, job: LoadJob) -> _Running:
        """A load with its staging taken from the arena and every fetch started (each stages its chunk)."""
        run = _Running(job)
        cache = next(iter(self.attn.values())).module.kv_cache if self.attn else None
        dims = [(a.kv_heads, a.head_dim) for a in self._order]
        dtype = cache.dtype if cache is not None else torch.bfloat16
        reap()  # earlier loads' staging whose device copies have finished since
        # On the CPU the staging takes its memory only when a chunk needs it: chunks read in place (the host
        # tier's mapping) need none, and a load wholly from the host holds no arena memory at all.
        lazy = self.loader.in_place and job.host and getattr(self.client, "host", None) is not None
        try:
            run.staging = Staging(self.arena, dims, job.plan.first, job.plan.end, dtype, lazy=lazy,
                                  order=self._stack_order)
        except ArenaFull as e:  # every buffer is in use by other loads: this one recomputes
            self._fail(run, LoadFailed("arena", None, str(e)))
            return run
        run.fetches = [self.bridge.submit(self.loader.fetch_and_stage(run, i, p)) for i, p in enumerate(job.plan.chunks)]
        return run

    def _blend(self, job: Any) -> None:
        """A RAG prompt's blend, whole, before this step's forward; a failure is vLLM's to recompute."""
        try:
            if self.blender is None:
                raise KDNError("blending is off on this worker")
            res = self.blender.run(job)
        except Exception as e:  # noqa: BLE001 -- any failure: those blocks are recomputed, never left unwritten
            log.warning("KDN blend of %s failed (%s: %s); vLLM recomputes", job.req_id, type(e).__name__, e)
            with self._lock:
                for st in (self.stats, self.totals):
                    st.failed("blend")
                self._bad_blocks.update(job.block_ids[i] for i in blocks_of(job.computed, job.end, self.block_size))
            return
        log.info("KDN blend of %s: %s", job.req_id, res.report.line())
        with self._lock:
            for st in (self.stats, self.totals):
                st.blended(res.written, res.report.tokens_reused, res.recomputed, res.seconds)

    def wait_layer(self, layer_name: str) -> None:
        layer = self.attn.get(layer_name)
        if layer is None or not self._running:
            return
        if self._ahead is not None and self._ahead.active:  # written by the writer thread: wait for its mark
            waited = self._ahead.wait(self._index[layer_name])
            for run in self._running:
                run.stall += waited
            return
        for run in self._running:
            if run.staged is None:
                t0 = time.perf_counter()
                self._collect(run)
                run.stall = time.perf_counter() - t0
                self._upload(run)
            # Tokens before a failed chunk are still loaded: vLLM keeps the blocks before the first
            # bad one, so every layer must hold them.
            if run.upto > run.job.plan.first:
                t0 = time.perf_counter()
                self._write_layer(run, layer)
                run.write += time.perf_counter() - t0

    def _collect_once(self, run: _Running) -> None:
        """The writer thread's first step for a load: wait for its chunks (as the first layer's wait does)."""
        if run.staged is None:
            self._collect(run)

    def _write_ahead(self, run: _Running, layer: AttnLayer, w: int, of: int) -> None:
        """Writer ``w`` of ``of``: its share of one layer of one load (writer 0's time is the ``write`` phase)."""
        if run.upto > run.job.plan.first:
            t0 = time.perf_counter()
            self._write_layer(run, layer, w, of)
            if w == 0:
                run.write += time.perf_counter() - t0

    def _collect(self, run: _Running) -> None:
        """Wait for a load's chunks to be staged (what is left of its deadline), up to the first that fails."""
        plan = run.job.plan
        limit = min(self.cfg.load_timeout, plan.deadline_s)  # the planner's, where it set a tighter one
        deadline = run.started + limit
        # A load the planner timed may be given up before its deadline, once its own progress shows it would
        # overrun it (kdn.planner.overruns); a cold one only once its first byte has landed (the wait for that
        # byte is the edge's own fill). Not one without the planner (load_timeout alone bounds it).
        judged = math.isfinite(plan.deadline_s)
        total = sum(p.size for p in plan.chunks)
        step = limit * OVERRUN_AFTER / 2
        run.staged = []
        for p, fut in zip(plan.chunks, run.fetches):
            try:
                run.staged.append(self._wait_chunk(run, fut, deadline, step if judged else math.inf, total, limit,
                                                   plan.cold))
                continue
            except concurrent.futures.TimeoutError as late:
                e = LoadFailed("timeout", p, str(late) or f"{p.address[:16]} not fetched within {limit:.3g} s")
            except LoadFailed as failed:
                e = failed
            except DigestMismatch as failed:
                e = LoadFailed("digest", p, str(failed))
            except (SourceError, OSError, KDNError) as failed:
                e = LoadFailed("missing", p, str(failed))
            except Exception as failed:  # noqa: BLE001 -- a bad header or basis record (bytes from the network):
                # this request recomputes, the engine's step goes on
                e = LoadFailed("decode", p, f"{type(failed).__name__}: {failed}")
            self._fail(run, e)
            break
        for fut in run.fetches[len(run.staged):]:
            fut.cancel()
        run.ready = time.perf_counter()
        # The planner's load speed: a load given up at its deadline moved what its own fetches landed by then
        # (not other loads' bytes: several in one step share the link, and each counts its own share, as a
        # load that completes does). A complete load's sample waits for its writes (end of the forward,
        # ``_account``): what the planner weighs against a prefill is the load into the cache, writes and all.
        # A cold load that completes timed the entry edge's upstream, not this engine's link: no sample. One
        # given up is sampled: the source it waited on said "cold" and then did not deliver within what the
        # request could afford, and the next plans compute instead of waiting on it again.
        if run.error is None:
            # A load wholly from the host tier teaches the host's speed; otherwise the link's, by the bytes that
            # crossed it (a mixed load's time includes its host chunks: a conservative measure of the link).
            hosted = [s.source == "host" for s in run.staged]
            if all(hosted):
                run.moved, run.from_host = sum(p.size for p in plan.chunks), True
            elif not plan.cold:
                run.moved = sum(p.size for p, h in zip(plan.chunks, hosted) if not h)
        elif run.error is not None and run.error.reason == "timeout":
            with self._lock:
                for st in (self.stats, self.totals):
                    st.sampled(run.tally.bytes, run.ready - run.started, abandoned=True)

    @staticmethod
    def _wait_chunk(run: _Running, fut: concurrent.futures.Future, deadline: float, step: float, total: int,
                    limit: float, cold: bool = False) -> Staged:
        """One chunk's result, by ``deadline``; every ``step`` s the load's progress is judged, and a load
        that would overrun its deadline is given up now (``TimeoutError`` saying so); a ``cold`` one only once
        its first byte has landed."""
        while True:
            now = time.perf_counter()
            try:
                return fut.result(max(min(deadline, now + step) - now, 0))
            except concurrent.futures.TimeoutError:
                now = time.perf_counter()
                if now >= deadline:
                    raise
                ran = now - run.started
                first = run.tally.first - run.started if run.tally.first is not None else None
                if overruns(ran, run.tally.bytes, total, limit, first, cold=cold):
                    raise concurrent.futures.TimeoutError(
                        f"given up after {ran * 1e3:.0f} ms: {run.tally.bytes:,} of {total:,} B landed, too slow "
                        f"to end within its {limit * 1e3:.0f} ms deadline") from None

    def _fail(self, run: _Running, e: LoadFailed) -> None:
        run.error = e
        job = run.job
        first = max(e.chunk.start, job.plan.first) if e.chunk else job.plan.first
        run.upto = min(run.upto, first)
        log.warning("KDN load of %s stopped at token %d (%s); vLLM recomputes", job.req_id, first, e)
        with self._lock:
            for st in (self.stats, self.totals):
                st.failed(e.reason)
            if not job.background:
                # In-forward loads fail by block: vLLM recomputes from the first bad one. A background
                # load fails as a whole request (vLLM takes no block errors with several cache groups).
                assert self.attn_group is not None  # (a load writes attention layers)
                table = job.block_ids[self.attn_group]
                self._bad_blocks.update(table[i] for i in blocks_of(first, job.plan.end, self.block_size))

    def bad_blocks(self) -> set[int]:
        out, self._bad_blocks = self._bad_blocks, set()
        return out

    def end_step(self) -> None:
        """After the forward: account for this step's in-forward loads, and hand their staging back (once the
        writer thread, where there is one, is done with them)."""
        if self._ahead is not None:
            self._ahead.end()
        for run in self._running:
            self._check_in_place(run)
            if run.upto > run.job.plan.first:
                self._account(run)
            _release(run, self.bridge)
        self._running = []

    def _check_in_place(self, run: _Running) -> None:
        """Chunks written from the host's mapping whose block was reused meanwhile fail (``Leased.intact``)."""
        staged = run.staged or []
        bad = next((p for i, p, lo, hi in run.spans() if lo < hi and i < len(staged)
                    and (ok := staged[i].intact) is not None and not ok()), None)
        if bad is not None:
            self._fail(run, LoadFailed("host", bad, "its block in the host tier changed while it was written"))

    def _account(self, run: _Running) -> None:
        seconds = time.perf_counter() - run.started
        staged = run.staged or []
        with self._lock:
            for st in (self.stats, self.totals):
                st.data["loads"] += 1
                st.data["seconds"].append(seconds)
                st.phase("fetch", run.ready - run.started)
                st.phase("stall", run.stall)
                st.phase("write", run.write)
                if run.moved >= 0:
                    st.sampled(run.moved, run.ready - run.started + run.write, host=run.from_host)
                for i, _, lo, hi in run.spans():
                    if i < len(staged):
                        st.loaded(staged[i].source, hi - lo, "staging" if staged[i].kv is None else "in_place")
                        st.fetched(staged[i].encoding, staged[i].nbytes)
            del self.totals.data["seconds"][:-1024]

    # --- write -------------------------------------------------------------------------------

    def _upload(self, run: _Running) -> None:
        """Once a load's staging is whole (its chunks collected), every layer's copy onto the device issued at
        once on the device's copy stream, an event each (``stage.Upload``): each layer's wait then waits for its
        own copy only, and the forward computes a layer while the next ones cross. On the CPU nothing crosses."""
        if run.staging is None or run.upto <= run.job.plan.first or not self.attn:
            return
        device = next(iter(self.attn.values())).module.kv_cache.device
        if device.type != "cpu":
            run.staging.upload(device)

    def _write_layer(self, run: _Running, layer: AttnLayer, w: int = 0, of: int = 1) -> None:
        """Layer ``layer``'s tokens ``[plan.first, upto)``: one backend write per run of staged chunks (on a GPU,
        once its copy has crossed: the compute stream waits for that layer's event only), and one per chunk read
        in place (a host-tier lease: from the mapping straight into the paged blocks)."""
        assert run.staging is not None
        cache = layer.module.kv_cache
        j = self._index[layer.name]
        slots = self._slots(run, cache.device)
        first = run.job.plan.first
        for lo, hi, held in segments(run)[w::of]:
            if held is None:  # [n, H, D]: on the CPU views of the staging; on a GPU the layer's copy, reordered
                k, v = run.staging.kv_on(j, cache.device, cache.dtype, hi, lo)
            else:  # [n, H, D] views of the mapping (its lease is the load's until it ends)
                assert held.kv is not None
                k, v = held.kv[j]  # tokens [held.start, held.start + len(k))
                if (lo, hi) != (held.start, held.start + k.shape[0]):
                    k, v = k[lo - held.start:hi - held.start], v[lo - held.start:hi - held.start]
            paged.write(layer.module, cache, k, v, slots[lo - first:hi - first])

    def _slots(self, run: _Running, device: torch.device) -> torch.Tensor:
        """The load's cache slots on ``device``: made once per load, not once per layer (on a GPU each copy
        of them over waits for the device)."""
        if run.slots is None or run.slots[0] != run.upto:
            assert self.attn_group is not None
            run.slots = (run.upto, paged.slots(run.job.block_ids[self.attn_group], run.job.plan.first, run.upto,
                                               self.block_size, device))
        return run.slots[1]

    def _write_states(self, run: _Running) -> None:
        """The conv and recurrent state at the load point, into each state layer's block for it."""
        job = run.job
        t = (run.staged or [])[-1].states
        for s in self.states:
            block = job.block_ids[s.group][job.plan.end // self.groups[s.group].block_size - 1]
            try:
                compat.write_gdn_state(s.module, block, t[f"L{s.index}.conv"], t[f"L{s.index}.ssm"])
            except compat.ModelMismatch as e:
                raise LoadFailed("mismatch", job.plan.last, str(e)) from None

    # --- background loads (hybrid) -----------------------------------------------------------

    def _load_in_background(self, job: LoadJob) -> None:
        run = self._begin(job)
        try:
            if self.device.type == "cuda":  # a new thread starts on device 0, not on this worker's rank's device
                torch.cuda.set_device(self.device)
            if run.error is None:
                self._collect(run)
            if run.error is None:  # a background load is all or nothing
                self._upload(run)
                t0 = time.perf_counter()
                for layer in self._order:
                    self._write_layer(run, layer)
                if self.states:
                    self._write_states(run)
                if self.device.type == "cuda":
                    # Reported finished only once its writes have landed: the engine's forward may run on a
                    # stream of its own, which nothing orders after this thread's (its copies included).
                    torch.cuda.current_stream(self.device).synchronize()
                run.write = time.perf_counter() - t0
        except LoadFailed as e:
            self._fail(run, e)
        except Exception as e:  # noqa: BLE001 -- never leave vLLM waiting on a request: report it failed
            log.exception("KDN background load of %s", job.req_id)
            self._fail(run, LoadFailed("decode", None, f"{type(e).__name__}: {e}"))
        if run.error is None:
            self._account(run)
        _release(run, self.bridge)
        with self._lock:
            (self._done if run.error is None else self._failed).add(job.req_id)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` background loads since the last call (failed ones are in both)."""
        with self._lock:
            done, failed = self._done | self._failed, set(self._failed)
            self._done, self._failed = set(), set()
        return done, failed

    def saved(self, n: int) -> None:
        with self._lock:
            for st in (self.stats, self.totals):
                st.data["saved"] += n

    def take_stats(self) -> KDNStats | None:
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KDNStats()
        return out

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._stager.shutdown(wait=True, cancel_futures=False)
