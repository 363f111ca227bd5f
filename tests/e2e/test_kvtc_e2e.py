"""kvtc end to end: an origin configured with a basis publishes kvtc-B objects and the basis itself;
a client (through an edge and straight from the origin) fetches the basis once, verifies it by its
address, and decodes within the codec's bound of the exact states."""

from __future__ import annotations

import os
import sys

import aiohttp
import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import PUBLISH, TENANT_A, cluster  # noqa: E402
from edge_helpers import publish as publish_doc  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.format.encodings import kvtc_bits  # noqa: E402
from kdn.errors import DigestMismatch, InvalidInput  # noqa: E402
from kdn.format.objects import to_torch  # noqa: E402
from kdn.origin.app import STORE  # noqa: E402
from kdn.service import REGISTRY  # noqa: E402
from kdn.registry.records import Encoding  # noqa: E402

TEXT = ("The keeper trimmed the wick at dusk and wrote the wind in the log. " * 10)[:600]


@pytest.fixture(scope="module")
def basis_file(tmp_path_factory):
    from kvtc_helpers import write_tiny_basis

    return write_tiny_basis(tmp_path_factory.mktemp("kvtc"))


def test_kvtc_encoding_names():
    assert kvtc_bits("kvtc-2") == 2.0 and kvtc_bits("kvtc-1p65") == 1.65 and kvtc_bits("kvtc-2p5") == 2.5
    assert kvtc_bits("zstd") is None and kvtc_bits("kvtc-2.5") is None and kvtc_bits("kvtc") is None
    with pytest.raises(InvalidInput):
        kvtc_bits("kvtc-0")


def test_choice_takes_kvtc_on_a_slow_link_only_within_its_worst_nll():
    client = KDNClient(origin="http://127.0.0.1:1")
    est = client.routing.estimates["http://127.0.0.1:1"]
    est.bandwidth, est.rtt = 5e6, 0.001  # 5 MB/s: bytes dominate
    encs = {"zstd": Encoding("zstd", 1_000_000, "0" * 64),
            "kvtc-2": Encoding("kvtc-2", int(1_000_000 * 1.45 / 6.96), "0" * 64)}
    assert client.choose_encoding(encs, 5.0) == "kvtc-2"
    assert client.choose_encoding(encs, 1.0) == "zstd"  # its worst measured NLL (+1.43%) is over 1%
    assert client.choose_encoding(encs, "lossless") == "zstd"


async def _origin_json(c, path: str) -> dict:
    async with aiohttp.ClientSession(c.origin_url(), headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
        async with s.get(path) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def test_publish_kvtc_fetch_via_edge_and_origin_within_bound(tmp_path, etcd_url, basis_file):
    path, addr = basis_file
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"kvtc_basis": str(path)}) as c:
        m = await publish_doc(c, TEXT, "d", encodings=["zstd", "kvtc-8"])
        model = await c.origin.app[REGISTRY].get_model(m["model_id"])
        assert model is not None and model.extra["kvtc_basis"] == addr
        # The basis: a signed-like-any record of kind "basis", stored under its own digest, linked from the model.
        rec = await _origin_json(c, f"/v1/registry/objects/{addr}")
        assert rec["kind"] == "basis" and rec["encodings"]["basis"]["digest"] == addr
        obj = await _origin_json(c, f"/v1/registry/objects/{m['addresses'][0]}")
        assert set(obj["encodings"]) == {"zstd", "kvtc-8"}
        for where in ({"edges": [c.edge_url("e1")]}, {"origin": c.origin_url()}):
            async with KDNClient(**where, quality=100.0) as client:
                hit = await client.lookup(m["prefix_tokens"], m["model_id"])
                assert hit.chunks == len(m["addresses"]) >= 2
                exact = await client.fetch_prefix(hit, encoding="zstd")
                lossy = await client.fetch_prefix(hit, encoding="kvtc-8")
                assert {f.encoding for f in lossy.fetched} == {"kvtc-8"}
                assert client.bases_fetched == 1  # once, for every object that names it
                for e, x in zip(exact.objects, lossy.objects):
                    assert {t.codec for n, t in x.header.tensors.items()} == {"kvtc"}
                    te, tx = to_torch(e), to_torch(x)
                    for name, ref in te.items():
                        rel = float((tx[name].float() - ref.float()).pow(2).mean() / ref.float().var())
                        assert rel < 0.02, (name, rel)  # the codec's 8-bit bound (tests/kernels/test_transform_fit.py)


async def test_a_tenant_decodes_its_kvtc_objects_with_the_models_basis(tmp_path, etcd_url, basis_file):
    """The basis is the model's (namespace public, kind basis): a tenant token that reads only its own
    namespace still reads it -- or its kvtc objects could never be decoded -- and nothing else public."""
    path, addr = basis_file
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"kvtc_basis": str(path)}) as c:
        mine = await publish_doc(c, TEXT, "d", namespace="acme", token=TENANT_A, encodings=["zstd", "kvtc-8"])
        public = await publish_doc(c, TEXT[::-1], "p")
        for where in ({"edges": [c.edge_url("e1")]}, {"origin": c.origin_url()}):
            async with KDNClient(**where, token=TENANT_A, quality=100.0) as client:
                hit = await client.lookup(mine["prefix_tokens"], mine["model_id"], "acme")
                states = await client.fetch_prefix(hit, encoding="kvtc-8")
                assert client.bases_fetched == 1 and len(states.objects) == hit.chunks >= 2
                assert (await client.record(addr)).kind == "basis"
                assert await client.record(public["addresses"][0]) is None  # other public objects stay hidden
                miss = await client.lookup(public["prefix_tokens"], public["model_id"])
                assert miss.tokens == 0


async def test_kvtc_publish_refused_without_a_basis(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        async with aiohttp.ClientSession(c.origin_url(), headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
            async with s.post("/v1/publish", json={"name": "d", "text": TEXT, "encodings": ["zstd", "kvtc-2"]}) as r:
                assert r.status == 400
                body = await r.json()
        assert "kvtc basis" in body["detail"] and "--kvtc-basis" in body["detail"]


async def test_tampered_basis_is_refused(tmp_path, etcd_url, basis_file):
    """A basis whose bytes are not its address is refused by the client itself (the origin here
    serves the tampered bytes as if they were intact), and nothing kvtc is decoded."""
    path, addr = basis_file
    async with cluster(tmp_path, etcd_url, edges=(), origin_kw={"kvtc_basis": str(path)}) as c:
        m = await publish_doc(c, TEXT, "d", encodings=["zstd", "kvtc-2"])
        store = c.origin.app[STORE]
        real_aget = store.aget

        async def tampered(address, encoding):
            got = await real_aget(address, encoding)
            if address != addr or got is None:
                return got
            bad = bytearray(got[0])
            bad[-1] ^= 0x01  # one bit of the last basis float
            return bytes(bad), got[1]

        store.aget = tampered
        async with KDNClient(origin=c.origin_url(), quality=100.0) as client:
            hit = await client.lookup(m["prefix_tokens"], m["model_id"])
            with pytest.raises(DigestMismatch):
                await client.fetch_prefix(hit, encoding="kvtc-2")
            assert client.bases_fetched == 0
            store.aget = real_aget  # intact again: the failed fetch is not cached, a retry loads it
            states = await client.fetch_prefix(hit, encoding="kvtc-2")
            assert client.bases_fetched == 1 and len(states.objects) == hit.chunks
