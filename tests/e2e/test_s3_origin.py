"""An origin whose store is an S3 bucket (a real SeaweedFS on loopback), end to end.

It publishes into the bucket, an edge fills from it and a client loads the prefix exactly; a second
origin process started on the same bucket (another machine, say, or the first one restarted on a new
disk) indexes it from the blobs' info objects and serves the same bytes without recomputing.
"""

from __future__ import annotations

import os
import sys

import obstore as obs
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, get, metric, publish  # noqa: E402

from kdn.adapters.hf import agenerate, load_model  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.origin.s3store import S3ObjectStore  # noqa: E402

TEXT = ("The ferry left at dawn with salt, letters and two goats for the island school. " * 12)[:600]


async def test_an_origin_on_s3_publishes_serves_and_a_second_origin_reuses_the_bucket(tmp_path, etcd_url,
                                                                                      s3_store_url):
    lm = load_model("tiny-llama")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"store": s3_store_url}) as c:
        m = await publish(c, TEXT)
        ids = m["prefix_tokens"] + [5, 6]
        async with KDNClient(edges=[c.edge_url("e1")]) as client:
            out = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1)
        status, first, _ = await get(c.origin_url(), m["addresses"][0], encoding="zstd")
        assert status == 200
        bucket = S3ObjectStore(s3_store_url)
        keys = [o["path"] for batch in obs.list(bucket._s3) for o in batch]
        for a in m["addresses"]:  # every object, in both encodings, with its info beside it
            for enc in ("zstd", "raw"):
                assert f"{a[:2]}/{a[2:4]}/{a}.{enc}" in keys and f"{a[:2]}/{a[2:4]}/{a}.{enc}.meta" in keys

        await c.origin.close()  # the first origin goes; a second one starts on the same bucket
        await c.start_origin(store=s3_store_url)
        status, again, _ = await get(c.origin_url(), m["addresses"][0], encoding="zstd")
        assert status == 200 and again == first
        m2 = await publish(c, TEXT)  # the same text again: found in the bucket, nothing recomputed
        assert m2["addresses"] == m["addresses"]
        assert metric(c.origin, "kdn_origin_chunks_computed") == 0
        assert metric(c.origin, "kdn_origin_chunks_reused") >= len(m["addresses"])
    plain = await agenerate(lm.model, lm.tokenizer, ids, None, max_new_tokens=1, use_cache=False)
    assert out.report.tokens_reused == 600
    torch.testing.assert_close(out.first_logits, plain.first_logits)
