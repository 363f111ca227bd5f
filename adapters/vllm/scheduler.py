"""The connector's scheduler side: how many of a request's tokens the KDN can supply, and which to save.

vLLM's scheduler is synchronous and asks ``matched`` for every request it
considers admitting, possibly several times while it waits for blocks. The
first call starts one lookup on the connector's own loop (``/v1/lookup`` for
the whole chunks, the parent record for a tail, then the records of the hit
for their digests); the answer is kept per request, so later calls cost
nothing and say the same. A lookup that has not answered yet makes ``matched``
return None (vLLM asks again next step) until ``lookup_timeout``, after which
the request runs without the KDN: a slow edge delays no one for long.

What the hit offers is then cut by the load planner (``planning.py``; setting
``plan``): only what is faster to load than to compute, decided once per
request and offered the same on every later call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kdn.chunk import Chunk
from kdn.format import address as A
from kdn.format.address import ModelId
from kdn.errors import KDNError
from kdn.format.store import validate_encoding

from kdn.adapters.vllm import compat
from kdn.adapters.vllm.blend import BlendScheduler
from kdn.adapters.vllm.config import ConnectorConfig
from kdn.adapters.vllm.meta import KDNMetadata, LoadJob, SaveChunk, SaveJob
from kdn.adapters.vllm.plan import LoadPlan, plan_load
from kdn.adapters.vllm.planning import Planner
from kdn.adapters.vllm.stats import KDNStats
from kdn.adapters.steering import SteerSpec
from kdn.adapters.vllm.question import QuestionSpec
from kdn.adapters.vllm.steer import SteerJob, spec_of

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import ObjectRecord

log = logging.getLogger("kdn.adapters.vllm")

FIRST_WAIT = 0.02  # seconds the first ``matched`` call waits for its lookup before answering "ask again"


@dataclass
class _Lookup:
    future: concurrent.futures.Future
    started: float
    chunks: list[Chunk] | None = None  # None until answered; [] for a miss or a failure


@dataclass
class _Save:
    namespace: str
    encodings: tuple[str, ...]
    chunks: list[SaveChunk]
    next: int = 0  # index of the first chunk not yet handed to the worker
    state_ok: bool = True


@dataclass
class SchedulerSide:
    cfg: ConnectorConfig
    model_id: ModelId
    block_size: int
    hybrid: bool
    consume: bool
    produce: bool
    background: bool  # load between steps (async) rather than inside the forward
    bridge: Any = None  # LoopThread, when consuming
    client: Any = None  # KDNClient on that loop
    kv_cache_manager: Any = None
    mamba_groups: tuple[int, ...] = ()  # hybrid models: the groups whose blocks hold states
    mamba_mode: str = "none"  # vLLM's mamba_cache_mode: "align" (prefix caching) or "none"
    steer: bool = False  # accept steered requests (connector setting ``steer``)
    n_layers: int = 0  # the model's, for steering specs
    n_heads: int = 0
    planner: Planner | None = None  # consumers: times the engine's steps; cuts plans where ``plan`` is on
    blender: BlendScheduler | None = None  # consumers: RAG prompts of standalone chunks (``blend`` setting)
    _lookups: dict[str, _Lookup] = field(default_factory=dict)
    _plans: dict[str, LoadPlan] = field(default_factory=dict)
    _ready: list[LoadJob] = field(default_factory=list)
    _saves: dict[str, _Save] = field(default_factory=dict)
    _given_up: set[str] = field(default_factory=set)  # requests whose load failed: vLLM recomputes them whole
    _steers: dict[str, SteerSpec | QuestionSpec | None] = field(default_factory=dict)  # per request: its steering
    _decided: dict[str, tuple[int, int, LoadPlan | None]] = field(default_factory=dict)  # (computed, tokens, cut)
    _stats: KDNStats = field(default_factory=KDNStats)  # the planner's choices since vLLM last took them
    totals: KDNStats = field(default_factory=KDNStats)  # lookups' times since start (benches, health reports)
    _probes: list[concurrent.futures.Future] = field(default_factory=list)  # the planner's, on the wire
    lookups_failed: int = 0
    steer_refused: int = 0  # steered requests run unsteered (a bad spec, no salt, steering off)

    # --- consumer --------------------------------------------------------------------------

    def matched(self, request: Any, computed: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if not self.consume or compat.kdn_params(request).get("load") is False or rid in self._given_up:
            return 0, False
        if self.blender is not None:
            spec = self.blender.spec_for(request)
            if spec is not None:  # its documents' chunks, composed: no prefix lookup
                return self.blender.matched(request, spec, computed)
        lk = self._lookups.get(rid)
        if lk is None:
            tokens = compat.prompt_tokens(request)
            if len(tokens) < self.cfg.chunk_tokens:
                return 0, False  # a lookup matches whole chunks first: a prompt shorter than one never hits
            host = compat.kdn_params(request).get("host") is not False  # a request may read past the host tier
            lk = self._lookups[rid] = _Lookup(self.bridge.submit(self._lookup(tokens, host)), time.monotonic())
            try:
                lk.future.result(FIRST_WAIT)
            except (concurrent.futures.TimeoutError, Exception):  # noqa: BLE001 -- read below
                pass
        if lk.chunks is None:
            if not lk.future.done():
                if time.monotonic() - lk.started < self.cfg.lookup_timeout:
                    return None, False
                lk.future.cancel()
                log.warning("KDN lookup for %s took over %.1f s: computing it instead", rid, self.cfg.lookup_timeout)
                lk.chunks = []
                self.lookups_failed += 1
            elif lk.future.cancelled() or lk.future.exception() is not None:
                log.warning("KDN lookup for %s failed: %s", rid, lk.future.exception() if not lk.future.cancelled() else "cancelled")
                lk.chunks = []
                self.lookups_failed += 1
            else:
                lk.chunks = lk.future.result()
                for stats in (self._stats, self.totals):
                    stats.phase("lookup", time.monotonic() - lk.started)
        num_tokens = request.num_tokens
        st = self._steer_for(request)
        if st is not None:  # the KDN's K/V past the question's start are unsteered: load up to it at most
            num_tokens = min(num_tokens, st.query_from + 1)
        plan = plan_load(lk.chunks, computed=computed, num_tokens=num_tokens, block_size=self.block_size,
                         needs_state=self.hybrid)
        if plan is not None and self.planner is not None:
            wanted = compat.kdn_params(request).get("plan")
            if wanted if isinstance(wanted, bool) else self.cfg.plan:
                if compat.kdn_params(request).get("host") is False and any(p.host for p in lk.chunks):
                    # this request reads past the host tier: its chunks cost what the link costs
                    chain = [replace(p, host=False) for p in lk.chunks]
                    same = {id(p): q for p, q in zip(lk.chunks, chain)}  # (decide finds its cut by identity)
                    plan = replace(plan, chunks=tuple(same.get(id(p), replace(p, host=False)) for p in plan.chunks))
                else:
                    chain = lk.chunks
                plan = self._cut(rid, plan, chain, computed, num_tokens)
        if plan is None:
            self._plans.pop(rid, None)
            return 0, False
        self._plans[rid] = plan
        return plan.tokens, self.background

    def _cut(self, rid: str, plan: LoadPlan, chain: list[Chunk], computed: int, num_tokens: int) -> LoadPlan | None:
        """``plan`` cut by the load planner, decided once per request (vLLM asks again while it waits for
        blocks: the same offer, counted once)."""
        got = self._decided.get(rid)
        if got is not None and got[:2] == (computed, num_tokens):
            return got[2]
        assert self.planner is not None
        self._probed()  # (a probe that landed while the engine idled: this plan knows the link again)
        cut, decision, outcome = self.planner.decide(plan, chain, num_tokens=num_tokens,
                                                     block_size=self.block_size, needs_state=self.hybrid)
        self._decided[rid] = (computed, num_tokens, cut)
        if decision.probe_s and plan.chunks:  # computes it all; the link is timed beside it (step_done learns)
            p = plan.chunks[0]
            self._probes.append(self.bridge.submit(self.client.probe(
                p.address, encoding=p.encoding, digest=p.digest, size=p.size, deadline_s=decision.probe_s,
                pieces=p.pieces)))
        loaded = cut.tokens if cut is not None else 0
        self._stats.planned(outcome, loaded, num_tokens - computed - loaded)
        if cut is None or cut.end < plan.end:
            log.info("KDN planner for %s: %s", rid, decision.reason)
        return cut

    async def _lookup(self, tokens: list[int], host: bool = True) -> list[Chunk]:
        """The published chain under ``tokens``, each chunk with the encoding and digest to fetch (asked of the
        machine's host tier first, unless the request reads past it: ``host``)."""
        c = self.client
        hit = await c.lookup(tokens, self.model_id, self.cfg.namespace, chunk_tokens=self.cfg.chunk_tokens,
                             host=host)
        if not hit.addresses:
            return []
        # The lookup brought the chain's records (checked as ``record`` checks them); older edges do not send them.
        recs = hit.records if len(hit.records) == len(hit.addresses) else \
            await asyncio.gather(*(c.record(a) for a in hit.addresses))
        chunks: list[Chunk] = []
        pos = 0
        for i, (addr, rec) in enumerate(zip(hit.addresses, recs)):
            want_end = min(pos + self.cfg.chunk_tokens, hit.tokens)
            why = self._refuse(rec, addr, pos, want_end)
            if why:
                log.info("KDN chain for this prompt stops at token %d: %s", pos, why)
                break
            pin = self.cfg.encoding
            enc = pin if pin is not None and pin in rec.encodings else c.choose_encoding(rec.encodings)
            if enc is None:
                break
            chunk = hit.chunk(i, rec, enc)
            chunks.append(replace(chunk, warm=c.warm(addr, chunk.tier)))
            pos = want_end
        if chunks and c.host is not None:  # what the host tier holds is planned at its own speed
            from kdn.client.hosted import held_of

            got = await held_of(c.host, hit, c.host_stats, len(chunks))  # (as the lookup heard it from the host)
            chunks = [replace(p, host=True) if i < len(got.encodings) and p.encoding in got.encodings[i] else p
                      for i, p in enumerate(chunks)]
        return chunks

    def _refuse(self, rec: ObjectRecord | None, addr: A.Address, start: int, end: int) -> str | None:
        """Why a record cannot be used for tokens ``[start, end)`` of this prompt, or None (its shape was checked
        when the client read it: ``kdn.client.trust``)."""
        if rec is None:
            return f"no record for {addr[:16]}"
        if rec.model_id != self.model_id or rec.namespace != self.cfg.namespace:
            return "record of another model or namespace"
        if (rec.start, rec.end) != (start, end) or rec.standalone:
            return f"record span [{rec.start}, {rec.end}) is not [{start}, {end})"
        engine = rec.engine or "transformers"
        if self.cfg.engines is not None and engine.split(" ")[0] not in self.cfg.engines:
            return f"produced by {engine}, not one of {list(self.cfg.engines)}"
        return None

    def hit_sources(self, request: Any, n: int) -> dict:
        """Tokens of the hit by the tier the entry edge said would serve them, as vLLM counts tiers."""
        plan = self._plans.get(request.request_id)
        if not n or plan is None:
            return {}
        out: dict = {}
        for p, lo, hi in plan.spans():
            src = _HIT_SOURCE.get(p.tier.split(":", 1)[0], compat.CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + (hi - lo)
        return out

    def allocated(self, request: Any, blocks: Any, n: int) -> None:
        rid = request.request_id
        if self.blender is not None and self.blender.allocated(request, blocks, n):
            return  # a blend: its K/V are not a prefix's, never saved nor steered
        if n > 0:
            plan = self._plans.get(rid)  # kept: vLLM asks hit_sources next, and finished() forgets it
            if plan is None or plan.tokens != n:
                # vLLM asked for a count the connector never offered: load nothing, it recomputes.
                log.error("vLLM allocated %d external tokens for %s, the KDN offered %s", n, rid,
                          plan.tokens if plan else 0)
            else:
                host = compat.kdn_params(request).get("host") is not False
                self._ready.append(LoadJob(rid, plan, compat.block_ids_of(blocks), self.background, host))
                for p in plan.chunks:  # the worker reads them through the edge, which then holds them (warm)
                    self.client.note_read(p.address)
        self._steer_for(request)
        if self.produce and rid not in self._saves:
            self._track_save(request)

    # --- steering ----------------------------------------------------------------------------

    def _steer_for(self, request: Any) -> SteerSpec | QuestionSpec | None:
        """The request's steering spec, decided once per request (a refusal is logged and counted once)."""
        rid = request.request_id
        if rid in self._steers:
            return self._steers[rid]
        params = compat.kdn_params(request)
        spec = None
        if "emphasis" in params or params.get("steer"):
            try:
                if not self.steer:
                    em = params.get("emphasis")
                    on = params.get("steer")
                    if not (on if on is not None else isinstance(em, dict) and em.get("default_on") is True):
                        return self._steers.setdefault(rid, None)  # asked for none: nothing to refuse
                    raise KDNError("steering is off on this engine (the connector's 'steer' setting)")
                spec = spec_of(params, n_layers=self.n_layers, n_heads=self.n_heads,
                               n_ids=len(compat.prompt_tokens(request)), cache_salt=compat.cache_salt(request))
            except KDNError as e:
                self.steer_refused += 1
                log.error("request %s runs unsteered: %s", rid, e)
        self._steers[rid] = spec
        return spec

    def _steer_jobs(self, out: Any) -> list[SteerJob]:
        if not self._steers:
            return []
        progress = compat.step_tokens(out)
        jobs = []
        for rid, spec in self._steers.items():
            if spec is None or rid not in progress:
                continue
            first, n = progress[rid]
            if first + n <= spec.query_from:
                continue  # the knowledge's own prefill: nothing to steer yet
            blocks = compat.request_blocks(self.kv_cache_manager, rid)
            jobs.append(SteerJob(rid, spec, first, n, tuple(tuple(b) for b in blocks)))
        return jobs

    # --- producer --------------------------------------------------------------------------

    def _track_save(self, request: Any) -> None:
        params = compat.kdn_params(request)
        if not (params.get("save") or self.cfg.save == "all"):
            return
        try:
            ns = A.validate_namespace(params.get("namespace", self.cfg.namespace))
            encs = params.get("encodings", self.cfg.encodings)
            if not isinstance(encs, (list, tuple)) or not encs:
                raise KDNError("'encodings' must be a non-empty list")
            encs = tuple(validate_encoding(e) for e in encs)
        except KDNError as e:
            log.error("request %s: not saved: %s", request.request_id, e)
            return
        tokens = compat.prompt_tokens(request)
        addrs = A.prefix_addresses(self.model_id, ns, tokens, self.cfg.chunk_tokens)
        spans = A.chunk_spans(len(tokens), self.cfg.chunk_tokens)
        chunks = [SaveChunk(a, addrs[i - 1] if i else None, s, e) for i, (a, (s, e)) in enumerate(zip(addrs, spans))]
        st = self._steer_for(request)
        if st is not None:  # steered layers change every later layer's K/V from query_from on
            chunks = [c for c in chunks if c.end <= st.query_from]
        self._saves[request.request_id] = _Save(ns, encs, chunks)

    def _save_jobs(self, out: Any) -> list[SaveJob]:
        if not self._saves:
            return []
        progress = compat.step_tokens(out)
        states = compat.boundary_states(out) if self.hybrid else {}
        jobs = []
        for rid, st in list(self._saves.items()):
            if rid not in progress:
                continue
            done = sum(progress[rid])  # tokens computed once this step ran
            ready = []
            while st.next < len(st.chunks) and st.chunks[st.next].end <= done:
                ready.append(st.chunks[st.next])
                st.next += 1
            if not ready:
                continue
            block_ids = compat.request_blocks(self.kv_cache_manager, rid)
            state_blocks: dict[int, int] | None = {}
            if self.hybrid:
                # A hybrid object carries the state at its end, and the engine holds only the state
                # where this step stops: each chunk must end a step (the origin schedules 256-token steps).
                if len(ready) > 1 or ready[-1].end != done:
                    log.error("request %s: step ended at token %d, not at a chunk end: hybrid chunks from %d on "
                              "are not saved (run the producer with max_num_batched_tokens = %d)",
                              rid, done, ready[0].start, self.cfg.chunk_tokens)
                    del self._saves[rid]
                    continue
                state_blocks = self._state_blocks(rid, block_ids, states.get(rid, []), done)
                if state_blocks is None:
                    del self._saves[rid]
                    continue
            jobs.append(SaveJob(rid, st.namespace, st.encodings, tuple(ready), block_ids, state_blocks or {}))
            if st.next == len(st.chunks):
                del self._saves[rid]
        return jobs

    def _state_blocks(self, rid: str, block_ids, offered: list, done: int) -> dict[int, int] | None:
        """The block of each mamba group that holds the state at ``done`` after this step."""
        out = {}
        for g in self.mamba_groups:
            hit = [b for (gid, b, n) in offered if gid == g and n == done]
            if hit:
                out[g] = hit[0]
            elif self.mamba_mode == "none" and block_ids[g]:
                out[g] = block_ids[g][-1]  # one state slot per request, updated in place
            else:
                log.error("request %s: no state block for group %d at token %d: not saved", rid, g, done)
                return None
        return out

    # --- both ------------------------------------------------------------------------------

    def build_meta(self, out: Any) -> KDNMetadata:
        meta = KDNMetadata(loads=self._ready, saves=self._save_jobs(out) if self.produce else [],
                           steers=self._steer_jobs(out), blends=self.blender.jobs() if self.blender else [])
        self._ready = []
        if self.planner is not None:  # timed until its output comes back (step_done)
            self.planner.steps.scheduled([(n, first) for first, n in compat.step_tokens(out).values()],
                                         loaded=bool(meta.loads or meta.blends))
        return meta

    def step_done(self, output: Any) -> None:
        """A step's output came back: its time teaches the prefill model; its loads teach the load speed."""
        if self.planner is None:
            return
        self.planner.steps.finished()
        data = getattr(getattr(output, "kv_connector_stats", None), "data", None)
        for sample in (data or {}).get("samples", ()):
            try:
                nbytes, seconds, abandoned = int(sample[0]), float(sample[1]), bool(sample[2])
                host = len(sample) > 3 and bool(sample[3])  # every byte from the host tier: its own speed
            except (TypeError, ValueError, IndexError):
                continue
            self.planner.speeds.observe_load(nbytes, seconds, abandoned=abandoned, host=host)
        self._probed()

    def _probed(self) -> None:
        """The planner's probes that landed teach the load speed (here, on the scheduler's thread)."""
        if not any(f.done() for f in self._probes):
            return
        assert self.planner is not None
        for f in [f for f in self._probes if f.done()]:
            self._probes.remove(f)
            if not f.cancelled() and f.exception() is not None:
                log.warning("KDN probe failed: %s", f.exception())
            got = None if f.cancelled() or f.exception() is not None else f.result()
            if got is not None:
                self.planner.speeds.observe_load(got.nbytes, got.seconds, abandoned=got.abandoned, probe=True)

    def take_stats(self) -> KDNStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KDNStats()
        return out

    def load_failed(self, req_ids: set[str]) -> None:
        """A background load failed and vLLM re-queued the request from scratch: asked again (it will be,
        its computed tokens are 0), offer nothing, or the same bad source would fail it again and again."""
        self._given_up.update(req_ids)

    def finished(self, request: Any) -> None:
        rid = request.request_id
        self._given_up.discard(rid)
        lk = self._lookups.pop(rid, None)
        if lk is not None and not lk.future.done():
            lk.future.cancel()
        self._plans.pop(rid, None)
        self._decided.pop(rid, None)
        self._saves.pop(rid, None)
        self._steers.pop(rid, None)
        if self.blender is not None:
            self.blender.finished(rid)


_HIT_SOURCE = {
    # The KDN is a remote store: an edge's memory reads as a peer's memory over the network, its
    # disk as disk; a fill from another edge, region or the origin has no closer vLLM name.
    "memory": compat.CacheHitSource.P2P,
    "disk": compat.CacheHitSource.DISK,
}
