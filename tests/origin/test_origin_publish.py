"""Publish real text through a running origin with real etcd; find every object by hash and check its tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdn.format import address as A
from kdn.adapters.hf import extract_chunks, load_model, standalone_chunk
from kdn.format.objects import decode_object, to_torch
from origin_records import open_records  # bench/lib/origin_records.py

from origin_helpers import PUBLISH_TOKEN, publish, running_origin

DOCS = Path(__file__).resolve().parents[2] / "kdn" / "data" / "docs"
CHUNK = 256


def doc_text(n_chars: int, name: str = "sourdough-guide.md") -> str:
    return (DOCS / name).read_text()[:n_chars]


async def check_published(session, registry_url, manifest, loaded, tokens, *, store, encoding="zstd"):
    """Every manifest address has a record (beside the origin's blobs in ``store``) and is served by the origin;
    its tensors equal a direct prefill."""
    reg = open_records(registry_url, store)
    try:
        assert manifest["addresses"] == A.prefix_addresses(loaded.model_id, manifest["namespace"], tokens, CHUNK)
        assert (await reg.get_manifest(manifest["namespace"], manifest["name"])).addresses == manifest["addresses"]
        direct = list(extract_chunks(loaded.model, tokens, chunk_tokens=CHUNK))
        assert len(direct) == len(manifest["addresses"])
        for i, (addr, chunk) in enumerate(zip(manifest["addresses"], direct)):
            rec = await reg.get_object(addr)
            assert rec is not None, f"chunk {i} has no object record"
            assert (rec.start, rec.end) == (chunk.start, chunk.end)
            assert rec.parent == (manifest["addresses"][i - 1] if i else None)
            async with session.get(f"/v1/objects/{addr}", headers={"Authorization": f"Bearer {PUBLISH_TOKEN}"}) as r:
                assert r.status == 200
                blob = await r.read()
                assert r.headers["ETag"] == f'"{rec.encodings[encoding].digest}"'
                assert r.headers["X-KDN-Encoding"] == encoding
            obj = decode_object(blob, expected_digest=rec.encodings[encoding].digest)
            assert obj.header.address == addr and obj.header.model_id == loaded.model_id
            got = to_torch(obj)
            assert set(got) == set(chunk.tensors)
            for name, t in chunk.tensors.items():
                assert torch.equal(got[name], t), f"chunk {i} tensor {name} differs from a direct prefill"
    finally:
        await reg.close()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bamba"])
async def test_publish_text_and_find_every_object(tmp_path, etcd_url, model):
    loaded = load_model(model)
    text = doc_text(900)  # byte tokenizer: 900 tokens = 3 full chunks + a tail
    async with running_origin(tmp_path, etcd_url, model=model) as (server, session):
        job = await publish(session, {"name": "sourdough", "text": text})
        assert job["state"] == "done", job
        manifest = job["manifest"]
        tokens = loaded.tokenizer.encode(text)
        assert manifest["prefix_tokens"] == tokens and manifest["tokens"] == len(tokens)
        await check_published(session, etcd_url, manifest, loaded, tokens, store=tmp_path / "store")
        # blobs are in the store under their addresses: zstd, and raw beside it (the tests' origins keep raw always)
        store = tmp_path / "store"
        for a in manifest["addresses"]:
            assert (store / a[:2] / a[2:4] / f"{a}.zstd").is_file()
            assert (store / a[:2] / a[2:4] / f"{a}.raw").is_file()


def test_default_encodings_follow_the_raw_copies_setting_and_the_disk():
    from kdn.errors import InvalidInput
    from kdn.origin.publish import RAW_MIN_FREE_BYTES, default_encodings

    gib = 1 << 30
    assert default_encodings("auto", (50 * gib, 100 * gib)) == ("zstd", "raw")
    assert default_encodings("auto", (24 * gib, 100 * gib)) == ("zstd",)  # a filling disk keeps zstd only
    assert default_encodings("auto", (RAW_MIN_FREE_BYTES, 1000 * gib)) == ("zstd", "raw")  # a large one has room
    assert default_encodings("auto", None) == ("zstd", "raw")  # a bucket: no disk to fill
    assert default_encodings("always", (gib, 100 * gib)) == ("zstd", "raw")
    assert default_encodings("never", (99 * gib, 100 * gib)) == ("zstd",)
    with pytest.raises(InvalidInput, match="raw copies"):
        default_encodings("sometimes", None)


async def test_raw_copies_never_and_a_named_list_store_only_what_they_say(tmp_path, etcd_url):
    from kdn.errors import InvalidInput
    from kdn.origin.app import OriginConfig, create_app

    with pytest.raises(InvalidInput, match="raw copies"):  # a bad setting fails at start
        create_app(OriginConfig(store=str(tmp_path / "bad"), raw_copies="maybe"))
    text = doc_text(600)
    async with running_origin(tmp_path, etcd_url, raw_copies="never") as (server, session):
        m = (await publish(session, {"name": "never", "text": text}))["manifest"]
        reg = open_records(etcd_url, tmp_path / "store")
        try:
            assert {tuple((await reg.get_object(a)).encodings) for a in m["addresses"]} == {("zstd",)}
        finally:
            await reg.close()
    (tmp_path / "b").mkdir()
    async with running_origin(tmp_path / "b", etcd_url) as (server, session):  # the body names raw only
        m = (await publish(session, {"name": "named", "text": doc_text(600, "harbor-policy.md"),
                                     "encodings": ["raw"]}))["manifest"]
        reg = open_records(etcd_url, tmp_path / "b" / "store")
        try:
            assert {tuple((await reg.get_object(a)).encodings) for a in m["addresses"]} == {("raw",)}
        finally:
            await reg.close()


async def test_partial_tail_is_listed_on_its_parent(tmp_path, etcd_url):
    text = doc_text(700)  # 2 full chunks + a 188-token tail
    async with running_origin(tmp_path, etcd_url) as (server, session):
        manifest = (await publish(session, {"name": "tail", "text": text}))["manifest"]
    reg = open_records(etcd_url, tmp_path / "store")
    try:
        parent = await reg.get_object(manifest["addresses"][1])
        assert parent.tails == {700 - 512: manifest["addresses"][2]}
        tail = await reg.get_object(manifest["addresses"][2])
        assert (tail.start, tail.end, tail.parent) == (512, 700, manifest["addresses"][1])
    finally:
        await reg.close()


async def test_republish_is_idempotent_and_computes_nothing(tmp_path, etcd_url):
    text = doc_text(800)
    async with running_origin(tmp_path, etcd_url) as (server, session):
        first = await publish(session, {"name": "doc", "text": text})
        files = sorted(p.name for p in (tmp_path / "store").rglob("*.zstd"))
        mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "store").rglob("*.zstd")}
        second = await publish(session, {"name": "doc", "text": text})
        assert second["manifest"]["addresses"] == first["manifest"]["addresses"]
        assert second["progress"]["computed"] == 0 and second["progress"]["done"] == second["progress"]["total"]
        assert sorted(p.name for p in (tmp_path / "store").rglob("*.zstd")) == files
        assert {p: p.stat().st_mtime_ns for p in (tmp_path / "store").rglob("*.zstd")} == mtimes  # nothing rewritten


async def test_extending_a_document_computes_only_the_new_chunks(tmp_path, etcd_url):
    loaded = load_model("tiny-llama")
    short, long = doc_text(512), doc_text(1100)  # 2 chunks, then 4 full chunks + a tail
    async with running_origin(tmp_path, etcd_url) as (server, session):
        await publish(session, {"name": "short", "text": short})
        job = await publish(session, {"name": "long", "text": long})
        assert job["progress"]["computed"] == 3  # chunks 2, 3 and the tail; 0 and 1 came from the store
        # The resumed chunks are bit-identical to an uninterrupted prefill.
        await check_published(session, etcd_url, job["manifest"], loaded, loaded.tokenizer.encode(long),
                              store=tmp_path / "store")


async def test_an_edit_recomputes_from_its_chunk_on_and_reuses_the_chunks_before(tmp_path, etcd_url):
    """A document edited in its middle (#30 item 1a): the chunks before the first changed token keep their
    addresses, records and blobs; the origin computes from that chunk on, says how many it reused, and the
    new version's chunks equal a prefill of the new text."""
    loaded = load_model("tiny-llama")
    text = doc_text(1400)
    cut = text.index(" ", 900)  # a word in the middle of the document, well past the first chunk
    edited = text[:cut] + " (revised: the oven runs hotter than it says)" + text[cut:]
    async with running_origin(tmp_path, etcd_url) as (server, session):
        old = await publish(session, {"name": "guide", "text": text})
        new = await publish(session, {"name": "guide", "text": edited})
        a, b = old["manifest"], new["manifest"]
        same = next(i for i, (x, y) in enumerate(zip(a["prefix_tokens"], b["prefix_tokens"])) if x != y)
        kept = same // CHUNK  # chunks wholly before the first changed token
        assert 1 <= kept < len(b["addresses"]) - 1
        assert b["addresses"][:kept] == a["addresses"][:kept] and b["addresses"][kept] != a["addresses"][kept]
        assert new["progress"]["computed"] == len(b["addresses"]) - kept  # reused the rest, and says so
        assert new["progress"]["done"] == new["progress"]["total"] == len(b["addresses"])
        await check_published(session, etcd_url, b, loaded, loaded.tokenizer.encode(edited), store=tmp_path / "store")


async def test_standalone_chunks(tmp_path, etcd_url):
    loaded = load_model("tiny-llama")
    text = doc_text(600)
    tokens = loaded.tokenizer.encode(text)
    async with running_origin(tmp_path, etcd_url) as (server, session):
        job = await publish(session, {"name": "alone", "text": text, "standalone": True, "prefix": False})
        m = job["manifest"]
        assert m["addresses"] == []
        assert m["standalone"] == A.standalone_addresses(loaded.model_id, "public", tokens, CHUNK)
        reg = open_records(etcd_url, tmp_path / "store")
        try:
            for i, addr in enumerate(m["standalone"]):
                rec = await reg.get_object(addr)
                assert rec.standalone and rec.parent is None
                async with session.get(f"/v1/objects/{addr}") as r:
                    obj = decode_object(await r.read(), expected_digest=rec.encodings["zstd"].digest)
                assert obj.header.position == 0
                direct = standalone_chunk(loaded.model, tokens[i * CHUNK:(i + 1) * CHUNK])
                got = to_torch(obj)
                for name, t in direct.tensors.items():
                    assert torch.equal(got[name], t)
        finally:
            await reg.close()


async def test_raw_and_zstd_encodings_decode_to_the_same_tensors(tmp_path, etcd_url):
    async with running_origin(tmp_path, etcd_url) as (server, session):
        m = (await publish(session, {"name": "two", "text": doc_text(300), "encodings": ["zstd", "raw"]}))["manifest"]
        a = m["addresses"][0]
        blobs = {}
        for enc in ("zstd", "raw"):
            async with session.get(f"/v1/objects/{a}", params={"encoding": enc}) as r:
                assert r.status == 200 and r.headers["X-KDN-Encoding"] == enc
                blobs[enc] = await r.read()
        assert len(blobs["raw"]) > len(blobs["zstd"])
        z, raw = to_torch(decode_object(blobs["zstd"])), to_torch(decode_object(blobs["raw"]))
        assert all(torch.equal(z[k], raw[k]) for k in z)
        async with session.get(f"/v1/objects/{a}", params={"encoding": "int8"}) as r:
            assert r.status == 404 and (await r.json())["error"] == "not_found"
