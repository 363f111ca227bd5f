"""The user-space link emulator (bench/lib/linkemu.py) and the fetch client's source-selection hook.

Loopback only, real sockets, each test bounded to a few seconds.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest
from aiohttp import web

from linkemu import LinkEmulator  # bench/lib/linkemu.py (tests/conftest.py puts bench/lib on the path)

from kdn.client import KDNClient

pytestmark = pytest.mark.timeout(60)


async def _echo_server():
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _rtts(port: int, n: int = 5, local: str | None = None) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0) if local else None)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            writer.write(b"ping")
            await writer.drain()
            got = b""
            while len(got) < 4:
                got += await reader.read(4 - len(got))
            out.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return out


async def test_adds_two_delays_per_round_trip():
    server, port = await _echo_server()
    async with server:
        base = statistics.median(await _rtts(port))
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=25, mbit=0) as link:
            rtt = statistics.median(await _rtts(link.port))
    assert base < 0.005
    assert 0.048 <= rtt <= 0.075, rtt  # 2 x 25 ms, plus a little scheduling


async def test_new_connection_pays_a_handshake_round_trip():
    server, port = await _echo_server()
    async with server:
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=20, mbit=0) as link:
            first, *rest = await _rtts(link.port, n=3)
    assert first >= 0.078, first  # handshake RTT + request RTT
    assert max(rest) < 0.07, rest


async def test_set_profile_slows_open_connections_and_stall_stops_every_byte():
    server, port = await _echo_server()
    async with server:
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=5, mbit=0) as link:
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            try:
                async def rtt() -> float:
                    t0 = time.perf_counter()
                    writer.write(b"ping")
                    await writer.drain()
                    got = b""
                    while len(got) < 4:
                        got += await reader.read(4 - len(got))
                    return time.perf_counter() - t0

                await rtt()
                fast = await rtt()
                link.set_profile(40, 0)  # the same, open connection: slower from its next chunk
                slow = await rtt()
                link.stall()
                stalled = asyncio.create_task(rtt())
                await asyncio.sleep(0.3)
                assert not stalled.done(), "a byte crossed a stalled link"
                link.resume()
                after = await asyncio.wait_for(stalled, 2)
            finally:
                writer.close()
    assert fast < 0.03, fast
    assert 0.078 <= slow <= 0.12, slow
    assert after >= 0.3


async def test_per_source_profiles():
    server, port = await _echo_server()
    async with server:
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=2, mbit=0, by_source={"127.0.0.9": (30, 0)}) as link:
            near = statistics.median(await _rtts(link.port))
            far = statistics.median(await _rtts(link.port, local="127.0.0.9"))
    assert near < 0.02, near
    assert 0.058 <= far <= 0.09, far


async def _blob_app(blob: bytes):
    async def get(request):
        return web.Response(body=blob)

    async def put(request):
        return web.json_response({"n": len(await request.read())})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/blob", get)
    app.router.add_post("/sink", put)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def test_caps_download_and_upload_throughput():
    blob = bytes(range(256)) * 4096  # 1 MiB
    runner, port = await _blob_app(blob)
    try:
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=5, mbit=40) as link:  # 5 MB/s
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{link.url}/blob") as r:  # opens the connection (pays the handshake)
                    assert await r.read() == blob
                t0 = time.perf_counter()
                async with s.get(f"{link.url}/blob") as r:
                    body = await r.read()
                down = len(body) / (time.perf_counter() - t0 - 0.010)
                t0 = time.perf_counter()
                async with s.post(f"{link.url}/sink", data=blob) as r:
                    assert (await r.json())["n"] == len(blob)
                up = len(blob) / (time.perf_counter() - t0 - 0.010)
            assert link.stats.bytes_down >= 2 * len(blob)
            assert link.stats.bytes_up >= len(blob)
    finally:
        await runner.cleanup()
    rate = 40e6 / 8
    assert 0.8 * rate <= down <= 1.2 * rate, down / rate
    assert 0.8 * rate <= up <= 1.2 * rate, up / rate


async def test_a_shared_link_slowed_then_restored_is_fast_again_on_every_connection():
    """One bottleneck (shared=True): a connection opened while the link was fast, then used while it was
    slow, must not leave the fast profile's bucket at the slow rate for connections opened after the link
    was restored (bench/vllm_plan.py's probe measured 40 Mbit on a restored link)."""
    blob = bytes(range(256)) * 4096  # 1 MiB
    runner, port = await _blob_app(blob)
    try:
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=0, mbit=0, shared=True) as link:
            async with aiohttp.ClientSession() as old, aiohttp.ClientSession() as new:
                async with old.get(f"{link.url}/blob") as r:  # opened under the fast profile
                    await r.read()
                link.set_profile(0, 40)  # 5 MB/s
                t0 = time.perf_counter()
                async with old.get(f"{link.url}/blob") as r:  # the same connection, now slow
                    await r.read()
                assert time.perf_counter() - t0 > 0.15
                link.set_profile(0, 0)
                t0 = time.perf_counter()
                async with new.get(f"{link.url}/blob") as r:  # a new connection under the fast profile again
                    assert await r.read() == blob
                assert time.perf_counter() - t0 < 0.1, "the restored link is still paced"
    finally:
        await runner.cleanup()


async def test_unlimited_link_passes_bytes_through_intact():
    blob = bytes(range(256)) * 8192  # 2 MiB
    runner, port = await _blob_app(blob)
    try:
        async with LinkEmulator(0, "127.0.0.1", port, delay_ms=0, mbit=0) as link:
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    async with s.get(f"{link.url}/blob") as r:
                        assert await r.read() == blob
    finally:
        await runner.cleanup()


async def test_stop_closes_open_connections():
    server, port = await _echo_server()
    async with server:
        link = await LinkEmulator(0, "127.0.0.1", port, delay_ms=1, mbit=0).start()
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"x")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), 2) == b"x"
        await asyncio.wait_for(link.stop(), 5)
        assert await asyncio.wait_for(reader.read(1), 2) == b""
        writer.close()
        assert link.stats.active == 0


# --- the client's ranking, and the rankings bench/geo.py puts in its place --------------------------------

EDGES = [("e1", "http://127.0.0.1:1"), ("e2", "http://127.0.0.1:2")]
ADDR = "ab" * 32


def _client(**kw) -> KDNClient:
    return KDNClient(edges=EDGES, remote_edges=["http://127.0.0.1:3"], origin="http://127.0.0.1:4", **kw)


def _geo():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import geo

    return geo


def test_the_clients_ranking_puts_the_owner_first_then_follows_measurements():
    c = _client()
    ranked = c._ranked(1 << 20, ADDR)
    owner = c.routing.ring.owner(ADDR)
    assert ranked[0].label == f"edge:{owner}"  # the owner edge first (labelled by its ring id)
    assert [s.kind for s in ranked][-2:] == ["region", "origin"]
    # measured estimates still decide: make the origin look fastest
    c.routing.estimates["http://127.0.0.1:4"].rtt = 1e-6
    c.routing.estimates["http://127.0.0.1:4"].bandwidth = 1e12
    for s in c.routing.all[:3]:
        c.routing.estimates[s.url].rtt = 0.5
    assert c._ranked(1 << 20, ADDR)[0].kind == "origin"


def test_the_geo_benchs_origin_only_ranking_asks_only_the_origin():
    geo = _geo()
    c = geo.BenchClient(edges=EDGES, remote_edges=["http://127.0.0.1:3"], origin="http://127.0.0.1:4",
                        oracle=geo.origin_only_ranking)
    assert [s.url for s in c._ranked(0)] == ["http://127.0.0.1:4"]
    assert [s.url for s in c._ranked(1 << 20, ADDR)] == ["http://127.0.0.1:4"]


def test_the_geo_benchs_random_ranking_is_seeded_and_covers_the_regions_edges():
    geo = _geo()

    def client():
        c = geo.BenchClient(edges=EDGES, origin="http://127.0.0.1:4", oracle=geo.region_random_ranking)
        c.rng.seed(7)
        return c

    c = client()
    firsts = [c._ranked(1 << 20, ADDR)[0].url for _ in range(200)]
    assert set(firsts) == {u for _, u in EDGES}
    assert all(c._ranked(0)[-1].kind == "origin" for _ in range(5))
    d = client()
    assert [d._ranked(1 << 20, ADDR)[0].url for _ in range(200)] == firsts


async def test_origin_only_fetch_goes_to_the_origin_over_http():
    """A real fetch: an edge that would answer is never asked under origin-only."""
    from blake3 import blake3

    blob = b"k" * 1000
    hits = {"edge": 0, "origin": 0}

    def app(name):
        async def obj(request):
            hits[name] += 1
            return web.Response(body=blob, headers={"X-KDN-Source": name, "X-KDN-Encoding": "raw"})

        a = web.Application()
        a.router.add_get("/v1/objects/{address}", obj)
        return a

    runners = []
    ports = {}
    for name in ("edge", "origin"):
        r = web.AppRunner(app(name))
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", 0).start()
        runners.append(r)
        ports[name] = r.addresses[0][1]
    try:
        geo = _geo()
        for oracle, want in ((geo.origin_only_ranking, "origin"), (None, "edge")):
            async with geo.BenchClient(edges=[f"http://127.0.0.1:{ports['edge']}"],
                                       origin=f"http://127.0.0.1:{ports['origin']}", oracle=oracle, max_hedges=0) as c:
                f = await c.fetch(ADDR, encoding="raw", digest=blake3(blob).hexdigest(), size=len(blob))
            assert f.source.endswith("/" + want)
    finally:
        for r in runners:
            await r.cleanup()
    assert hits == {"edge": 1, "origin": 1}
