"""Disk tier only: restarts, corrupted and half-written files, blobs without metadata, write order."""

from __future__ import annotations

import asyncio
import os
import time

from blake3 import blake3

from kdn.edge import disk as disk_mod
from kdn.edge.disk import DiskTier
from kdn.edge.tiers import EntryMeta, PolicyState
from kdn.format.store import STALE_PART_S, BlobDir


def key(i: int) -> tuple[str, str]:
    return blake3(f"key {i}".encode()).hexdigest(), "raw"


def blob(i: int, size: int = 1_000) -> bytes:
    return (f"<{i}>".encode() * size)[:size]


async def fill(tier: DiskTier, n: int, size: int = 1_000, ns: str = "public") -> None:
    for i in range(n):
        data = blob(i, size)
        meta = EntryMeta(size=size, digest=blake3(data).hexdigest(), namespace=ns, manifest="public/doc")
        assert await tier.put(key(i), data, meta)


async def test_restart_keeps_entries_and_metadata(tmp_path):
    t1 = DiskTier(tmp_path, 10_000)
    await fill(t1, 5)
    before = dict(t1.entries())
    t2 = await DiskTier.open(tmp_path, 10_000)
    assert t2.used == 5_000 and set(t2.keys()) == set(before)
    for k, m in t2.entries():
        assert (m.size, m.digest, m.namespace, m.manifest, m.inserted_at) == (
            before[k].size, before[k].digest, before[k].namespace, before[k].manifest, before[k].inserted_at,
        )
    for i in range(5):
        with await t2.acquire(key(i)) as h:
            assert await h.read() == blob(i)
    assert t2.stats.corrupt == 0 and t2.stats.hits == 5


async def test_restart_with_a_smaller_budget_evicts_down(tmp_path):
    await fill(DiskTier(tmp_path, 10_000), 8)
    evicted = []
    t = DiskTier(tmp_path, 3_500, on_evict=lambda k, m, r: evicted.append(r))
    assert t.used <= 3_500 and len(t.keys()) == 3
    assert evicted == ["capacity"] * 5
    assert sum(1 for p in tmp_path.glob("??/??/*.raw")) == 3  # the files went too


async def test_corrupted_file_is_detected_on_first_acquire_and_never_served(tmp_path):
    await fill(DiskTier(tmp_path, 10_000), 3)
    path = BlobDir(tmp_path).path(*key(1))
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0x01  # one flipped bit, same size
    path.write_bytes(raw)
    reasons = []
    t = DiskTier(tmp_path, 10_000, on_evict=lambda k, m, r: reasons.append((k, r)))
    assert t.contains(key(1))  # not known to be bad until read
    results = await asyncio.gather(*(t.acquire(key(1)) for _ in range(3)))  # racing first readers
    assert results == [None, None, None]
    assert t.stats.corrupt == 1 and reasons == [(key(1), "corrupt")]
    assert not path.exists() and not t.contains(key(1)) and t.used == 2_000
    assert await t.acquire(key(1)) is None
    with await t.acquire(key(0)) as h:  # the others are fine
        assert await h.read() == blob(0)


async def test_truncated_file_is_dropped_at_scan(tmp_path):
    await fill(DiskTier(tmp_path, 10_000), 1)
    path = BlobDir(tmp_path).path(*key(0))
    path.write_bytes(path.read_bytes()[:10])
    t = DiskTier(tmp_path, 10_000)  # size disagrees with the sidecar: dropped at the scan
    assert not t.contains(key(0)) and t.scan_dropped == 1 and not path.exists()


async def test_verified_entries_are_not_hashed_again(tmp_path, monkeypatch):
    await fill(DiskTier(tmp_path, 10_000), 2)
    t = DiskTier(tmp_path, 10_000)
    calls = []
    real = disk_mod._digest_matches
    monkeypatch.setattr(disk_mod, "_digest_matches", lambda p, m: calls.append(p) or real(p, m))
    for _ in range(3):
        (await t.acquire(key(0))).release()
    assert len(calls) == 1
    data = blob(7)
    await t.put(key(7), data, EntryMeta(size=1_000, digest=blake3(data).hexdigest(), namespace="public"))
    (await t.acquire(key(7))).release()  # written by this process: trusted
    assert len(calls) == 1


async def test_half_written_temp_file_is_ignored_and_removed(tmp_path):
    await fill(DiskTier(tmp_path, 10_000), 1)
    part = tmp_path / "tmp" / f"{key(5)[0]}.raw.abcdef.part"
    part.write_bytes(b"half a blob")
    old = time.time() - STALE_PART_S - 1
    os.utime(part, (old, old))  # a crash's leftover (a fresh one may be another writer's, and is kept)
    t = DiskTier(tmp_path, 10_000)
    assert set(t.keys()) == {key(0)} and t.used == 1_000
    assert not part.exists()


async def test_blob_without_metadata_is_dropped_at_scan(tmp_path):
    await fill(DiskTier(tmp_path, 10_000), 2)
    d = BlobDir(tmp_path)
    stray = d.put(key(8)[0], "raw", b"no sidecar")  # e.g. copied in by hand
    bad = d.put(key(9)[0], "raw", b"garbage sidecar")
    bad.with_name(bad.name + ".meta").write_bytes(b"\xc1 not msgpack")
    orphan = d.path(*key(10)).with_name(f"{key(10)[0]}.raw.meta")  # crash between sidecar and blob
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"x")
    t = DiskTier(tmp_path, 10_000)
    assert set(t.keys()) == {key(0), key(1)} and t.scan_dropped == 2
    assert not stray.exists() and not bad.exists() and not orphan.exists()
    assert not bad.with_name(bad.name + ".meta").exists()


async def test_sidecar_is_in_place_before_the_blob_is_visible(tmp_path, monkeypatch):
    seen = []
    real_put = BlobDir.put

    def checking_put(self, address, encoding, data):
        final = self.path(address, encoding)
        seen.append((final.exists(), final.with_name(final.name + ".meta").exists()))
        return real_put(self, address, encoding, data)

    monkeypatch.setattr(BlobDir, "put", checking_put)
    await fill(DiskTier(tmp_path, 10_000), 2)
    assert seen == [(False, True), (False, True)]


async def test_delete_removes_blob_and_sidecar(tmp_path):
    t = DiskTier(tmp_path, 10_000)
    await fill(t, 1)
    path = t.blobs.path(*key(0))
    assert await t.delete(key(0))
    assert not path.exists() and not path.with_name(path.name + ".meta").exists()
    assert DiskTier(tmp_path, 10_000).keys() == []


async def test_policy_state_is_reapplied_not_persisted(tmp_path):
    t = DiskTier(tmp_path, 10_000)
    t.apply_policy(lambda k, m: PolicyState(pinned=True, expires_at=m.inserted_at + 5))
    await fill(t, 1)
    assert t.entries()[0][1].pinned
    t2 = DiskTier(tmp_path, 10_000)
    m = t2.entries()[0][1]
    assert not m.pinned and m.expires_at is None and m.inserted_at > 0
    t2.apply_policy(lambda k, m: PolicyState(expires_at=m.inserted_at + 5))
    assert await t2.expire(m.inserted_at + 6) == 1


async def test_reader_cancelled_while_verifying_leaves_no_pin(tmp_path, monkeypatch):
    await fill(DiskTier(tmp_path, 10_000), 1)
    t = DiskTier(tmp_path, 10_000)
    started, gate = asyncio.Event(), asyncio.Event()
    real = t._check

    async def slow_check(e):
        started.set()
        await gate.wait()
        return await real(e)

    monkeypatch.setattr(t, "_check", slow_check)
    first = asyncio.create_task(t.acquire(key(0)))
    second = asyncio.create_task(t.acquire(key(0)))
    await started.wait()  # the first reader holds a pin and is hashing
    first.cancel()
    gate.set()
    h = await second
    assert first.cancelled() and h is not None
    h.release()
    path = h.path
    assert await t.delete(key(0))
    assert not path.exists() and t.used == 0  # no pin left behind: deleted at once


async def test_a_clock_stepped_back_while_the_edge_was_down_does_not_stretch_a_ttl(tmp_path):
    """Entries stamped by an edge whose clock was an hour ahead (or one that went back an hour while it was
    down) are found "from the future" by the next start: aged from that stamp they would outlive a TTL by
    the hour; they count as arrived long ago instead, and the TTL drops them at once."""
    ahead = 3600.0
    t1 = DiskTier(tmp_path, 10_000, clock=lambda: disk_mod.steady_wall() + ahead)
    await fill(t1, 3)
    t2 = DiskTier(tmp_path, 10_000)  # the real clock: an hour "earlier"
    assert t2.scan_future == 3
    t2.apply_policy(lambda k, m: PolicyState(expires_at=m.inserted_at + 5))
    assert await t2.expire(disk_mod.steady_wall()) == 3 and not t2.keys()


async def test_a_clock_stepped_forward_while_the_edge_was_down_only_expires_entries_early(tmp_path):
    await fill(DiskTier(tmp_path, 10_000), 2)
    later = DiskTier(tmp_path, 10_000, clock=lambda: disk_mod.steady_wall() + 3600.0)
    assert later.scan_future == 0 and len(later.keys()) == 2  # kept; a TTL policy would drop them (refill)
    fresh = DiskTier(tmp_path, 10_000)
    assert fresh.scan_future == 0 and all(m.inserted_at > disk_mod.LONG_AGO for _, m in fresh.entries())


async def test_an_entry_past_its_ttl_is_a_miss_before_the_expiry_pass_sweeps_it(tmp_path):
    now = [1_000_000.0]
    t = DiskTier(tmp_path, 10_000, clock=lambda: now[0])
    await fill(t, 2)
    t.apply_policy(lambda k, m: PolicyState(expires_at=m.inserted_at + 5))
    now[0] += 4
    assert t.contains(key(0))
    with await t.acquire(key(0)) as h:
        assert await h.read() == blob(0)
    now[0] += 2  # past the TTL; no expire() call in between
    assert not t.contains(key(1))
    assert await t.acquire(key(1)) is None and key(1) not in t.keys() and t.stats.evictions["ttl"] == 1


async def test_a_held_entry_past_its_ttl_is_dropped_so_its_refill_is_cached_fresh(tmp_path):
    """Another reader still holds it: the bytes stay for that reader, but the key is free, so the refill's
    put caches the object again with a new arrival time (it was once a miss for as long as anyone held it)."""
    now = [1_000_000.0]
    t = DiskTier(tmp_path, 10_000, clock=lambda: now[0])
    await fill(t, 1)
    t.apply_policy(lambda k, m: PolicyState(expires_at=m.inserted_at + 5))
    held = await t.acquire(key(0))
    now[0] += 6
    assert await t.acquire(key(0)) is None  # past its TTL: a miss although held
    data = blob(0)
    assert await t.put(key(0), data, EntryMeta(size=len(data), digest=blake3(data).hexdigest(), namespace="public"))
    assert dict(t.entries())[key(0)].inserted_at == now[0]  # a fresh arrival, a fresh TTL
    with await t.acquire(key(0)) as h:
        assert await h.read() == data
    assert await held.read() == data  # the first reader's bytes were never taken from it
    held.release()
