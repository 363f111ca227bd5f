"""Range requests on objects (#29 item 5), verified per piece: a consumer fetches one layer of a chunk.

A real origin (tiny-llama, 64 KiB pieces so its blobs have several) and edge on loopback. The origin,
the edge's memory tier and its disk tier (sendfile at an offset) all answer RFC 9110 single ranges;
``KDNClient.fetch_tensors`` takes a layer's K and V by ranges of pieces, each verified against the
signed record, and a source that lies inside the range is dropped for the next one.
"""

from __future__ import annotations

import os
import sys

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, get, publish  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402
from kdn.format.objects import decode_object  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402

TEXT = ("Lanterns were lit along the harbour wall as the last boats came in with the tide. " * 12)[:600]
PIECE = 64 << 10


async def ranged(url: str, address: str, rng: str, **headers) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/objects/{address}", params={"encoding": "raw"},
                         headers={"Range": rng, **headers}) as r:
            return r.status, await r.read(), r.headers.copy()


async def test_origin_and_both_edge_tiers_answer_single_ranges(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"piece_bytes": PIECE}) as c:
        m = await publish(c, TEXT, encodings=["raw"])
        a = m["addresses"][0]
        status, blob, headers = await get(c.origin_url(), a, encoding="raw")
        assert status == 200 and headers["Accept-Ranges"] == "bytes"
        n = len(blob)
        assert (await get(c.edge_url("e1"), a, encoding="raw"))[0] == 200  # the edge holds it now
        await c.stop_edge("e1")
        await c.start_edge("e1")  # its memory is gone: the next read is served from disk, with sendfile
        await c.wait_ring(["e1"])
        etag = headers["ETag"]
        for url in (c.origin_url(), c.edge_url("e1"), c.edge_url("e1")):  # origin, edge disk, edge memory
            status, body, h = await ranged(url, a, "bytes=100-70099")
            assert status == 206 and body == blob[100:70100] and h["Content-Range"] == f"bytes 100-70099/{n}", h
            assert h["ETag"] == etag and int(h["Content-Length"]) == 70000
            assert (await ranged(url, a, "bytes=-50"))[1] == blob[-50:]
            assert (await ranged(url, a, f"bytes={n - 10}-"))[1] == blob[-10:]
            assert (await ranged(url, a, f"bytes=5-{10 * n}"))[1] == blob[5:]  # clamped to the end
            status, _, h = await ranged(url, a, f"bytes={n}-")
            assert status == 416 and h["Content-Range"] == f"bytes */{n}"
            for ignored in ("bytes=0-1,5-9", "items=0-5", "bytes=9-2", "bytes=x-"):  # taken as no range
                status, body, _ = await ranged(url, a, ignored)
                assert status == 200 and body == blob, ignored
            status, body, _ = await ranged(url, a, "bytes=0-9", **{"If-Range": '"' + "0" * 64 + '"'})
            assert status == 200 and body == blob  # the validator names other bytes: the whole current body
            status, body, _ = await ranged(url, a, "bytes=0-9", **{"If-Range": etag})
            assert status == 206 and body == blob[:10]
        sources = []
        for _ in range(2):
            sources.append((await ranged(c.edge_url("e1"), a, "bytes=0-9"))[2]["X-KDN-Source"])
        assert "memory" in sources


async def liar(upstream: str) -> TestServer:
    """An edge that flips one byte of every ranged body it passes on (and passes everything else)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession() as s:
            async with s.get(upstream + str(request.rel_url), headers=request.headers) as r:
                body, status, headers = bytearray(await r.read()), r.status, r.headers
        out = {k: v for k, v in headers.items() if k.lower() in ("content-range", "x-kdn-encoding", "x-kdn-source",
                                                                 "content-type")}
        if status == 206:
            body[len(body) // 2] ^= 1
        return web.Response(status=status, body=bytes(body), headers=out)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_a_client_fetches_one_layer_by_verified_ranges(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    origin_kw = {"piece_bytes": PIECE, "signing_key": str(tmp_path / "origin.key")}
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw=origin_kw) as c:
        m = await publish(c, TEXT, encodings=["raw", "zstd"])
        a = m["addresses"][0]
        whole = decode_object((await get(c.origin_url(), a, encoding="raw"))[1])
        async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
            size = (await client.record(a)).encodings["raw"].size
            got = await client.fetch_tensors(a, ["L1.k", "L1.v"])
            assert set(got.tensors) == {"L1.k", "L1.v"}
            for name, data in got.tensors.items():
                assert bytes(data) == bytes(whole.tensors[name].data), name
            assert got.layout.header.address == a and got.bytes_fetched <= size
            first = await client.fetch_tensors(a, ["L0.k"])  # in the header's piece: nothing more to fetch
            assert bytes(first.tensors["L0.k"]) == bytes(whole.tensors["L0.k"].data)
            assert first.bytes_fetched == PIECE < size // 2
            with pytest.raises(InvalidInput, match="no tensor"):
                await client.fetch_tensors(a, ["L99.k"])
        fake = await liar(c.edge_url("e1"))
        try:
            url = str(fake.make_url("")).rstrip("/")
            async with KDNClient(edges=[url], origin=c.origin_url(), trusted_keys=[key.public], max_hedges=0) as client:
                got = await client.fetch_tensors(a, ["L0.k"])
                assert bytes(got.tensors["L0.k"]) == bytes(whole.tensors["L0.k"].data)
                assert client.failovers >= 1  # the lying range was refused, the origin's verified
        finally:
            await fake.close()
