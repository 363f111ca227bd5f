"""A cross-region probe is bounded: a stalled link to another region costs a fill PROBE_MIN_S (or 4x that
region's expected time), then the origin is asked; it once held the fill for the whole 30 s fill timeout."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import ADDRESS, BLOB, RECORD, serve_objects  # noqa: E402

from kdn.edge import fill  # noqa: E402
from kdn.edge.metrics import EdgeMetrics  # noqa: E402
from kdn.registry import NodeRecord  # noqa: E402

pytestmark = pytest.mark.timeout(30)


class _Members:
    def __init__(self, remote: NodeRecord) -> None:
        self.remote = remote

    def owner(self, address: str):
        return None  # alone in its region: no owner hop

    def regions(self):
        return {"far": [self.remote]}


async def _origin(request: web.Request) -> web.Response:
    return web.Response(body=BLOB)


class Clock:
    """The breaker's clock, stepped by the test: a rest passes without waiting it out."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _filler(session: aiohttp.ClientSession, far_url: str, origin_url: str, metrics: EdgeMetrics,
            clock=time.monotonic) -> fill.Filler:
    """An edge of region near, alone there, with one other region (far, at ``far_url``) and an origin."""
    return fill.Filler(session=session, membership=_Members(NodeRecord("edge", "far", "far-1", far_url)),
                       origin_urls=lambda: [origin_url], me=NodeRecord("edge", "near", "near-1", "http://x"),
                       upstream_headers={}, metrics=metrics, timeout=30.0, clock=clock)


async def test_a_stalled_region_is_abandoned_for_the_origin(monkeypatch):
    monkeypatch.setattr(fill, "PROBE_MIN_S", 0.5)
    release = asyncio.Event()

    async def stalled(request):
        await release.wait()  # a link that passes no byte
        return web.Response(body=BLOB)

    far, far_url = await serve_objects(stalled)
    org, org_url = await serve_objects(_origin)
    rec, metrics = RECORD, EdgeMetrics(CollectorRegistry(), lambda: None)
    async with aiohttp.ClientSession() as session:
        f = _filler(session, far_url, org_url, metrics)
        t0 = time.monotonic()
        try:
            got = await f.fetch((ADDRESS, "zstd"), rec, hop=False)
        finally:
            release.set()
            await far.cleanup()
            await org.cleanup()
    took = time.monotonic() - t0
    assert got.source == "origin" and got.blob == BLOB
    assert 0.5 <= took < 2.0, took  # the probe's bound, then the origin: not the 30 s fill timeout
    assert metrics.source_errors.labels("region")._value.get() == 1  # noqa: SLF001


async def test_a_region_that_keeps_failing_rests_then_is_probed_again(monkeypatch):
    monkeypatch.setattr(fill, "PROBE_MIN_S", 0.3)
    monkeypatch.setattr(fill, "PROBE_REST_S", 1.0)
    stalled = asyncio.Event()
    stalled.set()
    release = asyncio.Event()
    far_hits = {"n": 0}

    async def far_handler(request):
        far_hits["n"] += 1
        if stalled.is_set():
            await release.wait()  # a link that passes no byte
        return web.Response(body=BLOB)

    async def slower_origin(request):  # 30 ms away: a healthy region on loopback is worth asking first
        await asyncio.sleep(0.03)
        return web.Response(body=BLOB)

    far, far_url = await serve_objects(far_handler)
    org, org_url = await serve_objects(slower_origin)
    rec, metrics = RECORD, EdgeMetrics(CollectorRegistry(), lambda: None)

    async def timed(f) -> tuple[float, str]:
        t0 = time.monotonic()
        got = await f.fetch((ADDRESS, "zstd"), rec, hop=False)
        assert got.blob == BLOB
        return time.monotonic() - t0, got.source

    try:
        async with aiohttp.ClientSession() as session:
            clock = Clock()
            f = _filler(session, far_url, org_url, metrics, clock)
            for _ in range(fill.PROBE_TRIP):  # each failed probe costs its bound
                took, src = await timed(f)
                assert src == "origin" and took >= 0.3, (took, src)
            took, src = await timed(f)  # resting: not probed, straight to the origin
            assert src == "origin" and took < 0.25, took
            assert far_hits["n"] == fill.PROBE_TRIP
            assert metrics.region_skipped._value.get() == 1  # noqa: SLF001
            assert f.routes((ADDRESS, "zstd"), rec, hop=False)[0].label == "origin"  # a lookup's forecast agrees
            clock.now += 1.05  # rested: probed once more; it fails again, so it rests twice as long
            took, src = await timed(f)
            assert far_hits["n"] == fill.PROBE_TRIP + 1 and took >= 0.3
            clock.now += 1.05
            took, src = await timed(f)
            assert far_hits["n"] == fill.PROBE_TRIP + 1 and took < 0.25, "the second rest is 2 s, not 1"
            clock.now += 1.0
            stalled.clear()  # the link is back
            took, src = await timed(f)
            assert src == "region:far" and far_hits["n"] == fill.PROBE_TRIP + 2
            took, src = await timed(f)  # healthy again: probed on every fill
            assert src == "region:far" and far_hits["n"] == fill.PROBE_TRIP + 3
    finally:
        release.set()
        await far.cleanup()
        await org.cleanup()


async def test_a_region_that_keeps_missing_and_is_no_faster_than_the_origin_is_not_asked_first(monkeypatch):
    """A cached-only miss costs a round trip; a region is asked before the origin only while its recent hit
    rate pays for that (p x time saved > (1 - p) x its round trip). Then, stale, it is tried again."""
    monkeypatch.setattr(fill, "PROBE_HIT_STALE_S", 1.0)
    asked = {"far": 0}

    async def far_misses(request):  # 20 ms away, never holds the object
        asked["far"] += 1
        await asyncio.sleep(0.02)
        return web.Response(status=404)

    async def origin(request):  # as far as the far region
        await asyncio.sleep(0.02)
        return web.Response(body=BLOB)

    far, far_url = await serve_objects(far_misses)
    org, org_url = await serve_objects(origin)
    metrics = EdgeMetrics(CollectorRegistry(), lambda: None)
    try:
        async with aiohttp.ClientSession() as session:
            clock = Clock()
            f = _filler(session, far_url, org_url, metrics, clock)
            assert (await f.fetch((ADDRESS, "zstd"), RECORD, hop=False)).source == "origin"
            assert asked["far"] == 1  # unmeasured: asked (and so measured: its miss is a round-trip sample)
            assert f.hit_rate(far_url) < fill.PROBE_HIT_PRIOR
            for _ in range(5):
                assert (await f.fetch((ADDRESS, "zstd"), RECORD, hop=False)).source == "origin"
            assert asked["far"] == 1  # no faster than the origin and missing: a miss's round trip buys nothing
            assert metrics.region_not_worth._value.get() == 5  # noqa: SLF001
            assert [r.label for r in f.routes((ADDRESS, "zstd"), RECORD, hop=False)] == ["origin"]
            clock.now += 1.05  # the hit rate goes stale: back to the prior, asked again
            assert f.hit_rate(far_url) == fill.PROBE_HIT_PRIOR
    finally:
        await far.cleanup()
        await org.cleanup()


def test_a_region_that_holds_what_is_asked_stays_worth_asking():
    f = fill.Filler(session=None, membership=None, origin_urls=lambda: [], me=NodeRecord("edge", "near", "n-1", "http://x"),
                    upstream_headers={}, metrics=EdgeMetrics(CollectorRegistry(), lambda: None))
    url = "http://far"
    for _ in range(20):
        f._probe_outcome(url, True)  # noqa: SLF001
    f.estimates[url].observe(0, 0.05)  # 50 ms round trip
    f.estimates[url].observe(len(BLOB) * 100, 0.10)
    assert f.hit_rate(url) > 0.9
    assert f._worth_probing(url, len(BLOB), t_next=0.5)  # noqa: SLF001  (much faster than the origin)
    assert not f._worth_probing(url, len(BLOB), t_next=0.05)  # noqa: SLF001  (no faster: never worth a miss)


def test_hit_rates_are_bounded_and_forget_the_least_recently_updated_region():
    f = fill.Filler(session=None, membership=None, origin_urls=lambda: [], me=NodeRecord("edge", "near", "n-1", "http://x"),
                    upstream_headers={}, metrics=EdgeMetrics(CollectorRegistry(), lambda: None))
    for _ in range(20):
        f._probe_outcome("http://first", False)  # noqa: SLF001
    for i in range(4096):
        f._probe_outcome(f"http://r{i}", True)  # noqa: SLF001
        if i == 2000:
            f._probe_outcome("http://first", False)  # noqa: SLF001  (updated again: now recent)
    assert len(f._hit_rate) <= 4096  # noqa: SLF001
    assert f.hit_rate("http://first") < 0.1  # kept: updated after most others
    assert f.hit_rate("http://r0") == fill.PROBE_HIT_PRIOR  # forgotten: the least recently updated


def test_an_operator_who_prefers_less_origin_egress_has_every_region_asked():
    f = fill.Filler(session=None, membership=_Members(NodeRecord("edge", "far", "far-1", "http://far")),
                    origin_urls=lambda: ["http://origin"], me=NodeRecord("edge", "near", "near-1", "http://x"),
                    upstream_headers={}, metrics=EdgeMetrics(CollectorRegistry(), lambda: None))
    for url in ("http://far", "http://origin"):
        f.estimates[url].observe(0, 0.05)
    for _ in range(20):
        f._probe_outcome("http://far", False)  # noqa: SLF001  (it never has anything)
    labels = [r.label for r in f.routes((ADDRESS, "zstd"), RECORD, hop=False)]
    assert labels == ["origin"]
    f.always_probe_regions = True
    labels = [r.label for r in f.routes((ADDRESS, "zstd"), RECORD, hop=False)]
    assert labels == ["region:far", "origin"]
