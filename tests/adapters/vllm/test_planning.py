"""The load planner inside vLLM's scheduler (adapters/vllm/planning.py): step timing, and plans cut to blocks.

Pure: no vLLM, no network. The engine side (a slow edge learnt, then computed) is in test_vllm_dense.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kdn.chunk import Chunk
from kdn.planner import (COLD_FILL_S, COLD_OF_PREFILL, LEARN_TOKENS, PROBE_AFTER_S, PrefillModel, Speeds,
                         cold_deadline, decide)

from kdn.adapters.vllm.fetching import Staged
from kdn.adapters.vllm.plan import plan_load
from kdn.adapters.vllm.planning import Planner, Steps, prefill_model

MiB = 1 << 20


def chain(*ends: int, size: int = 4 * MiB, tier: str = "memory") -> list[Chunk]:
    out, start = [], 0
    for i, e in enumerate(ends):
        out.append(Chunk(f"{i:064x}", start, e, "raw", "0" * 64, size, tier))
        start = e
    return out


def calibrated(seconds_for_1024: float = 0.1) -> Speeds:
    """An engine that has timed a 1024-token prefill (a tiny model: its weights and attention as below)."""
    s = Speeds(PrefillModel(params=50_000_000, layers=8, attn_width=512))
    s.observe_prefill(1024, 0, seconds_for_1024)
    return s


def link(bps: float, rtt: float = 0.001):
    return lambda b: rtt + b / bps


def test_prefill_model_counts_the_weights_a_token_multiplies():
    """A Llama-3-8B config: ~7B of weights in its layers (the 0.5B embedding is a lookup, not a matmul)."""
    cfg = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          num_hidden_layers=32, intermediate_size=14336)
    m = prefill_model(cfg)
    assert 6.5e9 < m.params < 7.2e9
    assert (m.layers, m.attn_width) == (32, 4096)
    moe = prefill_model(SimpleNamespace(**{**vars(cfg), "num_experts_per_tok": 2, "moe_intermediate_size": 1024}))
    assert moe.params < m.params  # two small experts per token multiply fewer weights than one dense MLP


def test_steps_time_compute_and_skip_overlap_and_loads():
    sp = Speeds(PrefillModel(params=1_000_000, layers=2, attn_width=64))
    st = Steps(sp)
    st.scheduled([(LEARN_TOKENS, 0)], loaded=False, now=0.0)
    st.scheduled([(LEARN_TOKENS, LEARN_TOKENS)], loaded=False, now=0.1)  # async scheduling: planned while 1 runs
    st.finished(now=1.0)
    k1 = sp.prefill.k
    assert k1 == pytest.approx(1.0 / sp.prefill.flops(LEARN_TOKENS, 0))
    st.finished(now=2.0)  # it ran from 1.0 (when the step before it ended), not from 0.1
    assert sp.prefill.samples == 2
    want = 1.0 / sp.prefill.flops(LEARN_TOKENS, LEARN_TOKENS)
    assert sp.prefill.k == pytest.approx(min(k1, want))  # the engine's demonstrated speed
    st.scheduled([(LEARN_TOKENS, 0)], loaded=True, now=3.0)  # a step that loaded: its time is not compute
    st.finished(now=9.0)
    assert sp.prefill.samples == 2
    st.finished(now=10.0)  # an output with no step pending (a restart of the count): ignored
    assert sp.prefill.samples == 2


def test_a_batch_step_teaches_its_summed_work():
    a = PrefillModel(params=1_000_000, layers=2, attn_width=64)
    b = PrefillModel(params=1_000_000, layers=2, attn_width=64)
    a.observe_step([(200, 0), (200, 1000), (1, 5000)], 0.5)
    b._learn(401, a.flops(200, 0) + a.flops(200, 1000) + a.flops(1, 5000), 0.5)
    assert a.k == b.k and a.k is not None


def test_a_fast_link_loads_the_whole_offer_with_the_planners_deadline():
    chunks = chain(256, 512, 768, 1024, 1100)
    lp = plan_load(chunks, computed=0, num_tokens=1140, block_size=128, needs_state=False)
    p = Planner(calibrated(), link=link(10e9), max_deadline_s=10)
    cut, decision, outcome = p.decide(lp, chunks, num_tokens=1140, block_size=128, needs_state=False)
    assert cut == lp.__class__(lp.first, lp.end, lp.chunks, decision.deadline_s)
    assert outcome == "load" and decision.deadline_s < 1.0
    assert p.reasons.counts == {"load": 1} and p.reasons.tokens_loaded == 1024


def test_a_slow_link_computes_and_says_so():
    chunks = chain(256, 512, 768, 1024, 1100)
    lp = plan_load(chunks, computed=0, num_tokens=1140, block_size=128, needs_state=False)
    p = Planner(calibrated(), link=link(10e6))  # 16 MiB at 10 MB/s: 1.7 s against a ~0.1 s prefill
    cut, decision, outcome = p.decide(lp, chunks, num_tokens=1140, block_size=128, needs_state=False)
    assert cut is None and outcome == "compute" and decision.reason.startswith("compute: load")
    assert p.reasons.tokens_computed == 1140


def test_what_the_engine_holds_is_not_planned_again():
    """Past vLLM's own 512 cached tokens the planner weighs only the rest, each prefill after them."""
    chunks = chain(256, 512, 768, 1024, 1100)
    lp = plan_load(chunks, computed=512, num_tokens=1140, block_size=128, needs_state=False)
    p = Planner(calibrated(), link=link(10e9))
    cut, decision, _ = p.decide(lp, chunks, num_tokens=1140, block_size=128, needs_state=False)
    assert cut is not None and (cut.first, cut.end) == (512, 1024)
    pre = p.speeds.prefill
    assert decision.compute_all_s == pytest.approx(pre.seconds(1140 - 512, 512))


def test_a_dear_last_chunk_is_left_to_compute_and_the_cut_stays_on_a_block():
    """Three cheap chunks and a huge fourth: load three, compute the rest; the cut ends on a block."""
    chunks = chain(256, 512, 768, size=MiB) + [Chunk("f" * 64, 768, 1024, "raw", "0" * 64, 512 * MiB, "memory")]
    lp = plan_load(chunks, computed=0, num_tokens=1100, block_size=128, needs_state=False)
    p = Planner(calibrated(), link=link(1e9))
    cut, _, outcome = p.decide(lp, chunks, num_tokens=1100, block_size=128, needs_state=False)
    assert outcome == "load_part" and cut is not None and (cut.first, cut.end) == (0, 768)
    assert len(cut.chunks) == 3 and math.isfinite(cut.deadline_s)
    # A block of 512 tokens: the planner's 768 comes down to 512.
    lp512 = plan_load(chunks, computed=0, num_tokens=1100, block_size=512, needs_state=False)
    cut512, _, _ = p.decide(lp512, chunks, num_tokens=1100, block_size=512, needs_state=False)
    assert cut512 is not None and cut512.end == 512


def test_a_hybrid_cut_ends_where_a_state_is():
    """A hybrid object carries its state at its own end: with 384-token blocks the cut after three chunks
    (768) is also the second block's end; after two (512) it is not, so one chunk would be none."""
    chunks = chain(256, 512, 768, size=MiB) + [Chunk("f" * 64, 768, 1024, "raw", "0" * 64, 512 * MiB, "memory")]
    lp = plan_load(chunks, computed=0, num_tokens=1100, block_size=384, needs_state=True)
    assert lp.end == 768
    p = Planner(calibrated(), link=link(1e9))
    cut, _, _ = p.decide(lp, chunks, num_tokens=1100, block_size=384, needs_state=True)
    assert cut is not None and cut.end == 768


def test_a_cold_load_is_bounded_by_a_multiple_of_the_prefill_not_the_load_timeout():
    """Chunks the entry edge must fill first: its upstream's time is not this link's, so not the link's tight
    deadline either; but not the whole ``load_timeout`` (a lying edge that called every hit cold and stalled
    cost each request that): ``COLD_OF_PREFILL`` prefills plus the fill allowance."""
    chunks = chain(256, 512, 768, 1024, 1100, tier="origin")
    lp = plan_load(chunks, computed=0, num_tokens=1140, block_size=128, needs_state=False)
    p = Planner(calibrated(), link=link(10e9), max_deadline_s=10)
    cut, decision, _ = p.decide(lp, chunks, num_tokens=1140, block_size=128, needs_state=False)
    assert cut is not None and decision.deadline_s < 1
    assert cut.deadline_s == COLD_OF_PREFILL * decision.compute_all_s + COLD_FILL_S < 10


def test_a_load_given_up_teaches_the_planner_to_compute_from_the_next_request():
    """A link that turns slow: the load given up at its deadline reports the bytes that landed by then (the
    load's own ``kdn.wire.bodyget.Tally``), so one load is spoiled, not one per doubling of the
    deadline, and the next request computes."""
    chunks = chain(256, 512, 768, 1024, 1100, size=256 << 10)
    lp = plan_load(chunks, computed=0, num_tokens=1140, block_size=128, needs_state=False)
    p = Planner(calibrated(0.2), link=link(1e9))  # the client still believes the link is fast
    true_bps = 2e6  # what the link now gives: 1.3 MiB in ~0.65 s, against a 0.2 s prefill
    spent = []
    for _ in range(8):
        cut, decision, outcome = p.decide(lp, chunks, num_tokens=1140, block_size=128, needs_state=False)
        if cut is None:
            break
        nbytes = sum(x.size for x in cut.chunks)
        took = nbytes / true_bps
        if took > cut.deadline_s:  # the worker gives up at the deadline and reports what landed by then
            p.speeds.observe_load(int(true_bps * cut.deadline_s), cut.deadline_s, abandoned=True)
            spent.append(cut.deadline_s)
        else:
            p.speeds.observe_load(nbytes, took)
    assert outcome == "compute", p.reasons.counts
    assert len(spent) == 1 and sum(spent) < 0.3, spent


def test_a_stale_measurement_probes_one_chunk_beside_the_request_then_loads_again():
    chunks = chain(256, 512, 768, 1024, 1100)
    lp = plan_load(chunks, computed=0, num_tokens=1140, block_size=128, needs_state=False)
    sp = calibrated()
    sp.observe_load(16 * MiB, 2.0, now=0.0)  # slow when last measured
    written = [replace(x, start=lo, end=hi) for x, lo, hi in lp.spans()]
    fresh = decide(written, 1140, link=link(10e9), speeds=sp, now=1.0)
    assert not fresh.loads_anything
    stale = decide(written, 1140, link=link(10e9), speeds=sp, now=PROBE_AFTER_S + 1)
    assert not stale.loads_anything and stale.reason.startswith("probe")  # computed; chunk 0 fetched beside it
    assert math.isfinite(stale.probe_s) and stale.probe_s > 0
    sp.observe_load(4 * MiB, 0.001, now=PROBE_AFTER_S + 2)  # the probe found the link fast again
    assert decide(written, 1140, link=link(10e9), speeds=sp, now=PROBE_AFTER_S + 3).load >= 1


def test_what_an_engine_read_before_is_timed_against_its_link_even_when_the_edge_says_only_edge():
    """An edge tells an anonymous caller only "edge" (cache state is hidden). An object this engine fetched
    lately is warm there (KDNClient.warm): its load gets the planner's deadline, and a give-up teaches the
    speed (with load_timeout for every such load, a slow link cost 3.5x a prefill in bench/vllm_plan.py). One
    it has not read may be a fill: the cold deadline (kdn.planner.cold_deadline)."""
    import dataclasses

    from kdn.client import KDNClient

    client = KDNClient(edges=["http://127.0.0.1:1"])
    seen = chain(256, 512, 768, 1024, 1100)
    for p in seen:
        client.note_read(p.address)
    assert client.warm(seen[0].address, "edge") and not client.warm("e" * 64, "edge")
    import kdn.client.client

    old, kdn.client.client.RECENT_S = kdn.client.client.RECENT_S, 0.0  # read longer ago than an edge is taken to keep it
    try:
        assert not client.warm(seen[0].address, "edge")
    finally:
        kdn.client.client.RECENT_S = old
    assert client.warm("e" * 64, "memory") and not client.warm(seen[0].address, "origin")
    for tier, known, cold in (("edge", True, False), ("edge", False, True), ("memory", False, False),
                              ("disk", False, False), ("origin", True, True), ("peer:e2", True, True),
                              ("region:us", True, True)):
        chunks = [dataclasses.replace(p, tier=tier, warm=client.warm(p.address if known else "e" * 64, tier))
                  for p in chain(256, 512, 768, 1024, 1100)]
        lp = plan_load(chunks, computed=0, num_tokens=1140, block_size=128, needs_state=False)
        cut, decision, _ = Planner(calibrated(), link=link(10e9), max_deadline_s=10).decide(
            lp, chunks, num_tokens=1140, block_size=128, needs_state=False)
        assert cut is not None and cut.cold == cold
        want = cold_deadline(decision.expected_load_s, 10, decision.compute_all_s) if cold else decision.deadline_s
        assert cut.deadline_s == want and (want > decision.deadline_s) == cold, tier


def test_the_worker_reports_a_given_up_load_by_its_own_tally_not_the_bytes_it_meant_to_move():
    """``WorkerSide._collect``: a load past its deadline is sampled with the body bytes its own fetches landed
    (its ``Tally``), a load that completes with all its bytes (no vLLM needed: the worker's own bookkeeping)."""
    import concurrent.futures
    from types import SimpleNamespace

    from kdn.adapters.vllm.meta import LoadJob
    from kdn.adapters.vllm.plan import LoadPlan
    from kdn.adapters.vllm.stats import KDNStats
    from kdn.adapters.vllm.worker import WorkerSide, _Running

    chunks = chain(256, 512, size=4 * MiB, tier="memory")
    w = WorkerSide.__new__(WorkerSide)  # only what _collect and _fail touch
    w.cfg = SimpleNamespace(load_timeout=10.0)
    w.stats, w.totals, w._lock, w._bad_blocks = KDNStats(), KDNStats(), __import__("threading").Lock(), set()
    w.attn_group, w.block_size = 0, 128

    def run_of(deadline_s: float, done: bool, source: str = "memory") -> _Running:
        job = LoadJob("r", LoadPlan(0, 512, tuple(chunks), deadline_s), ([1, 2, 3, 4],), background=False)
        run = _Running(job)
        run.fetches = [concurrent.futures.Future() for _ in chunks]
        if done:
            for f in run.fetches:
                f.set_result(Staged(source, "raw", 4 * MiB))
        run.tally.bytes = 300_000  # what its fetches landed so far
        return run

    w._collect(run_of(0.05, done=False))  # nothing arrives: given up at its 50 ms deadline
    done = run_of(10.0, done=True)
    w._collect(done)
    assert len(w.totals.data["samples"]) == 1  # a complete load is sampled once its writes are timed too
    done.write = 0.25  # its layers' writes into the paged cache, inside the forward
    w._account(done)
    (gave_up_bytes, took, abandoned, _), (done_bytes, done_took, done_abandoned, done_host) = w.totals.data["samples"]
    assert (gave_up_bytes, abandoned) == (300_000, 1) and 0.005 < took < 1.0
    assert (done_bytes, done_abandoned, done_host) == (8 * MiB, 0, 0)
    assert done_took == done.ready - done.started + 0.25  # the planner weighs the load writes and all
    hosted = run_of(10.0, done=True, source="host")  # every chunk from the host tier: a sample of its speed
    w._collect(hosted)
    w._account(hosted)
    assert [(b, a, h) for b, _, a, h in w.totals.data["samples"][2:]] == [(8 * MiB, 0, 1)]


def _bare_worker(load_timeout: float = 10.0):
    from types import SimpleNamespace

    from kdn.adapters.vllm.stats import KDNStats
    from kdn.adapters.vllm.worker import WorkerSide

    w = WorkerSide.__new__(WorkerSide)  # only what _collect and _fail touch
    w.cfg = SimpleNamespace(load_timeout=load_timeout)
    w.stats, w.totals, w._lock, w._bad_blocks = KDNStats(), KDNStats(), __import__("threading").Lock(), set()
    w.attn_group, w.block_size = 0, 128
    return w


def test_a_load_too_slow_for_its_deadline_is_given_up_by_its_progress_not_at_the_deadline():
    """``WorkerSide._collect`` with ``kdn.planner.overruns``: a planned warm load whose fetches have landed a
    trickle is given up at half its deadline (its progress says it would end far past the deadline; before
    that, a trickle under 1 MiB may be TCP's slow start, not the link's speed), and says so; so is a cold one
    once its first bytes landed; a cold one with nothing landed yet (the entry edge fills first: its first
    bytes wait for that fill) and one without the planner's deadline (``load_timeout`` alone) wait to the end
    of their bound. Each given up is sampled, abandoned, for the planner (a cold one too: the next plan
    computes instead of waiting on that source again)."""
    import concurrent.futures

    from kdn.adapters.vllm.meta import LoadJob
    from kdn.adapters.vllm.plan import LoadPlan
    from kdn.adapters.vllm.worker import _Running

    def run_of(deadline_s: float, tier: str, landed: int) -> _Running:
        chunks = chain(256, 512, size=4 * MiB, tier=tier)
        run = _Running(LoadJob("r", LoadPlan(0, 512, tuple(chunks), deadline_s), ([1, 2, 3, 4],), background=False))
        run.fetches = [concurrent.futures.Future() for _ in chunks]
        run.tally.bytes = landed  # a trickle: 64 KiB of 8 MiB (or nothing)
        return run

    timed = {}
    for name, deadline, tier, timeout, landed in (("warm", 2.0, "memory", 10.0, 64 * 1024),
                                                  ("cold, a trickle", 2.0, "origin", 10.0, 64 * 1024),
                                                  ("cold, nothing yet", 0.4, "origin", 10.0, 0),
                                                  ("no planner", math.inf, "memory", 0.4, 64 * 1024)):
        w = _bare_worker(timeout)
        run = run_of(deadline, tier, landed)
        t0 = time.perf_counter()
        w._collect(run)
        timed[name] = time.perf_counter() - t0
        assert run.error is not None and run.error.reason == "timeout", name
        if deadline == 2.0:
            assert "given up after" in str(run.error) and "65,536 of 8,388,608 B landed" in str(run.error)
        assert [(b, a) for b, _, a, _ in w.totals.data["samples"]] == [(landed, 1)], name
    assert 0.95 <= timed["warm"] < 1.4  # half of 2 s (and a step of the poll), not the 2 s
    assert 0.95 <= timed["cold, a trickle"] < 1.4
    assert timed["cold, nothing yet"] >= 0.39 and timed["no planner"] >= 0.39  # each ran to its bound


def test_a_load_on_pace_for_its_deadline_is_not_given_up():
    """The same bookkeeping, a load whose bytes land at a speed that ends inside its deadline: it completes."""
    import concurrent.futures
    import threading

    from kdn.adapters.vllm.meta import LoadJob
    from kdn.adapters.vllm.plan import LoadPlan
    from kdn.adapters.vllm.worker import _Running

    chunks = chain(256, 512, size=4 * MiB, tier="memory")
    run = _Running(LoadJob("r", LoadPlan(0, 512, tuple(chunks), 1.0), ([1, 2, 3, 4],), background=False))
    run.fetches = [concurrent.futures.Future() for _ in chunks]
    stop = threading.Event()

    def land() -> None:  # 8 MiB over 0.6 s of a 1 s deadline, in steps of 20 ms, then both chunks done
        for _ in range(30):
            if stop.wait(0.02):
                return
            run.tally.bytes += 8 * MiB // 30
        for f in run.fetches:
            f.set_result(Staged("memory", "raw", 1))

    t = threading.Thread(target=land)
    t.start()
    try:
        _bare_worker()._collect(run)
    finally:
        stop.set()
        t.join()
    assert run.error is None and len(run.staged or []) == 2
