"""A stand-in edge on loopback (aiohttp) for the transformers adapter's load tests, and the objects it serves:
what an origin of a model would publish for a prompt (raw encoding, unsigned records), so a real ``KDNClient``
looks up, reads records and fetches objects from memory. ``serve`` can stall objects from one chunk on, or
(``server.slow["on"] = True``) send each object's first ``partial`` bytes and then nothing; ``server.seen``
lists what was asked ("lookup", "object"); ``server.release`` ends every stall."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

from kdn.format import address as A
from kdn.adapters.hf import extract_chunks
from kdn.format.objects import encode_object, from_torch


def published(model: Any, mid: A.ModelId, ids: list[int], chunk: int) -> tuple[list[A.Address], dict, dict]:
    """(addresses, blobs, records) an origin of ``model`` (model id ``mid``) would publish for ``ids``."""
    addrs = A.prefix_addresses(mid, "public", ids, chunk)
    blobs, records = {}, {}
    with torch.inference_mode():
        chunks = list(extract_chunks(model, ids, chunk_tokens=chunk))
    for c, a in zip(chunks, addrs):
        blob = encode_object(kind=c.kind, address=a, model_id=mid, namespace="public", start=c.start, end=c.end,
                             position=c.start, parent=addrs[c.index - 1] if c.index else None,
                             tensors=from_torch(c.tensors), encoding="raw")
        blobs[a] = blob
        records[a] = {"address": a, "model_id": mid, "namespace": "public", "kind": c.kind, "start": c.start,
                      "end": c.end, "parent": None, "standalone": False, "origin": "test", "tails": {},
                      "encodings": {"raw": {"name": "raw", "size": len(blob), "digest": blake3(blob).hexdigest()}}}
    return addrs, blobs, records


async def serve(addrs: list[A.Address], blobs: dict, records: dict, *, stall_from: int | None = None,
                partial: int = 1000) -> TestServer:
    """The stand-in edge, started on a free loopback port."""
    release = asyncio.Event()
    slow = {"on": False}
    seen: list[str] = []

    async def lookup(request: web.Request) -> web.Response:
        seen.append("lookup")
        asked = (await request.json())["addresses"]
        n = next((i for i, a in enumerate(asked) if a not in blobs), len(asked))
        return web.json_response({"length": n, "sources": ["memory"] * n})

    async def record(request: web.Request) -> web.Response:
        rec = records.get(request.match_info["address"])
        return web.json_response(rec) if rec else web.json_response({"error": "not_found"}, status=404)

    async def obj(request: web.Request) -> web.StreamResponse:
        seen.append("object")
        a = request.match_info["address"]
        if stall_from is not None and addrs.index(a) >= stall_from:
            await release.wait()  # a stalled source: never answers (until the test ends)
        if slow["on"]:  # a link gone slow: the first bytes, then nothing
            r = web.StreamResponse(headers={"X-KDN-Encoding": "raw", "X-KDN-Source": "memory"})
            r.content_length = len(blobs[a])
            await r.prepare(request)
            await r.write(blobs[a][:partial])
            await release.wait()
            return r
        return web.Response(body=blobs[a], headers={"X-KDN-Encoding": "raw", "X-KDN-Source": "memory"})

    app = web.Application()
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/v1/registry/objects/{address}", record)
    app.router.add_get("/v1/objects/{address}", obj)
    server = TestServer(app, host="127.0.0.1")
    server.release = release  # type: ignore[attr-defined]
    server.slow = slow  # type: ignore[attr-defined]
    server.seen = seen  # type: ignore[attr-defined]
    await server.start_server()
    return server
