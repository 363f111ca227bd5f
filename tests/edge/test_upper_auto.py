"""The upper tier chosen by measured latency (edge/upper.py): without an ``upper`` policy, the region whose
edges measured the shortest round trip to the origin, when it is clearly nearer than the rest; a policy
overrides it; ``--upper-tier policy`` turns it off; the figures come from the registry and are checked."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

import linkemu  # bench/lib/linkemu.py (tests/conftest.py puts bench/lib on the path)
from edge_helpers import cluster, get, origin_served, publish

from kdn.edge import upper
from kdn.edge.config import EdgeConfig
from kdn.errors import InvalidInput, RegistryUnavailable
from kdn.registry import NodeRecord, Policy, open_registry

pytestmark = pytest.mark.timeout(60)

TEXT = ("Whichever region sits next to the origin shields it for the others. " * 30)[:1500]


def _node(region: str, i: int, rtt: object = None) -> NodeRecord:
    extra = {} if rtt is None else {upper.EXTRA_KEY: rtt}
    return NodeRecord("edge", region, f"{region}-{i}", f"http://127.0.0.1:{9000 + i}", extra=extra)


def _regions(**rtts: list[object]) -> dict[str, list[NodeRecord]]:
    return {r: [_node(r, i, v) for i, v in enumerate(vs)] for r, vs in rtts.items()}


def test_the_region_clearly_nearest_the_origin_is_chosen():
    assert upper.choose(_regions(eu=[1.5], us=[80.0], ap=[160.0])) == "eu"
    # Per region, the median of its edges' figures: one slow edge does not move its region.
    assert upper.choose(_regions(eu=[1.0, 2.0, 900.0], us=[80.0, 81.0])) == "eu"
    # Ties go to the first name, so every edge picks the same.
    assert upper.choose(_regions(us=[1.0], eu=[1.0], ap=[100.0])) == "eu"


def test_no_region_is_chosen_when_none_is_clearly_nearer_or_too_few_advertise():
    assert upper.choose(_regions(eu=[1.0])) is None  # one region: nothing to shield
    assert upper.choose(_regions(eu=[1.0], us=[])) is None
    assert upper.choose(_regions(eu=[1.0], us=[None])) is None  # us advertises nothing (yet)
    # Within AUTO_RATIO of the others: a tier would add a hop and save little.
    assert upper.choose(_regions(eu=[50.0], us=[80.0], ap=[90.0])) is None
    # Twice as near but only a few ms: every region is on one machine (loopback) or one site.
    assert upper.choose(_regions(eu=[0.4], us=[1.2], ap=[3.0])) is None
    assert upper.AUTO_MIN_GAP_MS >= 10


@pytest.mark.parametrize("bad", [True, "1.0", math.nan, math.inf, -1.0, upper.MAX_RTT_MS + 1, [1.0], {"ms": 1}])
def test_a_figure_from_the_registry_that_is_not_a_round_trip_is_ignored(bad):
    assert upper.advertised(_node("eu", 0, bad)) is None
    # Ignored, not taken as zero: the region with only bad figures advertises nothing.
    assert upper.choose(_regions(eu=[bad], us=[80.0], ap=[90.0])) is None


async def test_a_round_advertises_the_least_probe_and_rewrites_the_record_only_when_it_moves():
    answers: list[float] = []
    sent: list[dict] = []
    failing = {"registry": False}

    async def probe(url: str) -> float:
        if url.endswith(":2"):
            raise aiohttp.ClientConnectionError("down")  # one origin down: the other still counts
        return answers.pop(0)

    async def advertise(extra: dict) -> None:
        if failing["registry"]:
            raise RegistryUnavailable("etcd is down")
        sent.append(extra)

    a = upper.AutoUpper(origin_urls=lambda: ["http://127.0.0.1:1", "http://127.0.0.1:2"], probe=probe,
                        advertise=advertise, regions=lambda: {}, revision=lambda: 0)
    answers[:] = [0.050, 0.040, 0.045]
    await a.round()
    assert a.rtt_ms == pytest.approx(40.0) and sent == [{upper.EXTRA_KEY: 40.0}]
    answers[:] = [0.044, 0.046, 0.047]  # within 20%: the record is not rewritten
    await a.round()
    assert a.rtt_ms == pytest.approx(44.0) and len(sent) == 1 and a.advertised_ms == 40.0
    failing["registry"] = True  # moved, but the registry is down: kept to try again next round
    answers[:] = [0.010, 0.011, 0.012]
    await a.round()
    assert len(sent) == 1 and a.advertised_ms == 40.0
    failing["registry"] = False
    answers[:] = [0.010, 0.011, 0.012]
    await a.round()
    assert sent[-1] == {upper.EXTRA_KEY: 10.0} and a.advertised_ms == 10.0


async def test_the_choice_is_recomputed_only_when_the_membership_moves():
    view = {"regions": _regions(eu=[1.0], us=[80.0]), "rev": 1}
    calls = {"n": 0}

    def regions():
        calls["n"] += 1
        return view["regions"]

    a = upper.AutoUpper(origin_urls=list, probe=None, advertise=None, regions=regions,  # type: ignore[arg-type]
                        revision=lambda: view["rev"])
    assert a.region == "eu" and a.region == "eu" and calls["n"] == 1
    view["regions"], view["rev"] = _regions(eu=[90.0], us=[2.0]), 2
    assert a.region == "us" and calls["n"] == 2


def test_the_setting_is_checked():
    assert EdgeConfig().upper_tier == "auto"
    with pytest.raises(InvalidInput, match="upper_tier"):
        EdgeConfig(upper_tier="nearest")


async def _healthz(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/healthz") as r:
        return await r.json()


async def test_edges_far_from_the_origin_fill_through_the_region_that_measured_it_near(tmp_path, etcd_url):
    """eu reaches the origin over loopback; us and ap through a link 20 ms each way. Every edge measures,
    advertises and reads the others' figures: all take eu as the upper tier, and the origin serves one fill
    for an object both far regions read. A policy overrides the choice; without either, fills go to the
    origin."""
    async with cluster(tmp_path, etcd_url, edges=("eu1",)) as c:
        far = linkemu.LinkEmulator(0, "127.0.0.1", c.origin.port, delay_ms=20, mbit=1000)
        await far.start()
        try:
            for nid, region in (("us1", "us"), ("ap1", "ap")):
                await c.start_edge(nid, region=region, origin=far.url)
            def every_figure_in(m) -> bool:  # each region's edge has measured and advertised its figure
                return (all(upper.advertised(n) is not None for ns in m.regions().values() for n in ns)
                        and set(m.regions()) == {"eu", "us", "ap"})

            for nid in ("eu1", "us1", "ap1"):
                await c.edge(nid).membership.wait_for(every_figure_in, timeout=15)
            for nid in ("eu1", "us1", "ap1"):
                assert c.edge(nid).upper_regions() == {"eu"} and c.edge(nid).upper_chosen_by == "latency"
            h = await _healthz(c.edge_url("ap1"))
            assert h["upper_tiers"] == ["eu"] and h["upper_chosen_by"] == "latency"
            assert h["origin_rtt_ms"] >= 40.0  # two 20 ms legs
            assert (await _healthz(c.edge_url("eu1")))["origin_rtt_ms"] < 20.0
            # The figure is in the edge's own record, as every other edge reads it.
            recs = {r.node_id: r for r in c.edge("eu1").membership.nodes.values()}
            assert upper.advertised(recs["us1"]) >= 40.0 > upper.advertised(recs["eu1"])

            m = await publish(c, TEXT)
            a = m["addresses"][0]
            answers = await asyncio.gather(*(get(c.edge_url(n), a) for n in ("us1", "ap1")))
            assert [s for s, _, _ in answers] == [200, 200]
            assert {h["X-KDN-Source"] for _, _, h in answers} == {"upper:eu"}
            assert origin_served(c) == 1

            # An operator's policy names the tier instead.
            reg = open_registry(c.registry)
            try:
                await reg.put_policy(Policy(name="shield", kind="upper", region="us"))
            finally:
                await reg.close()
            await c.edge("ap1").policies.wait_applied(lambda p: "us" in p.upper_regions)
            assert c.edge("ap1").upper_regions() == {"us"} and c.edge("ap1").upper_chosen_by == "policy"
            b = m["addresses"][1]
            status, _, headers = await get(c.edge_url("ap1"), b)
            assert status == 200 and headers["X-KDN-Source"] == "upper:us"
        finally:
            await far.stop()


async def test_with_upper_tier_policy_the_edges_neither_measure_nor_choose(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("eu1",), upper_tier="policy") as c:
        edge = c.edge("eu1")
        assert edge.auto_upper is None and edge.upper_regions() == frozenset()
        h = await _healthz(c.edge_url("eu1"))
        assert h["upper_chosen_by"] is None and h["origin_rtt_ms"] is None
        assert upper.EXTRA_KEY not in edge.membership.me.extra
