"""The origin's authenticated ingest (``PUT /v1/objects/{address}``, ``kdn.origin.ingest``), over HTTP on loopback.

What it takes (an object of the sender's namespace at its own keyed address: 201, then 200 for the same bytes)
and how the record says from whom, signed; and each refusal, before anything is stored: no token, a token
without ``publish`` there, an address that is not the key's, a header that names another address, a
lossy or unknown encoding, no preimage, other bytes over stored ones, a body past the origin's limit.
"""

from __future__ import annotations

import hashlib
import os
import sys

import aiohttp
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "lib"))

from edge_helpers import EDGE_TOKEN, TENANT_A, TENANT_B, cluster  # noqa: E402

from kdn.adapters.lmcache.keys import SCHEME, chunk_address, key_text, shard_of  # noqa: E402
from kdn.format.objects import encode_object, from_torch  # noqa: E402
from kdn.origin.config import STORE  # noqa: E402
from kdn.registry import open_registry  # noqa: E402
from kdn.registry.signing import Signer, Verifier  # noqa: E402
from kdn.service import METRICS  # noqa: E402

MID = "ab" * 32
HASH = bytes.fromhex("5e" * 32)


def blob_for(address: str, namespace: str = "acme", value: float = 1.0, encoding: str = "raw", **kw) -> bytes:
    t = torch.full((2, 2, 8, 16), value, dtype=torch.bfloat16)
    return encode_object(kind="kv", address=address, model_id=MID, namespace=namespace, start=0, end=8,
                         position=0, parent=kw.get("parent"), tensors=from_torch({"kv_2ltd": t}), encoding=encoding)


def preimage(salt: str = "") -> dict[str, str]:
    return {"X-KDN-Key-Scheme": SCHEME, "X-KDN-Key-Shard": shard_of(0, 0), "X-KDN-Key": key_text(HASH, salt),
            "X-KDN-Engine": "lmcache 0.5.6"}


async def put(c, address: str, body: bytes, token: str | None = TENANT_A, encoding: str = "raw", **headers):
    h = {**({"Authorization": f"Bearer {token}"} if token else {}), **headers}
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{c.origin_url()}/v1/objects/{address}", params={"encoding": encoding}, data=body,
                         headers=h) as r:
            return r.status, await r.json()


async def test_ingest_stores_signs_and_refuses(tmp_path, etcd_url):
    key = tmp_path / "origin.key"
    Signer.generate(str(key))
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(key),
                                                                     "records": "registry",
                                                                     "max_body_bytes": 64 << 10}) as c:
        a = chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=0)
        body = blob_for(a)
        # refusals first: nothing of them is stored
        assert (await put(c, a, body, token=None, **preimage()))[0] == 401
        assert (await put(c, a, body, token="not-a-token-of-this-origin", **preimage()))[0] == 401
        assert (await put(c, a, body, token=EDGE_TOKEN, **preimage()))[0] == 403  # read * only
        assert (await put(c, a, body, token=TENANT_B, **preimage()))[0] == 403  # publish on beta, not acme
        st, err = await put(c, a, body)  # no preimage
        assert st == 400 and "X-KDN-Key-Scheme" in err["detail"]
        st, err = await put(c, a, body, **preimage(salt="someone-else"))  # not this key's address
        assert st == 400 and "is not the lmcache-chunk address" in err["detail"]
        b_addr = chunk_address(MID, "beta", chunk_hash=HASH, kv_rank=0)  # B's address, A's bytes: the header says acme
        st, err = await put(c, b_addr, blob_for(b_addr, namespace="acme"), **preimage())
        assert st == 400 and "is not the lmcache-chunk address" in err["detail"]
        st, err = await put(c, a, blob_for("cd" * 32), **preimage())  # the header names another address
        assert st == 400 and "header names" in err["detail"]
        assert (await put(c, a, body, encoding="int8", **preimage()))[0] == 400
        assert (await put(c, a, blob_for(a, value=2.0) + b"\0" * (80 << 10), **preimage()))[0] == 413
        assert (await put(c, a, b"not an object", **preimage()))[0] == 400
        assert not c.origin.app[STORE].encodings(a)

        # the object itself: stored (201), the same bytes again (200)
        st, got = await put(c, a, body, **preimage())
        assert st == 201 and got["namespace"] == "acme" and got["size"] == len(body)
        fp = "sha256:" + hashlib.sha256(TENANT_A.encode()).hexdigest()[:16]
        assert got["origin"] == f"origin-1 ingest {fp}"
        assert (await put(c, a, body, **preimage()))[0] == 200
        # other bytes over them: never rewritten
        st, err = await put(c, a, blob_for(a, value=3.0), **preimage())
        assert st == 409 and "never rewritten" in err["detail"]
        # zstd beside raw, same address: a second encoding of the same object
        assert (await put(c, a, blob_for(a, encoding="zstd"), encoding="zstd", **preimage()))[0] == 201

        # its record: signed by the origin's key, saying from whom and what engine the sender named
        reg = open_registry(c.registry)
        try:
            rec = await reg.get_object(a)
        finally:
            await reg.close()
        assert rec is not None and set(rec.encodings) == {"raw", "zstd"}
        assert (rec.namespace, rec.kind, rec.origin, rec.engine) == ("acme", "kv", f"origin-1 ingest {fp}",
                                                                      "lmcache 0.5.6")
        Verifier.from_file(str(key) + ".pub").check(rec)
        counted = c.origin.app[METRICS].get_sample_value
        assert [counted("kdn_origin_ingested_total", {"outcome": o}) for o in ("stored", "same", "conflict")] == \
            [2, 1, 1]
