"""An etcd member dies or freezes under a registry client: one given every member of the cluster
(``etcd://h1:p1,h2:p2,h3:p3/prefix``) moves to another; one pinned to the dead member cannot.

Against a real three-member cluster on loopback (``bench/lib/etcd_cluster.py``), plus the pieces that
made a frozen or re-electing cluster cost an edge its place in the ring, each on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aetcd
import pytest
from etcd_cluster import EtcdCluster  # bench/lib/, on sys.path through tests/conftest.py

from kdn.errors import InvalidInput, RegistryError, RegistryUnavailable
from kdn.registry import EtcdRegistry, NodeRecord, open_registry
from kdn.registry.follow import follow
from kdn.registry.lease import NodeLease

pytestmark = pytest.mark.timeout(120)


# --- URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, endpoints, prefix",
    [
        ("etcd://a:1,b:2,c:3/team", [("a", 1), ("b", 2), ("c", 3)], "/team/"),
        ("etcd://a,b:2", [("a", 2379), ("b", 2)], "/kdn/"),
        ("etcd://[::1]:1,127.0.0.1:2", [("::1", 1), ("127.0.0.1", 2)], "/kdn/"),
    ],
)
async def test_a_url_names_every_member(url, endpoints, prefix):
    reg = open_registry(url)
    assert isinstance(reg, EtcdRegistry)
    assert reg._client.endpoints == endpoints and (reg.host, reg.port) == endpoints[0] and reg.prefix == prefix
    assert all(f":{port}" in repr(reg) for _, port in endpoints)
    await reg.close()


@pytest.mark.parametrize("url", ["etcd://a:1,a:1", "etcd://a:1,b:x", "etcd://a:1,", "etcd://a:1,u@b:2"])
def test_a_malformed_member_list_is_a_one_line_error(url):
    with pytest.raises(InvalidInput) as e:
        open_registry(url)
    assert "\n" not in str(e.value)


# --- the pieces, each on its own ------------------------------------------------------------------


async def test_a_server_side_deadline_is_unavailability_and_leaves_the_member():
    """etcd answers a call whose deadline passed on the server (a keep-alive held by a member waiting for a
    leader) with gRPC UNKNOWN "context deadline exceeded": it was a RegistryError, which a lease's keep-alive
    gave up on, instead of an unreachable member to leave."""
    reg = EtcdRegistry("127.0.0.1", 1, more_endpoints=[("127.0.0.1", 2)])
    try:
        async def timed_out():
            raise aetcd.ClientError("context deadline exceeded")

        with pytest.raises(RegistryUnavailable, match="did not answer in time"):
            await reg._rpc(timed_out)  # noqa: SLF001 - the mapping is the unit
        assert reg._client.endpoint == "127.0.0.1:2"  # noqa: SLF001
    finally:
        await reg.close()


async def test_a_lease_is_kept_alive_through_an_outage_longer_than_its_ttl():
    """A leader election (or an etcd restart) extends every lease by its TTL, so a lease that could not be
    renewed for longer than that is alive afterwards; giving up at the TTL stopped the one keep-alive that would
    have kept it (bench/faults.py etcd_member_stopped: the edges' keys deleted in 1 run of 2)."""
    answers = iter([RegistryUnavailable("electing")] * 6 + [True] * 100)

    async def refresh(_lease_id: int) -> bool:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    async def revoke(_lease_id: int) -> None:
        return None

    lease = NodeLease(1, 0.3, refresh, revoke)  # 6 failures x 0.1 s: twice its TTL without an answer
    await asyncio.sleep(1.2)
    assert not lease.done.is_set()
    await lease.close()


async def test_a_lease_refused_past_its_ttl_is_done():
    """What is not unavailability (refused, failing) still ends the lease after its TTL, as before."""

    async def refresh(_lease_id: int) -> bool:
        raise RegistryError("permission denied")

    async def revoke(_lease_id: int) -> None:
        return None

    lease = NodeLease(1, 0.3, refresh, revoke)
    await asyncio.wait_for(lease.done.wait(), 2)
    await lease.close()


# --- a real cluster --------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path):
    c = EtcdCluster(tmp_path / "etcd")
    c.start()
    c.make_leader(c.members[0])
    try:
        yield c
    finally:
        c.stop()


def _url(members, prefix: str = "/dies/") -> str:
    return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in members) + prefix


async def _until_written(reg, key: str, value: bytes, timeout: float = 20.0) -> float:
    """Write until it lands (an election drops writes in flight); the seconds it took."""
    t0 = time.monotonic()
    while True:
        try:
            await reg._put(reg._key(key), value)  # noqa: SLF001 - a raw write is all this needs
            return time.monotonic() - t0
        except RegistryUnavailable:
            assert time.monotonic() - t0 < timeout, f"no write landed in {timeout} s"
            await asyncio.sleep(0.1)


async def test_the_members_leader_killed_under_a_pinned_and_a_listing_client(cluster):
    a, b, c = cluster.members
    every, pinned = open_registry(_url([a, b, c])), open_registry(_url([a]))
    events: list[str] = []
    # a put, or a re-list's snapshot (a write that lands while the watch moves is in the next one's listing)
    follower = asyncio.create_task(follow(every, "k/", lambda ev: events.extend([ev.key] if ev.key else ev.items),
                                          what="test", backoff=(0.05, 0.2)))
    try:
        await _until_written(every, "k/before", b"1")
        assert await pinned._read([pinned._key("k/before")]) == [b"1"]  # noqa: SLF001
        a.kill()
        # the listing client's reads move on at once; its first write after the election lands
        assert await every._read([every._key("k/before")]) == [b"1"]  # noqa: SLF001
        await _until_written(every, "k/after", b"2")
        for _ in range(100):  # and its watch followed it to another member
            if "k/after" in events:
                break
            await asyncio.sleep(0.05)
        assert "k/after" in events
        assert every._client.endpoint != f"127.0.0.1:{a.client_port}"  # noqa: SLF001
        with pytest.raises(RegistryUnavailable):  # the pinned one has nowhere to go
            await pinned._read([pinned._key("k/before")])  # noqa: SLF001
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await every.close()
        await pinned.close()


async def test_the_members_leader_frozen_under_a_lease(cluster):
    """SIGSTOP on the member every call goes to: a keep-alive there waited the call timeout (5 s), longer than a
    2 s lease, which expired on the new leader while two good members were there (4 of 4 edges' keys deleted in
    bench/faults.py etcd_member_stopped). Now each member gets a third of the TTL, then the next is asked."""
    a, b, c = cluster.members
    reg, observer = open_registry(_url([a, b, c])), open_registry(_url([b, c]))
    deletes: list[str] = []

    def on_event(ev) -> None:
        if ev.kind == "delete":
            deletes.append(ev.key or "")

    watching = asyncio.create_task(follow(observer, "nodes/", on_event, what="observer", backoff=(0.05, 0.2)))
    try:
        lease = await reg.register_node(NodeRecord("edge", "eu", "e1", "http://127.0.0.1:1"), ttl=2)
        await asyncio.sleep(0.3)
        a.pause()
        try:
            await asyncio.sleep(3 * lease.ttl)
        finally:
            a.resume()
        assert deletes == [] and not lease.done.is_set()
        assert [n.node_id for n in await observer.list_nodes("edge")] == ["e1"]
        await lease.close()
    finally:
        a.resume()
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await reg.close()
        await observer.close()
