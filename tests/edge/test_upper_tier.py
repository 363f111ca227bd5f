"""The upper tier (origin shield): with an ``upper`` policy naming a region, every other region's owner
edge fills through that region's owner of the object, so the origin serves one fill per object whatever
the number of regions; the upper tier fills from the origin alone; a failing upper tier is passed over
for the origin and rests like a region."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import ADDRESS, BLOB, RECORD, cluster, get, metric, origin_served, publish, serve_objects  # noqa: E402

from kdn.edge import fill  # noqa: E402
from kdn.edge.metrics import EdgeMetrics  # noqa: E402
from kdn.registry.policy_records import validate_policy  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402
from kdn.wire.fetch import CACHED_ONLY, HOP, TIER  # noqa: E402
from kdn.registry import NodeRecord, Policy, open_registry  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TEXT = ("The upper tier keeps the origin's link for what no region holds yet. " * 30)[:1500]


async def _upper(c, region: str) -> None:
    reg = open_registry(c.registry)
    try:
        await reg.put_policy(Policy(name="shield", kind="upper", region=region))
    finally:
        await reg.close()
    for nid in c.edges:
        await c.edge(nid).policies.wait_applied(lambda e: region in e.upper_regions)


def _edge(c, node_id: str):
    return c.edge(node_id)


async def test_other_regions_fill_through_the_upper_tier_and_the_origin_serves_each_object_once(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("eu1", "eu2")) as c:
        for nid, region in (("us1", "us"), ("us2", "us"), ("ap1", "ap")):
            await c.start_edge(nid, region=region)
        await c.wait_ring(["us1", "us2"], region="us")
        await c.wait_ring(["ap1"], region="ap")
        for nid in ("us1", "ap1"):
            await _edge(c, nid).membership.wait_for(lambda mb: {"eu", "us", "ap"} <= set(mb.regions()), timeout=10)
        await _upper(c, "eu")
        assert metric(c.edges["ap1"], "kdn_edge_upper_tiers") == 1
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{c.edge_url('us2')}/healthz") as r:
                assert (await r.json())["upper_tiers"] == ["eu"]
        m = await publish(c, TEXT)
        addresses = m["addresses"]
        assert len(addresses) >= 2

        # One object, asked at once by every edge outside the upper tier: one origin fill in all.
        a = addresses[0]
        answers = await asyncio.gather(*(get(c.edge_url(n), a) for n in ("us1", "us2", "ap1")))
        assert all(status == 200 for status, _, _ in answers)
        assert len({body for _, body, _ in answers}) == 1
        assert origin_served(c) == 1
        eu_owner = _edge(c, "eu1").membership.owner(a).node_id
        assert _edge(c, eu_owner).memory.contains((a, "zstd"))  # the shield keeps what it filled
        sources = {headers["X-KDN-Source"] for _, _, headers in answers}
        # Each region's owner filled through the upper tier; a non-owner through its owner.
        assert sources <= {"upper:eu", f"peer:{_edge(c, 'us1').membership.owner(a).node_id}"}, sources
        assert "upper:eu" in sources
        assert metric(c.edges["ap1"], "kdn_edge_fill_bytes", source="upper") > 0

        # An edge of the upper tier itself fills from the origin, as without the policy.
        b = addresses[1]
        status, _, headers = await get(c.edge_url("eu1"), b)
        assert status == 200 and headers["X-KDN-Source"] in ("origin", f"peer:{eu_owner}")
        before = origin_served(c)
        status, _, headers = await get(c.edge_url("ap1"), b)
        assert status == 200 and headers["X-KDN-Source"] == "upper:eu"
        assert origin_served(c) == before  # held by the upper tier: the origin is not asked again

        # X-KDN-Tier ("fill from the origin, you are the upper tier") is for edges: from anyone else it is
        # ignored, and the read goes through the upper tier as any other.
        from edge_helpers import EDGE_TOKEN

        m2 = await publish(c, TEXT[::-1], name="doc2")
        e, f = m2["addresses"][0], m2["addresses"][1]
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{c.edge_url('ap1')}/v1/objects/{e}", headers={TIER: "1"}) as r:
                assert r.status == 200 and r.headers["X-KDN-Source"] == "upper:eu"
            async with s.get(f"{c.edge_url('ap1')}/v1/objects/{f}",
                             headers={TIER: "1", HOP: "1", "Authorization": f"Bearer {EDGE_TOKEN}"}) as r:
                assert r.status == 200 and r.headers["X-KDN-Source"] == "origin"  # an edge's tier request

        # Without the policy, a region misses past the others to the origin (cached-only asks fill nothing).
        reg = open_registry(c.registry)
        try:
            assert await reg.delete_policy("shield")
        finally:
            await reg.close()
        await _edge(c, "ap1").policies.wait_applied(lambda e: not e.upper_regions)
        d = addresses[-1]
        before = origin_served(c)
        status, _, headers = await get(c.edge_url("ap1"), d)
        assert status == 200 and headers["X-KDN-Source"] == "origin"
        assert origin_served(c) == before + 1
        eu_d_owner = _edge(c, "eu1").membership.owner(d).node_id
        assert not _edge(c, eu_d_owner).memory.contains((d, "zstd"))


# --- the plan and its failures, one filler against small servers --------------------------------

class _Members:
    """One edge per region, and no in-region owner hop."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.nodes = {r: [NodeRecord("edge", r, f"{r}-1", u)] for r, u in urls.items()}

    def owner(self, address: str):
        return None

    def regions(self):
        return self.nodes


def _filler(session, me: str, urls: dict[str, str], origin_url: str, uppers, metrics=None) -> fill.Filler:
    return fill.Filler(session=session, membership=_Members(urls), origin_urls=lambda: [origin_url],
                       me=NodeRecord("edge", me, f"{me}-1", "http://127.0.0.1:9"), upstream_headers={},
                       metrics=metrics or EdgeMetrics(CollectorRegistry(), lambda: None), timeout=30.0,
                       upper_regions=lambda: frozenset(uppers))


def test_the_plan_puts_the_upper_tier_after_the_cached_only_asks_and_before_the_origin():
    urls = {"eu": "http://127.0.0.1:1", "us": "http://127.0.0.1:2", "ap": "http://127.0.0.1:3"}
    origin = "http://127.0.0.1:4"
    key = (ADDRESS, "zstd")

    def plan(me, uppers, **kw):
        f = _filler(None, me, {r: u for r, u in urls.items()}, origin, uppers)
        return [(r.label, r.headers) for r in f.routes(key, RECORD, hop=False, **kw)]

    got = plan("ap", {"eu"})
    assert [label for label, _ in got] == ["region:us", "upper:eu", "origin"]
    assert CACHED_ONLY in got[0][1] and TIER in got[1][1] and CACHED_ONLY not in got[1][1]
    # The upper tier's own edges, and any edge without the policy: the regions cached-only, then the origin.
    assert [label for label, _ in plan("eu", {"eu"})] == ["region:us", "region:ap", "origin"]
    assert [label for label, _ in plan("ap", set())] == ["region:eu", "region:us", "origin"]
    # A lower region's fill at the upper tier: the origin alone (the asker made the cross-region asks).
    assert [label for label, _ in plan("eu", {"eu"}, tier=True)] == ["origin"]
    # Two upper tiers: a region outside both asks both (fastest first), then the origin.
    two = plan("ap", {"eu", "us"})
    assert [label for label, _ in two] in (["upper:eu", "upper:us", "origin"], ["upper:us", "upper:eu", "origin"])
    assert all(TIER in headers and HOP in headers for _, headers in two[:2])
    # An edge in one of two upper tiers asks the other cached-only, never as a tier fill.
    assert [(label, TIER in headers) for label, headers in plan("eu", {"eu", "us"})] == [
        ("region:us", False), ("region:ap", False), ("origin", False)]


def test_a_fill_asks_at_most_two_other_regions_cached_only_unless_told_to_ask_every_one():
    urls = {f"r{i}": f"http://127.0.0.1:{10 + i}" for i in range(1, 9)}
    key = (ADDRESS, "zstd")
    metrics = EdgeMetrics(CollectorRegistry(), lambda: None)
    f = _filler(None, "r0", urls, "http://127.0.0.1:4", set(), metrics)
    labels = [r.label for r in f.routes(key, RECORD, hop=False, filling=True)]
    assert len(labels) == fill.PROBE_MAX_REGIONS + 1 and labels[-1] == "origin", labels
    assert metrics.region_capped._value.get() == 8 - fill.PROBE_MAX_REGIONS  # noqa: SLF001
    f.always_probe_regions = True
    assert len(f.routes(key, RECORD, hop=False)) == 8 + 1


def test_a_region_is_worth_asking_first_against_the_upper_tier_not_the_origin():
    """A cached-only ask pays off by what it saves on a hit: with an upper tier measured as near as the
    other regions, asking them first only adds a round trip to every miss."""
    urls = {"eu": "http://127.0.0.1:1", "us": "http://127.0.0.1:2"}
    origin = "http://127.0.0.1:4"
    key = (ADDRESS, "zstd")
    # Below an upper tier the origin is never asked, so never measured: the upper tier's fills are.
    f = _filler(None, "ap", urls, origin, {"eu"})
    assert [r.label for r in f.routes(key, RECORD, hop=False)] == ["region:us", "upper:eu", "origin"]
    for url in (urls["eu"], urls["us"]):
        f.estimates[url].observe(100, 0.06)
    assert [r.label for r in f.routes(key, RECORD, hop=False)] == ["upper:eu", "origin"]
    # Without one, the same regions against an origin 5x as far: worth asking.
    f = _filler(None, "ap", urls, origin, set())
    for url, seconds in ((origin, 0.3), (urls["eu"], 0.06), (urls["us"], 0.06)):
        f.estimates[url].observe(100, seconds)
    assert [r.label for r in f.routes(key, RECORD, hop=False)] == ["region:eu", "region:us", "origin"]


async def test_a_failing_upper_tier_is_passed_over_for_the_origin_then_rests(monkeypatch):
    monkeypatch.setattr(fill, "PROBE_REST_S", 30.0)
    hits = {"upper": 0, "origin": 0}

    async def broken(request):
        hits["upper"] += 1
        return web.Response(status=503, text="overloaded")

    async def origin(request):
        hits["origin"] += 1
        return web.Response(body=BLOB)

    up, up_url = await serve_objects(broken)
    org, org_url = await serve_objects(origin)
    metrics = EdgeMetrics(CollectorRegistry(), lambda: None)
    try:
        async with aiohttp.ClientSession() as session:
            f = _filler(session, "ap", {"eu": up_url}, org_url, {"eu"}, metrics)
            for _ in range(fill.PROBE_TRIP):
                got = await f.fetch((ADDRESS, "zstd"), RECORD, hop=False)
                assert got.source == "origin" and got.blob == BLOB
            assert hits == {"upper": fill.PROBE_TRIP, "origin": fill.PROBE_TRIP}
            assert metrics.source_errors.labels("upper")._value.get() == fill.PROBE_TRIP  # noqa: SLF001
            # Resting: the next fill goes straight to the origin.
            assert [r.label for r in f.routes((ADDRESS, "zstd"), RECORD, hop=False)] == ["origin"]
            got = await f.fetch((ADDRESS, "zstd"), RECORD, hop=False)
            assert got.source == "origin" and hits["upper"] == fill.PROBE_TRIP
    finally:
        await up.cleanup()
        await org.cleanup()


async def test_a_lying_upper_tier_is_never_served(monkeypatch):
    async def liar(request):
        return web.Response(body=b"X" * len(BLOB), headers={"X-KDN-Encoding": "zstd"})

    async def origin(request):
        return web.Response(body=BLOB)

    up, up_url = await serve_objects(liar)
    org, org_url = await serve_objects(origin)
    metrics = EdgeMetrics(CollectorRegistry(), lambda: None)
    try:
        async with aiohttp.ClientSession() as session:
            got = await _filler(session, "ap", {"eu": up_url}, org_url, {"eu"}, metrics).fetch(
                (ADDRESS, "zstd"), RECORD, hop=False)
    finally:
        await up.cleanup()
        await org.cleanup()
    assert got.source == "origin" and got.blob == BLOB
    assert metrics.digest_failures.labels("upper")._value.get() == 1  # noqa: SLF001


def test_an_upper_policy_names_a_region_and_nothing_else():
    assert validate_policy(Policy(name="shield", kind="upper", region="eu")).region == "eu"
    with pytest.raises(InvalidInput, match="names the upper tier's region"):
        validate_policy(Policy(name="shield", kind="upper"))
    with pytest.raises(InvalidInput, match="takes a region only"):
        validate_policy(Policy(name="shield", kind="upper", region="eu", namespace="public"))
