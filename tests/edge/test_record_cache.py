"""The edge's record cache: records kept, absences remembered briefly (a flood of unknown addresses
once cost one registry read per request)."""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "registry"))

from registry_helpers import addr, model, obj  # noqa: E402

from kdn.edge.records import RecordCache  # noqa: E402
from kdn.registry import EmbeddedRegistry  # noqa: E402


class Counting:
    """The real registry, with its object reads counted."""

    def __init__(self, reg) -> None:
        self.reg, self.reads = reg, 0

    async def get_object(self, address):
        self.reads += 1
        return await self.reg.get_object(address)

    async def get_objects(self, addresses):
        self.reads += len(addresses)
        return await self.reg.get_objects(addresses)


async def test_absent_addresses_cost_one_registry_read_per_ttl(tmp_path):
    async with EmbeddedRegistry(tmp_path / "r.sqlite3") as reg:
        await reg.put_model(model())
        counting = Counting(reg)
        now = [0.0]
        cache = RecordCache(counting, size=100, negative_ttl=0.3, clock=lambda: now[0])
        a = addr("one")
        for _ in range(1000):
            assert await cache.get(a) is None
        assert await cache.get_many([a] * 4096) == [None] * 4096
        assert counting.reads == 1
        await reg.put_objects([obj("one")])  # published meanwhile: seen once the TTL has passed
        assert await cache.get(a) is None
        now[0] += 0.29
        assert await cache.get(a) is None and counting.reads == 1  # still within the TTL
        now[0] += 0.02
        assert (await cache.get(a)).address == a
        assert counting.reads == 2
        for _ in range(10):
            await cache.get(a)  # a record, once found, is kept
        assert counting.reads == 2


async def test_absences_are_bounded_and_forget_clears_one(tmp_path):
    async with EmbeddedRegistry(tmp_path / "r.sqlite3") as reg:
        counting = Counting(reg)
        cache = RecordCache(counting, size=10, negative_ttl=60)
        await cache.get_many([addr(str(i)) for i in range(100)])
        assert len(cache._absent) == 10  # noqa: SLF001 - the bound is the point
        cache.forget(addr("99"))
        await cache.get(addr("99"))
        assert counting.reads == 101


async def test_a_record_stored_under_another_address_is_absent(tmp_path):
    """A registry writer stores B's (validly signed) record under A's key: the edge once took it as A's."""
    async with EmbeddedRegistry(tmp_path / "r.sqlite3") as reg:
        await reg.put_model(model())
        a, b = addr("a"), addr("b")
        await reg.put_objects([obj("b")])
        await reg._put(reg._object_key(a), (await reg.get_object(b)).pack())  # B's record at A's key
        refused = []
        cache = RecordCache(reg, size=100, on_refused=lambda: refused.append(1))
        assert await cache.get(a) is None and (await cache.get_many([a])) == [None]
        assert refused and (await cache.get(b)).address == b


class Slow(Counting):
    """The real registry, each read ``delay`` seconds slow (a registry far away)."""

    def __init__(self, reg, delay: float) -> None:
        super().__init__(reg)
        self.delay = delay

    async def get_object(self, address):
        await asyncio.sleep(self.delay)
        return await super().get_object(address)


async def test_the_floor_of_a_no_follows_the_source_when_it_is_slower(tmp_path):
    """A "no" is held to the floor, or to recent reads' p99 when the registry is slower than that: a floor below
    the reads would let a cached record's "no" show again (#28 item 10)."""
    from kdn.errors import InvalidInput

    async with EmbeddedRegistry(tmp_path / "r.sqlite3") as reg:
        cache = RecordCache(Slow(reg, 0.03), size=100, floor_s=0.002)
        assert cache.no_floor() == 0.002  # nothing read yet
        for i in range(5):
            await cache.get(addr(str(i)))
        assert 0.03 <= cache.no_floor() <= 0.05
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await cache.hold(t0)
        assert loop.time() - t0 >= 0.029
        off = RecordCache(Slow(reg, 0.03), size=100, floor_s=0)
        await off.get(addr("x"))
        assert off.no_floor() == 0
        for bad in (-0.001, 1.5, float("nan")):
            try:
                RecordCache(reg, size=10, floor_s=bad)
            except InvalidInput as e:
                assert "floor" in str(e)
            else:
                raise AssertionError(f"floor {bad} accepted")


async def test_a_failed_read_does_not_raise_the_floor_of_a_no(tmp_path):
    """A registry down for a while (each read failing after its timeout) once set every later "no" to wait out
    that timeout, capped at 1 s: in bench/attacks.py's world, 600 probes took minutes. Only reads that answered
    count, and the floor follows them to 50 ms at most."""
    from kdn.service.records import MAX_FLOOR_S
    from kdn.errors import RegistryUnavailable

    class Down:
        async def get_object(self, address):
            await asyncio.sleep(0.02)
            raise RegistryUnavailable("etcd: connection refused")

    cache = RecordCache(Down(), size=10, floor_s=0.002)
    for i in range(3):
        try:
            await cache.get(addr(str(i)))
        except RegistryUnavailable:
            pass
    assert cache.no_floor() == 0.002
    async with EmbeddedRegistry(tmp_path / "r.sqlite3") as reg:
        slow = RecordCache(Slow(reg, 0.2), size=10, floor_s=0.002)
        await slow.get(addr("x"))
        assert slow.no_floor() == MAX_FLOOR_S


async def test_the_floor_of_a_no_covers_the_checks_of_what_was_read_not_the_read_alone(tmp_path):
    """#28 second reading: the floor followed the source's reads only, while the signature checks of what they
    returned (~0.1 ms a record) came after, so a batch of present records (another tenant's chain, posted to
    /v1/lookup) answered later than the same batch absent, past the floor. The checks count now."""
    import time

    class SlowChecks:
        def ok(self, rec) -> bool:
            time.sleep(0.004)  # a check as slow as a big batch's signatures
            return True

    async with EmbeddedRegistry(tmp_path / "r.sqlite3") as reg:
        recs = [obj(f"tenant{i}") for i in range(8)]
        await reg.put_objects(recs)
        cache = RecordCache(reg, size=100, verifier=SlowChecks(), floor_s=0.002)
        assert [r.address for r in await cache.get_many([r.address for r in recs])] == [r.address for r in recs]
        assert cache.no_floor() >= 8 * 0.004  # the read and the eight checks, not the read alone
