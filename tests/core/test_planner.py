"""The load planner: load what is faster to load than to compute, on measured speeds (kdn/planner.py)."""

from __future__ import annotations

import math

import pytest

from kdn.chunk import Chunk
from kdn.planner import LEARN_TOKENS, PROBE_AFTER_S, PrefillModel, Speeds, decide

MiB = 1 << 20


def llama8b() -> PrefillModel:
    """A Llama-3-8B shape whose prefill of 8k tokens takes ~246 ms (an H200, docs/benchmarks.md)."""
    m = PrefillModel(params=8_000_000_000, layers=32, attn_width=4096)
    m.observe(8192, 0, 0.246)
    return m


def chunks(n=32, tokens=256, nbytes=32 * MiB, host=False):
    return [Chunk(f"{i:064x}", i * tokens, (i + 1) * tokens, "raw", "0" * 64, nbytes, host=host) for i in range(n)]


def link(gbps: float, rtt: float = 0.001):
    return lambda b: rtt + b / (gbps * 1e9)


def test_a_fast_link_loads_everything():
    p = decide(chunks(), 8192 + 16, link=link(50), speeds=Speeds(llama8b()))
    assert (p.head, p.load) == (0, 32) and p.tokens_loaded == 8192
    assert p.speedup > 5 and p.expected_load_s < 0.05
    assert p.deadline_s == pytest.approx(max(2 * p.expected_load_s + 0.05, 0.25 * p.compute_all_s))


def test_a_slow_link_computes_everything():
    p = decide(chunks(), 8192 + 16, link=link(1), speeds=Speeds(llama8b()))
    assert not p.loads_anything and p.load == 0 and p.tokens_loaded == 0
    assert p.reason.startswith("compute: load") and p.expected_s == p.compute_all_s
    assert math.isinf(p.deadline_s)


def test_a_slow_loader_counts_even_over_a_fast_link():
    """The engine's own measured load speed (fetch to cache) bounds the link's."""
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 2.0)  # 0.5 GB/s into the cache, measured
    assert not decide(chunks(), 8192 + 16, link=link(50), speeds=s).loads_anything


def test_unmeasured_prefill_loads_and_says_why():
    p = decide(chunks(4), 1040, link=link(0.01), speeds=Speeds(PrefillModel(1_000_000, 2, 64)))
    assert p.load == 4 and p.reason == "load: prefill not measured yet"


def test_head_overlap_computes_the_head_while_the_tail_loads():
    """Over a link where loading everything is a bit slower than computing, an engine that can compute its
    head meanwhile loads only the tail (the head's compute hides under the transfer)."""
    speeds = Speeds(llama8b())
    no = decide(chunks(), 8192 + 16, link=link(4), speeds=speeds)
    yes = decide(chunks(), 8192 + 16, link=link(4), speeds=speeds, overlap=True)
    assert yes.expected_s <= no.expected_s
    assert yes.head > 0 and yes.load == 32 and yes.expected_s < yes.compute_all_s


def test_a_deadline_cap_bounds_the_load():
    p = decide(chunks(), 8192 + 16, link=link(50), speeds=Speeds(llama8b()), max_deadline_s=0.01)
    assert p.deadline_s == 0.01


def test_small_forwards_teach_the_fixed_cost_not_the_per_flop_one():
    m = PrefillModel(params=8_000_000_000, layers=32, attn_width=4096)
    m.observe(16, 8192, 0.010)  # a 16-token suffix: launch overhead, mostly
    assert m.k is None and m.fixed == 0.010 and math.isinf(m.seconds(8192))
    m.observe(LEARN_TOKENS * 4, 0, 0.05)
    assert m.k is not None and m.seconds(8192) > m.seconds(1024) > m.fixed
    assert m.seconds(1024, after=8192) > m.seconds(1024)  # attention grows with what is cached


def test_nothing_published_computes():
    p = decide([], 100, link=link(50), speeds=Speeds(llama8b()))
    assert not p.loads_anything and p.reason == "nothing published"


def test_where_a_prefill_is_dear_a_load_may_run_long_before_it_is_abandoned():
    """On a CPU a prefill takes seconds and a load milliseconds: a noisy moment must not throw the load away."""
    slow = PrefillModel(params=8_000_000_000, layers=32, attn_width=4096)
    slow.observe(8192, 0, 20.0)
    p = decide(chunks(), 8192 + 16, link=link(3), speeds=Speeds(slow))
    assert p.load == 32 and p.expected_load_s < 0.5 and p.deadline_s == pytest.approx(0.25 * p.compute_all_s)


def test_an_abandoned_load_sets_the_speed_to_what_landed_at_once():
    """A load given up at its deadline reports the bytes that landed by then: that speed, no moving average's
    step (and never a rise)."""
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 0.1)  # 10 GB/s, measured
    s.observe_load(64 << 20, 2.0, abandoned=True)  # then a load given up after 2 s, 64 MiB in
    assert s.load_bps == pytest.approx((64 << 20) / 2.0)
    s.observe_load(1 << 30, 0.1, abandoned=True)  # an abandoned load never raises the estimate
    assert s.load_bps == pytest.approx((64 << 20) / 2.0)
    p = decide(chunks(), 8192 + 16, link=link(1), speeds=s)
    assert p.outcome == "compute"  # 1 GiB at 32 MiB/s loses to the 8B model's prefill


def test_an_abandoned_load_that_moved_nothing_makes_loads_lose_until_the_probe():
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 0.1, now=0.0)
    s.observe_load(0, 0.5, now=1.0, abandoned=True)  # a stalled source: no byte in 0.5 s
    assert s.load_bps is not None and s.load_bps <= 2.0
    assert decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=2.0).outcome == "compute"
    assert decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=1.0 + PROBE_AFTER_S + 1).outcome == "probe"
    s.observe_load(0, 0.0, abandoned=True)  # no time: nothing learnt
    assert s.loads == 2


def test_cached_tokens_are_costed_after_what_the_engine_holds():
    s = Speeds(llama8b())
    p = decide(chunks(8), 4096 + 16, link=link(1), speeds=s, cached=4096)
    assert p.compute_all_s == pytest.approx(s.prefill.seconds(4096 + 16, 4096))
    assert p.compute_all_s > s.prefill.seconds(4096 + 16)  # attention over the held tokens costs too
    assert p.outcome == "compute"


def test_a_stale_speed_is_replaced_by_the_next_measurement_not_blended():
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 10.0, now=0.0)  # slow, 100 MB/s
    s.observe_load(1 << 30, 0.1, now=1.0)  # fresh: a moving average's step
    assert s.load_bps == pytest.approx((1 << 30) / 10 + 0.3 * ((1 << 30) / 0.1 - (1 << 30) / 10))
    s.observe_load(1 << 30, 10.0, now=2.0, abandoned=True)
    s.observe_load(32 << 20, 0.01, now=100.0)  # a probe after 98 s: its speed, as measured
    assert s.load_bps == pytest.approx((32 << 20) / 0.01)


def test_the_probe_a_plan_asked_for_replaces_the_stale_speed():
    """The real order: a stale speed makes a plan ask for a probe (which marks the link as just probed), then the
    probe lands. Its speed must replace the stale one, not be blended into it: blended, a 50x faster link read
    as 15x and an engine with a fast prefill kept computing after the link recovered."""
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 10.0, now=0.0)  # slow when last measured: ~107 MB/s
    assert decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=100.0).outcome == "probe"
    s.observe_load(32 << 20, 0.01, now=100.2, probe=True)  # the probe lands: 3.4 GB/s
    assert s.load_bps == pytest.approx((32 << 20) / 0.01)
    s2 = Speeds(llama8b())  # the same landing as a load, not a probe: blended (what the probe must not be)
    s2.observe_load(1 << 30, 10.0, now=0.0)
    decide(chunks(), 8192 + 16, link=link(1), speeds=s2, now=100.0)
    s2.observe_load(32 << 20, 0.01, now=100.2)
    assert s2.load_bps < 0.5 * (32 << 20) / 0.01


def test_one_probe_per_stale_period_even_before_it_measures():
    """Requests planned while a probe is on the wire compute: a stale speed costs one chunk per period."""
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 10.0, now=0.0)  # slow when last measured
    first = decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=100.0)
    second = decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=100.5)
    assert first.reason.startswith("probe") and first.probe_s > 0 and not second.loads_anything
    assert not second.probe_s
    # The probe is off the request path: the request itself computes it all, at a prefill's cost.
    assert not first.loads_anything and first.expected_s == first.compute_all_s
    assert math.isfinite(first.probe_s) and first.probe_s >= 1.0
    assert decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=100.0 + PROBE_AFTER_S + 1).reason.startswith("probe")
    assert not decide(chunks(), 8192 + 16, link=link(1), speeds=s, now=300.0, probe=False).loads_anything


def test_a_load_that_would_overrun_its_deadline_is_given_up_once_an_eighth_of_it_has_passed():
    """``overruns``: judged by the load's own progress (bytes landed over time run), never before an eighth of
    its deadline, and only past the margin (1.5x the deadline at the speed so far)."""
    from kdn.planner import OVERRUN_AFTER, OVERRUN_MARGIN, STALL_AFTER, overruns

    total, d = 100 * MiB, 2.0
    assert not overruns(OVERRUN_AFTER * d * 0.99, 1, total, d)  # too early to judge, even a trickle
    assert not overruns(OVERRUN_AFTER * d, 0, total, d)  # nothing yet: a first byte may wait on a busy machine
    assert overruns(STALL_AFTER * d, 0, total, d)  # a stalled source: nothing landed in half the deadline
    assert not overruns(0.25, 1 * MiB, total, d)  # a trickle, but too little landed to judge a speed yet ...
    assert overruns(1.0, 1 * MiB, total, d)  # ... until half the deadline: 100 s at this speed against 2 s
    assert not overruns(0.03, 3_012_846, 47_265_888, 0.208)  # a fast link's first 30 ms (bench/vllm_plan.py)
    # The wait for the first byte (a 40 ms round trip) is paid once, not per byte (bench/ttft.py's far link):
    assert overruns(0.063, 4_126_227, 32_536_963, 0.298)  # judged from the start: 500 ms projected
    assert not overruns(0.063, 4_126_227, 32_536_963, 0.298, first_s=0.045)  # from its first byte: 187 ms
    assert overruns(1.0, 1 * MiB, total, d, first_s=0.4)  # a trickle after a late first byte is still one
    on_time = 0.25 * total / (0.9 * d)  # the speed that ends at 0.9x the deadline, after 0.25 s
    assert not overruns(0.25, int(on_time), total, d)
    slow_start = int(0.65 * on_time)  # 0.65x that landed (the first byte waited): still within the margin
    assert not overruns(0.25, slow_start, total, d)
    edge = 0.5 * total / (OVERRUN_MARGIN * d)  # exactly at the margin after 0.5 s: not yet; a little under: yes
    assert not overruns(0.5, int(edge) + 1, total, d) and overruns(0.5, int(edge) - 1, total, d)
    assert not overruns(1.9, total, total, d)  # everything landed: nothing to give up
    assert not overruns(5.0, 0, total, math.inf)  # no deadline (no planner): never judged
    # TCP's slow start over a link with a 20 ms delay: 256 KiB of a 7.8 MB load 65 ms in, of a 672 ms deadline
    # (bench/ttft.py's far edge; the whole load takes ~90 ms). Not judged on so few bytes before half the
    # deadline; at half of it, what has landed is its speed.
    assert not overruns(0.065, 256 << 10, 7_800_000, 0.672)
    assert overruns(0.336, 256 << 10, 7_800_000, 0.672)


def test_a_stale_speed_a_probe_cannot_re_measure_is_not_used():
    """One load given up on a slow link sets the measured speed low. A warm hit re-measures it by a probe
    beside a request that computes; a cold one cannot (the edge must fill first: a probe would time the
    edge's upstream), so once stale the speed is not used and the plan goes by the link's estimate: before,
    such an engine computed every new document from then on (bench/ttft.py)."""
    s = Speeds(PrefillModel(params=135e6, layers=30, attn_width=576))
    s.prefill.observe(2048, 0, 1.0)
    s.observe_load(256 << 10, 0.065, now=100.0, abandoned=True)  # ~4 MB/s
    fast = link(1e9)  # the link's own estimate: fast
    assert not decide(chunks(), 8192 + 16, link=fast, speeds=s, now=110.0, probe=False).loads_anything  # fresh
    late = 100.0 + PROBE_AFTER_S + 1
    assert decide(chunks(), 8192 + 16, link=fast, speeds=s, now=late, probe=False).loads_anything  # cold, stale
    warm = decide(chunks(), 8192 + 16, link=fast, speeds=s, now=late, probe=True)  # warm, stale: probed instead
    assert not warm.loads_anything and warm.probe_s > 0


def test_chunks_the_host_tier_holds_are_costed_at_the_hosts_speed_not_the_links():
    """Over a slow link the hit computes; the same hit held by the machine's host tier loads (at the host's
    measured speed, which the link's does not drag down, nor the host's lift), and a hit half held costs both."""
    s = Speeds(llama8b())
    s.observe_load(1 << 30, 10.0)  # the edge's loads: 0.1 GB/s
    s.observe_load(1 << 30, 0.04, host=True)  # the host's: ~27 GB/s (a pinned DMA)
    assert s.load_bps == pytest.approx((1 << 30) / 10.0) and s.loads == 1 and s.host_loads == 1
    held = chunks(host=True)
    assert not decide(chunks(), 8192 + 16, link=link(1), speeds=s).loads_anything
    p = decide(held, 8192 + 16, link=link(1), speeds=s)
    assert p.load == 32 and p.expected_load_s == pytest.approx(32 * 32 * MiB / s.host_bps)
    half = held[:16] + chunks(16)
    q = decide(half, 8192 + 16, link=link(50), speeds=s)  # what the host holds loads, the slow edge's half computes
    assert q.load == 16 and q.expected_load_s == pytest.approx(16 * 32 * MiB / s.host_bps)
    fast = Speeds(llama8b())  # an edge not measured slow: both halves load, their times summed
    fast.observe_load(1 << 30, 0.04, host=True)
    r = decide(half, 8192 + 16, link=link(50), speeds=fast)
    assert r.load == 32 and r.expected_load_s == pytest.approx(16 * 32 * MiB / fast.host_bps + link(50)(16 * 32 * MiB))


def test_before_the_host_tier_is_measured_its_prior_is_used():
    from kdn.planner import HOST_PRIOR_BPS

    p = decide(chunks(1, host=True), 256 + 16, link=link(0.001), speeds=Speeds(llama8b()))
    assert p.expected_load_s == pytest.approx(32 * MiB / HOST_PRIOR_BPS)
