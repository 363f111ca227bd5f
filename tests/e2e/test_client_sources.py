"""The fetch client against real servers: source choice, hedging, failover, verification, registry discovery."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import EDGE_TOKEN, cluster, free_port, publish  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.client.sync import SyncKDNClient  # noqa: E402
from kdn.errors import DigestMismatch  # noqa: E402
from kdn.registry import open_registry  # noqa: E402

TEXT = ("The fog bell rang twice a minute through the night. " * 30)[:900]


async def proxy(upstream: str, *, delay: float = 0.0, corrupt: bool = False, fail: bool = False,
                objects_only: bool = False, control_only: bool = False) -> TestServer:
    """A real HTTP source in front of ``upstream`` that can be slow (``delay``: on every request, on object
    reads only, or on everything else only: lookups and registry reads), lie, or fail."""
    hits = {"n": 0, "objects": 0}

    async def handle(request: web.Request) -> web.StreamResponse:
        hits["n"] += 1
        is_object = request.path.startswith("/v1/objects/")
        hits["objects"] += is_object
        if fail:
            return web.Response(status=500)
        if (not objects_only or is_object) and (not control_only or not is_object):
            await asyncio.sleep(delay)
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, f"{upstream}{request.rel_url}", headers={
                    "Authorization": f"Bearer {EDGE_TOKEN}"}, data=await request.read()) as r:
                body = bytearray(await r.read())
                headers = {k: v for k, v in r.headers.items() if k.lower().startswith("x-kdn") or k == "ETag"}
                status = r.status
        if corrupt and request.path.startswith("/v1/objects/") and body:
            body[len(body) // 2] ^= 0xFF
        return web.Response(body=bytes(body), status=status, headers=headers,
                            content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    server.hits = hits
    return server


def url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def test_prefers_the_faster_source_after_measuring(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        slow = await proxy(c.edge_url("e1"), delay=0.15)
        try:
            async with KDNClient(edges=[url(slow)], origin=c.origin_url(), max_hedges=0) as client:
                for _ in range(2):  # a first read fills the edge (measures its upstream); the second is a hit
                    for a in m["addresses"]:
                        await client.fetch(a)
                # the 150 ms edge, measured on its hits, now ranks behind the origin
                assert client._ranked(100_000)[0].kind == "origin"
        finally:
            await slow.close()


async def test_hedges_a_slow_request_and_verifies_everything(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        slow = await proxy(c.edge_url("e1"), delay=2.0, objects_only=True)
        try:
            async with KDNClient(edges=[url(slow)], origin=c.origin_url()) as client:
                await client.record(m["addresses"][0])
                # Given these estimates (the edge near, the origin far), the edge is asked first...
                client.routing.estimates[url(slow)].rtt, client.routing.estimates[c.origin_url()].rtt = 0.005, 0.2
                assert client._ranked(1 << 20)[0].kind == "edge"
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                f = await client.fetch(m["addresses"][0])
                assert loop.time() - t0 < 1.0, "the slow source was not hedged"
                assert client.hedges == 1 and f.source.startswith("origin"), (client.hedges, client.failovers, f.source)
                rec = await client.record(m["addresses"][0])
                assert blake3(f.blob).hexdigest() == rec.encodings[f.encoding].digest
        finally:
            await slow.close()


async def test_slow_lookups_do_not_make_a_near_edge_look_far_for_transfers(tmp_path, etcd_url):
    # An edge busy with its registry reads answers lookups slowly; its object reads are still fast.
    # Lookup time must rank lookups only: it once made the geo bench's near edge look 50 ms away.
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        busy = await proxy(c.edge_url("e1"), delay=0.3, control_only=True)
        try:
            async with KDNClient(edges=[url(busy)], origin=c.origin_url(), max_hedges=0) as client:
                for a in m["addresses"][:3]:
                    assert await client.record(a) is not None
                assert client._ranked(0, control=True)[0].kind == "origin"  # registry reads: the origin now
                assert client._ranked(1 << 20)[0].kind == "edge"  # transfers: still the edge
                f = await client.fetch(m["addresses"][0])
                assert f.source.startswith("edge:0/"), f.source
        finally:
            await busy.close()


async def test_a_slow_fetch_is_hedged_once_not_fanned_out_to_every_source(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        slow = [await proxy(c.edge_url("e1"), delay=1.0, objects_only=True) for _ in range(3)]
        try:
            async with KDNClient(edges=[url(s) for s in slow]) as client:
                rec = await client.record(m["addresses"][0])
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                f = await client.fetch(m["addresses"][0])
                assert loop.time() - t0 < 1.9  # the hedge (after ~20 ms) and the first request race
                assert blake3(f.blob).hexdigest() == rec.encodings[f.encoding].digest
                assert client.hedges == 1, client.hedges
                assert sorted(s.hits["objects"] for s in slow) == [0, 1, 1]  # the third source never asked
        finally:
            for s in slow:
                await s.close()


async def test_an_object_the_edge_would_fill_through_its_owner_counts_as_cold(tmp_path, etcd_url):
    # Not in the answering edge's tiers means a fill, whether from the origin or through the owner
    # peer: neither is worth a hedge (it would start a second fill of the same object).
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2")) as c:
        m = await publish(c, TEXT)
        owners = {a: c.edge("e1").membership.owner(a).node_id for a in m["addresses"]}
        assert set(owners.values()) == {"e1", "e2"}, "the test needs chunks owned by each edge"
        async with KDNClient(edges=[c.edge_url("e1")], token=EDGE_TOKEN) as client:  # a token sees the tiers
            hit = await client.lookup(m["prefix_tokens"], m["model_id"])
            chunks = hit.addresses[:len(hit.sources)]  # whole chunks (a partial tail is found by its record)
            assert [w.split(":")[0] for w in hit.sources] == ["peer" if owners[a] == "e2" else "origin" for a in chunks]
            assert "peer" in {w.split(":")[0] for w in hit.sources}, "the test needs a chunk e2 owns"
            assert hit.cold == set(chunks)
            states = await client.fetch_prefix(hit)
            assert client.hedges == 0 and len(states.objects) == len(m["addresses"])
            again = await client.lookup(m["prefix_tokens"], m["model_id"])
            assert again.cold == set()  # now in e1's memory (or disk): hits, which may be hedged


async def test_fails_over_from_dead_failing_and_lying_sources(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        liar = await proxy(c.edge_url("e1"), corrupt=True)
        broken = await proxy(c.edge_url("e1"), fail=True)
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        try:
            for bad in (dead, url(broken), url(liar)):
                async with KDNClient(edges=[bad, c.edge_url("e1")], max_hedges=0) as client:
                    hit = await client.lookup(m["prefix_tokens"], m["model_id"])
                    assert hit.tokens == len(m["prefix_tokens"])
                    states = await client.fetch_prefix(hit)
                    assert len(states.objects) == len(m["addresses"])
                    assert all(not f.source.startswith("edge:0") for f in states.fetched)
            async with KDNClient(edges=[url(liar)], max_hedges=0) as client:
                with pytest.raises(DigestMismatch, match="intact"):  # every source lied: not a plain miss
                    await client.fetch(m["addresses"][0])
        finally:
            await liar.close()
            await broken.close()


async def test_sources_from_the_registry_route_to_the_owner(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2")) as c:
        m = await publish(c, TEXT)
        reg = open_registry(etcd_url)
        try:
            client = await KDNClient.from_registry(reg, "eu")
        finally:
            await reg.close()
        async with client:
            kinds = sorted(s.kind for s in client.routing.all)
            assert kinds == ["edge", "edge", "origin"]
            for a in m["addresses"]:
                owner = c.edge("e1").membership.owner(a).node_id
                f = await client.fetch(a)
                assert f.source.startswith(f"edge:{owner}/"), f"{a} fetched from {f.source}, owner {owner}"


def test_sync_wrapper(tmp_path, etcd_server):
    import secrets

    etcd = f"{etcd_server.replace('http://', 'etcd://')}/s{secrets.token_hex(4)}/"

    async def setup():
        cm = cluster(tmp_path, etcd, edges=("e1",))
        c = await cm.__aenter__()
        return cm, c, await publish(c, TEXT)

    runner = asyncio.Runner()
    cm, c, m = runner.run(setup())
    try:
        # the cluster runs on `runner`'s loop; drive the sync client from a thread meanwhile
        import threading

        out = {}

        def use_sync_client():
            with SyncKDNClient(edges=[c.edge_url("e1")]) as client:
                hit = client.lookup(m["prefix_tokens"], m["model_id"])
                out["tokens"] = hit.tokens
                out["chunks"] = len(client.fetch_prefix(hit).objects)
                out["manifest"] = client.manifest("public", "doc").addresses

        t = threading.Thread(target=use_sync_client)
        t.start()
        while t.is_alive():
            runner.run(asyncio.sleep(0.05))
        assert out["tokens"] == len(m["prefix_tokens"]) and out["chunks"] == len(m["addresses"])
        assert out["manifest"] == m["addresses"]
    finally:
        runner.run(cm.__aexit__(None, None, None))
        runner.close()
