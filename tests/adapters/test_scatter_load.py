"""Raw objects received straight into the transformers cache (kdn/wire/scatter.py + CacheBuilder.place), over real
loopback servers: exact, and never a wrong byte when a source lies."""

from __future__ import annotations

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

from kdn.adapters.hf import CacheBuilder, build_cache, extract_chunks, load_model
from kdn.wire.bodyget import BodyGetter
from kdn.errors import SourceError
from kdn.wire.estimate import Estimates
from kdn.wire.fetch import Fetcher, Route, Want
from kdn.format.objects import decode_object, encode_object, from_torch, to_torch
from kdn.wire.scatter import Scatter

MID = "cd" * 32
CHUNK = 32


@pytest.fixture(scope="module")
def world():
    lm = load_model("tiny-llama")
    ids = torch.randint(0, 200, (3 * CHUNK + 7,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        chunks = list(extract_chunks(lm.model, ids, chunk_tokens=CHUNK))
    blobs = []
    for c in chunks:
        blobs.append(encode_object(kind=c.kind, address=f"{c.index:064x}", model_id=MID, namespace="public",
                                   start=c.start, end=c.end, position=c.start, parent=None,
                                   tensors=from_torch(c.tensors), encoding="raw"))
    return lm, chunks, blobs


async def serve(blobs, *, lie: bool = False) -> TestServer:
    async def handler(request):
        body = bytearray(blobs[int(request.match_info["address"], 16)])
        if lie:
            body[len(body) // 2] ^= 0xFF  # right length, wrong bytes: lands in the cache before the digest fails
        return web.Response(body=bytes(body), headers={"X-KDN-Encoding": "raw", "X-KDN-Source": "memory"})

    app = web.Application()
    app.router.add_get("/v1/objects/{address}", handler)
    s = TestServer(app, host="127.0.0.1")
    await s.start_server()
    return s


async def load(builder: CacheBuilder, blobs, routes_of, identity=None) -> list:
    getter = BodyGetter(ssl=None)
    fetcher = Fetcher(getter, Estimates(), timeout=10)
    try:
        for i, blob in enumerate(blobs):
            assert builder.placeable(i)

            def place(layout, i=i):
                if identity is not None:
                    identity(layout.header)
                return builder.place(i, layout)

            body = await fetcher.fetch(Want(f"{i:064x}", "raw", len(blob), blake3(blob).hexdigest()), routes_of(),
                                       alloc=lambda n: Scatter(n, place))
            builder.placed(i, body.buffer.layout)
    finally:
        getter.close()
    return fetcher


async def test_a_scattered_load_equals_the_decoded_one(world):
    lm, chunks, blobs = world
    server = await serve(blobs)
    try:
        url = str(server.make_url("")).rstrip("/")
        b = CacheBuilder(lm.model, [c.end - c.start for c in chunks])
        await load(b, blobs, lambda: [Route("edge:a", url, "edge")])
        cache, n = b.finish()
    finally:
        await server.close()
    want, m = build_cache(lm.model, [to_torch(decode_object(x)) for x in blobs])
    assert n == m == chunks[-1].end
    for got, ref in zip(cache.layers, want.layers):
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)


async def test_a_lying_source_s_bytes_are_rewritten_by_the_next_source(world):
    """The liar's body lands in the cache's memory before its digest fails; the honest source after it
    rewrites every byte of the same runs, so the loaded cache is exact."""
    lm, chunks, blobs = world
    liar, honest = await serve(blobs, lie=True), await serve(blobs)
    try:
        urls = [str(s.make_url("")).rstrip("/") for s in (liar, honest)]
        b = CacheBuilder(lm.model, [c.end - c.start for c in chunks])
        fetcher = await load(b, blobs, lambda: [Route("edge:liar", urls[0], "edge"), Route("origin", urls[1], "origin")])
        cache, _ = b.finish()
    finally:
        await liar.close()
        await honest.close()
    assert fetcher.failovers == len(blobs)  # every chunk came first from the liar
    want, _ = build_cache(lm.model, [to_torch(decode_object(x)) for x in blobs])
    for got, ref in zip(cache.layers, want.layers):
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)


async def test_a_header_the_engine_does_not_expect_is_refused_before_a_byte_is_placed(world):
    lm, chunks, blobs = world
    server = await serve(blobs)
    try:
        url = str(server.make_url("")).rstrip("/")
        b = CacheBuilder(lm.model, [c.end - c.start for c in chunks])
        for pair in b.kv.values():
            for t in pair:
                t.fill_(7.0)

        def another_model(h):
            raise SourceError(f"object of model {h.model_id[:8]}, expected another")

        with pytest.raises(SourceError, match="body refused.*expected another"):
            await load(b, blobs[:1], lambda: [Route("edge:a", url, "edge")], identity=another_model)
        assert all(bool((t == 7.0).all()) for pair in b.kv.values() for t in pair)  # refused at the head: nothing written
        assert b.placeable(0)  # not counted as added
    finally:
        await server.close()
