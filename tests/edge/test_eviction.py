"""Policy-level cases for the edge's policies, S3-FIFO and ARC (the default); what every tier must do is in
test_tier_contract.py; the bench's comparison policies (LRU, W-TinyLFU, PrefixLRU) in tests/bench."""

from __future__ import annotations

import pytest

from kdn.edge import eviction
from kdn.edge.eviction import ARC, S3FIFO


def evict(policy, need: int, sizes: dict, skip=frozenset()) -> list:
    """What a tier does: walk victims, remove the ones it may evict, until ``need`` bytes are freed."""
    out, freed = [], 0
    walk = policy.victims()
    for k in walk:
        if k in skip:
            continue
        policy.remove(k)
        out.append(k)
        freed += sizes[k]
        if freed >= need:
            break
    walk.close()
    return out


def filled(policy_cls, budget: int, n: int, size: int = 10):
    p = policy_cls(budget)
    sizes = {}
    for i in range(n):
        p.on_insert(i, size)
        sizes[i] = size
    return p, sizes


def test_s3fifo_one_hit_wonders_leave_from_the_small_queue():
    p, sizes = filled(S3FIFO, 50, 5)  # a full cache; small target: 5 bytes
    assert all(p.queue_of(i) == "small" for i in range(5))
    assert evict(p, 20, sizes) == [0, 1]
    assert p.queue_of(0) == p.queue_of(1) == "ghost"
    assert len(p) == 3


def test_s3fifo_reaccessed_entry_is_promoted_to_main():
    p, sizes = filled(S3FIFO, 50, 5)
    p.on_access(0)
    assert evict(p, 10, sizes) == [1]  # 0 was hit while in S: moved to M, not evicted
    assert p.queue_of(0) == "main" and p.queue_of(1) == "ghost"


def test_s3fifo_ghost_hit_goes_to_main():
    p, sizes = filled(S3FIFO, 1_000, 3)
    assert evict(p, 10, sizes) == [0]
    assert p.queue_of(0) == "ghost"
    p.on_insert(0, 10)  # seen recently: straight to M
    assert p.queue_of(0) == "main" and 0 in p


def test_s3fifo_main_reinserts_by_frequency():
    p = S3FIFO(100)  # small target 10 bytes
    sizes = {k: 10 for k in "abc"}
    for k in "abc":  # through the ghost into main
        p.on_insert(k, 10)
        assert evict(p, 10, sizes) == [k]
        p.on_insert(k, 10)
    assert [p.queue_of(k) for k in "abc"] == ["main"] * 3
    p.on_access("a")
    p.on_access("a")
    p.on_access("b")
    assert evict(p, 10, sizes) == ["c"]  # a and b spend a frequency bit each and stay
    assert evict(p, 10, sizes) == ["b"]
    assert evict(p, 10, sizes) == ["a"]


def test_s3fifo_is_byte_sized():
    p = S3FIFO(1_000)
    p.on_insert("big", 150)  # alone over the 100-byte small target
    p.on_insert("x", 10)
    p.on_access("x")
    assert evict(p, 10, {"big": 150, "x": 10}) == ["big"]


def test_s3fifo_frequency_is_capped_at_three():
    p = S3FIFO(100)
    p.on_insert("a", 10)
    for _ in range(10):
        p.on_access("a")
    assert p._freq["a"] == 3


@pytest.mark.parametrize("policy_cls", [S3FIFO, ARC])
def test_skipped_victims_stay_and_the_walk_ends(policy_cls):
    p, sizes = filled(policy_cls, 60, 6)
    p.on_access(2)
    # S3-FIFO moves 2 (hit while in S) to M and offers it after S; ARC moves it to T2, replaced after T1.
    assert evict(p, 10**9, sizes, skip={0, 3}) == [1, 4, 5, 2]
    assert 0 in p and 3 in p and len(p) == 2
    assert sorted(p.victims()) == [0, 3]  # refused keys are offered again by the next walk


@pytest.mark.parametrize("policy_cls", [S3FIFO, ARC])
def test_remove_forgets_a_key(policy_cls):
    p, sizes = filled(policy_cls, 1_000, 3)
    p.remove(1)
    p.remove(42)  # unknown: no error
    assert 1 not in p and evict(p, 10**9, sizes) == [0, 2]


def test_a_hot_set_reused_just_past_the_cache_stays_in_s3fifo_and_not_in_arc():
    """Each round: five hot keys, then six keys seen once, in a cache of ten. The hot keys come back after
    eleven others, past the cache: S3-FIFO's main queue keeps them; ARC's ghost hits on them grow T1 (the
    wrong way here), so like LRU it keeps none. Why ``--eviction s3-fifo`` stays (docs/benchmarks.md):
    ARC won on the real traces summed over budgets, not on every workload."""
    hot = [f"h{i}" for i in range(5)]
    results = {}
    for cls in (S3FIFO, ARC):
        p, used, sizes = cls(100), 0, {}
        hits = 0
        for rnd in range(40):
            for k in hot + [f"scan{rnd}-{j}" for j in range(6)]:
                if k in p:
                    p.on_access(k)
                    hits += k in hot
                    continue
                while used + 10 > 100:
                    v = evict(p, 10, sizes)[0]
                    used -= sizes.pop(v)
                p.on_insert(k, 10)
                sizes[k] = 10
                used += 10
        results[cls.__name__] = hits
    assert results["S3FIFO"] > 150 and results["ARC"] == 0, results


def test_the_edge_offers_its_policies_by_name_and_defaults_to_the_trace_chosen_one():
    assert eviction.policy_named("arc") is ARC and eviction.policy_named("s3-fifo") is S3FIFO
    assert eviction.POLICIES[eviction.DEFAULT_POLICY] is ARC
    with pytest.raises(ValueError, match="use one of arc, s3-fifo"):
        eviction.policy_named("lru")


@pytest.mark.parametrize("policy_cls", [S3FIFO, ARC])
def test_ghosts_are_bounded_in_keys_as_well_as_bytes(policy_cls, monkeypatch):
    # Ghosts are bounded by bytes like the cache; a tier of tiny objects would keep millions of keys.
    monkeypatch.setattr(eviction, "MAX_GHOST_KEYS", 50)
    p = policy_cls(10**9)
    for i in range(1_000):  # one-byte keys, each evicted at once: every one becomes a ghost
        p.on_insert(i, 1)
        assert evict(p, 1, {i: 1}) == [i]
    where = p.queue_of if policy_cls is S3FIFO else p.list_of
    ghosts = [k for k in range(1_000) if where(k) in ("ghost", "B1", "B2")]
    assert len(ghosts) == 50 and ghosts == list(range(950, 1_000))  # the newest are kept
