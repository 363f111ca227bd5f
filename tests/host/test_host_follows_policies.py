"""The host tier follows its region's policies (#53 deliverable 1, ``kdn host serve --registry URL --region R``):
a push to its region fills it without any engine asking, a pin keeps objects held while fills of others churn
through a small budget and removing the policy releases them, a pin that does not fit is refused (logged,
counted) without evicting a lease, and a scheduled push fills ahead of its window and holds until it ends.

Real parts: etcd, an origin that signs (tiny-llama), an edge in eu, policies set and removed by the
``kdn policy`` CLI; the host started in-process on a temp socket with its segment in a temp folder. The
cluster is shared by the module, so each test's host follows a region of its own (a region need not have
edges: hosts given one are a group pushes and pins can name), except the first, which removes its policies.
The store's pin set is tested alone first.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from datetime import datetime
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest
import pytest_asyncio
from edge_helpers import EDGE_TOKEN, cluster, get, publish
from host_helpers import host_config, object_record, running

from kdn import cli
from kdn.client.host import HostClient
from kdn.errors import InvalidInput
from kdn.host.alloc import ALIGN
from kdn.host.store import HostStore, NoRoom, footprint
from kdn.registry.signing import Signer
from kdn.wire.host import STAMP

TEXT = ("The lighthouse keeper trims the wick at dusk, logs the wind at every watch, and rows out to the "
        "buoy when the bell goes quiet. ")


# --- the store's pin set, alone ---------------------------------------------------------------------------------

BLOCK = 16 * ALIGN
RECORD = object_record("0" * 64)  # the store keeps a record with each object, and reads none of it


def put(store: HostStore, name: str):
    r = store.reserve(BLOCK - STAMP, name * 64)  # (its stamp fills the block)
    return store.commit(r, (name * 64, "raw"), RECORD)


def test_pinned_objects_stay_while_others_churn_and_go_once_unpinned():
    store = HostStore(4 * BLOCK, 4 * BLOCK)
    store.set_pins({"a" * 64, "b" * 64})  # b before it is held: kept from its commit on
    a, b = put(store, "a"), put(store, "b")
    assert (store.pinned, store.pinned_bytes) == (2, 2 * BLOCK)
    for name in "cdefghij":  # two blocks left for eight objects
        put(store, name)
    assert store.get(a.key) is a and store.get(b.key) is b and store.stats.evictions == 6
    assert a not in list(store.evictable())
    store.set_pins(set())
    assert (store.pinned, store.pinned_bytes) == (0, 0) and a in list(store.evictable())
    for name in "klmn":
        put(store, name)
    assert a.key not in store and b.key not in store


def test_a_pin_that_does_not_fit_is_refused_and_logged_once_never_evicting_a_lease(caplog):
    store = HostStore(4 * BLOCK, 4 * BLOCK)
    leased = put(store, "z")
    store.acquire(leased.key)
    store.set_pins({c * 64 for c in "abcde"})
    for name in "abc":
        put(store, name)
    with caplog.at_level(logging.WARNING, logger="kdn.host.store"):
        for name in "de":
            with pytest.raises(NoRoom):
                put(store, name)
    assert store.get(leased.key) is leased and store.stats.evictions == 0
    assert (store.stats.pins_refused, store.stats.refused, store.pinned) == (2, 2, 3)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 and len(caplog.records) == 1
    assert "does not fit the host tier" in caplog.records[0].message


def test_a_registry_without_a_region_is_refused_in_one_line(tmp_path):
    with pytest.raises(InvalidInput, match="give --region too"):
        host_config(tmp_path, registry="etcd://127.0.0.1:2379/x/")
    with pytest.raises(InvalidInput, match="invalid name"):
        host_config(tmp_path, region="eu west")


# --- with a CDN ----------------------------------------------------------------------------------------------------

pytestmark_cdn = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cdn(etcd_server, tmp_path_factory):
    """One CDN for the module: three documents published in eu (publishing runs the model)."""
    tmp = tmp_path_factory.mktemp("host-policies")
    key = Signer.generate(tmp / "origin.key")
    (tmp / "trusted").write_text(key.public + "\n")
    etcd = f"{etcd_server.replace('http://', 'etcd://')}/p{secrets.token_hex(4)}/"
    async with cluster(tmp, etcd, edges=("e1",), origin_kw={"signing_key": str(tmp / "origin.key")}) as c:
        # (each its own opening words: documents that begin alike share their first chunks' addresses)
        docs = {name: await publish(c, (f"{name}: " + TEXT * 12)[:n], name=name, encodings=["raw", "zstd"])
                for name, n in (("harbor", 700), ("small", 300), ("big", 1500))}
        sizes = {}
        for m in docs.values():
            for a in m["addresses"]:
                status, blob, _ = await get(c.origin_url(), a, encoding="raw")
                assert status == 200
                sizes[a] = len(blob)
        yield SimpleNamespace(c=c, docs=docs, sizes=sizes, trusted=str(tmp / "trusted"))


def config(cdn, d, region: str, **kw):
    (d / "edge-token").write_text(EDGE_TOKEN + "\n")
    return host_config(d, edges=(cdn.c.edge_url("e1"),), trusted_keys=cdn.trusted, token_file=str(cdn.c.tokens),
                       upstream_token_file=str(d / "edge-token"), region=region, registry=cdn.c.registry, **kw)


async def policy(cdn, *argv: str) -> None:
    assert await asyncio.to_thread(cli.main, ["policy", *argv, "--registry", cdn.c.registry]) == 0


def room(cdn, addresses) -> int:
    """The segment bytes these objects' raw blobs take."""
    return sum(footprint(cdn.sizes[a]) for a in addresses)


@pytestmark_cdn
async def test_a_push_to_its_region_fills_the_host_without_any_engine_asking(cdn, short_dir):
    addrs = cdn.docs["harbor"]["addresses"]
    async with running(config(cdn, short_dir, "eu")) as tier:
        engine = tier.policies.engine
        try:
            await policy(cdn, "set", "harbor-us", "--push", "public/harbor", "--to", "us")
            await engine.wait_applied(lambda e: "harbor-us" in e.policies)
            assert "harbor-us" not in engine.active and tier.stats()["warm_runs"] == 0  # another region's push
            await policy(cdn, "set", "harbor-eu", "--push", "public/harbor", "--to", "eu")
            await engine.wait_applied(lambda e: e.stats.warm_done == 1, timeout=30)
            s = tier.stats()
            assert (s["connections"], s["fills"], s["warmed"], s["warm_runs"]) == (0, len(addrs), len(addrs), 1)
            assert s["policies"] == 1 and s["misses"] == 0  # filled by the policy alone
            async with HostClient(tier.config.socket) as host:
                assert (await host.lookup(addrs)).prefix == len(addrs)
                for a in addrs:  # held, in the encoding engines lease first, the origin's bytes
                    _, blob, _ = await get(cdn.c.origin_url(), a, encoding="raw")
                    async with host.lease(a, "raw") as obj:
                        assert not obj.filled and bytes(obj.view) == blob
            assert tier.stats()["hits"] == len(addrs)
        finally:
            for name in ("harbor-us", "harbor-eu"):
                await policy(cdn, "rm", name)


@pytestmark_cdn
async def test_a_pin_keeps_objects_through_churn_and_removing_it_releases_them(cdn, short_dir):
    kept, others = cdn.docs["small"]["addresses"], cdn.docs["big"]["addresses"]
    assert len(others) >= 4
    budget = room(cdn, kept) + max(footprint(cdn.sizes[a]) for a in others)  # the pinned, and one other at a time
    async with running(config(cdn, short_dir, "pins", budget=budget)) as tier:
        engine = tier.policies.engine
        await policy(cdn, "set", "small-pin", "--pin", "public/small", "--region", "pins")
        await policy(cdn, "set", "small-warm", "--warm", "public/small", "--region", "pins")
        await engine.wait_applied(lambda e: e.stats.warm_done == 1 and e.pinned_addresses == set(kept), timeout=30)
        assert (tier.store.pinned, tier.store.pinned_bytes) == (len(kept), room(cdn, kept))
        async with HostClient(tier.config.socket) as host:
            for _ in range(2):  # every other object twice through the room left: each evicts the one before
                for a in others:
                    async with host.lease(a, "raw"):
                        pass
            s = tier.stats()
            assert s["evictions"] >= 2 * len(others) - 1 and s["pinned"] == len(kept)
            assert (await host.lookup(kept)).prefix == len(kept)  # the pinned objects stayed through it all
            assert s["used_bytes"] <= budget and s["refused"] == 0

            await policy(cdn, "rm", "small-pin")
            await engine.wait_applied(lambda e: not e.pinned_addresses)
            assert (tier.store.pinned, tier.store.pinned_bytes) == (0, 0)
            evictable = {h.key[0] for h in tier.store.evictable()}
            assert set(kept) <= evictable
            for _ in range(3):  # released: the churn takes them too, as the eviction policy orders
                for a in others:
                    async with host.lease(a, "raw"):
                        pass
                if not any((await host.lookup(kept)).held):
                    break
            assert not any((await host.lookup(kept)).held)
        await policy(cdn, "rm", "small-warm")


@pytestmark_cdn
async def test_a_pin_larger_than_the_room_left_is_refused_and_a_lease_keeps_its_object(cdn, short_dir, caplog):
    small, big = cdn.docs["small"]["addresses"][0], cdn.docs["big"]["addresses"]
    budget = footprint(cdn.sizes[small]) + room(cdn, big[:2])  # the leased object, and two of big's
    async with running(config(cdn, short_dir, "tight", budget=budget)) as tier:
        engine = tier.policies.engine
        async with HostClient(tier.config.socket) as host, host.lease(small, "raw") as leased:
            blob = bytes(leased.view)
            with caplog.at_level(logging.WARNING, logger="kdn.host.store"):
                await policy(cdn, "set", "big-pin", "--pin", "public/big", "--region", "tight")
                await policy(cdn, "set", "big-warm", "--warm", "public/big", "--region", "tight")
                await engine.wait_applied(lambda e: e.stats.warm_done == 1, timeout=30)
            s = tier.stats()
            assert s["pins_refused"] >= len(big) - 2 and s["refused"] == s["pins_refused"]
            assert 1 <= s["pinned"] <= 2 and s["pinned_bytes"] + footprint(len(blob)) <= budget
            assert s["warmed"] == s["pinned"] and s["warm_failures"] == 0  # refusals are outcomes, not failures
            assert bytes(leased.view) == blob and tier.store.get((small, "raw")) is not None  # never evicted
            assert sum("does not fit the host tier" in r.message for r in caplog.records) == 1
        await policy(cdn, "rm", "big-pin")
        await policy(cdn, "rm", "big-warm")


class SteppedClock:
    """Wall time that moves only when the test says so (``to``); a sleeper wakes at every step and looks again
    (tests/edge/test_scheduled_policies.py's)."""

    def __init__(self, now: float) -> None:
        self.t, self._moved = now, asyncio.Event()

    def now(self) -> float:
        return self.t

    def to(self, now: float) -> None:
        self.t = now
        self._moved.set()
        self._moved = asyncio.Event()

    async def sleep_until(self, t: float) -> None:
        if self.t < t:
            await self._moved.wait()


@pytestmark_cdn
async def test_a_scheduled_push_fills_ahead_of_its_window_and_holds_until_it_ends(cdn, short_dir):
    addrs = cdn.docs["harbor"]["addresses"]
    opens = datetime(2025, 6, 2, 8, 0, tzinfo=ZoneInfo("UTC")).timestamp()
    clock = SteppedClock(opens - 2 * 3600)
    async with running(config(cdn, short_dir, "sched")) as tier:
        engine = tier.policies.engine
        engine.clock = clock  # (no schedule is set yet: no timer runs on the old clock)
        await policy(cdn, "set", "harbor-mornings", "--push", "public/harbor", "--to", "sched",
                     "--at", "0 8 * * *", "--tz", "UTC", "--for", "1h")
        await engine.wait_applied(lambda e: "harbor-mornings" in e.phases)
        lead = engine.phases["harbor-mornings"].lead_s
        assert lead < 2 * 3600 and tier.stats()["warm_runs"] == 0 and tier.stats()["fills"] == 0

        clock.to(opens - lead + 1)  # the push runs ahead of the window, and pins what it fills
        await engine.wait_applied(lambda e: e.stats.warm_done == 1, timeout=30)
        assert clock.now() < opens and tier.store.pinned == len(addrs)
        assert tier.stats()["warmed"] == len(addrs)

        clock.to(opens + 3600 + 1)  # the window ended: the pins go, the objects stay until room is wanted
        await engine.wait_applied(lambda e: not e.pinned_addresses)
        assert tier.store.pinned == 0 and all((a, "raw") in tier.store for a in addrs)
        await policy(cdn, "rm", "harbor-mornings")
