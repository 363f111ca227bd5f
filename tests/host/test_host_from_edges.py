"""The host tier against a real CDN on loopback: etcd, an origin that signs (tiny-llama), an edge; the host
started in-process and filled from that edge.

A leased object is the origin's blob byte for byte and decodes to its tensors; a prefix loaded into a
transformers cache from the host continues bit-identically to one loaded from the edge (and to the model's
own prefill); a tenant's objects need its token; a restarted host refills from the edge; and what an edge
lies about is never held.
"""

from __future__ import annotations

import asyncio
import secrets
from types import SimpleNamespace

import aiohttp
import pytest
import pytest_asyncio
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from edge_helpers import EDGE_TOKEN, TENANT_A, TENANT_B, cluster, get, publish
from host_helpers import host_config, running

from kdn.client import KDNClient
from kdn.format.objects import decode_object
from kdn.client.host import HostClient
from kdn.wire.host import HostError
from kdn.registry.signing import Signer

pytestmark = pytest.mark.asyncio(loop_scope="module")

DOC = ("The keeper's log for the night of the storm records wind from the north-east, "
       "two ships sighted, and the lamp relit twice after the glass cracked. ") * 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cdn(etcd_server, tmp_path_factory):
    """One CDN for the module (publishing runs the model): two documents, one public and one of tenant acme."""
    tmp = tmp_path_factory.mktemp("host-cdn")
    key = Signer.generate(tmp / "origin.key")
    (tmp / "trusted").write_text(key.public + "\n")
    etcd = f"{etcd_server.replace('http://', 'etcd://')}/x{secrets.token_hex(4)}/"
    async with cluster(tmp, etcd, edges=("e1",), origin_kw={"signing_key": str(tmp / "origin.key")}) as c:
        m = await publish(c, DOC[:1100], encodings=["raw", "zstd"])
        acme = await publish(c, DOC[200:900], name="acme-doc", namespace="acme", token=TENANT_A, encodings=["raw"])
        yield SimpleNamespace(c=c, m=m, acme=acme, trusted=str(tmp / "trusted"))


def config(cdn, d, **kw):
    (d / "edge-token").write_text(EDGE_TOKEN + "\n")
    kw.setdefault("edges", (cdn.c.edge_url("e1"),))
    kw.setdefault("trusted_keys", cdn.trusted)
    return host_config(d, token_file=str(cdn.c.tokens), upstream_token_file=str(d / "edge-token"), **kw)


async def test_a_leased_object_is_the_origins_blob_and_decodes_to_its_tensors(cdn, short_dir):
    addresses = cdn.m["addresses"]
    async with running(config(cdn, short_dir)) as tier, HostClient(tier.config.socket) as host:
        for a in addresses:
            status, blob, _ = await get(cdn.c.origin_url(), a, encoding="raw")
            assert status == 200
            want = decode_object(blob).tensors
            async with host.lease(a, "raw") as raw, host.lease(a, "zstd") as packed:
                assert raw.filled and bytes(raw.view) == blob and raw.view.readonly
                assert raw.record["address"] == a and raw.record["sig"]  # the signed record it was checked against
                assert raw.record == (await tier.filler.record(a)).to_dict()  # as its typed record's map
                got, unpacked = raw.tensors(), packed.tensors()
                assert set(got) == set(want) == set(unpacked)
                for name, t in want.items():
                    assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape)
                    assert got[name].data == t.data == unpacked[name].data
        async with host.lease(addresses[0], "raw") as again:
            assert not again.filled  # held: a hit, no second fill
        s = tier.stats()
        assert (s["fills"], s["hits"], s["leases"]) == (2 * len(addresses), 1, 0)
        assert (await host.lookup(addresses + ["0" * 64])).prefix == len(addresses)


async def test_a_prefix_loaded_from_the_host_continues_bit_identically_to_one_from_the_edge(cdn, short_dir):
    from kdn.adapters.hf import CacheBuilder, continue_from_cache, load_model, prefill

    lm = load_model("tiny-llama")
    ids = cdn.m["prefix_tokens"] + lm.tokenizer.encode(" What did the keeper record?")
    async with KDNClient(edges=[cdn.c.edge_url("e1")]) as client:
        hit = await client.lookup(ids, cdn.m["model_id"])
        assert hit.tokens == len(cdn.m["prefix_tokens"]) and hit.addresses == cdn.m["addresses"]
        from_edge = CacheBuilder(lm.model, hit.token_counts())
        await client.fetch_prefix(hit, encoding="raw", into=from_edge.add)
    from_host = CacheBuilder(lm.model, hit.token_counts())
    async with running(config(cdn, short_dir)) as tier, HostClient(tier.config.socket) as host:
        assert (await host.warm(hit.addresses, "raw")) == ["filled"] * hit.chunks
        for i, a in enumerate(hit.addresses):
            async with host.lease(a, "raw") as obj:
                from_host.add(i, obj.object())  # the one copy: mapping -> cache, layer by layer
    logits = []
    for builder in (from_edge, from_host):
        cache, n = builder.finish()
        logits.append(continue_from_cache(lm.model, cache, n, ids[n:], last=1)[-1])
    own = prefill(lm.model, ids[:hit.tokens], chunk_tokens=256)
    reference = continue_from_cache(lm.model, own, hit.tokens, ids[hit.tokens:], last=1)[-1]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], reference)


async def test_a_tenants_objects_are_leased_with_its_token_only(cdn, short_dir):
    theirs = cdn.acme["addresses"][0]
    async with running(config(cdn, short_dir)) as tier:
        async with HostClient(tier.config.socket, token=TENANT_B) as beta:
            with pytest.raises(HostError, match="absent"):
                async with beta.lease(theirs, "raw"):
                    pass
        assert tier.stats()["fills"] == 0
        async with HostClient(tier.config.socket, token=TENANT_A) as acme:
            async with acme.lease(theirs, "raw") as obj:  # filled with the host's own token, from the edge
                assert obj.object().header.namespace == "acme"


async def test_another_tenants_held_object_is_refused_as_slowly_as_one_never_published(cdn, short_dir):
    """What a tenant's neighbours read on this machine must not show in how fast the host says "absent":
    another tenant's object held here is refused at once, an address never published only after the edges
    were asked, so every "absent" (lease, lease_many, warm) waits for the floor (``--deny-floor-ms``). What
    the caller may read is not held back."""
    import time

    floor = 0.25
    theirs = cdn.acme["addresses"][0]

    async def timed(call):
        t0 = time.perf_counter()
        try:
            got = await call()
        except HostError as e:
            got = e.code
        return got, time.perf_counter() - t0

    async def lease_of(client, address):
        async with client.lease(address, "raw"):
            return "leased"

    async with running(config(cdn, short_dir, deny_floor_ms=floor * 1000)) as tier, \
            HostClient(tier.config.socket, token=TENANT_A) as acme, \
            HostClient(tier.config.socket, token=TENANT_B) as beta:
        assert await acme.warm([theirs], "raw") == ["filled"]  # held here now
        never = secrets.token_hex(32)
        nos = [await timed(lambda a=a: lease_of(beta, a)) for a in (theirs, never, theirs, never)]
        assert [g for g, _ in nos] == ["absent"] * 4 and min(t for _, t in nos) >= floor, nos
        many, t_many = await timed(lambda: beta.lease_many([theirs, never], "raw"))
        assert [x.code for x in many] == ["absent", "absent"] and t_many >= floor
        warmed, t_warm = await timed(lambda: beta.warm([theirs], "raw"))
        assert warmed == ["absent"] and t_warm >= floor
        own = [await timed(lambda: lease_of(acme, theirs)) for _ in range(3)]
        assert [g for g, _ in own] == ["leased"] * 3 and sorted(t for _, t in own)[1] < floor / 2, own
        assert tier.stats()["leases"] == 0


async def test_a_restarted_host_refills_from_the_edges(cdn, short_dir):
    a = cdn.m["addresses"][1]
    async with running(config(cdn, short_dir)) as first:
        old = await HostClient(first.config.socket).connect()
        async with old.lease(a, "raw") as obj:
            blob = bytes(obj.view)
    with pytest.raises(HostError, match="unavailable"):  # its host went away: the engine reads from the edge
        await old.lookup([a])
    await old.close()
    async with running(config(cdn, short_dir)) as second, HostClient(second.config.socket) as host:
        assert (await host.lookup([a])).prefix == 0  # a cache: nothing survived, nothing stale either
        async with host.lease(a, "raw") as obj:
            assert obj.filled and bytes(obj.view) == blob
        assert second.stats()["fills"] == 1


async def test_an_edge_that_corrupts_bodies_fills_nothing(cdn, short_dir):
    """Verified once, when it lands: a body that is not its record's digest never becomes an object."""
    edge = cdn.c.edge_url("e1")

    async def relay(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{edge}{request.rel_url}", headers={"Authorization": request.headers.get(
                    "Authorization", "")}) as r:
                body, status, headers = bytearray(await r.read()), r.status, r.headers
        if request.path.startswith("/v1/objects/") and body:
            body[len(body) // 2] ^= 1
        keep = {k: v for k, v in headers.items() if k.lower().startswith("x-kdn-")}
        return web.Response(body=bytes(body), status=status, headers=keep)

    app = web.Application()
    app.router.add_get("/{tail:.*}", relay)
    liar = TestServer(app, host="127.0.0.1")
    await liar.start_server()
    try:
        async with running(config(cdn, short_dir, edges=(str(liar.make_url("")).rstrip("/"),))) as tier:
            async with HostClient(tier.config.socket) as host:
                with pytest.raises(HostError, match="unavailable"):
                    async with host.lease(cdn.m["addresses"][0], "raw"):
                        pass
                assert (await host.lookup(cdn.m["addresses"][:1])).prefix == 0
            s = tier.stats()
            assert (s["fills"], s["fill_failures"], s["used_bytes"], s["objects"]) == (0, 1, 0, 0)
    finally:
        await liar.close()


async def test_a_record_no_trusted_key_signed_is_absent(cdn, short_dir, tmp_path):
    stranger = Signer.generate(tmp_path / "stranger.key")
    (tmp_path / "trusted").write_text(stranger.public + "\n")
    async with running(config(cdn, short_dir, trusted_keys=str(tmp_path / "trusted"))) as tier:
        async with HostClient(tier.config.socket) as host:
            with pytest.raises(HostError, match="absent"):
                async with host.lease(cdn.m["addresses"][0], "raw"):
                    pass
        assert tier.stats()["fills"] == 0


async def test_kdn_host_serve_runs_serves_metrics_and_stops_clean(cdn, short_dir):
    """The command itself, as a process: its segment in /dev/shm, an engine's lease, /metrics on loopback,
    and SIGTERM leaves no socket and no segment behind."""
    import asyncio
    import os
    import signal
    import sys

    from ports import free_port

    port, segment = free_port(), f"/dev/shm/kdn-test-{secrets.token_hex(4)}.seg"
    (short_dir / "edge-token").write_text(EDGE_TOKEN + "\n")
    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "kdn.cli", "host", "serve", "--edge", cdn.c.edge_url("e1"),
        "--trusted-keys", cdn.trusted, "--token-file", str(cdn.c.tokens), "--upstream-token-file",
        str(short_dir / "edge-token"), "--socket", str(short_dir / "h.sock"), "--segment", segment,
        "--segment-bytes", "16MiB", "--metrics-port", str(port), stdout=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    try:
        assert (await asyncio.wait_for(serve.stdout.readline(), 60)).startswith(b"kdn host:")
        async with HostClient(short_dir / "h.sock", token=TENANT_A) as host:
            async with host.lease(cdn.acme["addresses"][0], "raw") as obj:
                assert obj.filled and obj.object().header.namespace == "acme"
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    text = await r.text()
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kdn_host_"))
        assert float(samples["kdn_host_fills_total"]) == 1 and float(samples["kdn_host_leases"]) == 1
        assert float(samples["kdn_host_segment_bytes"]) == 16 << 20 and float(samples["kdn_host_objects"]) == 1
        serve.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(serve.wait(), 30) == 0
        assert not os.path.exists(segment) and not (short_dir / "h.sock").exists()
    finally:
        if serve.returncode is None:
            serve.kill()
            await serve.wait()
        if os.path.exists(segment):
            os.unlink(segment)


async def test_agenerate_loads_from_the_host_first_and_its_tokens_are_the_edges(cdn, short_dir):
    """#53 deliverable 2 in the transformers loader: a ``KDNClient(host=...)`` loads a prefix the host holds from
    the mapping (sources ``host``), generates exactly what the edge-loaded request generated, and asks the host,
    behind the request, for what the edges had to serve."""
    from kdn.adapters.hf import agenerate, load_model
    from kdn.adapters.hf.plan import speeds_of

    lm = load_model("tiny-llama")
    ids = cdn.m["prefix_tokens"] + lm.tokenizer.encode(" What did the keeper record?")
    async with KDNClient(edges=[cdn.c.edge_url("e1")]) as plain:
        want = await agenerate(lm.model, lm.tokenizer, ids, plain, max_new_tokens=8, plan=False)
    assert want.report.tokens_reused == len(cdn.m["prefix_tokens"])
    async with running(config(cdn, short_dir)) as tier, HostClient(tier.config.socket) as host:
        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            first = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8, plan=False)
            assert first.ids == want.ids and client.host_stats.hits == 0  # the host held nothing yet
            await asyncio.gather(*client.behind.tasks)  # the edges' objects, asked of the host behind the request
            assert (await host.lookup(cdn.m["addresses"])).prefix == len(cdn.m["addresses"])
            ops, real = [], host._request

            async def counted(op, **fields):
                ops.append(op)
                return await real(op, **fields)

            host._request = counted  # type: ignore[method-assign]
            edge_asks, json_real, record_real = [], client._json, client.record

            async def asked_json(*a, **kw):
                edge_asks.append(a[:2])
                return await json_real(*a, **kw)

            async def asked_record(*a, **kw):
                edge_asks.append(("record",))
                return await record_real(*a, **kw)

            client._json, client.record = asked_json, asked_record  # type: ignore[method-assign]
            second = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8, plan=False)
            client._json, client.record = json_real, record_real  # type: ignore[method-assign]
            assert second.ids == want.ids
            # The lookup asked the host alone (the chain, then its partial tail; their signed records came with
            # the answers): no edge was asked. Then the prefix's objects leased in one round trip and ended in one.
            assert ops == ["lookup", "lookup", "lease_many", "release_many"], ops
            assert edge_asks == [], edge_asks
            host._request = real  # type: ignore[method-assign]
            assert client.host_stats.hits == len(cdn.m["addresses"]) and client.host_stats.fallbacks == 0
            assert set(second.report.sources) == {"host"}, second.report.sources
            # Planned: the host's chunks are costed at the host's own measured speed, and a load wholly from it
            # teaches that speed, not the link's
            speeds = speeds_of(lm.model)
            before = (speeds.host_loads, speeds.loads)
            third = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8)
            assert third.ids == want.ids and set(third.report.sources) == {"host"}, third.report.line()
            assert (speeds.host_loads, speeds.loads) == (before[0] + 1, before[1]) and speeds.host_bps > 0


async def test_a_host_that_went_away_leaves_the_edges_to_serve(cdn, short_dir):
    """The host tier stopped after it was filled (the engine still holds its old connection): every object comes from the edges, the tokens are
    the same, and the failures are counted, not raised."""
    from kdn.adapters.hf import agenerate, load_model

    lm = load_model("tiny-llama")
    ids = cdn.m["prefix_tokens"] + lm.tokenizer.encode(" Which ships were sighted?")
    async with KDNClient(edges=[cdn.c.edge_url("e1")]) as plain:
        want = await agenerate(lm.model, lm.tokenizer, ids, plain, max_new_tokens=8, plan=False)
    async with running(config(cdn, short_dir)) as tier:
        host = await HostClient(tier.config.socket).connect()
        assert await host.warm(cdn.m["addresses"], "raw")
    try:  # (the tier is stopped now: the client's connection is gone)
        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            got = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8, plan=False)
            assert got.ids == want.ids and client.host_stats.hits == 0
            assert "host" not in got.report.sources
    finally:
        await host.close()


async def test_an_engine_comes_back_to_a_restarted_host(cdn, short_dir, monkeypatch):
    """The host restarts (a new segment): the engine's client, which held the old connection, reconnects on a later
    load (at most every RECONNECT_S) and loads from the new host again; before that, the edges serve."""
    import kdn.client.hosted as hosted
    from kdn.adapters.hf import agenerate, load_model

    monkeypatch.setattr(hosted, "RECONNECT_S", 0.0)
    lm = load_model("tiny-llama")
    ids = cdn.m["prefix_tokens"] + lm.tokenizer.encode(" How often was the lamp relit?")
    async with running(config(cdn, short_dir)) as first:
        host = await HostClient(first.config.socket).connect()
        await host.warm(cdn.m["addresses"], "raw")
    try:
        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            assert host.gone
            async with running(config(cdn, short_dir)) as second:
                async with HostClient(second.config.socket) as filler:
                    await filler.warm(cdn.m["addresses"], "raw")
                got = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4, plan=False)
                assert not host.gone and client.host_stats.reconnects == 1
                assert set(got.report.sources) == {"host"}, got.report.sources
    finally:
        await host.close()


async def test_an_engine_that_started_before_its_host_finds_it_later(cdn, short_dir, monkeypatch):
    import kdn.client.hosted as hosted
    from kdn.adapters.hf import agenerate, load_model

    monkeypatch.setattr(hosted, "RECONNECT_S", 0.0)
    lm = load_model("tiny-llama")
    ids = cdn.m["prefix_tokens"] + lm.tokenizer.encode(" Who kept the log?")
    cfg = config(cdn, short_dir)
    host = HostClient.unconnected(cfg.socket)
    try:
        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            first = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4, plan=False)
            assert "host" not in first.report.sources  # no host yet: the edges serve
            async with running(cfg) as tier:
                async with HostClient(tier.config.socket) as filler:
                    await filler.warm(cdn.m["addresses"], "raw")
                got = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4, plan=False)
                assert set(got.report.sources) == {"host"} and got.ids == first.ids
    finally:
        await host.close()


@pytest.mark.parametrize("edge", ["up", "down"])
async def test_a_host_killed_mid_load_leaves_the_rest_to_the_edges_then_to_compute(cdn, short_dir, edge,
                                                                                   monkeypatch):
    """``kdn host serve`` is killed (SIGKILL) while a load reads from it, between its second and third object: the
    objects leased still come from the mapping (the kernel keeps mapped pages), the rest from the edge; with the
    edge gone too, the rest is computed. Either way the tokens are the edge-loaded request's, and the load does
    not wait on the dead host."""
    import os
    import sys
    import time

    from edge_proxy import Proxy

    import kdn.client.host as host_module
    from kdn.adapters.hf import agenerate, load_model

    lm = load_model("tiny-llama")
    ids = cdn.m["prefix_tokens"] + lm.tokenizer.encode(" Where was the glass cracked?")
    chunks = len(cdn.m["addresses"])
    async with KDNClient(edges=[cdn.c.edge_url("e1")]) as plain:
        want = await agenerate(lm.model, lm.tokenizer, ids, plain, max_new_tokens=8, plan=False)
    segment = f"/dev/shm/kdn-test-{secrets.token_hex(4)}.seg"
    (short_dir / "edge-token").write_text(EDGE_TOKEN + "\n")
    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "kdn.cli", "host", "serve", "--edge", cdn.c.edge_url("e1"),
        "--trusted-keys", cdn.trusted, "--upstream-token-file", str(short_dir / "edge-token"),
        "--socket", str(short_dir / "h.sock"), "--segment", segment, "--segment-bytes", "16MiB",
        stdout=asyncio.subprocess.PIPE, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    proxy = Proxy(cdn.c.edge_url("e1"))
    host = None
    try:
        assert (await asyncio.wait_for(serve.stdout.readline(), 60)).startswith(b"kdn host:")
        host = await HostClient(short_dir / "h.sock").connect()
        assert set(await host.warm(cdn.m["addresses"], "raw")) == {"filled"}
        # A load leases the objects the host holds in batches (lease_many); two a batch here, so that the host
        # can die between the first batch (granted, read from the mapping) and the next (refused: the edges)
        monkeypatch.setattr(host_module, "MAX_LEASE_MANY", 2)
        real, granted = host._request, []

        async def request_then_die(op, **fields):
            answer = await real(op, **fields)
            if op == "lease_many":
                granted.extend(fields["addresses"])
                serve.kill()  # the host dies while these objects are read from its mapping
                await serve.wait()
                proxy.mode = "ok" if edge == "up" else "down"
            return answer

        host._request = request_then_die  # type: ignore[method-assign]
        async with KDNClient(edges=[proxy.url], host=host) as client:
            t0 = time.perf_counter()
            got = await asyncio.wait_for(agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8,
                                                   plan=False), 60)
            took = time.perf_counter() - t0
        r = got.report
        assert got.ids == want.ids, r.line()
        assert len(granted) == 2 and client.host_stats.hits == 2 and client.host_stats.fallbacks == chunks - 2
        if edge == "up":  # the rest from the edge
            assert r.tokens_reused == len(cdn.m["prefix_tokens"]) and r.sources.get("host") == 2, r.line()
            assert sum(r.sources.values()) == chunks, r.sources
        else:  # the rest computed: the two chunks the host gave are kept, and the report says why
            assert r.tokens_reused == 2 * 256 and r.chunks_reused == 2, r.line()
            assert "failed (SourceError: " in r.plan and f"2 of {chunks} chunks used, the rest computed" in r.plan
        assert took < 30, took  # nothing waited on the dead host (its requests fail at once)
    finally:
        if host is not None:
            await host.close()
        proxy.stop()
        if serve.returncode is None:
            serve.kill()
            await serve.wait()
        if os.path.exists(segment):
            os.unlink(segment)


async def test_a_load_whose_copy_fails_ends_its_leases_only_after_every_copy(cdn, short_dir):
    """The objects a load leases are read by the decode threads straight from the mapping, so no lease may end
    while a thread still reads its bytes: when the copy of one object fails, the load raises that failure
    only after the other thread's copies have ended, and then the host holds none of its leases."""
    import time

    from kdn.errors import ModelMismatch

    addresses = cdn.m["addresses"]
    assert len(addresses) >= 3
    async with running(config(cdn, short_dir)) as tier, HostClient(tier.config.socket) as host:
        assert set(await host.warm(addresses, "raw")) == {"filled"}
        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            hit = await client.lookup(cdn.m["prefix_tokens"], cdn.m["model_id"])
            assert hit.held is not None and len(hit.addresses) == len(addresses)
            threads = client.decode_threads
            assert threads == 2  # a batch's objects dealt out: 0, 2, ... on one thread, 1, 3, ... on the other
            read: dict[int, int] = {}

            def into(index, view):
                if index == 1:
                    raise ModelMismatch("chunk 1 does not fit")
                time.sleep(0.2)  # a slow copy, still reading when chunk 1's has failed
                assert bytes(view.buffer[:8])  # its bytes still readable
                read[index] = tier.stats()["leases"]

            with pytest.raises(ModelMismatch, match="chunk 1 does not fit"):
                await client.fetch_prefix(hit, encoding="raw", into=into)
            assert sorted(read) == list(range(0, len(addresses), 2)), read  # the other thread ran to its end
            assert all(n > 0 for n in read.values()), read  # ... its leases held all along
            for _ in range(50):  # (the release's answer reached the client; the host's count follows it)
                if tier.stats()["leases"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert tier.stats()["leases"] == 0


async def test_a_load_given_up_leases_no_more_and_its_leases_end_after_their_copies(cdn, short_dir, monkeypatch):
    """A load whose caller stops waiting (its deadline: the task cancelled) leases no further batch from the
    host; the batches it had leased are still copied to their end (their threads read the mapping), and then
    every lease ends."""
    import time

    import kdn.client.host as host_module

    addresses = cdn.m["addresses"]
    assert len(addresses) >= 3
    monkeypatch.setattr(host_module, "MAX_LEASE_MANY", 1)  # a batch an object
    async with running(config(cdn, short_dir)) as tier, HostClient(tier.config.socket) as host:
        assert set(await host.warm(addresses, "raw")) == {"filled"}
        real, ops = host._request, []

        async def slow_leases(op, **fields):  # a host slow to answer leases: 0.1 s a batch
            ops.append(op)
            if op == "lease_many":
                await asyncio.sleep(0.1)
            answer = await real(op, **fields)
            if op == "lease_many":
                ops.append("granted")
            return answer

        host._request = slow_leases  # type: ignore[method-assign]
        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            hit = await client.lookup(cdn.m["prefix_tokens"], cdn.m["model_id"])
            copied: list[tuple[int, int]] = []

            def into(index, view):
                time.sleep(0.3)  # a slow copy, still reading when the load is given up
                copied.append((index, tier.stats()["leases"]))

            load = asyncio.ensure_future(client.fetch_prefix(hit, encoding="raw", into=into))
            await asyncio.sleep(0.15)  # the first batch granted and being copied, the second asked
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            await asyncio.sleep(0.3)
            assert ops.count("lease_many") < len(addresses), ops  # no batch asked after the load was given up
            granted = ops.count("granted")
            for _ in range(100):  # the batches granted run to their end, then end their leases
                if len(copied) == granted and tier.stats()["leases"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert granted >= 1 and len(copied) == granted, (ops, copied)
            assert all(n > 0 for _, n in copied), copied  # each copied under its lease
            assert tier.stats()["leases"] == 0  # (a batch granted to nobody is released by the client too)
        host._request = real  # type: ignore[method-assign]
