"""Three edges, one origin, real etcd: owner routing, single-flight, tiers, restart, verification."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from blake3 import blake3

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import (  # noqa: E402
    EDGE_TOKEN,
    TENANT_A,
    TENANT_B,
    cluster,
    get,
    metric,
    origin_served,
    publish,
)

from kdn.registry import open_registry  # noqa: E402

TEXT = ("A lighthouse keeper trims the wick at dusk and winds the clockwork at midnight. " * 20)[:1200]


def owner_of(c, address: str) -> str:
    return c.edge(next(iter(c.edges))).membership.owner(address).node_id


async def digest_of(c, address: str, encoding: str = "zstd") -> str:
    reg = c.open_records()
    try:
        return (await reg.get_object(address)).encodings[encoding].digest
    finally:
        await reg.close()


async def test_owner_routing_and_second_read_from_memory(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][0]
        owner = owner_of(c, a)
        other = next(n for n in c.edges if n != owner)
        status, body, headers = await get(c.edge_url(other), a)
        assert status == 200 and headers["X-KDN-Source"] == f"peer:{owner}", headers
        assert headers["ETag"] == f'"{await digest_of(c, a)}"' == f'"{blake3(body).hexdigest()}"'
        assert "immutable" in headers["Cache-Control"]
        # the owner filled from the origin and kept it; the non-owner kept a hot copy in memory
        assert c.edge(owner).memory.contains((a, "zstd"))
        await c.edge(owner).idle()  # its disk copy is written off the response path
        assert c.edge(owner).disk.contains((a, "zstd"))
        assert not c.edge(other).disk.contains((a, "zstd"))
        status, body2, headers = await get(c.edge_url(other), a)
        assert headers["X-KDN-Source"] == "memory" and body2 == body
        status, _, headers = await get(c.edge_url(owner), a)
        assert headers["X-KDN-Source"] == "memory"
        assert origin_served(c) == 1


async def test_concurrent_requests_to_all_edges_cause_one_origin_fetch(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][1]
        urls = [c.edge_url(n) for n in c.edges] * 6  # 18 concurrent readers over 3 edges
        results = await asyncio.gather(*(get(u, a) for u in urls))
        assert {r[0] for r in results} == {200}
        assert len({r[1] for r in results}) == 1
        assert origin_served(c) == 1, "N concurrent requests must cause exactly one origin fetch in the region"


async def test_cancelled_caller_does_not_cancel_the_fill(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][0]
        edge = c.edge("e1")
        rec = await edge.records.get(a)
        key = (a, "zstd")
        first = asyncio.create_task(edge.load(key, rec))
        second = asyncio.create_task(edge.load(key, rec))
        for _ in range(20):  # both pass the tiers (a miss) and join the same flight
            await asyncio.sleep(0)
            if edge.flight.joined:
                break
        assert edge.flight.in_flight(key) and edge.flight.started == 1 and edge.flight.joined == 1
        first.cancel()
        loaded = await second
        assert loaded.source == "origin"
        assert blake3(loaded.data).hexdigest() == rec.encodings["zstd"].digest
        with pytest.raises(asyncio.CancelledError):
            await first
        again = await edge.load(key, rec)  # kept in memory by the flight, not by each caller
        assert again.source == "memory" and again.data.obj is loaded.data.obj
        again.release()


async def test_disk_tier_survives_restart_and_corruption_is_never_served(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a, b = m["addresses"][0], m["addresses"][1]
        for x in (a, b):
            assert (await get(c.edge_url("e1"), x))[0] == 200
        await c.stop_edge("e1")
        # flip one byte of b's file on disk while the edge is down
        path = tmp_path / "disk-e1" / b[:2] / b[2:4] / f"{b}.zstd"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        await c.start_edge("e1")
        await c.wait_ring(["e1"])
        status, body, headers = await get(c.edge_url("e1"), a)
        assert status == 200 and headers["X-KDN-Source"] == "disk"
        served_before = origin_served(c)
        status, body, headers = await get(c.edge_url("e1"), b)
        assert status == 200 and headers["X-KDN-Source"] == "origin", "a corrupted disk file was served"
        assert blake3(body).hexdigest() == await digest_of(c, b)
        assert origin_served(c) == served_before + 1
        assert c.edge("e1").disk.stats.corrupt == 1


async def test_a_disk_hit_promoted_to_memory_keeps_its_arrival_time(tmp_path, etcd_url):
    """The memory copy of a disk hit expires with the object, not a TTL after the promotion (the clock_jump
    fault scenario saw hits 7 s after their fill under a 3 s TTL)."""
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][0]
        key = (a, "zstd")
        edge = c.edge("e1")
        assert (await get(c.edge_url("e1"), a))[2]["X-KDN-Source"] == "origin"
        await edge.idle()  # the disk copy is written off the response path
        arrived = dict(edge.memory.entries())[key].inserted_at
        assert dict(edge.disk.entries())[key].inserted_at == arrived
        await asyncio.sleep(0.05)
        assert await edge.memory.delete(key)
        reads = await asyncio.gather(*(get(c.edge_url("e1"), a) for _ in range(4)))
        assert {r[2]["X-KDN-Source"] for r in reads} <= {"disk", "memory"}
        await edge.idle()  # promoted off the response path, once however many disk hits came meanwhile
        assert dict(edge.memory.entries())[key].inserted_at == arrived
        assert edge.memory.stats.inserts == 2 and not edge._promoting


async def test_budgets_hold(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",), mem_budget=150_000, disk_budget=300_000) as c:
        m = await publish(c, ("Budgets hold under pressure. " * 200)[:3500])
        for a in m["addresses"]:
            assert (await get(c.edge_url("e1"), a))[0] == 200
            e = c.edge("e1")
            assert e.memory.used <= e.memory.budget and e.disk.used <= e.disk.budget
        assert metric(c.edges["e1"], "kdn_edge_evictions") > 0


async def test_lying_peer_is_detected_and_never_served(tmp_path, etcd_url):
    """A registered 'edge' that returns wrong bytes for everything: the real edge verifies and falls back."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from kdn.registry import NodeRecord

    import aiohttp

    async def liar(request):
        # The right object from the origin, one byte flipped: right length, wrong bytes.
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{c.origin_url()}/v1/objects/{request.match_info['address']}",
                             params=request.query, headers={"Authorization": f"Bearer {EDGE_TOKEN}"}) as r:
                body = bytearray(await r.read())
        body[len(body) // 3] ^= 0x01
        return web.Response(body=bytes(body))

    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        server = TestServer(web.Application(), host="127.0.0.1")
        server.app.router.add_get("/v1/objects/{address}", liar)
        await server.start_server()
        reg = open_registry(etcd_url)
        lease = await reg.register_node(NodeRecord("edge", "eu", "liar", str(server.make_url("")).rstrip("/")), ttl=10)
        try:
            await c.wait_ring(["e1", "liar"])
            edge = c.edge("e1")
            lied = [a for a in m["addresses"] if edge.membership.owner(a).node_id == "liar"]
            assert lied, "the liar owns none of the addresses; use more chunks"
            for a in lied:
                status, body, headers = await get(c.edge_url("e1"), a)
                assert status == 200 and headers["X-KDN-Source"] == "origin"
                assert blake3(body).hexdigest() == await digest_of(c, a)
            assert metric(c.edges["e1"], "kdn_edge_digest_failures", source="peer") == len(lied)
        finally:
            await lease.close()
            await reg.close()
            await server.close()


async def test_an_upstream_answer_in_another_encoding_is_refused(tmp_path, etcd_url):
    """The edge fills through kdn.wire.fetch, as the client does: a peer that answers with another encoding than
    asked (its bytes even match the digest) is a failed source; the edge once took any 200 whose digest
    matched, while the client refused it."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from kdn.registry import NodeRecord

    import aiohttp

    async def relabel(request):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{c.origin_url()}/v1/objects/{request.match_info['address']}",
                             params=request.query, headers={"Authorization": f"Bearer {EDGE_TOKEN}"}) as r:
                body = await r.read()
        return web.Response(body=body, headers={"X-KDN-Encoding": "raw", "X-KDN-Source": "memory"})

    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        server = TestServer(web.Application(), host="127.0.0.1")
        server.app.router.add_get("/v1/objects/{address}", relabel)
        await server.start_server()
        reg = open_registry(etcd_url)
        lease = await reg.register_node(NodeRecord("edge", "eu", "relabel", str(server.make_url("")).rstrip("/")),
                                        ttl=10)
        try:
            await c.wait_ring(["e1", "relabel"])
            edge = c.edge("e1")
            owned = [a for a in m["addresses"] if edge.membership.owner(a).node_id == "relabel"]
            assert owned, "the relabeller owns none of the addresses; use more chunks"
            for a in owned:
                status, _, headers = await get(c.edge_url("e1"), a)
                assert status == 200 and headers["X-KDN-Source"] == "origin"
            assert metric(c.edges["e1"], "kdn_edge_source_errors", source="peer") == len(owned)
        finally:
            await lease.close()
            await reg.close()
            await server.close()


async def test_tenant_isolation_at_the_edge(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT, namespace="acme", token=TENANT_A)
        a = m["addresses"][0]
        assert (await get(c.edge_url("e1"), a, TENANT_A))[0] == 200
        for token in (None, TENANT_B):
            status, body, _ = await get(c.edge_url("e1"), a, token)
            assert status == 404, "another tenant (or anonymous) could read acme's object"
        assert (await get(c.edge_url("e1"), a, EDGE_TOKEN))[0] == 200


async def test_lookup_reports_longest_prefix_and_sources(tmp_path, etcd_url):
    import aiohttp

    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        addrs = m["addresses"]
        await get(c.edge_url("e1"), addrs[0])
        answers = {}
        async with aiohttp.ClientSession() as s:
            for who, token in (("anonymous", None), ("token", EDGE_TOKEN)):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                async with s.post(f"{c.edge_url('e1')}/v1/lookup", json={"addresses": addrs + ["9" * 64]},
                                  headers=headers) as r:
                    answers[who] = await r.json()
        body = answers["token"]
        assert body["length"] == len(addrs)
        assert body["sources"][0] == "memory" and set(body["sources"][1:]) == {"origin"}
        # Without a token the same prefix is found, but not which tier holds what (others' recent reads).
        assert answers["anonymous"] == {"length": len(addrs), "sources": ["edge"] * len(addrs)}


async def test_the_owner_persists_to_disk_off_the_response_path(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a = m["addresses"][0]
        edge = c.edge("e1")
        rec = await edge.records.get(a)
        key = (a, "zstd")
        loaded = await edge.load(key, rec)
        loaded.release()
        assert loaded.source == "origin" and edge.memory.contains(key)
        for _ in range(200):  # the durable copy lands in the background
            if edge.disk.contains(key):
                break
            await asyncio.sleep(0.01)
        assert edge.disk.contains(key)
        status, body, headers = await get(c.edge_url("e1"), a)
        assert status == 200 and headers["X-KDN-Source"] == "memory"
