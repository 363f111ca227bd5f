"""The registry contract: every test runs against the embedded registry, etcd, and a locked-down etcd
(TLS only, client certificates required, auth on: what a production deployment runs)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest

from kdn.errors import InvalidAddress, InvalidInput, LeaseExpired, RegistryError
from kdn.registry import Manifest, NodeRecord, Policy, Registry, find_relation
from kdn.registry.signing import Signer, Verifier
from registry_helpers import (MID, addr, chain, enc, eventually, manifest, model, next_event, node, obj, policy,
                              relation, until)


@pytest.fixture(params=["embedded", "etcd", "etcd-secured"])
async def registry_factory(request, tmp_path, registry_maker):
    async with registry_maker(request, tmp_path, request.param) as factory:
        yield factory


async def test_is_a_registry(registry):
    assert isinstance(registry, Registry)


# --- round trips and misses ---------------------------------------------------


async def test_model_round_trip(registry):
    assert await registry.get_model(MID) is None
    assert await registry.list_models() == []
    await registry.put_model(model())
    assert await registry.get_model(MID) == model()
    assert await registry.list_models() == [model()]


async def test_relation_round_trip_beside_the_models(registry):
    other = addr("variant-2")
    assert await registry.get_relation(MID) is None
    assert await registry.list_relations() == []
    await registry.put_relation(relation())
    await registry.put_relation(relation(other, recompute=[0, 1, 2]))
    assert await registry.get_relation(MID) == relation()
    assert await registry.get_relation(other) == relation(other, recompute=[0, 1, 2])
    assert sorted(await registry.list_relations(), key=lambda r: r.variant) == sorted(
        [relation(), relation(other, recompute=[0, 1, 2])], key=lambda r: r.variant)
    await registry.put_relation(relation(budget=1.0))  # one per variant: the latest put wins
    assert (await registry.get_relation(MID)).budget == 1.0
    assert await registry.get_model(MID) is None  # a relation is not a model record
    assert [k for k, _ in await registry.list_keys("relations/")] == sorted([f"relations/{MID}", f"relations/{other}"])
    with pytest.raises(InvalidInput):
        await registry.put_relation(model())  # type: ignore[arg-type]
    with pytest.raises(InvalidAddress):
        await registry.get_relation("not-a-model")


async def test_a_junk_or_misplaced_relation_is_refused_on_read_and_hides_only_itself(registry):
    good, junk, moved = addr("good"), addr("junk"), addr("moved")
    await registry.put_relation(relation(good))
    await registry._put(registry._key(f"relations/{junk}"), b"\x93not a relation")
    await registry._put(registry._key(f"relations/{moved}"), relation(good, budget=99.0).pack())  # another's
    assert await registry.get_relation(junk) is None
    assert await registry.get_relation(moved) is None
    assert await registry.list_relations() == [relation(good)]


async def test_find_relation_returns_only_what_a_trusted_key_signed(registry, tmp_path):
    publisher, stranger = Signer.generate(tmp_path / "pub.key"), Signer.generate(tmp_path / "other.key")
    trusted = Verifier([publisher.public])
    signed, foreign, unsigned = addr("signed"), addr("foreign"), addr("unsigned")
    await registry.put_relation(publisher.sign(relation(signed)))
    await registry.put_relation(stranger.sign(relation(foreign)))
    await registry.put_relation(relation(unsigned))
    assert await find_relation(registry, signed, trusted) == publisher.sign(relation(signed))
    assert await find_relation(registry, foreign, trusted) is None
    assert await find_relation(registry, unsigned, trusted) is None
    assert await find_relation(registry, addr("absent"), trusted) is None
    forged = dataclasses.replace(publisher.sign(relation(addr("forged"))), recompute=[0])  # changed after signing
    await registry.put_relation(forged)
    assert await find_relation(registry, forged.variant, trusted) is None

    class Client:  # what a KDNClient made with trusted_keys holds
        verifier = trusted

    assert await find_relation(registry, signed, Client()) == publisher.sign(relation(signed))
    with pytest.raises(InvalidInput, match="trusted"):
        await find_relation(registry, signed, None)


async def test_object_round_trip_and_batch_get(registry):
    a, b, c = chain("doc", 3)
    tailed = a.with_tail(17, addr("tail"))
    await registry.put_objects([tailed, c])
    assert await registry.get_object(a.address) == tailed
    assert await registry.get_object(b.address) is None
    assert await registry.get_objects([a.address, b.address, c.address]) == [tailed, None, c]
    assert await registry.get_objects([]) == []


async def test_get_objects_beyond_one_transaction(registry):
    objs = chain("long", 300)  # more than etcd's 128 operations per transaction
    await registry.put_objects(objs)
    got = await registry.get_objects([o.address for o in objs] + [addr("missing")])
    assert got == objs + [None]


async def test_manifest_round_trip_list_delete(registry):
    objs = chain("m", 2)
    m1, m2 = manifest("docs", objs), manifest("faq", objs[:1], namespace="acme")
    m1 = await registry.put_manifest(m1, objs)  # as stored: versioned
    m2 = await registry.put_manifest(m2)
    assert m1.version > 0 and m2.version > 0
    assert await registry.get_manifest("public", "docs") == m1
    assert await registry.get_manifest("public", "nope") is None
    assert await registry.list_manifests() == [m2, m1]  # key order: acme/ before public/
    assert await registry.list_manifests("acme") == [m2]
    assert await registry.list_manifests("other") == []
    assert await registry.get_objects(m1.addresses) == objs
    assert await registry.delete_manifest("public", "docs") is True
    assert await registry.delete_manifest("public", "docs") is False
    assert await registry.get_manifest("public", "docs") is None


async def test_policy_round_trip_and_delete(registry):
    p1 = policy("pin-docs")
    p2 = policy("ttl-all", kind="ttl", manifest=None, namespace="public", ttl_s=3600.0)
    p3 = policy("quota-acme", kind="quota", region=None, manifest=None, namespace="acme", quota_bytes=1 << 30)
    for p in (p1, p2, p3):
        await registry.put_policy(p)
    assert await registry.list_policies() == [p1, p3, p2]
    assert await registry.delete_policy("quota-acme") is True
    assert await registry.delete_policy("quota-acme") is False
    assert await registry.list_policies() == [p1, p2]


async def test_list_keys_is_relative_and_sorted(registry):
    await registry.put_model(model())
    await registry.put_policy(policy())
    keys = [k for k, _ in await registry.list_keys()]
    assert keys == [f"models/{MID}", "policies/pin-docs"]
    [(k, v)] = await registry.list_keys("policies/")
    assert Policy.unpack(v) == policy()


# --- writes that belong together ----------------------------------------------


@pytest.mark.parametrize("n", [5, 300])
async def test_put_manifest_never_visible_before_its_objects(registry, n):
    objs = chain(f"atomic{n}", n)
    m = manifest("atomic", objs)
    watch = registry.watch("")
    async with contextlib.aclosing(watch):
        assert (await next_event(watch)).kind == "snapshot"
        await registry.put_manifest(m, objs)
        events = await until(watch, lambda ev: ev.key == "manifests/public/atomic", timeout=10)
    revs = {ev.key: ev.revision for ev in events}
    assert len(revs) == n + 1
    if n < 100:  # fits in one transaction: one revision for everything
        assert len(set(revs.values())) == 1
    # In every case, the manifest is the last thing to appear.
    assert revs["manifests/public/atomic"] == max(revs.values())
    assert events[-1].key == "manifests/public/atomic"


async def test_concurrent_readers_never_see_manifest_without_objects(registry_factory):
    writer, reader = registry_factory(), registry_factory()
    objs = chain("race", 40)
    m = manifest("race", objs)
    done = asyncio.Event()
    seen = 0

    async def read() -> None:
        nonlocal seen
        while not done.is_set():
            if await reader.get_manifest("public", "race") is not None:
                assert None not in await reader.get_objects(m.addresses)
                seen += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(read())
    await writer.put_manifest(m, objs)
    await eventually(lambda: asyncio.sleep(0, seen))
    done.set()
    await task


async def test_republishing_keeps_added_encodings_and_tails(registry):
    a = obj("p")
    await registry.put_objects([a])
    await registry.add_tail(a.address, 9, addr("t9"))
    await registry.put_manifest(manifest("p", [a]), [obj("p", encs=("zstd-planes",))])
    got = await registry.get_object(a.address)
    assert set(got.encodings) == {"raw", "zstd-planes"}
    assert got.tails == {9: addr("t9")}


async def test_add_encoding_and_tail_on_a_missing_object_is_none(registry):
    assert await registry.add_encoding(addr("ghost"), enc()) is None
    assert await registry.add_tail(addr("ghost"), 3, addr("t")) is None
    assert await registry.get_object(addr("ghost")) is None


async def test_concurrent_read_modify_writes_lose_no_update(registry_factory):
    a, b = registry_factory(), registry_factory()  # two clients / two connections
    rec = obj("hot")
    await a.put_objects([rec])
    n = 24

    async def one(i: int) -> None:
        reg = a if i % 2 else b
        await reg.add_encoding(rec.address, enc(f"codec{i}", bytes([i])))
        await reg.add_tail(rec.address, i + 1, addr(f"tail{i}"))

    await asyncio.gather(*(one(i) for i in range(n)))
    got = await a.get_object(rec.address)
    assert set(got.encodings) == {"raw"} | {f"codec{i}" for i in range(n)}
    assert got.encodings["codec5"] == enc("codec5", bytes([5]))
    assert got.tails == {i + 1: addr(f"tail{i}") for i in range(n)}


# --- nodes and leases ------------------------------------------------------------


async def test_node_present_while_alive_and_gone_right_after_close(registry):
    lease = await registry.register_node(node("edge-1"), ttl=2)
    other = await registry.register_node(node("origin-1", role="origin", region="us"), ttl=2)
    assert await registry.list_nodes() == [node("edge-1"), node("origin-1", role="origin", region="us")]
    assert await registry.list_nodes(role="edge") == [node("edge-1")]
    assert await registry.list_nodes(region="us") == [node("origin-1", role="origin", region="us")]
    assert await registry.list_nodes(role="edge", region="us") == []
    assert lease.lease_id != other.lease_id and not lease.done.is_set()
    await lease.close()
    assert lease.done.is_set()
    assert await registry.list_nodes() == [node("origin-1", role="origin", region="us")]
    await other.close()


async def test_a_node_record_is_rewritten_under_its_lease_and_goes_with_it(registry):
    lease = await registry.register_node(node("edge-1"), ttl=2)
    watch = registry.watch("nodes/")
    async with contextlib.aclosing(watch):
        assert list((await next_event(watch)).items) == ["nodes/edge/eu/edge-1"]
        moved = dataclasses.replace(node("edge-1"), extra={"origin_rtt_ms": 41.5})
        await registry.update_node(moved, lease)
        ev = await next_event(watch)
        assert (ev.kind, ev.key, NodeRecord.unpack(ev.value)) == ("put", "nodes/edge/eu/edge-1", moved)
        assert await registry.list_nodes() == [moved]
        await lease.close()  # the rewritten key is still the lease's: it goes with it
        ev = await next_event(watch)
        assert (ev.kind, ev.key) == ("delete", "nodes/edge/eu/edge-1")
    assert await registry.list_nodes() == []
    with pytest.raises(RegistryError):  # a lease that is gone takes no record
        await registry.update_node(moved, lease)
    with pytest.raises(InvalidInput):
        await registry.update_node(moved, lease.lease_id)


async def test_killed_node_expires_within_ttl(registry):
    lease = await registry.register_node(node(), ttl=2)
    ttl = lease.ttl
    # Kept alive past its TTL by the refresh task...
    end = time.monotonic() + ttl * 1.5
    while time.monotonic() < end:
        assert await registry.list_nodes() == [node()]
        await asyncio.sleep(0.2)
    # ...then the node "dies": refreshing stops, nothing revokes.
    lease._stop_keepalive()
    stopped = time.monotonic()
    await eventually(lambda: _no_nodes(registry), timeout=ttl + 3)
    assert time.monotonic() - stopped <= ttl + 1.0
    await lease.close()  # revoking an expired lease is not an error


async def _no_nodes(registry) -> bool:
    return await registry.list_nodes() == []


async def test_lease_done_when_lost(registry):
    lease = await registry.register_node(node(), ttl=1)
    await registry._revoke(lease.lease_id)  # the registry forgets it (expired, or an admin revoked it)
    await asyncio.wait_for(lease.done.wait(), lease.ttl + 2)
    await lease.close()


async def test_closing_the_registry_revokes_its_leases(registry_factory):
    a, b = registry_factory(), registry_factory()
    await a.register_node(node(), ttl=5)
    assert await b.list_nodes() == [node()]
    await a.close()
    assert await b.list_nodes() == []


# --- watches -----------------------------------------------------------------------


async def test_watch_snapshot_then_events_in_order(registry):
    await registry.put_policy(policy("p0"))
    watch = registry.watch("policies/")
    async with contextlib.aclosing(watch):
        snap = await next_event(watch)
        assert snap.kind == "snapshot"
        assert {k: Policy.unpack(v) for k, v in snap.items.items()} == {"policies/p0": policy("p0")}
        await registry.put_model(model())  # outside the watched prefix
        await registry.put_policy(policy("p1"))
        await registry.put_policy(policy("p1", kind="warm"))
        await registry.delete_policy("p0")
        evs = [await next_event(watch) for _ in range(3)]
    assert [(e.kind, e.key) for e in evs] == [("put", "policies/p1"), ("put", "policies/p1"), ("delete", "policies/p0")]
    assert Policy.unpack(evs[1].value) == policy("p1", kind="warm")
    assert evs[2].value is None
    assert snap.revision < evs[0].revision < evs[1].revision < evs[2].revision


async def test_watch_sees_writes_from_another_handle(registry_factory):
    watcher, writer = registry_factory(), registry_factory()
    watch = watcher.watch("manifests/")
    async with contextlib.aclosing(watch):
        assert (await next_event(watch)).items == {}
        m = manifest("x", chain("x", 1))
        m = await writer.put_manifest(m)  # as stored: versioned
        ev = await next_event(watch)
    assert (ev.kind, ev.key, Manifest.unpack(ev.value)) == ("put", "manifests/public/x", m)


async def test_watch_sees_lease_expiry_as_delete(registry):
    lease = await registry.register_node(node(), ttl=1)
    watch = registry.watch("nodes/")
    async with contextlib.aclosing(watch):
        snap = await next_event(watch)
        assert list(snap.items) == ["nodes/edge/eu/edge-1"]
        lease._stop_keepalive()
        ev = await next_event(watch, timeout=lease.ttl + 3)
    assert (ev.kind, ev.key, ev.value) == ("delete", "nodes/edge/eu/edge-1", None)
    await lease.close()


async def test_watch_relists_after_compaction(registry):
    await registry.put_policy(policy("p0"))
    watch = registry.watch("policies/")
    async with contextlib.aclosing(watch):
        first = await next_event(watch)
        assert list(first.items) == ["policies/p0"]
        # The watcher falls behind: two writes, then history up to now is compacted.
        await registry.put_policy(policy("p1"))
        await registry.delete_policy("p0")
        async with contextlib.aclosing(registry.watch("")) as probe:
            now = (await next_event(probe)).revision
        await registry.compact(now)
        again = await next_event(watch)
        assert again.kind == "snapshot"
        assert list(again.items) == ["policies/p1"] and again.revision >= now
        # ...and it keeps watching from there.
        await registry.put_policy(policy("p2"))
        ev = await next_event(watch)
    assert (ev.kind, ev.key) == ("put", "policies/p2") and ev.revision > again.revision


async def test_cancelling_a_watch_cleans_up(registry):
    got_snapshot = asyncio.Event()

    async def consume() -> None:
        async for ev in registry.watch("policies/"):
            got_snapshot.set()

    def subscribed() -> bool:  # the watch past its snapshot, waiting for events: etcd's or the hub's subscription
        return bool(registry._client._watcher._callbacks if hasattr(registry, "_client") else registry._hub.subs)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_snapshot.wait(), 5)
    await eventually(lambda: asyncio.sleep(0, subscribed()))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: asyncio.sleep(0, not subscribed()))  # the subscription went with the watch
    # The registry is still fine, and a break also ends a watch.
    await registry.put_policy(policy())
    async with contextlib.aclosing(registry.watch("policies/")) as w:
        async for ev in w:
            assert ev.kind == "snapshot" and list(ev.items) == ["policies/pin-docs"]
            break


# --- validation -----------------------------------------------------------------


async def test_invalid_identifiers_are_rejected_before_becoming_keys(registry):
    with pytest.raises(InvalidAddress):
        await registry.get_object("../../etc/passwd")
    with pytest.raises(InvalidAddress):
        await registry.get_objects([addr("ok"), "A" * 64])
    with pytest.raises(InvalidAddress):
        await registry.get_model("not-a-model")
    with pytest.raises(InvalidInput):
        await registry.get_manifest("Public", "docs")
    with pytest.raises(InvalidInput):
        await registry.get_manifest("public", "../docs")
    with pytest.raises(InvalidInput):
        await registry.list_manifests("a/b")
    with pytest.raises(InvalidInput):
        await registry.delete_policy("a/b")
    with pytest.raises(InvalidAddress):
        await registry.add_tail(addr("x"), 3, "nope")
    with pytest.raises(InvalidInput):
        await registry.add_tail(addr("x"), 0, addr("y"))
    with pytest.raises(InvalidInput):
        await registry.list_nodes(role="edge/../x")
    with pytest.raises(InvalidInput):
        await registry.register_node(node(), ttl=0)
    with pytest.raises(InvalidInput):
        await registry.put_model(object())  # type: ignore[arg-type]
    assert await registry.list_keys() == []


async def test_writing_under_an_expired_lease_fails(registry):
    lease_id, _ = await registry._grant(1)
    await registry._revoke(lease_id)
    await registry._revoke(lease_id)  # twice is fine
    with pytest.raises(LeaseExpired):
        await registry._put(registry._key("nodes/edge/eu/late"), b"x", lease=lease_id)
    assert await registry.list_nodes() == []
