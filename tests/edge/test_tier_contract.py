"""One contract suite that every cache tier passes (memory, disk), under both eviction policies where it matters."""

from __future__ import annotations

import asyncio
import random

import pytest
from blake3 import blake3

from kdn.edge.disk import DiskTier
from kdn.edge.eviction import ARC, S3FIFO
from kdn.edge.memory import MemoryTier
from kdn.edge.tiers import EntryMeta, PolicyState
from kdn.errors import InvalidInput


def key(i: int, enc: str = "raw") -> tuple[str, str]:
    return blake3(f"key {i}".encode()).hexdigest(), enc


def blob(i: int, size: int) -> bytes:
    return (f"<{i}>".encode() * (size // 3 + 2))[:size]


def meta(data: bytes, ns: str = "public", **kw) -> EntryMeta:
    return EntryMeta(size=len(data), digest=blake3(data).hexdigest(), namespace=ns, **kw)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "disk"])
def make_tier(request, tmp_path):
    """``make_tier(budget, policy=ARC)`` -> (tier, clock); several calls give separate tiers."""
    made = 0

    def make(budget: int, policy=ARC, **kw):
        nonlocal made
        made += 1
        clock = Clock()
        if request.param == "memory":
            return MemoryTier(budget, policy, clock=clock, **kw), clock
        return DiskTier(tmp_path / f"disk{made}", budget, policy, fsync=False, clock=clock, **kw), clock

    return make


async def put(tier, i, size, ns="public", **kw) -> bool:
    data = blob(i, size)
    return await tier.put(key(i), data, meta(data, ns, **kw))


async def test_round_trip_returns_the_same_bytes(make_tier):
    tier, _ = make_tier(10_000)
    data = blob(1, 777)
    assert await tier.put(key(1), memoryview(data), meta(data))
    assert tier.contains(key(1)) and tier.used == 777
    with await tier.acquire(key(1)) as h:
        assert h.size == 777 and h.meta.digest == blake3(data).hexdigest()
        assert bytes(await h.read()) == data
        if tier.name == "memory":
            assert isinstance(h.data, memoryview) and h.data == data
        else:
            assert h.path.read_bytes() == data
    assert tier.keys() == [key(1)]
    assert [k for k, _ in tier.entries()] == [key(1)]
    assert await tier.put(key(1), data, meta(data))  # already there: fine, not written twice
    assert tier.used == 777


async def test_miss_is_none_and_counted(make_tier):
    tier, _ = make_tier(10_000)
    assert await tier.acquire(key(9)) is None
    await put(tier, 1, 10)
    assert await tier.acquire(key(1, "zstd")) is None  # other encoding, other key
    (await tier.acquire(key(1))).release()
    assert (tier.stats.hits, tier.stats.misses, tier.stats.hit_bytes) == (1, 2, 10)


async def test_bad_input_is_refused(make_tier):
    tier, _ = make_tier(10_000)
    with pytest.raises(InvalidInput):
        await tier.acquire(("../etc/passwd", "raw"))
    with pytest.raises(InvalidInput):
        await tier.put(key(1), b"abc", meta(b"abcd"))  # size disagrees
    with pytest.raises(InvalidInput):
        EntryMeta(size=1, digest="x", namespace="public")


@pytest.mark.parametrize("policy", [ARC, S3FIFO])
@pytest.mark.parametrize("seed", [0, 1])
async def test_budget_is_never_exceeded(make_tier, policy, seed):
    rng = random.Random(seed)
    budget = 20_000
    tier, _ = make_tier(budget, policy)
    held = []
    for step in range(400):
        i = rng.randrange(120)  # repeats: hits, re-inserts
        op = rng.random()
        if op < 0.55:
            ok = await put(tier, i, rng.randint(1, 4_000))
            assert ok or tier.used + 4_000 > budget
        elif op < 0.85:
            h = await tier.acquire(key(i))
            if h is not None:
                assert bytes(await h.read()) == blob(i, h.size)
                held.append(h)
        elif held:
            held.pop(rng.randrange(len(held))).release()
        assert 0 <= tier.used <= budget
        live = sum(m.size for _, m in tier.entries())
        assert live <= tier.used
    for h in held:
        h.release()
    assert tier.used == sum(m.size for _, m in tier.entries())


async def test_entry_held_by_a_reader_is_not_evicted_until_release(make_tier):
    tier, _ = make_tier(10_000)
    evicted = []
    tier.on_evict = lambda k, m, reason: evicted.append(k)
    await put(tier, 0, 3_000)
    h = await tier.acquire(key(0))
    for i in range(1, 40):  # far more than fits
        assert await put(tier, i, 3_000)
        assert tier.used <= 10_000
    assert tier.contains(key(0)) and key(0) not in evicted
    assert bytes(await h.read()) == blob(0, 3_000)
    h.release()
    h.release()  # idempotent
    for i in range(40, 80):  # re-read entries: hot enough to push a released one out under any policy
        await put(tier, i, 1_000)
        (await tier.acquire(key(i))).release()
    assert not tier.contains(key(0)) and key(0) in evicted


async def test_delete_of_a_held_entry_waits_for_the_last_release(make_tier):
    tier, _ = make_tier(10_000)
    await put(tier, 0, 4_000)
    h1, h2 = await tier.acquire(key(0)), await tier.acquire(key(0))
    assert await tier.delete(key(0))
    assert not tier.contains(key(0)) and await tier.acquire(key(0)) is None
    assert tier.used == 4_000  # still held: still counted
    h1.release()
    assert bytes(await h2.read()) == blob(0, 4_000)  # bytes stay valid under the last reader
    if tier.name == "disk":
        assert h2.path.exists()
    h2.release()
    assert tier.used == 0
    if tier.name == "disk":
        assert not h2.path.exists()
    assert not await tier.delete(key(0))


async def test_put_of_a_deleted_but_held_entry_takes_it_back(make_tier):
    tier, _ = make_tier(10_000)
    await put(tier, 0, 1_000)
    h = await tier.acquire(key(0))
    await tier.delete(key(0))
    assert await put(tier, 0, 1_000)
    h.release()
    assert tier.contains(key(0)) and tier.used == 1_000
    with await tier.acquire(key(0)) as h2:
        assert bytes(await h2.read()) == blob(0, 1_000)


async def test_pinned_entries_survive_pressure(make_tier):
    tier, _ = make_tier(10_000)
    tier.apply_policy(lambda k, m: PolicyState(pinned=m.manifest == "public/handbook"))
    await put(tier, 0, 2_000, manifest="public/handbook")
    await put(tier, 1, 2_000, manifest="public/handbook")
    for i in range(2, 50):
        assert await put(tier, i, 2_000)
    assert tier.contains(key(0)) and tier.contains(key(1))
    assert all(m.pinned == (m.manifest is not None) for _, m in tier.entries())
    # Only 2 KB is left unpinned: a 7 KB object cannot fit, and nothing is evicted trying.
    before = set(tier.keys())
    assert not await put(tier, 99, 7_000)
    assert set(tier.keys()) == before and tier.stats.refused == 1
    tier.apply_policy(lambda k, m: PolicyState())  # unpin: now they may go
    for i in range(50, 60):
        await put(tier, i, 2_000)
    assert not tier.contains(key(0)) and not tier.contains(key(1))


async def test_policy_applied_while_a_put_is_in_flight_reaches_that_entry(make_tier):
    tier, _ = make_tier(10_000)
    data = blob(0, 1_000)
    writing = asyncio.ensure_future(tier.put(key(0), data, meta(data)))
    await asyncio.sleep(0)  # the put has reserved its room; the disk tier is still writing in a thread
    tier.apply_policy(lambda k, m: PolicyState(pinned=k == key(0)))  # the rule decides by key
    assert await writing
    assert dict(tier.entries())[key(0)].pinned


async def test_pin_everything_refuses_inserts(make_tier):
    tier, _ = make_tier(5_000)
    tier.apply_policy(lambda k, m: PolicyState(pinned=True))
    assert await put(tier, 0, 3_000)
    assert not await put(tier, 1, 3_000)
    assert tier.contains(key(0)) and not tier.contains(key(1))


async def test_expired_entries_go_first_and_expire_purges_them(make_tier):
    tier, clock = make_tier(10_000)
    reasons = []
    tier.on_evict = lambda k, m, reason: reasons.append((k, reason))
    tier.apply_policy(lambda k, m: PolicyState(expires_at=m.inserted_at + 60 if m.namespace == "news" else None))
    await put(tier, 0, 3_000)
    await put(tier, 1, 3_000, ns="news")  # newer than 0, but it will expire
    await put(tier, 2, 3_000)
    clock.now += 61
    assert await put(tier, 3, 3_000)  # needs 2 KB: the expired one goes, not the oldest
    assert reasons == [(key(1), "ttl")]
    assert tier.contains(key(0)) and tier.contains(key(2))
    await put(tier, 4, 500, ns="news")
    await put(tier, 5, 500, ns="news")
    h = await tier.acquire(key(5))  # in use: expire() leaves it until release
    assert await tier.expire(clock.now + 30) == 0
    assert await tier.expire(clock.now + 61) == 1
    assert not tier.contains(key(4)) and tier.contains(key(5))
    h.release()
    assert await tier.expire(clock.now + 61) == 1
    assert tier.stats.evictions["ttl"] == 3 and tier.stats.evictions["capacity"] == 0


async def test_pinned_beats_ttl(make_tier):
    tier, clock = make_tier(10_000)
    tier.apply_policy(lambda k, m: PolicyState(pinned=True, expires_at=m.inserted_at + 1))
    await put(tier, 0, 100)
    assert await tier.expire(clock.now + 10) == 0 and tier.contains(key(0))


async def test_quota_tenant_cannot_evict_another_tenants_data(make_tier):
    tier, _ = make_tier(10_000)
    tier.set_quotas({"tenant-a": 4_000})
    for i in range(6):
        assert await put(tier, 100 + i, 1_000, ns="tenant-b")
    b_keys = {key(100 + i) for i in range(6)}
    evicted = []
    tier.on_evict = lambda k, m, reason: evicted.append((k, m.namespace))
    for i in range(30):
        assert await put(tier, i, 1_000, ns="tenant-a")
        a_used = sum(m.size for _, m in tier.entries() if m.namespace == "tenant-a")
        assert a_used <= 4_000
    assert b_keys <= set(tier.keys())
    assert evicted and all(ns == "tenant-a" for _, ns in evicted)
    assert not await put(tier, 99, 5_000, ns="tenant-a")  # over its quota on its own
    assert b_keys <= set(tier.keys())


async def test_quota_pinned_bytes_count_and_are_never_evicted(make_tier):
    tier, _ = make_tier(10_000)
    tier.set_quotas({"tenant-a": 3_000})
    tier.apply_policy(lambda k, m: PolicyState(pinned=m.manifest is not None))
    await put(tier, 0, 2_000, ns="tenant-a", manifest="tenant-a/docs")
    await put(tier, 1, 5_000, ns="tenant-b")
    assert await put(tier, 2, 1_000, ns="tenant-a")
    assert await put(tier, 3, 1_000, ns="tenant-a")  # evicts 2, its own
    assert not tier.contains(key(2)) and tier.contains(key(0)) and tier.contains(key(1))
    assert not await put(tier, 4, 1_500, ns="tenant-a")  # pinned 2 KB + 1.5 KB > quota: refused
    assert tier.contains(key(1)) and tier.contains(key(3))


async def test_an_object_larger_than_the_budget_is_refused(make_tier):
    tier, _ = make_tier(1_000)
    await put(tier, 0, 500)
    assert not await put(tier, 1, 1_001)
    assert tier.contains(key(0)) and not tier.contains(key(1))
    assert tier.stats.refused == 1 and tier.used == 500


async def test_stats_and_on_evict_count_capacity_evictions(make_tier):
    calls = []
    tier, _ = make_tier(4_000, on_evict=lambda k, m, reason: calls.append((k, m.size, reason)))
    for i in range(6):
        await put(tier, i, 1_000)
    assert tier.stats.inserts == 6 and tier.stats.inserted_bytes == 6_000
    assert tier.stats.evictions["capacity"] == 2 and tier.stats.evicted_bytes["capacity"] == 2_000
    assert [(s, r) for _, s, r in calls] == [(1_000, "capacity")] * 2
    assert {k for k, _, _ in calls} == {key(0), key(1)}  # S3-FIFO: one-hit wonders, oldest first
    for i in range(2, 6):
        (await tier.acquire(key(i))).release()
    assert tier.stats.hits == 4 and tier.stats.hit_bytes == 4_000


async def test_concurrent_puts_of_one_key_write_once(make_tier):
    tier, _ = make_tier(10_000)
    data = blob(0, 2_000)
    results = await asyncio.gather(*(tier.put(key(0), data, meta(data)) for _ in range(5)))
    assert all(results) and tier.used == 2_000 and tier.stats.inserts == 1


def test_tiers_import_no_torch():
    """The edge moves bytes: its tiers, and the whole server (the app, its Edge, the read path), must not pull
    in torch or transformers."""
    import subprocess
    import sys

    code = (
        "import sys, kdn.edge.memory, kdn.edge.disk, kdn.edge.eviction, kdn.edge.tiers, kdn.edge.node, kdn.edge.app\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


async def test_a_copy_keeps_its_arrival_time_so_a_ttl_counts_from_arrival(make_tier):
    """A put that carries ``inserted_at`` (a disk persist, a promotion to memory) keeps it; one that leaves it
    0 is stamped with the tier's clock. With a re-stamp each copy restarted the TTL."""
    tier, clock = make_tier(10_000)
    tier.apply_policy(lambda k, m: PolicyState(expires_at=m.inserted_at + 10))
    arrived = clock.now - 8
    assert await put(tier, 0, 100, inserted_at=arrived)
    await put(tier, 1, 100)
    got = dict(tier.entries())
    assert got[key(0)].inserted_at == arrived and got[key(1)].inserted_at == clock.now
    assert await tier.expire(clock.now + 3) == 1  # the copy's TTL ran from its arrival, 8 s ago
    assert not tier.contains(key(0)) and tier.contains(key(1))


async def test_an_entry_counts_its_whole_reads_and_an_eviction_starts_it_again(make_tier):
    """The console's per-manifest hits: each entry counts the reads a handle says it answered whole; acquiring
    alone (a HEAD, a fill's re-check) counts nothing; the count leaves with the entry (here by its TTL)."""
    tier, clock = make_tier(1000)
    assert await put(tier, 1, 400, expires_at=clock.now + 60)
    assert tier.reads(key(1)) == 0 and tier.reads(key(9)) is None
    for n in (1, 2):
        with await tier.acquire(key(1)) as h:
            h.count_read()
        assert tier.reads(key(1)) == n
    with await tier.acquire(key(1)):
        pass
    assert tier.reads(key(1)) == 2
    clock.now += 61
    assert tier.reads(key(1)) is None  # past its TTL: not served, so no count either
    assert await tier.expire() == 1 and tier.stats.evictions["ttl"] == 1
    assert await put(tier, 1, 400)
    assert tier.reads(key(1)) == 0
