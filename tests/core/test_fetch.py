"""The one verified fetch (kdn/wire/fetch.py): what a body must be before either the edge or the client keeps it.

Each source below is a real aiohttp server on loopback that misbehaves in one way. The same checks run
for the edge's fills and the client (both call ``Fetcher.fetch``; ``test_the_edge_and_the_client_share_it``).
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

from kdn.wire.arena import Arena
from kdn.wire.bodyget import BodyGetter
from kdn.errors import DigestMismatch, SourceError
from kdn.wire.estimate import Estimates
from kdn.wire.fetch import CACHED_ONLY, Fetcher, Route, Want

BLOB = bytes(range(256)) * 4096  # 1 MiB
ADDR = "ab" * 32
WANT = Want(ADDR, "zstd", len(BLOB), blake3(BLOB).hexdigest())


def serve(behaviour: str, *, delay: float = 0.0, seen: list | None = None):
    async def handler(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(dict(request.headers))
        if delay:
            await asyncio.sleep(delay)
        headers = {"X-KDN-Encoding": request.query.get("encoding", ""), "X-KDN-Source": "memory"}
        if behaviour == "miss":
            return web.Response(status=404)
        if behaviour == "error":
            return web.Response(status=503)
        if behaviour == "lie":
            body = bytearray(BLOB)
            body[1000] ^= 1
            return web.Response(body=bytes(body), headers=headers)
        if behaviour == "short":
            return web.Response(body=BLOB[:-10], headers=headers)
        if behaviour == "other-encoding":
            return web.Response(body=BLOB, headers={**headers, "X-KDN-Encoding": "raw"})
        if behaviour == "filled":
            return web.Response(body=BLOB, headers={**headers, "X-KDN-Source": "origin"})
        return web.Response(body=BLOB, headers=headers)

    app = web.Application()
    app.router.add_get("/v1/objects/{address}", handler)
    return TestServer(app, host="127.0.0.1")


@pytest.fixture
async def servers():
    started: list[TestServer] = []

    async def make(behaviour: str, **kw) -> str:
        s = serve(behaviour, **kw)
        await s.start_server()
        started.append(s)
        return str(s.make_url("")).rstrip("/")

    yield make
    for s in started:
        await s.close()


@pytest.fixture
async def fetcher():
    getter = BodyGetter(ssl=None)
    yield Fetcher(getter, Estimates(), timeout=5.0)
    getter.close()


@pytest.mark.parametrize("behaviour, error", [("lie", DigestMismatch), ("short", SourceError),
                                              ("other-encoding", SourceError), ("error", SourceError)])
async def test_a_bad_body_is_never_returned_and_the_next_source_is_asked(servers, fetcher, behaviour, error):
    bad, good = await servers(behaviour), await servers("ok")
    body = await fetcher.fetch(WANT, [Route("edge:bad", bad, "edge"), Route("origin", good, "origin")])
    assert bytes(body.blob) == BLOB and body.route.label == "origin" and fetcher.failovers == 1
    with pytest.raises(error):
        await fetcher.fetch(WANT, [Route("edge:bad", bad, "edge")])


async def test_every_source_lying_is_a_digest_mismatch_not_a_plain_miss(servers, fetcher):
    urls = [await servers("lie") for _ in range(2)]
    with pytest.raises(DigestMismatch, match="no source delivered .* intact"):
        await fetcher.fetch(WANT, [Route(f"edge:{i}", u, "edge") for i, u in enumerate(urls)])


async def test_a_cached_only_404_is_a_miss_measured_as_a_round_trip(servers, fetcher):
    far, origin = await servers("miss"), await servers("ok")
    routes = [Route("region:us", far, "region", {CACHED_ONLY: "1"}), Route("origin", origin, "origin")]
    body = await fetcher.fetch(WANT, routes)
    assert body.route.kind == "origin" and fetcher.failovers == 0
    assert fetcher.estimates[far].samples == 1 and fetcher.estimates[far].failures == 0
    with pytest.raises(SourceError, match="none holds it"):
        await fetcher.fetch(WANT, routes[:1])


async def test_only_a_body_served_from_the_source_s_own_tiers_measures_its_link(servers, fetcher):
    filled, cached = await servers("filled"), await servers("ok")
    await fetcher.fetch(WANT, [Route("edge:a", filled, "edge")])
    await fetcher.fetch(WANT, [Route("edge:b", cached, "edge")])
    assert fetcher.estimates[filled].samples == 0  # it had to fill: that measured its upstream
    assert fetcher.estimates[cached].samples == 1


async def test_a_slow_source_is_hedged_and_the_loser_s_buffer_goes_back(servers, fetcher):
    arena = Arena(16 << 20)
    slow, fast = await servers("ok", delay=1.0), await servers("ok")
    fetcher.estimates[slow].set_prior(0.001)
    body = await fetcher.fetch(WANT, [Route("edge:slow", slow, "edge"), Route("region:fast", fast, "region")],
                               hedge=True, alloc=arena.take)
    assert body.route.label == "region:fast" and fetcher.hedges == 1
    assert arena.in_use > 0  # the winner's buffer, until the caller is done with it
    body.buffer.release()
    assert arena.in_use == 0  # the cancelled request handed its buffer back too


@pytest.mark.parametrize("behaviour", ["lie", "short", "error"])
async def test_a_failed_attempt_hands_its_buffer_back(servers, fetcher, behaviour):
    arena = Arena(4 << 20)
    bad = await servers(behaviour)
    for _ in range(20):  # would exhaust a 4 MiB arena of 1 MiB buffers if any leaked
        with pytest.raises((SourceError, DigestMismatch)):
            await fetcher.fetch(WANT, [Route("edge:bad", bad, "edge")], alloc=arena.take)
    assert arena.in_use == 0 and arena.stats.allocated == 1


async def test_credentials_are_asked_for_per_request_sent(servers):
    seen: list[dict] = []
    url = await servers("miss", seen=seen)
    asked: list[str] = []

    def authorize(u: str) -> dict:
        asked.append(u)
        return {"Authorization": "Bearer t0ken-for-loopback"}

    getter = BodyGetter(ssl=None)
    try:
        f = Fetcher(getter, Estimates(), authorize=authorize)
        with pytest.raises(SourceError):
            await f.fetch(WANT, [Route("region:a", url, "region", {CACHED_ONLY: "1"})] * 2)
    finally:
        getter.close()
    assert len(asked) == 2 and all(h["Authorization"] == "Bearer t0ken-for-loopback" for h in seen)
    assert asked[0].endswith(f"/v1/objects/{ADDR}?encoding=zstd")


async def test_the_client_fetches_through_it(servers):
    """One implementation: the client's fetches are ``Fetcher.fetch``'s (the edge's: tests/edge/test_edge_fill.py
    ``test_an_upstream_answer_in_another_encoding_is_refused``)."""
    from kdn.client import KDNClient

    bad = await servers("other-encoding")
    async with KDNClient(edges=[bad], max_hedges=0, timeout=5) as client:
        assert isinstance(client.fetcher, Fetcher)
        with pytest.raises(SourceError, match="asked for zstd, got raw"):
            await client.fetch(ADDR, encoding="zstd", digest=WANT.digest, size=WANT.size)
        assert client.failovers == 1


async def test_fetches_side_by_side_measure_the_source_s_speed_not_their_share(servers, fetcher):
    """Eight fetches at once from one source: each sample is scaled by the company it had, so the load
    planner's estimate (``expected_load``) is near the source's speed, not one transfer's share of it."""
    url = await servers("ok", delay=0.05)
    route = Route("edge", url, "edge", {})
    await asyncio.gather(*(fetcher.fetch(WANT, [route]) for _ in range(8)))
    est = fetcher.estimates[url]
    assert est.aggregate is not None and est.aggregate > 3 * est.bandwidth
    assert fetcher.company._n[url] == 0  # every transfer's company ended
