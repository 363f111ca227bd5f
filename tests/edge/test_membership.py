"""Edge membership over both registries: edges see each other, agree on owners, and leave and rejoin promptly."""

from __future__ import annotations

import asyncio
import contextlib
import random

import msgpack
import pytest

from kdn.edge.membership import Membership
from kdn.errors import RegistryError, RegistryUnavailable
from kdn.registry import NodeRecord

TTL = 2.0  # etcd's minimum TTL
WAIT = 5.0  # generous ceiling for anything that should be prompt


def rec(node_id: str, region: str = "eu") -> NodeRecord:
    return NodeRecord("edge", region, node_id, f"http://{node_id}.test:8080", {})


def addrs(n: int) -> list[str]:
    rng = random.Random(7)
    return [rng.randbytes(32).hex() for _ in range(n)]


def has(*ids: str):
    return lambda m: all(i in m.nodes for i in ids)


def lacks(*ids: str):
    return lambda m: not any(i in m.nodes for i in ids)


@contextlib.asynccontextmanager
async def members(registry_factory, *specs: tuple[str, str]):
    """Start one Membership per (node_id, region), each on its own registry handle, and wait until all see all."""
    ms = [Membership(registry_factory(), rec(i, r), ttl=TTL) for i, r in specs]
    try:
        for m in ms:
            await m.start()
        ids = [i for i, _ in specs]
        for m in ms:
            await m.wait_for(has(*ids), WAIT)
        yield ms
    finally:
        for m in ms:
            await m.close()


async def test_edges_see_each_other_and_agree_on_owners(registry_factory):
    async with members(registry_factory, ("eu-1", "eu"), ("eu-2", "eu"), ("us-1", "us")) as (e1, e2, u1):
        assert e1.ring.nodes == e2.ring.nodes == ["eu-1", "eu-2"]
        assert u1.ring.nodes == ["us-1"]
        assert [p.node_id for p in e1.peers()] == ["eu-2", "us-1"]
        assert [p.node_id for p in e1.peers("us")] == ["us-1"]
        assert [p.node_id for p in u1.peers("eu")] == ["eu-1", "eu-2"]
        assert {r: [n.node_id for n in ns] for r, ns in u1.regions().items()} == {"eu": ["eu-1", "eu-2"], "us": ["us-1"]}
        assert e1.is_me("eu-1") and not e1.is_me("eu-2")
        assert e2.nodes["us-1"] == rec("us-1", "us")
        for a in addrs(2000):
            o1, o2 = e1.owner(a), e2.owner(a)
            assert o1 is not None and o1 == o2 and o1.region == "eu"
            assert e1.preference(a)[0] == o1
            assert u1.owner(a) == rec("us-1", "us")
        both = {e1.owner(a).node_id for a in addrs(200)}
        assert both == {"eu-1", "eu-2"}


async def test_closed_member_leaves_at_once(registry_factory):
    async with members(registry_factory, ("eu-1", "eu"), ("eu-2", "eu"), ("us-1", "us")) as (e1, e2, u1):
        await e2.close()  # revokes: no TTL wait
        await e1.wait_for(lacks("eu-2"), 1.0)
        await u1.wait_for(lacks("eu-2"), 1.0)
        assert e1.ring.nodes == ["eu-1"]
        assert all(e1.owner(a).node_id == "eu-1" for a in addrs(100))


async def test_killed_member_leaves_within_ttl(registry_factory):
    async with members(registry_factory, ("eu-1", "eu"), ("eu-2", "eu"), ("us-1", "us")) as (e1, e2, u1):
        granted = e2.lease.ttl
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await e2._kill()  # keep-alive and watch stop, nothing revoked: a SIGKILL
        await e1.wait_for(lacks("eu-2"), granted + 1)
        elapsed = loop.time() - t0
        await u1.wait_for(lacks("eu-2"), max(0.1, granted + 1 - (loop.time() - t0)))
        assert elapsed <= granted + 1
        assert e1.ring.nodes == ["eu-1"]
        print(f"killed edge left after {elapsed:.2f}s (lease ttl {granted:.0f}s)")


async def test_member_registers_again_after_its_lease_is_revoked(registry_factory):
    async with members(registry_factory, ("eu-1", "eu"), ("eu-2", "eu")) as (e1, e2):
        old = e2.lease
        await e2.registry._revoke(old.lease_id)  # behind its back: as if it expired during an outage
        await e1.wait_for(lacks("eu-2"), WAIT)  # it left the ring...
        await e1.wait_for(has("eu-2"), WAIT)  # ...and came back with a new lease
        await e2.wait_for(lambda m: m.reregistrations == 1 and "eu-2" in m.ring, WAIT)
        assert e2.lease is not old and not e2.lease.done.is_set()
        assert e1.ring.nodes == e2.ring.nodes == ["eu-1", "eu-2"]


class FlakyWatch:
    """A registry handle whose watch can be made to fail on demand (an outage of the watch only)."""

    def __init__(self, inner):
        self._inner = inner
        self.broken = asyncio.Event()
        self.failed = asyncio.Event()
        self.failures = 0

    def _fail(self) -> RegistryUnavailable:
        self.failures += 1
        self.failed.set()
        return RegistryUnavailable("registry down (test)")

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def watch(self, prefix: str = ""):
        # Broken: the live watch fails at its next event, then two re-watches fail at once.
        if self.broken.is_set() and self.failures < 3:
            raise self._fail()
        async with contextlib.aclosing(self._inner.watch(prefix)) as inner:
            async for ev in inner:
                if self.broken.is_set() and self.failures == 0:
                    raise self._fail()
                yield ev


async def test_watch_failure_keeps_last_ring_and_recovers(registry_factory):
    flaky = FlakyWatch(registry_factory())
    m = Membership(flaky, rec("eu-1"), ttl=TTL, backoff=(0.05, 0.2))
    async with members(registry_factory, ("eu-2", "eu")):
        await m.start()
        try:
            await m.wait_for(has("eu-1", "eu-2"), WAIT)
            flaky.broken.set()
            # The next event raises inside the watch; a third edge joining produces one.
            async with members(registry_factory, ("eu-3", "eu")):
                await asyncio.wait_for(flaky.failed.wait(), WAIT)
                assert m.ring.nodes[:2] == ["eu-1", "eu-2"]  # still serving with the last ring
                assert m.owner(addrs(1)[0]) is not None
                await m.wait_for(has("eu-3"), WAIT)  # re-watched (with backoff) after two more failures
                assert flaky.failures == 3
                assert m.ring.nodes == ["eu-1", "eu-2", "eu-3"]
        finally:
            await m.close()


async def test_start_fails_when_registry_is_down(registry_factory):
    reg = registry_factory()
    await reg.close()
    m = Membership(reg, rec("eu-1"), ttl=TTL)
    with pytest.raises(RegistryError):
        await m.start()
    assert m.lease is None or m.lease.done.is_set()


async def test_ignores_keys_that_are_not_edge_records(registry_factory):
    reg = registry_factory()
    async with members(registry_factory, ("eu-1", "eu")) as (e1,):
        await reg._put(reg._key("nodes/edge/eu/x/deeper"), rec("deep").pack())  # 5 parts
        await reg._put(reg._key("nodes/edge/eu/junk"), b"\xc1not msgpack")  # unreadable
        await reg._put(reg._key("nodes/edge/eu/liar"), rec("someone-else").pack())  # key and record disagree
        await reg._put(reg._key("nodes/origin/eu/o-1"), NodeRecord("origin", "eu", "o-1", "http://o", {}).pack())
        for nid, url in [("thief", "http://kdn:pw@evil.test"), ("files", "file:///etc/passwd"), ("blank", "")]:
            # a writer that skips NodeRecord's checks: URLs no edge may send its token or a request to
            raw = {**rec(nid).to_dict(), "url": url}
            await reg._put(reg._key(f"nodes/edge/eu/{nid}"), msgpack.packb(raw, use_bin_type=True))
        await reg.register_node(rec("eu-2"), TTL)  # a real one, after the others: its arrival means they were seen
        await e1.wait_for(has("eu-2"), WAIT)
        assert sorted(e1.nodes) == ["eu-1", "eu-2"]
        assert e1.ring.nodes == ["eu-1", "eu-2"]
        listed = {n.node_id for n in await reg.list_nodes("edge")}
        assert {"eu-1", "eu-2"} <= listed and not listed & {"thief", "files", "blank"}
