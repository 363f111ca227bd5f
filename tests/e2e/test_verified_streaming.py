"""Verified streaming end to end (kdn/format/pieces.py): the origin signs piece digests, an edge and a client check them.

A real origin (tiny-llama, 64 KiB pieces so its small blobs have several) and edge on loopback; a lying
edge in front of the honest one flips one byte in the first piece of every body it serves. The client,
with the origin's key, drops each lie within a piece and takes the bytes from the origin instead: the
continuation is the one a full prefill gives.
"""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, get, publish  # noqa: E402

from kdn.adapters.hf import agenerate, load_model  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402

TEXT = ("The keeper logged the wind, the ships and the glass each hour of the storm. " * 14)[:700]
PIECE = 64 << 10


async def flipper(upstream: str, sent: list[list[int]]) -> TestServer:
    """An edge that serves every object body with one byte of its first piece flipped, 16 KiB at a time."""

    async def handle(request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{upstream}{request.rel_url}", headers=request.headers) as r:
                body, status, headers = bytearray(await r.read()), r.status, r.headers
        if status != 200 or not request.path.startswith("/v1/objects/"):
            return web.Response(body=bytes(body), status=status, content_type=headers.get("Content-Type"))
        body[PIECE // 2] ^= 0x40  # inside the first piece's tensor bytes
        resp = web.StreamResponse(headers={"X-KDN-Encoding": headers["X-KDN-Encoding"], "X-KDN-Source": "memory",
                                           "Content-Length": str(len(body))})
        await resp.prepare(request)
        sent.append(seen := [0, len(body)])  # bytes sent so far (aiohttp cancels this handler on a hang-up)
        try:
            for i in range(0, len(body), 16 << 10):
                await resp.write(bytes(body[i:i + (16 << 10)]))
                seen[0] = min(i + (16 << 10), len(body))
                await asyncio.sleep(0.001)
        except (ConnectionError, RuntimeError):
            pass  # the reader hung up
        return resp

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_signed_piece_digests_drop_a_lying_edge_within_a_piece(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    lm = load_model("tiny-llama")
    origin_kw = {"signing_key": str(tmp_path / "origin.key"), "piece_bytes": PIECE}
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw=origin_kw) as c:
        m = await publish(c, TEXT, encodings=["raw"])
        ids = m["prefix_tokens"] + [7, 8, 9]
        async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
            rec = await client.record(m["addresses"][0])
        raw = rec.encodings["raw"]
        assert raw.size > 2 * PIECE and raw.piece_bytes == PIECE
        assert len(raw.pieces) == -(-raw.size // PIECE)  # signed: the client took the record with the key
        status, blob, _ = await get(c.edge_url("e1"), m["addresses"][0])  # the edge's own fill checked its pieces
        assert status == 200 and len(blob) == raw.size

        sent: list[list[int]] = []
        fake = await flipper(c.edge_url("e1"), sent)
        try:
            liar = str(fake.make_url("")).rstrip("/")
            async with KDNClient(edges=[liar], origin=c.origin_url(), trusted_keys=[key.public]) as client:
                out = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1)
                failovers = client.failovers
        finally:
            await fake.close()
    plain = await agenerate(lm.model, lm.tokenizer, ids, None, max_new_tokens=1, use_cache=False)
    assert out.report.tokens_reused == 700 and failovers >= 1
    torch.testing.assert_close(out.first_logits, plain.first_logits)
    assert sent and all(size > PIECE for _, size in sent)
    for got, size in sent:  # each lie stopped before its end: after the first piece, plus what sockets held
        assert got < size, sent
