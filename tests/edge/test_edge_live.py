"""Running edges: prefetch, operator policies applied live, and fills from another region."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import cluster, get, metric, origin_served, publish, wait_until  # noqa: E402

from kdn.registry import Policy, open_registry  # noqa: E402

TEXT = ("Keepers logged the weather, the ships, and the oil burned each night. " * 30)[:1500]


def owner(c, address: str):
    return c.edge(next(iter(c.edges))).membership.owner(address).node_id


async def test_prefetch_brings_the_next_chunks_before_they_are_asked(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, prefetch=2) as c:
        m = await publish(c, TEXT)
        a = m["addresses"]
        for e in c.edges:  # every edge learns the chain from the manifest watch
            await wait_until(lambda e=e: c.edge(e).chains.following(a[0], 2) == a[1:3])
        reader = owner(c, a[0])
        assert (await get(c.edge_url(reader), a[0]))[0] == 200
        for e in c.edges:
            await c.edge(e).prefetcher.idle()
        for x in a[1:3]:
            assert c.edge(owner(c, x)).memory.contains((x, "zstd")), "chunk i+1/i+2 was not prefetched into its owner"
        assert not any(c.edge(e).memory.contains((a[3], "zstd")) for e in c.edges), "prefetched further than k"
        # the prefetched chunk is then read: counted as used, and no new origin fetch
        served = origin_served(c)
        status, _, headers = await get(c.edge_url(owner(c, a[1])), a[1])
        assert status == 200 and headers["X-KDN-Source"] == "memory"
        assert sum(metric(s, "kdn_edge_prefetch_used") for s in c.edges.values()) >= 1
        for e in c.edges:
            await c.edge(e).prefetcher.idle()
        assert origin_served(c) >= served  # reading a[1] may prefetch a[3]; nothing else changed


async def test_prefetch_fills_the_encoding_the_read_was_of(tmp_path, etcd_url):
    # A client on a fast last hop reads raw copies; prefetching zstd ones for it would be a miss each time.
    async with cluster(tmp_path, etcd_url, prefetch=2) as c:
        m = await publish(c, TEXT)
        a = m["addresses"]
        for e in c.edges:
            await wait_until(lambda e=e: c.edge(e).chains.following(a[0], 2) == a[1:3])
        reader = owner(c, a[0])
        status, _, headers = await get(c.edge_url(reader), a[0], encoding="raw")
        assert status == 200 and headers["X-KDN-Encoding"] == "raw"
        for _ in range(2):  # a hint passed to another owner lands there, then runs
            for e in c.edges:
                await c.edge(e).prefetcher.idle()
            await asyncio.sleep(0.05)
        for x in a[1:3]:
            held = c.edge(owner(c, x)).memory
            assert held.contains((x, "raw")) and not held.contains((x, "zstd")), "prefetched another encoding"


async def test_the_eviction_setting_reaches_both_tiers(tmp_path, etcd_url):
    from kdn.edge.eviction import ARC, S3FIFO
    from kdn.errors import InvalidInput
    from kdn.edge.app import EdgeConfig

    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        await c.start_edge("e2", eviction="s3-fifo")
        assert all(isinstance(t._policy, ARC) for t in c.edge("e1").tiers)  # noqa: SLF001 - the default
        assert all(isinstance(t._policy, S3FIFO) for t in c.edge("e2").tiers)  # noqa: SLF001
        assert len(c.edge("e2").tiers) == 2
    with pytest.raises(InvalidInput, match="eviction must be one of arc, s3-fifo"):
        EdgeConfig(eviction="lru")


async def test_warm_and_pin_policies_take_effect_live(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url) as c:
        m = await publish(c, TEXT, name="hot")
        reg = open_registry(etcd_url)
        try:
            await reg.put_policy(Policy(name="warm-hot", kind="warm", region="eu", manifest="public/hot"))
            await reg.put_policy(Policy(name="pin-hot", kind="pin", region="eu", manifest="public/hot"))
            for a in m["addresses"]:
                e = c.edge(owner(c, a))
                await e.policies.wait_applied(lambda p: a in p.pinned_addresses)
                await wait_until(lambda e=e, a=a: e.memory.contains((a, "zstd")))
            assert origin_served(c) == len(m["addresses"])  # warmed once each, by its owner only
            # pinned entries are marked and survive pressure
            for a in m["addresses"]:
                e = c.edge(owner(c, a))
                meta = dict(e.memory.entries())[(a, "zstd")]
                assert meta.pinned
            # reads are now memory hits with no new origin traffic
            for a in m["addresses"]:
                status, _, headers = await get(c.edge_url(owner(c, a)), a)
                assert headers["X-KDN-Source"] == "memory"
            assert origin_served(c) == len(m["addresses"])
            await reg.delete_policy("pin-hot")
            for a in m["addresses"]:
                e = c.edge(owner(c, a))
                await e.policies.wait_applied(lambda p: a not in p.pinned_addresses)
                assert not dict(e.memory.entries())[(a, "zstd")].pinned
        finally:
            await reg.close()


async def test_ttl_and_quota_policies(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][0]
        await get(c.edge_url("e1"), a)
        e = c.edge("e1")
        reg = open_registry(etcd_url)
        try:
            await reg.put_policy(Policy(name="short", kind="ttl", namespace="public", ttl_s=0.001))
            await e.policies.wait_applied(lambda p: "short" in p.active)
            dropped = sum([await t.expire() for t in e.tiers])
            assert dropped >= 1 and not e.memory.contains((a, "zstd"))
            await reg.put_policy(Policy(name="q", kind="quota", namespace="public", quota_bytes=1))
            await e.policies.wait_applied(lambda p: "q" in p.active)
            await reg.delete_policy("short")
            await e.policies.wait_applied(lambda p: "short" not in p.active)
            status, _, _ = await get(c.edge_url("e1"), a)
            assert status == 200  # served, but not cached beyond the namespace's quota
            assert e.memory.used <= 1 or not any(k[0] == a for k, _ in e.memory.entries())
        finally:
            await reg.close()


async def test_other_region_is_asked_before_the_origin(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("eu1",)) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][0]
        assert (await get(c.edge_url("eu1"), a))[2]["X-KDN-Source"] == "origin"
        await c.start_edge("us1", region="us")
        await c.wait_ring(["us1"], region="us")
        await c.edge("us1").membership.wait_for(lambda mb: "eu" in mb.regions(), timeout=10)
        status, body, headers = await get(c.edge_url("us1"), a)
        assert status == 200 and headers["X-KDN-Source"] == "region:eu"
        assert origin_served(c) == 1
        # a miss in the other region falls through to the origin without filling there
        b = m["addresses"][1]
        status, _, headers = await get(c.edge_url("us1"), b)
        assert headers["X-KDN-Source"] == "origin"
        assert not c.edge("eu1").memory.contains((b, "zstd"))


async def test_a_malformed_manifest_record_hides_only_itself(tmp_path, etcd_url):
    """One unreadable manifest record once failed the prefetch index's whole snapshot: prefetch off for every
    manifest, and every manifest re-listed in a retry loop."""
    reg = open_registry(etcd_url)
    try:
        async with cluster(tmp_path, etcd_url, edges=(), prefetch=2) as c:
            await reg._put(reg._key("manifests/public/broken"), b"\xc1 not msgpack")  # noqa: SLF001 - a raw bad record
            m = await publish(c, TEXT)  # before the edge starts: both are in its first snapshot
            await c.start_edge("e1", prefetch=2)
            await c.wait_ring(["e1"])
            a = m["addresses"]
            await wait_until(lambda: c.edge("e1").chains.following(a[0], 2) == a[1:3])
            await reg._put(reg._key("manifests/public/broken2"), b"\xc1")  # noqa: SLF001 - and one that arrives live
            m2 = await publish(c, "Another log entirely: " + TEXT, name="doc2")  # no prefix shared with vol1
            await wait_until(lambda: c.edge("e1").chains.following(m2["addresses"][0], 1) == m2["addresses"][1:2])
            # each unreadable record counted (again if a re-list sees it again); the live one came before doc2
            assert metric(c.edges["e1"], "kdn_edge_bad_registry_records", kind="manifest") >= 2
    finally:
        await reg.close()


async def test_an_edge_follows_manifests_once_and_a_pin_named_before_its_manifest_applies(tmp_path, etcd_url,
                                                                                          monkeypatch):
    """The prefetch index and the policy engine once each watched ``manifests/``: two watches, two
    copies of every manifest. The edge now has one view and hands each event to the engine."""
    import kdn.edge.views as edge_views
    import kdn.edge.membership as membership
    import kdn.edge.policies as policies
    from kdn.registry.follow import follow

    followed: list[str] = []

    def counting(registry, prefix, *a, **kw):
        followed.append(prefix)
        return follow(registry, prefix, *a, **kw)

    for module in (edge_views, policies, membership):
        monkeypatch.setattr(module, "follow", counting)
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        e = c.edge("e1")
        reg = open_registry(etcd_url)
        try:
            # The pin names a manifest that does not exist yet: it resolves through the edge's feed.
            await reg.put_policy(Policy(name="pin-later", kind="pin", region="eu", manifest="public/later"))
            await e.policies.wait_applied(lambda p: "public/later" in p.unresolved)
            m = await publish(c, TEXT, name="later")
            await e.policies.wait_applied(lambda p: set(m["addresses"]) <= p.pinned_addresses)
        finally:
            await reg.close()
        assert followed.count("manifests/") == 1, followed
        assert followed.count("policies/") == 1, followed
