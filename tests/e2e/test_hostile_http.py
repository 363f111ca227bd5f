"""HTTP-level attacks on origin and edge, each named after what it tried (and what used to work)."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import TENANT_A, cluster, free_port, get, publish  # noqa: E402

TEXT = ("Tide tables for the north harbor, kept by the pier master every morning. " * 12)[:700]


async def test_tenant_objects_are_not_marked_for_shared_caches(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        public = await publish(c, TEXT)
        tenant = await publish(c, TEXT, name="t", namespace="acme", token=TENANT_A)
        _, _, h = await get(c.edge_url("e1"), public["addresses"][0])
        assert h["Cache-Control"].startswith("public")
        for url in (c.edge_url("e1"), c.origin_url()):
            status, _, h = await get(url, tenant["addresses"][0], token=TENANT_A)
            assert status == 200
            # A proxy between the edge and a tenant must not hand the object to the next caller.
            assert h["Cache-Control"].startswith("private") and h["Vary"] == "Authorization"


async def test_a_publish_body_is_not_read_before_the_token_is_checked(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        host, port = c.origin.host, c.origin.port
        reader, writer = await asyncio.open_connection(host, port)
        try:
            # Announce 10 MB and send none of it: the old origin waited for the body before asking for a token.
            writer.write(f"POST /v1/publish HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 10000000\r\n\r\n".encode())
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 5)
        finally:
            writer.close()
        assert status_line.split()[1] == b"401", status_line


async def test_an_upstream_redirect_is_not_followed_with_the_edge_token(tmp_path, etcd_url):
    """A source that answers 302 to another host is a failed source: the edge's token never goes there."""
    seen: list[dict] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.Response(text="stolen")

    trap = web.Application()
    trap.router.add_route("*", "/{tail:.*}", elsewhere)
    trap_server = TestServer(trap, host="127.0.0.1")
    await trap_server.start_server()

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(str(trap_server.make_url(request.path_qs)))

    bad = web.Application()
    bad.router.add_route("*", "/{tail:.*}", redirect)
    bad_server = TestServer(bad, host="127.0.0.1", port=free_port())
    await bad_server.start_server()
    try:
        async with cluster(tmp_path, etcd_url, edges=()) as c:
            m = await publish(c, TEXT)
            # an edge whose only upstream redirects
            await c.start_edge("e1", origin=str(bad_server.make_url("")).rstrip("/"))
            await c.wait_ring(["e1"])
            status, _, _ = await get(c.edge_url("e1"), m["addresses"][0])
            assert status == 503
            assert seen == [], "the edge followed the redirect (and showed its upstream token)"
    finally:
        await bad_server.close()
        await trap_server.close()


async def test_cache_probes_are_for_edges_only(tmp_path, etcd_url):
    """Cached-only and hop headers, and HEAD's tier, once answered anyone: a free probe of what is cached."""
    from edge_helpers import EDGE_TOKEN

    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a, b = m["addresses"][0], m["addresses"][1]
        status, _, _ = await get(c.edge_url("e1"), a, EDGE_TOKEN)
        assert status == 200  # (and that read warms it)
        async with aiohttp.ClientSession() as s:
            probe = {"X-KDN-Cached-Only": "1"}
            async with s.get(f"{c.edge_url('e1')}/v1/objects/{b}", headers={**probe, "Authorization": f"Bearer {EDGE_TOKEN}"}) as r:
                assert r.status == 404  # an edge's probe: answered from the tiers only
            async with s.get(f"{c.edge_url('e1')}/v1/objects/{b}", headers=probe) as r:
                assert r.status == 200  # anyone else: the header means nothing, a normal read
            async with s.head(f"{c.edge_url('e1')}/v1/objects/{a}") as r:
                assert r.status == 200 and r.headers["X-KDN-Source"] == "edge"  # not which tier holds it
            async with s.head(f"{c.edge_url('e1')}/v1/objects/{a}", headers={"Authorization": f"Bearer {EDGE_TOKEN}"}) as r:
                assert r.headers["X-KDN-Source"] == "memory"


async def test_a_lying_lookup_length_is_clamped(tmp_path):
    """An edge answering a lookup with -1 or 10**9 chunks once made the client slice its chain wrongly."""
    from kdn.client import KDNClient

    answers = iter([{"length": -1}, {"length": 10**9}, {"length": "many"}])

    async def lookup(request: web.Request) -> web.Response:
        return web.json_response(next(answers))

    async def record(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/v1/registry/objects/{a}", record)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")]) as client:
            tokens = list(range(600))
            hits = [await client.lookup(tokens, "ab" * 32) for _ in range(3)]
    finally:
        await server.close()
    assert [h.tokens for h in hits] == [0, 512, 0]  # -1 -> nothing; 10**9 -> at most the 2 whole chunks asked


@pytest.mark.parametrize("token_hosts, leaks", [("127.0.0.1", False), (None, True)])
async def test_a_rogue_node_record_does_not_get_the_edge_token(tmp_path, etcd_url, token_hosts, leaks):
    """One node record written into the registry once made every fill send the edge's ``read *`` token to
    that URL. Now the token goes over plain http only to --token-hosts; the default (loopback, which
    includes ``localhost``) shows the rogue gets it when its host is allowed, so the test can fail."""
    from edge_helpers import EDGE_TOKEN, metric

    from kdn.registry import NodeRecord, open_registry

    seen: list[str | None] = []

    async def rogue(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rogue)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    reg = open_registry(etcd_url)
    try:
        async with cluster(tmp_path, etcd_url, edges=()) as c:
            m = await publish(c, TEXT)
            # "another region's edge", by a name the loopback pattern covers but 127.0.0.1 does not
            lease = await reg.register_node(NodeRecord("edge", "us", "rogue", f"http://localhost:{server.port}"), ttl=10)
            try:
                await c.start_edge("e1", token_hosts=token_hosts)
                await c.wait_ring(["e1"])
                await c.edge("e1").membership.wait_for(lambda mb: "us" in mb.regions(), timeout=10)
                for a in m["addresses"][:2]:
                    status, _, headers = await get(c.edge_url("e1"), a, EDGE_TOKEN)
                    assert status == 200 and headers["X-KDN-Source"] == "origin"  # served all the same
                assert seen, "the edge never asked the rogue region; the test proves nothing"
                if leaks:
                    assert seen == [f"Bearer {EDGE_TOKEN}"] * len(seen)
                else:
                    assert seen == [None] * len(seen)
                    assert metric(c.edges["e1"], "kdn_edge_token_withheld") == len(seen)
            finally:
                await lease.close()
    finally:
        await reg.close()
        await server.close()
