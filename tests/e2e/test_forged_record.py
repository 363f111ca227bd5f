"""The attack: a lying edge forges an object record and a blob that agree with each other.

Without publisher keys the client takes the digest from the same edge that
sends the bytes, so a forgery that is self-consistent passes verification.
With the origin's key trusted, the forged record's signature does not cover
its fields: a miss, counted, and no forged byte reaches the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aiohttp
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, get, publish  # noqa: E402

from kdn.adapters.hf import agenerate, load_model  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.format.objects import decode_object, encode_object, from_torch, to_torch  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402

TEXT = ("The keeper logged the wind, the ships and the glass each hour of the storm. " * 14)[:700]


def forge(blob: bytes) -> bytes:
    """A well-formed object for the same address, its K/V replaced: what a lying edge would serve."""
    obj = decode_object(blob)
    h = obj.header
    tensors = {k: torch.randn_like(t) * 8 for k, t in to_torch(obj).items()}  # K and V: another text's, say
    return encode_object(kind=h.kind, address=h.address, model_id=h.model_id, namespace=h.namespace, start=h.start,
                         end=h.end, position=h.position, parent=h.parent, tensors=from_torch(tensors), encoding="zstd")


async def forger(upstream: str) -> TestServer:
    """An edge that serves forged blobs and records whose digests match them: read one by one, or sent
    with a lookup's answer."""
    forged: dict[str, bytes] = {}

    async def forge_record(rec: dict) -> dict:
        address = rec["address"]
        async with aiohttp.ClientSession() as s:  # forge the blob now, so the record can match it
            async with s.get(f"{upstream}/v1/objects/{address}?encoding=zstd") as r:
                fake = forged.setdefault(address, forge(await r.read()))
        rec["encodings"] = {"zstd": {"name": "zstd", "size": len(fake), "digest": blake3(fake).hexdigest()}}
        return rec  # the origin's signature is kept: it no longer covers the fields

    async def handle(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{upstream}{request.rel_url}") as r:
                body, status = await r.read(), r.status
        parts = request.path.split("/")
        if status == 200 and request.path.startswith("/v1/objects/"):
            body = forged.setdefault(parts[-1], forge(body))
            return web.Response(body=body, headers={"X-KDN-Encoding": "zstd", "X-KDN-Source": "memory"})
        if status == 200 and request.path.startswith("/v1/registry/objects/"):
            return web.json_response(await forge_record(json.loads(body)))
        return web.Response(body=body, status=status, content_type="application/json")

    async def post(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{upstream}{request.rel_url}", data=await request.read(),
                              headers={"Content-Type": "application/json"}) as r:
                body, status = await r.read(), r.status
        if status == 200 and request.path == "/v1/lookup":
            answer = json.loads(body)
            answer["records"] = [await forge_record(rec) for rec in answer.get("records") or []]
            return web.json_response(answer)
        return web.Response(body=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    app.router.add_route("POST", "/{tail:.*}", post)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_forged_record_and_blob_are_refused_with_the_origins_key(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    lm = load_model("tiny-llama")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        m = await publish(c, TEXT)
        ids = m["prefix_tokens"] + [7, 8, 9]
        fake = await forger(c.edge_url("e1"))
        try:
            liar = str(fake.make_url("")).rstrip("/")
            async with KDNClient(edges=[liar]) as client:  # no publisher key: the forgery passes
                fooled = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1)
            async with KDNClient(edges=[liar], trusted_keys=[key.public]) as client:
                safe = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1)
                refused = client.rejected_records
            async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
                honest = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1)
        finally:
            await fake.close()
    plain = await agenerate(lm.model, lm.tokenizer, ids, None, max_new_tokens=1, use_cache=False)
    assert fooled.report.tokens_reused == 700, "the forgery must pass without a key (else this test proves nothing)"
    assert not torch.allclose(fooled.first_logits, plain.first_logits, atol=1e-2)
    assert safe.report.tokens_reused == 0 and refused >= 1
    torch.testing.assert_close(safe.first_logits, plain.first_logits)
    assert honest.report.tokens_reused == 700  # signed records, tails included, verify through an honest edge


async def test_an_edge_with_trusted_keys_treats_unsigned_records_as_absent(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    # This origin signs nothing: every record it writes is unsigned.
    async with cluster(tmp_path, etcd_url, edges=("e1",), trusted_keys=str(tmp_path / "trusted")) as c:
        m = await publish(c, TEXT)
        status, _, _ = await get(c.edge_url("e1"), m["addresses"][0])
        assert status == 404
        from edge_helpers import metric

        assert metric(c.edges["e1"], "kdn_edge_refused_records") >= 1


async def test_an_origins_model_record_is_signed_and_kdn_registry_show_checks_it(tmp_path, etcd_url, capsys):
    """#28 item 11 (model records): they were unsigned, so a registry writer could change what a model record
    says (its kvtc basis, its origin, its shape) unseen. The origin signs it as it signs its objects;
    ``kdn registry show --trusted-keys`` says whether the record is the origin's word."""
    import dataclasses

    from kdn import cli
    from kdn.registry import open_registry
    from kdn.registry.signing import Verifier

    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    async with cluster(tmp_path, etcd_url, edges=(), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        reg = open_registry(c.registry)
        try:
            (model,) = await reg.list_models()
            assert Verifier([key.public]).ok(model)
            show = ["registry", "show", model.model_id, "--registry", c.registry, "--trusted-keys",
                    str(tmp_path / "trusted")]
            capsys.readouterr()
            assert await asyncio.to_thread(cli.main, show) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["type"] == "model" and out["verified"] is True
            # A writer's edit: the signature kept, a field changed (the origin's URL, where fills would go).
            forged = dataclasses.replace(model, extra={**model.extra, "origin": "http://127.0.0.2:1"})
            await reg._put(reg._model_key(model.model_id), forged.pack())
            assert await asyncio.to_thread(cli.main, show) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["verified"] is False and "does not match" in out["why"]
            # Second reading: another key's record, signed and whole, put under this model's key. It verifies as a
            # record, but it is not this model's.
            other = Signer.load(str(tmp_path / "origin.key")).sign(dataclasses.replace(model, model_id="d" * 64))
            await reg._put(reg._model_key(model.model_id), other.pack())
            assert await asyncio.to_thread(cli.main, show) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["verified"] is False and "not " + model.model_id[:80] in out["why"]
        finally:
            await reg.close()
