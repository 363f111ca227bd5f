"""The chunk-chain replay of bench/eviction.py (``--trace mooncake``) and the policies it compares: the
edge's ARC (``kdn.edge.eviction``, checked here against a textbook ARC) and the bench's LRU, W-TinyLFU and
PrefixLRU (``bench/eviction_policies.py``), each against known behaviour.

All policy-level and fast (a few seconds in all); the cross-checks against theine run when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from blake3 import blake3

from kdn.edge.eviction import ARC, S3FIFO
from kdn.edge.memory import MemoryTier
from kdn.edge.tiers import EntryMeta

_spec = importlib.util.spec_from_file_location("kdn_bench_eviction",
                                               Path(__file__).resolve().parents[2] / "bench" / "eviction.py")
ev = sys.modules.setdefault("kdn_bench_eviction", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(ev)
from eviction_policies import LRU, FrequencySketch, PrefixLRU, WTinyLFU  # noqa: E402 (bench/, on the path now)

pytestmark = pytest.mark.timeout(60)

ALL = {
    "LRU": (LRU, False),
    "S3-FIFO": (S3FIFO, False),
    "ARC": (ARC, False),
    "W-TinyLFU": (lambda b: WTinyLFU(b, capacity=b), False),
    "PrefixLRU": (PrefixLRU, True),
}


def evict(policy, need: int = 1, skip=frozenset()) -> list:
    """What a tier does with unit-size keys: walk victims, remove the ones it may evict, until ``need`` are gone."""
    out = []
    walk = policy.victims()
    for k in walk:
        if k in skip:
            continue
        policy.remove(k)
        out.append(k)
        if len(out) >= need:
            break
    walk.close()
    return out


# --- the replay's accounting -------------------------------------------------


def test_replay_counts_reusable_prefix_tokens_and_object_hits_by_hand():
    chains = [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3], [9, 1, 2]]
    r = ev.replay_chains(LRU, chains, budget=4)
    # [1,2,3]: cold.           cache {1,2,3}
    # [1,2,4]: prefix 2, hits 2; 4 fills.            LRU order 3 1 2 4
    # [1,5]:   prefix 1, hits 1; 5 evicts 3.         order 2 4 1 5
    # [1,2,3]: prefix 2, hits 2; 3 evicts 4.         order 5 1 2 3
    # [9,1,2]: prefix 0 (9 missing first), hits 2.
    assert r.prefix_tokens == (0 + 2 + 1 + 2 + 0) * 256
    assert r.object_hits == 0 + 2 + 1 + 2 + 2
    assert (r.tokens, r.objects) == (14 * 256, 14)
    assert r.max_used == 4
    assert r.prefix_ratio == pytest.approx(5 / 14) and r.object_ratio == pytest.approx(7 / 14)


def test_replay_gives_chain_aware_policies_each_chunks_parent():
    seen = []

    class Spy(PrefixLRU):
        def on_insert(self, key, size, parent=None):
            seen.append((key, parent))
            super().on_insert(key, size, parent=parent)

    ev.replay_chains(Spy, [[1, 2, 3], [1, 2, 4]], budget=10, chain_aware=True)
    assert seen == [(1, None), (2, 1), (3, 2), (4, 2)]


def test_unbounded_cache_hits_every_repeat():
    r = ev.unbounded([[1, 2], [1, 2, 3], [4], [1, 2, 3, 4]])
    assert r.prefix_tokens == (2 + 4) * 256 and r.object_hits == 2 + 4


def test_mooncake_loader_sorts_by_time_and_splits_blocks_in_two(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": 5, "input_length": 700, "output_length": 1, "hash_ids": [0, 1]},
            {"timestamp": 1, "input_length": 300, "output_length": 1, "hash_ids": [0]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert ev.load_mooncake(p) == [[0, 1], [0, 1, 2, 3]]
    chains = ev.load_mooncake()  # the shipped trace: 12,031 requests, every one starting at block 0
    assert len(chains) == 12_031 and all(ch[:2] == [0, 1] for ch in chains)


def test_synthetic_requests_are_prefixes_of_their_documents():
    chains = ev.synthetic_chains(n_docs=50, n_requests=400, alpha=1.0, max_chunks=20, seed=3)
    assert chains == ev.synthetic_chains(n_docs=50, n_requests=400, alpha=1.0, max_chunks=20, seed=3)
    for ch in chains:
        assert 1 <= len(ch) <= 20 and ch == list(range(ch[0], ch[0] + len(ch)))
    firsts = {ch[0] for ch in chains}
    assert all(ch[0] in firsts for ch in chains) and len(firsts) <= 50


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("frac", [0.01, 0.1, 0.3])
def test_budget_is_never_exceeded_and_the_policy_agrees_with_the_cache(name, frac):
    factory, aware = ALL[name]
    made = []

    def make(budget):
        made.append(factory(budget))
        return made[-1]

    chains = ev.synthetic_chains(n_docs=200, n_requests=600, alpha=0.9, max_chunks=40, seed=1)
    budget = max(1, int(ev.working_set(chains) * frac))
    r = ev.replay_chains(make, chains, budget, chain_aware=aware)
    bound = ev.unbounded(chains)
    assert r.max_used <= budget and len(made[0]) <= budget
    assert r.prefix_tokens <= r.object_hits * 256 <= r.tokens
    assert r.prefix_tokens <= bound.prefix_tokens and r.object_hits <= bound.object_hits


def test_theine_replay_respects_the_budget():
    pytest.importorskip("theine_core")
    chains = ev.synthetic_chains(n_docs=200, n_requests=600, alpha=0.9, max_chunks=40, seed=1)
    budget = int(ev.working_set(chains) * 0.05)
    r = ev.replay_theine_runs(chains, budget, runs=3)
    assert r.max_used <= budget and r.prefix_tokens <= r.object_hits * 256 <= r.tokens
    assert r.spread[0] <= r.prefix_ratio <= r.spread[1]


def test_chain_tables_headline_picks_the_strongest_other_policy(capsys):
    chains = ev.synthetic_chains(n_docs=100, n_requests=300, alpha=1.0, max_chunks=30, seed=2)
    runs = [ev.run_chains(chains, [0.05, 0.3])]
    heads = ev.print_chain_tables("t", runs, [0.05, 0.3])
    out = capsys.readouterr().out
    assert "reusable-prefix-token hit ratio" in out and "object hit ratio" in out
    for frac, winner, w_v, other, o_v in heads:
        row = {n: x.prefix_ratio for n, x in runs[0]["results"][frac].items()}
        assert w_v == max(row.values()) and winner != other
        assert o_v == max(v for n, v in row.items() if n != winner)


# --- LRU (the baseline) -------------------------------------------------------


def test_lru_evicts_least_recently_used():
    p = LRU(1_000)
    for i in range(4):
        p.on_insert(i, 1)
    p.on_access(0)
    p.on_access(2)
    assert evict(p, 4) == [1, 3, 0, 2]


def test_the_real_traces_load_and_the_second_is_the_other_release_workload():
    conv, synth = ev.load_mooncake(ev.MOONCAKE), ev.load_mooncake(ev.MOONCAKE_SYNTHETIC)
    assert len(conv) == 12_031 and len(synth) == 3_993
    assert ev.working_set(synth) > 10_000 and all(len(c) % 2 == 0 for c in synth[:100])


# --- ARC ---------------------------------------------------------------------


def test_arc_keeps_a_reused_set_through_a_scan_that_flushes_lru():
    def run(policy):
        cached = set()
        for k in [0, 1, 2, 3, 4] * 2 + list(range(100, 200)):  # five keys used twice, then a one-pass scan
            if k in cached:
                policy.on_access(k)
                continue
            if len(cached) >= 10:
                cached.difference_update(evict(policy))
            policy.on_insert(k, 1)
            cached.add(k)
        return cached

    arc = ARC(10)
    assert {0, 1, 2, 3, 4} <= run(arc)
    assert all(arc.list_of(k) == "T2" for k in range(5)) and arc.p == 0
    assert not ({0, 1, 2, 3, 4} & run(LRU(10)))


def test_arc_adapts_p_on_ghost_hits():
    a = ARC(4)
    for k in "ab":
        a.on_insert(k, 1)
        a.on_access(k)  # T2 = {a, b}
    for k in "cd":
        a.on_insert(k, 1)  # T1 = {c, d}: full
    assert evict(a) == ["c"] and a.list_of("c") == "B1"  # |T1| = 2 > p = 0: from T1, into its ghost
    a.on_insert("e", 1)
    assert evict(a) == ["d"]
    a.on_insert("c", 1)  # a B1 hit: T1 was too small; p grows by one
    assert a.p == 1 and a.list_of("c") == "T2"
    assert evict(a) == ["a"] and a.list_of("a") == "B2"  # |T1| = 1 = p: from T2 now
    a.on_insert("a", 1)  # a B2 hit: p shrinks again
    assert a.p == 0 and a.list_of("a") == "T2"
    assert sorted(k for k in "abcde" if k in a) == ["a", "b", "c", "e"] and len(a) == 4


class TextbookARC:
    """ARC exactly as the paper's Figure 4 (unit sizes), for the cross-check."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def _replace(self, x) -> None:
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            self.b1[self.t1.popitem(last=False)[0]] = None
        else:
            self.b2[self.t2.popitem(last=False)[0]] = None

    def request(self, x) -> bool:
        if x in self.t1 or x in self.t2:
            (self.t1 if x in self.t1 else self.t2).pop(x)
            self.t2[x] = None
            return True
        if x in self.b1:
            self.p = min(self.c, self.p + max(1.0, len(self.b2) / len(self.b1)))
            self._replace(x)
            self.b1.pop(x)
            self.t2[x] = None
        elif x in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self._replace(x)
            self.b2.pop(x)
            self.t2[x] = None
        else:
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == self.c:
                if len(self.t1) < self.c:
                    self.b1.popitem(last=False)
                    self._replace(x)
                else:
                    self.t1.popitem(last=False)
            elif total >= self.c:
                if total == 2 * self.c:
                    self.b2.popitem(last=False)
                self._replace(x)
            self.t1[x] = None
        return False


def unit_trace(n_requests: int, seed: int) -> list[int]:
    """Zipf-ish hot set with bursts of one-pass scans: both ARC lists and both adaptations get used."""
    rng = random.Random(seed)
    out, scan = [], 10_000
    while len(out) < n_requests:
        if rng.random() < 0.05:
            out.extend(range(scan, scan + 60))
            scan += 60
        else:
            out.append(int(rng.paretovariate(0.9)) % 2_000)
    return out[:n_requests]


def replay_units(policy, trace: list[int], budget: int) -> float:
    cached, hits = set(), 0
    for k in trace:
        if k in cached:
            hits += 1
            policy.on_access(k)
            continue
        if len(cached) >= budget:
            cached.difference_update(evict(policy))
        policy.on_insert(k, 1)
        cached.add(k)
        assert len(cached) <= budget and len(policy) == len(cached)
    return hits / len(trace)


@pytest.mark.parametrize("budget", [50, 400])
def test_arc_matches_the_textbook_arc(budget):
    trace = unit_trace(40_000, seed=budget)
    ref = TextbookARC(budget)
    want = sum(ref.request(k) for k in trace) / len(trace)
    got = replay_units(ARC(budget), trace, budget)
    assert got == pytest.approx(want, rel=0.02)
    assert got > replay_units(LRU(budget), trace, budget)


# --- W-TinyLFU ---------------------------------------------------------------


def test_tinylfu_admits_a_key_seen_twice_over_main_but_not_one_hit_wonders():
    wonder, hot, x, y = 1000, 1001, 1002, 1003
    p = WTinyLFU(100, capacity=1024)  # window 1 key, main 99; a wide sketch: no collisions here
    for k in range(100):
        p.on_insert(k, 1)
    assert p.queue_of(99) == "window" and p.queue_of(0) == "probation"
    # each evict() is the room made for the next insert: the window's key (the last one
    # inserted) duels probation's oldest (0), and the less frequent of the two goes
    assert evict(p) == [99]  # seen once vs once: the candidate loses (TinyLFU admits only the more frequent)
    p.on_insert(wonder, 1)
    assert evict(p) == [wonder]
    p.on_insert(hot, 1)
    assert evict(p) == [hot]
    p.on_insert(x, 1)
    assert evict(p) == [x]
    p.on_insert(hot, 1)  # its second request: frequency 2 ...
    assert evict(p) == [0]  # ... beats the victim's 1: 0 goes, and hot moves into main
    assert p.queue_of(hot) == "probation"
    p.on_insert(y, 1)
    assert len(p) == 100 and wonder not in p and x not in p


def test_tinylfu_probation_hit_is_protected_and_protected_overflow_demotes():
    p = WTinyLFU(10, capacity=10)  # window 1, main 9, protected 7
    for k in range(10):
        p.on_insert(k, 1)
    for k in range(8):
        p.on_access(k)
    assert [p.queue_of(k) for k in range(8)].count("protected") == 7
    assert p.queue_of(0) == "probation"  # the oldest protected key was demoted


def test_frequency_sketch_counts_saturates_and_halves():
    s = FrequencySketch(64)
    for _ in range(20):
        s.increment(1)
    for _ in range(3):
        s.increment(2)
    assert s.frequency(1) == 15 and s.frequency(2) >= 3 and s.frequency(3) <= 1
    s.reset()
    assert s.frequency(1) == 7 and s.frequency(2) >= 1
    s2 = FrequencySketch(16)  # sample size 160: aging happens by itself
    for i in range(200):
        s2.increment(i)
    assert s2.additions < 160


def test_tinylfu_matches_theine_on_a_zipf_trace():
    theine_core = pytest.importorskip("theine_core")
    ids, _ = ev.zipf_trace(5_000, 60_000, 0.9, seed=5)
    trace = ids.tolist()
    for budget in (100, 1_000):
        core, cached, hits = theine_core.TlfuCore(budget), set(), 0
        for k in trace:
            h = theine_core.spread(hash(k))
            if h in cached:
                hits += 1
                core.access([h])
            else:
                cached.add(h)
                cached.difference_update(core.set([(h, 0)]))
        ref = hits / len(trace)
        got = replay_units(WTinyLFU(budget, capacity=budget), trace, budget)
        assert got == pytest.approx(ref, rel=0.05), (budget, got, ref)
        assert got > replay_units(LRU(budget), trace, budget)


# --- PrefixLRU ---------------------------------------------------------------


def chain(p: PrefixLRU, keys: str, parent=None) -> None:
    for k in keys:
        if k in p:
            p.on_access(k)
        else:
            p.on_insert(k, 1, parent=parent)
        parent = k


def test_prefix_lru_evicts_the_least_recent_chain_from_its_tail():
    p = PrefixLRU()
    chain(p, "abc")
    chain(p, "de")
    lru = LRU()
    for k in "abcde":
        lru.on_insert(k, 1)
    assert evict(lru) == ["a"]  # LRU strands b and c: no request can reuse them
    assert evict(p, 3) == ["c", "b", "a"]
    assert evict(p, 2) == ["e", "d"] and len(p) == 0


def test_prefix_lru_keeps_a_shared_head_while_any_chain_under_it_lives():
    p = PrefixLRU()
    chain(p, "sx")  # s: a system prompt, x and y: two conversations on it
    chain(p, "sy")
    chain(p, "z")
    assert evict(p) == ["x"]
    assert evict(p) == ["y"]  # s is older than z, but only now a leaf
    assert evict(p) == ["s"]
    assert evict(p) == ["z"]


def test_prefix_lru_evicts_orphans_first_and_adopts_them_back():
    p = PrefixLRU()
    chain(p, "ab")
    p.on_insert("q", 1, parent="missing")  # its parent is not here: no prefix can reach it
    chain(p, "cd")
    assert evict(p) == ["q"]
    p.on_insert("k", 1, parent="j")  # orphan ...
    p.on_insert("j", 1)  # ... until its parent arrives: now a normal leaf
    assert evict(p) == ["b"]
    p.on_access("j")
    p.on_access("k")
    assert evict(p, 3) == ["a", "d", "c"]


def test_prefix_lru_without_parents_is_lru():
    rng = random.Random(4)
    p, lru, cached = PrefixLRU(), LRU(), set()
    for _ in range(5_000):
        k = rng.randrange(300)
        if k in cached:
            p.on_access(k)
            lru.on_access(k)
            continue
        if len(cached) >= 100:
            v = evict(p)
            assert v == evict(lru)
            cached.difference_update(v)
        p.on_insert(k, 1)
        lru.on_insert(k, 1)
        cached.add(k)


def test_prefix_lru_walk_skips_refused_keys_and_ends():
    p = PrefixLRU()
    chain(p, "abc")
    chain(p, "de")
    assert evict(p, skip={"c"}) == ["e"]  # c is held: the next leaf in order goes
    # d and c held: their ancestors are offered last, least recently used first; then the walk ends
    assert evict(p, 10, skip={"c", "d"}) == ["a", "b"]
    assert sorted(k for k in "abcde" if k in p) == ["c", "d"]


# --- in a real tier -------------------------------------------------------------


@pytest.mark.parametrize("policy", [ARC, WTinyLFU, PrefixLRU])
async def test_new_policies_keep_a_memory_tier_within_budget_with_readers(policy):
    rng = random.Random(7)
    budget = 20_000
    tier = MemoryTier(budget, policy)
    held = []
    for _ in range(400):
        i = rng.randrange(120)
        op = rng.random()
        k = (blake3(f"key {i}".encode()).hexdigest(), "raw")
        if op < 0.55:
            data = bytes([i]) * rng.randint(1, 4_000)
            ok = await tier.put(k, data, EntryMeta(size=len(data), digest=blake3(data).hexdigest(),
                                                     namespace="public"))
            assert ok or tier.used + 4_000 > budget
        elif op < 0.85:
            h = await tier.acquire(k)
            if h is not None:
                held.append(h)
        elif held:
            held.pop(rng.randrange(len(held))).release()
        assert 0 <= tier.used <= budget
        assert len(tier._policy) == len(tier.keys())
    for h in held:
        h.release()
    assert tier.used == sum(m.size for _, m in tier.entries())
