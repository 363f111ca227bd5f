"""Object records beside the blobs (#29 item 1, first part): etcd keeps the control plane only.

A real origin started with ``records="store"`` (``--records store``) keeps its signed object records in
its store (``records.sqlite3`` in a folder; small objects in an s3:// bucket, a real SeaweedFS here), and its whole
manifests too, etcd keeping a signed pointer per name; an edge with ``records="origin"`` asks the origin for them, never the
registry. On a real etcd: no ``objects/`` key is written, lookups and loads work and verify, a record
planted in etcd is never read, the origin's restart keeps every record, and ``kdn registry migrate``
moves an existing registry's records into a store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

from collections.abc import Callable

import aiohttp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, get, publish, wait_until  # noqa: E402

from kdn import cli  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.origin.s3records import S3Records  # noqa: E402
from kdn.registry import EmbeddedRegistry, KVRegistry, Manifest, ObjectRecord, open_registry  # noqa: E402
from kdn.registry.records import Encoding  # noqa: E402
from kdn.registry.split import RECORDS_FILE, RecordsBeside  # noqa: E402
from kdn.registry.signing import Signer, Verifier  # noqa: E402

TEXT = ("The tide tables for the northern harbour were revised twice that winter, once for the storm. " * 9)[:700]


async def registry_keys(url: str, prefix: str) -> list[str]:
    async with open_registry(url) as reg:
        return [k for k, _ in await reg.list_keys(prefix)]


async def post_records(url: str, addresses: list[str]) -> list:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/records", json={"addresses": addresses}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["records"]


def records_store(request, tmp_path, medium: str) -> tuple[str, Callable[[], KVRegistry]]:
    """The origin's store (a folder, or a fresh prefix of the session's SeaweedFS bucket) and a handle on the
    records beside its blobs."""
    if medium == "s3":
        url = request.getfixturevalue("s3_store_url")
        return url, lambda: S3Records(url)
    store = tmp_path / "origin-store"
    return str(store), lambda: EmbeddedRegistry(store / RECORDS_FILE)


@pytest.mark.parametrize("medium", ["folder", "s3"])
async def test_records_live_beside_the_blobs_and_edges_read_them_there(request, tmp_path, etcd_url, capsys, medium):
    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    store, beside = records_store(request, tmp_path, medium)
    async with cluster(tmp_path, etcd_url, edges=("e1",), records="origin", trusted_keys=str(tmp_path / "trusted"),
                       origin_kw={"records": "store", "signing_key": str(tmp_path / "origin.key"),
                                  "store": store}) as c:
        m = await publish(c, TEXT)
        addrs = m["addresses"]
        assert len(addrs) == 3
        # etcd holds the manifest, the model and the nodes; not one object record
        assert await registry_keys(etcd_url, "objects/") == []
        assert await registry_keys(etcd_url, "manifests/public/") == ["manifests/public/doc"]
        async with beside() as recs:
            stored = await recs.get_objects(addrs)
        assert all(r is not None and Verifier([key.public]).ok(r) for r in stored)

        # The manifest too: etcd keeps a signed pointer (name, version, sizes, the body's digest); the whole
        # manifest, token list and all, is beside the records. Clients read it whole, through the edge.
        async with open_registry(etcd_url) as reg:
            raw = dict(await reg.list_keys("manifests/public/"))["manifests/public/doc"]
            pointer = Manifest.unpack(raw)
        assert pointer.body is not None and pointer.prefix_tokens == [] and pointer.addresses == []
        assert len(raw) < 1024 and Verifier([key.public]).ok(pointer)
        async with beside() as recs:
            assert (await recs.get_objects(addrs))[0] is not None
        async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
            whole = await client.manifest("public", "doc")
        assert whole is not None and whole.prefix_tokens == m["prefix_tokens"] and whole.addresses == addrs
        assert whole.version == pointer.version and whole.body is None
        # the edge's prefetch chains read it whole (from its manifest watch: asynchronous to the publish)
        await wait_until(lambda: c.edge("e1").chains.following(addrs[0], 2) == addrs[1:3])
        async with aiohttp.ClientSession() as s:
            url = f"{c.edge_url('e1')}/v1/registry/manifests/public/doc"
            async with s.get(url, params={"body": "0" * 64}) as r:
                assert r.status == 404  # no such body
            # A pointer planted in etcd naming a body that is not stored: a clear 502, never a wrong manifest.
            async with open_registry(etcd_url) as reg:
                await reg._put(reg._manifest_key("public", "ghost"),
                               dataclasses.replace(pointer, name="ghost", body="1" * 64, sig={}).pack())
            async with s.get(f"{c.edge_url('e1')}/v1/registry/manifests/public/ghost") as r:
                assert r.status == 502 and "could not be read" in await r.text()

        # A record planted in etcd (a forged digest, unsigned) is never read: records come from the store.
        async with open_registry(etcd_url) as reg:
            forged = dataclasses.replace(stored[0], sig={}, encodings={"zstd": Encoding("zstd", 10, "0" * 64)})
            await reg.put_objects([forged])

        async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
            hit = await client.lookup(m["prefix_tokens"] + [5, 6], m["model_id"])
            assert hit.addresses == addrs[:2] or hit.addresses == addrs, hit.addresses
            loaded = await client.fetch_prefix(hit)
            enc = loaded.fetched[0].encoding
            assert loaded.objects[0].header.address == addrs[0]
            origin_blob = (await get(c.origin_url(), addrs[0], encoding=enc))[1]
            assert bytes(loaded.fetched[0].blob) == origin_blob  # verified against the record from the store
            assert (await get(c.edge_url("e1"), addrs[0], encoding=enc))[1] == origin_blob
            assert (await client.record(addrs[0])).encodings == stored[0].encodings

        # Both servers answer many records at once, in order, null for an unknown address.
        unknown = "f" * 64
        for url in (c.origin_url(), c.edge_url("e1")):
            got = await post_records(url, [addrs[1], unknown, addrs[0]])
            assert [g and g["address"] for g in got] == [addrs[1], None, addrs[0]]

        # `kdn registry show` finds a record the registry never held, through the origin.
        rc = await asyncio.to_thread(cli.main, ["registry", "show", addrs[1], "--registry", etcd_url])
        out = capsys.readouterr().out
        assert rc == 0 and '"from": "origin"' in out and addrs[1] in out

        # The origin restarts: every record is still there (the file is in its store).
        await c.origin.close()
        await c.start_origin(records="store", signing_key=str(tmp_path / "origin.key"), store=store)
        async with KDNClient(origin=c.origin_url(), trusted_keys=[key.public]) as client:
            assert [(await client.record(a)).address for a in addrs] == addrs


@pytest.mark.parametrize("medium", ["folder", "s3"])
async def test_migrate_moves_a_registrys_records_into_the_store(request, tmp_path, etcd_url, capsys, medium):
    store, beside = records_store(request, tmp_path, medium)
    # An origin from before the default moved: its records and whole manifests in etcd.
    async with cluster(tmp_path, etcd_url, edges=(), origin_kw={"store": store, "records": "registry"}) as c:
        m = await publish(c, TEXT)
        addrs = m["addresses"]
        assert sorted(await registry_keys(etcd_url, "objects/")) == sorted(f"objects/{a}" for a in addrs)
        await c.origin.close()
        c.origin = None

        async with open_registry(etcd_url) as reg:
            whole = await reg.get_manifest("public", m["name"])
        assert whole.body is None and whole.prefix_tokens  # a whole manifest, token list and all, in etcd

        argv = ["registry", "migrate", "--store", store, "--registry", etcd_url, "--delete"]
        assert await asyncio.to_thread(cli.main, argv) == 0
        out = capsys.readouterr().out
        assert "3 object records copied" in out and "1 manifests moved" in out
        assert await registry_keys(etcd_url, "objects/") == []
        async with beside() as recs:
            assert [r and r.address for r in await recs.get_objects(addrs)] == addrs
            async with open_registry(etcd_url) as reg:
                pointer = await reg.get_manifest("public", m["name"])
                # What a --records store origin would have written: a pointer, its body beside the records.
                assert pointer.body is not None and pointer.prefix_tokens == [] and pointer.points_at(whole)
                assert await RecordsBeside(reg, recs).get_manifest("public", m["name"]) == whole
        assert await asyncio.to_thread(cli.main, argv) == 0  # again: nothing left to move, nothing lost
        out = capsys.readouterr().out
        assert "0 object records copied" in out and "0 manifests moved" in out and "1 pointers" in out

        await c.start_origin(records="store", store=store)
        await c.start_edge("e1", records="origin")
        await c.wait_ring(["e1"])
        async with KDNClient(edges=[c.edge_url("e1")]) as client:
            hit = await client.lookup(m["prefix_tokens"] + [5], m["model_id"])
            assert hit.addresses[:2] == addrs[:2]
            assert len((await client.fetch_prefix(hit)).objects) == len(hit.addresses)


async def test_migrate_moves_a_signed_manifest_only_with_its_key_and_never_over_a_newer_publish(tmp_path):
    from kdn.registry.split import migrate_manifests

    key, other = Signer.generate(tmp_path / "k"), Signer.generate(tmp_path / "other")
    control, records = EmbeddedRegistry(tmp_path / "control.sqlite3"), EmbeddedRegistry(tmp_path / "records.sqlite3")
    try:
        control.signer = key
        man = Manifest(namespace="public", name="doc", model_id="c" * 64, addresses=["a" * 64], tokens=256,
                       chunk_tokens=256, prefix_tokens=list(range(256)))
        signed = await control.put_manifest(man)
        unsigned = Manifest(namespace="team-b", name="notes", model_id="c" * 64, addresses=["b" * 64], tokens=256,
                            chunk_tokens=256, prefix_tokens=list(range(256)), version=5)
        await control._put(control._manifest_key("team-b", "notes"), unsigned.pack())
        control.signer = None

        # Without the key that signed it (or with another), a signed manifest stays whole; an unsigned one moves.
        for signer in (None, other):
            assert await migrate_manifests(control, records, signer=signer) == (1 if signer is None else 0,
                                                                                  0 if signer is None else 1, 1)
            assert (await control.get_manifest("public", "doc")) == signed
        p = await control.get_manifest("team-b", "notes")
        assert p.body is not None and not p.sig and p.points_at(unsigned)

        # A publish that lands between the body's write and the swap wins: the manifest is left as it is then.
        newer = dataclasses.replace(man, addresses=["d" * 64])
        real_put = records._put

        async def put_then_publish(k, v, lease=None):
            await real_put(k, v, lease)
            control.signer = key
            await control.put_manifest(newer)
            control.signer = None

        records._put = put_then_publish
        assert await migrate_manifests(control, records, signer=key) == (0, 1, 1)
        records._put = real_put
        now = await control.get_manifest("public", "doc")
        assert now.body is None and now.addresses == ["d" * 64] and now.version > signed.version

        # With its key: moved, its pointer signed by that key, and read back whole through RecordsBeside.
        assert await migrate_manifests(control, records, signer=key) == (1, 1, 0)
        p = await control.get_manifest("public", "doc")
        assert p.body is not None and key.signed_it(p) and p.points_at(now)
        assert Verifier([key.public]).ok(p) and Verifier([key.public]).ok(now)
        assert await RecordsBeside(control, records).get_manifest("public", "doc") == now
    finally:
        await control.close()
        await records.close()


async def test_records_beside_routes_objects_to_the_store_and_the_rest_to_the_registry(tmp_path):
    key = Signer.generate(tmp_path / "k")
    control, records = EmbeddedRegistry(tmp_path / "control.sqlite3"), EmbeddedRegistry(tmp_path / "records.sqlite3")
    async with RecordsBeside(control, records) as reg:
        reg.signer = key
        assert control.signer is key and records.signer is key
        a, t = "a" * 64, "b" * 64
        rec = ObjectRecord(address=a, model_id="c" * 64, namespace="public", kind="kv", start=0, end=256,
                           parent=None, standalone=False, encodings={"zstd": Encoding("zstd", 10, "1" * 64)},
                           origin="o")
        from kdn.registry import Manifest

        man = Manifest(namespace="public", name="doc", model_id="c" * 64, addresses=[a], tokens=256,
                       chunk_tokens=256, prefix_tokens=list(range(256)))
        stored = await reg.put_manifest(man, objects=[rec])
        assert stored.version > 0 and stored.sig
        assert [k for k, _ in await control.list_keys("")] == ["manifests/public/doc"]
        pointer = await control.get_manifest("public", "doc")  # the registry's: signed, the tokens elsewhere
        assert pointer.body is not None and pointer.prefix_tokens == [] and key.signed_it(pointer)
        assert pointer.version == stored.version and pointer.points_at(stored)
        assert [k for k, _ in await records.list_keys("")] == [f"manifest-bodies/{pointer.body}", f"objects/{a}"]
        assert sorted(k for k, _ in await reg.list_keys("")) == ["manifests/public/doc", f"objects/{a}"]
        assert await reg.list_manifests() == [stored]  # listed whole
        assert await reg.get_manifest_body("0" * 64) is None
        tailed = await reg.add_tail(a, 12, t)
        assert tailed is not None and tailed.tails == {12: t} and key.signed_it(tailed)
        assert (await reg.get_objects([a, t])) == [tailed, None]
        assert (await reg.get_manifest("public", "doc")) == stored


async def test_a_record_miss_goes_through_the_owner_edge_so_the_origins_read_each_record_once_a_region(tmp_path,
                                                                                                     etcd_url):
    """#29 item 1 (the owner hop): with --records origin every edge's record miss went to the origins, so they
    read each record once per edge. Now a miss goes to the address's owner edge (X-KDN-Hop), whose cache
    stands for the region: three edges looking the same prompt up cost the origins one read per record."""
    from edge_helpers import metric

    store = tmp_path / "origin-store"
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2", "e3"), records="origin",
                       origin_kw={"records": "store", "store": str(store)}) as c:
        await c.wait_ring(["e1", "e2", "e3"])
        m = await publish(c, TEXT)
        addrs = m["addresses"]
        for e in ("e1", "e2", "e3"):
            async with KDNClient(edges=[c.edge_url(e)]) as client:
                hit = await client.lookup(m["prefix_tokens"] + [5], m["model_id"])
                assert hit.addresses[:2] == addrs[:2]
                assert len((await client.fetch_prefix(hit)).objects) == len(hit.addresses)

        def reads(source: str) -> float:
            return sum(metric(c.edges[e], "kdn_edge_record_reads", source=source) for e in ("e1", "e2", "e3"))

        assert reads("origin") == len(addrs), (reads("origin"), reads("owner"))  # once each, by its owner
        assert reads("owner") >= 2  # the others asked the owners
        # An owner gone: its edges' misses go to the origins (nothing is lost, only the collapse).
        await c.stop_edge("e3")
        async with KDNClient(edges=[c.edge_url("e1")]) as client:
            c.edge("e1").records._lru.clear()
            hit = await client.lookup(m["prefix_tokens"] + [5], m["model_id"])
            assert hit.addresses[:2] == addrs[:2]


async def test_auto_the_edge_default_reads_the_origins_first_and_the_registry_for_what_none_has(tmp_path, etcd_url):
    """``--records auto`` (the edge default): records an origin keeps beside its blobs come from the origin, with
    no registry read; a record only the registry holds (what a producer without an origin store writes,
    ``kdn.adapters.vllm.save``) is still found there, believed only as far as its signature; and with no
    origin answering, the registry alone serves."""
    from edge_helpers import metric

    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    async with cluster(tmp_path, etcd_url, edges=("e1",), trusted_keys=str(tmp_path / "trusted"),
                       origin_kw={"records": "store", "signing_key": str(tmp_path / "origin.key")}) as c:
        assert c.configs["e1"].records == "auto"  # nobody asked for it
        m = await publish(c, TEXT)
        addrs = m["addresses"]

        def reads(source: str) -> float:
            return metric(c.edges["e1"], "kdn_edge_record_reads", source=source)

        async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
            hit = await client.lookup(m["prefix_tokens"] + [5], m["model_id"])
            assert hit.addresses[:2] == addrs[:2]
            assert len((await client.fetch_prefix(hit)).objects) == len(hit.addresses)
        assert reads("origin") >= len(hit.addresses) and reads("registry") == 0

        # A signed record the registry alone holds (a producer wrote it there), and a forged one beside it.
        mine, forged = "1" * 64, "2" * 64
        async with open_registry(etcd_url) as reg:
            reg.signer = key
            await reg.put_objects([dataclasses.replace(c.edge("e1").records._lru[addrs[0]], address=mine, sig={})])
            reg.signer = None
            await reg.put_objects([dataclasses.replace(c.edge("e1").records._lru[addrs[0]], address=forged, sig={})])
        got = await post_records(c.edge_url("e1"), [mine, forged, addrs[1]])
        assert [g and g["address"] for g in got] == [mine, None, addrs[1]]
        assert reads("registry") == 2  # the two no origin had (the forged one refused: unsigned)

        await c.start_edge("e2", "us", origin=False)  # follows the registry's list of origins
        await wait_until(lambda: bool(c.edge("e2").origin_urls()), timeout=15)
        # The origin gone: the registry answers alone (an edge that keeps serving what it can).
        await c.origin.close()
        c.edge("e1").records._lru.pop(mine)
        got = await post_records(c.edge_url("e1"), [mine])
        assert got[0] is not None and got[0]["address"] == mine
        # An edge that follows the registry's list of origins (no --origin): once the origin is no longer listed
        # at all, a record the registry lacks is unknown, not absent: it may sit in the store of an origin that
        # is restarting (a "no" would be cached, and answered as a 404).
        e2 = c.edge("e2")
        await wait_until(lambda: not e2.origin_urls(), timeout=15)
        got = await post_records(c.edge_url("e2"), [mine])
        assert got[0] is not None and got[0]["address"] == mine  # the registry's "yes" still counts
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{c.edge_url('e2')}/v1/records", json={"addresses": ["3" * 64]}) as r:
                assert r.status == 503, await r.text()


def test_every_records_mode_the_cli_offers_is_one_the_edge_takes():
    from kdn.edge.config import RECORDS_MODES, EdgeConfig

    args = cli.build_parser().parse_args(["edge", "serve", "--registry", "file:/x"])
    assert args.records == EdgeConfig.records == RECORDS_MODES[0] == "auto"
    for mode in RECORDS_MODES:
        assert cli.build_parser().parse_args(["edge", "serve", "--records", mode, "--registry", "file:/x"]).records == mode
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["edge", "serve", "--records", "etcd", "--registry", "file:/x"])


async def test_an_edge_serves_once_it_knows_the_origins(tmp_path, etcd_url, monkeypatch):
    """An edge without ``--origin`` lists the origins from the registry. Until the list is in it knows none,
    and ``--records auto`` took the registry's word for records the origins keep beside their blobs: a
    (re)started edge answered 404 for published objects, and remembered the "no" (bench/faults.py's
    kill_during_write saw ~100 such reads under load). It serves only once the list is in."""
    from kdn.registry.etcd import EtcdRegistry

    async with cluster(tmp_path, etcd_url, edges=(), origin_kw={"records": "store"}) as c:
        m = await publish(c, TEXT)
        watch = EtcdRegistry.watch

        async def slowed(self, prefix: str = ""):  # the registry answers the origins' list late (a busy etcd)
            if prefix.startswith("nodes/origin"):
                await asyncio.sleep(1.0)
            async for ev in watch(self, prefix):
                yield ev

        monkeypatch.setattr(EtcdRegistry, "watch", slowed)
        await c.start_edge("e1", origin=False)
        assert c.edge("e1").origin_urls() == [c.origin_url().rstrip("/")]
        for a in m["addresses"]:
            status, _, _ = await get(c.edge_url("e1"), a)
            assert status == 200, (a, status)
