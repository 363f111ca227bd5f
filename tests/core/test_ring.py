"""The consistent-hash ring: same owner everywhere, balanced shares, minimal movement on leave."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kdn.errors import InvalidAddress, InvalidInput
from kdn.ring import Ring

NODES = [f"edge-{i}" for i in range(8)]


def addrs(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [rng.randbytes(32).hex() for _ in range(n)]


def test_empty_ring_has_no_owner():
    r = Ring()
    a = addrs(1)[0]
    assert r.owner(a) is None
    assert r.preference(a) == []
    assert r.shares() == {}
    assert len(r) == 0 and r.nodes == []


def test_invalid_address_raises():
    r = Ring(NODES[:3])
    for bad in ("", "AB" * 32, "ab" * 31, "zz" * 32, b"ab" * 32, None, "ab" * 32 + "\n"):
        with pytest.raises(InvalidAddress):
            r.owner(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidAddress):
            r.preference(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidAddress):
        Ring().owner("nope")  # validated even when empty


def test_invalid_node_and_vnodes():
    with pytest.raises(InvalidInput):
        Ring(["a/b"])
    with pytest.raises(InvalidInput):
        Ring(vnodes=0)


def test_owner_independent_of_instance_and_insertion_order():
    a = Ring(NODES)
    b = Ring(reversed(NODES))
    c = Ring()
    for n in random.Random(3).sample(NODES, len(NODES)):
        c.add(n)
    c.add(NODES[0])  # re-adding changes nothing
    assert a.nodes == b.nodes == c.nodes == sorted(NODES)
    for x in addrs(2000):
        assert a.owner(x) == b.owner(x) == c.owner(x)
    assert a.shares() == b.shares() == c.shares()


# Pinned placements: every edge and client must compute the same owner, in any
# process and any version; a change here re-homes every cached object.
VECTORS = {"00" * 32: "edge-4", "ab" * 32: "edge-0", "ff" * 32: "edge-1"}  # 320 vnodes


def test_owner_vectors_and_other_processes():
    r = Ring(NODES)
    assert {a: r.owner(a) for a in VECTORS} == VECTORS
    sample = addrs(200)
    code = (
        "import json, sys; from kdn.ring import Ring; r = Ring(json.loads(sys.argv[1]));"
        "print(json.dumps([r.owner(a) for a in json.loads(sys.argv[2])]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")  # Python's hash() would differ; ours must not
    argv = [sys.executable, "-P", "-c", code, json.dumps(NODES), json.dumps(sample)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [r.owner(a) for a in sample]


def test_preference_lists_every_node_once_owner_first():
    r = Ring(NODES)
    for x in addrs(500):
        pref = r.preference(x)
        assert pref[0] == r.owner(x)
        assert sorted(pref) == sorted(NODES)
        assert r.preference(x, 3) == pref[:3]
        assert r.preference(x, 0) == []
        # The fallback after the owner is who owns it once the owner is gone.
        without = Ring(n for n in NODES if n != pref[0])
        assert without.owner(x) == pref[1]


@pytest.mark.parametrize("n", [4, 8])
def test_removing_one_node_moves_only_its_keys(n):
    nodes = NODES[:n]
    full = Ring(nodes)
    sample = addrs(20_000, seed=n)
    before = [full.owner(x) for x in sample]
    shares = full.shares()
    moved_total = 0.0
    for gone in nodes:
        after = Ring(x for x in nodes if x != gone)
        moved = [(b, after.owner(x)) for x, b in zip(sample, before) if after.owner(x) != b]
        assert all(b == gone for b, _ in moved), "a key moved between two survivors"
        share = len(moved) / len(sample)
        assert share == pytest.approx(shares[gone], abs=0.015)  # sampled ~ exact arc share
        # Per node the move is that node's share: 1/N on average, at most the balance bound.
        assert share <= (1 + BALANCE) / n
        moved_total += share
    assert moved_total / n <= 1.1 / n  # the goal holds on average (it is 1/N, up to sampling)
    # The same on adding: a new node takes keys only for itself.
    grown = Ring([*nodes, "edge-new"])
    assert all(grown.owner(x) in (b, "edge-new") for x, b in zip(sample, before))


# 320 vnodes (160 measured; 320 keeps every single departure <= 1.1/N): relative spread ~1/sqrt(320)
# = 8% (1 sigma). Measured for 3-32 nodes named edge-i: within -15%/+14%.
# 25% is ~3 sigma: a bound that holds for other names too, not just these.
BALANCE = 0.25


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_shares_sum_to_one_and_are_balanced(n):
    r = Ring(f"edge-{i}" for i in range(n))
    shares = r.shares()
    assert set(shares) == set(r.nodes) and len(shares) == n
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    for s in shares.values():
        assert abs(s * n - 1) <= BALANCE


def test_shares_match_sampled_ownership():
    r = Ring(NODES[:4])
    sample = addrs(20_000, seed=9)
    counts = {n: 0 for n in r.nodes}
    for x in sample:
        counts[r.owner(x)] += 1
    for node, s in r.shares().items():
        assert counts[node] / len(sample) == pytest.approx(s, abs=0.015)


def test_add_remove_idempotent():
    r = Ring(["a", "b"])
    r.remove("zz")
    r.add("a")
    assert r.nodes == ["a", "b"] and len(r) == 2 and "a" in r
    r.remove("a")
    assert r.nodes == ["b"]
    assert r.owner("00" * 32) == "b"
