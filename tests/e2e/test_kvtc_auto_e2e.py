"""kvtc-auto end to end: an origin with a basis publishes objects whose budget its rate control picked per
object, and a client decodes them with no more than the basis (each tensor names its own water level)."""

from __future__ import annotations

import os
import sys

import aiohttp
import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import PUBLISH, cluster  # noqa: E402
from edge_helpers import publish as publish_doc  # noqa: E402

from kdn.adapters.hf.kvtc_rate import RateSettings  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402
from kdn.format.objects import to_torch  # noqa: E402
from kdn.kernels import encode_as, encoding_plan  # noqa: E402
from kdn.origin.app import PRODUCER  # noqa: E402

TEXT = ("The keeper trimmed the wick at dusk and wrote the wind in the log. " * 10)[:600]


@pytest.fixture(scope="module")
def basis_file(tmp_path_factory):
    from kvtc_helpers import write_tiny_basis

    return write_tiny_basis(tmp_path_factory.mktemp("kvtc-auto"))[0]


def test_kvtc_auto_is_a_known_encoding_that_encode_as_refuses():
    encoding_plan("kvtc-auto", n_layers=2)  # a publish may name it
    with pytest.raises(InvalidInput, match="rate control"):
        encode_as("kvtc-auto", n_layers=2, tensors={}, position=0)


async def test_publish_kvtc_auto_and_decode_each_object_at_its_own_rung(tmp_path, etcd_url, basis_file):
    async with cluster(tmp_path, etcd_url, edges=(), origin_kw={"kvtc_basis": str(basis_file)}) as c:
        # a ladder far apart (1 and 8 bits) and a KL bound no object meets: the budget decides every rung
        c.origin.app[PRODUCER].rate = RateSettings.parse("ladder=1,8 kl=1e-12 target=4.5 probe=8")
        m = await publish_doc(c, TEXT, "d", encodings=["zstd", "kvtc-auto"])
        async with KDNClient(origin=c.origin_url(), quality=100.0) as client:
            hit = await client.lookup(m["prefix_tokens"], m["model_id"])
            assert hit.chunks == len(m["addresses"]) >= 3
            exact = await client.fetch_prefix(hit, encoding="zstd")
            lossy = await client.fetch_prefix(hit, encoding="kvtc-auto")
            errs = []
            for e, x in zip(exact.objects, lossy.objects):
                assert x.header.encoding == "kvtc-auto"
                assert {t.codec for t in x.header.tensors.values()} == {"kvtc"}
                te, tx = to_torch(e), to_torch(x)
                errs.append(max(float((tx[n].float() - r.float()).pow(2).mean() / r.float().var()) for n, r in te.items()))
            # 8 bits (the burst) first, then 1 bit until the budget has room again: 8, 1, 1, ... (mean <= 4.5 + 3.5 / n)
            assert errs[0] < 0.02 < errs[1], errs


async def test_kvtc_auto_publish_refused_without_a_basis(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        async with aiohttp.ClientSession(c.origin_url(), headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
            async with s.post("/v1/publish", json={"name": "d", "text": TEXT, "encodings": ["zstd", "kvtc-auto"]}) as r:
                assert r.status == 400
                body = await r.json()
        assert "kvtc-auto" in body["detail"] and "--kvtc-basis" in body["detail"]
