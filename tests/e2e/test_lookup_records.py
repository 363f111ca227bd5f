"""A lookup's answer carries the matched chain's signed records, so a client verifies a hit in one round trip.

The edge reads every record of the chain to answer ``POST /v1/lookup``; before, a client with publisher keys
then read each one again (``GET /v1/registry/objects/A``, one request per chunk), and vLLM's scheduler a
third time. Now ``{"records": true}`` brings them with the answer. They are as untrusted as anything an edge
says: each is checked against the publisher keys as a record read on its own is; one the answer lacks, or
that is not the record of its address, is read by itself (an older edge sends none).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, publish  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402

TEXT = ("The harbour master opened the ledger at dawn and read the tide tables aloud. " * 30)[:2000]


class Relay:
    """A pass-through in front of an edge that counts the requests by route and may rewrite lookup answers."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.asked: Counter[str] = Counter()
        self.rewrite = lambda answer: answer  # what a lookup answer becomes on its way back

    async def handle(self, request: web.Request) -> web.Response:
        route = "/".join(request.path.split("/")[:4])  # /v1/registry/objects, /v1/lookup, /v1/objects/<a>
        self.asked[route if not route.startswith("/v1/objects/") else "/v1/objects"] += 1
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, f"{self.upstream}{request.rel_url}", data=await request.read(),
                                 headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
                                 allow_redirects=False) as r:
                body, status, ctype = await r.read(), r.status, r.content_type
        if status == 200 and request.path == "/v1/lookup":
            return web.json_response(self.rewrite(json.loads(body)))
        return web.Response(body=body, status=status, content_type=ctype)

    async def start(self) -> TestServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        return server


async def test_a_verified_lookup_reads_no_record_on_its_own(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        m = await publish(c, TEXT)
        ids = m["prefix_tokens"] + [7, 8, 9]
        whole = len(m["prefix_tokens"]) // 256
        assert whole >= 5, "the text must make several chunks, else one round trip saves nothing to count"
        relay = Relay(c.edge_url("e1"))
        server = await relay.start()
        try:
            url = str(server.make_url("")).rstrip("/")
            async with KDNClient(edges=[url], trusted_keys=[key.public]) as client:
                hit = await client.lookup(ids, m["model_id"])
            assert hit.tokens == len(m["prefix_tokens"]) and hit.addresses == m["addresses"]
            assert [r.address for r in hit.records] == m["addresses"], "the records, in chain order, tail included"
            assert client.rejected_records == 0
            # One lookup; the only record read by itself is the partial tail's (not part of the whole chunks).
            assert relay.asked["/v1/lookup"] == 1 and relay.asked["/v1/registry/objects"] == len(m["addresses"]) - whole

            # An edge that sends no records (an older one): each is read by itself, and the lookup is the same.
            relay.asked.clear()
            relay.rewrite = lambda answer: {k: v for k, v in answer.items() if k != "records"}
            async with KDNClient(edges=[url], trusted_keys=[key.public]) as client:
                old = await client.lookup(ids, m["model_id"])
            assert (old.addresses, old.tokens, old.records) == (hit.addresses, hit.tokens, hit.records)
            assert relay.asked["/v1/registry/objects"] == len(m["addresses"])

            # Records sent out of order are not their addresses' records: read again, never taken for another's.
            relay.asked.clear()
            relay.rewrite = lambda answer: {**answer, "records": answer["records"][::-1]}
            async with KDNClient(edges=[url], trusted_keys=[key.public]) as client:
                swapped = await client.lookup(ids, m["model_id"])
                assert client.rejected_records == 0
            assert swapped.records == hit.records and relay.asked["/v1/registry/objects"] >= whole - 1
        finally:
            await server.close()


async def test_a_record_forged_in_the_lookup_answer_ends_the_chain_there(tmp_path, etcd_url):
    """A signed record whose digest an edge changed, sent with the answer: refused and counted, and the chain
    stops before it (never read again from the same liar, never believed)."""
    key = Signer.generate(tmp_path / "origin.key")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        m = await publish(c, TEXT)
        relay = Relay(c.edge_url("e1"))

        def forge_third(answer: dict) -> dict:
            recs = answer["records"]
            enc = next(iter(recs[2]["encodings"].values()))
            enc["digest"] = "0" * 64
            return answer

        relay.rewrite = forge_third
        server = await relay.start()
        try:
            async with KDNClient(edges=[str(server.make_url("")).rstrip("/")], trusted_keys=[key.public]) as client:
                hit = await client.lookup(m["prefix_tokens"], m["model_id"])
                assert client.rejected_records == 1
            assert hit.addresses == m["addresses"][:2] and hit.tokens == 512 and len(hit.records) == 2
        finally:
            await server.close()


async def test_an_origin_answers_a_lookup_with_its_records_too(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        m = await publish(c, TEXT)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{c.origin_url()}/v1/lookup", json={"addresses": m["addresses"][:3], "records": True}) as r:
                answer = await r.json()
            async with s.post(f"{c.origin_url()}/v1/lookup", json={"addresses": m["addresses"][:3]}) as r:
                plain = await r.json()
    assert answer["length"] == 3 and [rec["address"] for rec in answer["records"]] == m["addresses"][:3]
    assert "records" not in plain  # only when asked: the answer stays small for callers that need none
