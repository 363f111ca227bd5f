"""Non-prefix reuse end to end: standalone chunks published through a real origin, served by an edge,
composed by ``generate_rag`` in a different order than they were published, blended, generated."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, publish  # noqa: E402

from kdn.format import address as A  # noqa: E402
from kdn.adapters.hf import generate_rag, load_model  # noqa: E402
from kdn.adapters.hf.rag import full_prefill, rag_frame  # noqa: E402
from kdn.client import KDNClient  # noqa: E402

DOCS = [
    "The keeper's log for the night of the storm records wind from the north-east and two ships sighted. " * 3,
    "Harbor & Finch reimburse mileage at $0.62 per mile when staff use their own car on company business. " * 2,
    "A first-order Fresnel lens has a focal distance of 920 millimeters and stands taller than a person. " * 4,
]
QUERY = "What is the mileage rate?"


async def publish_standalone(c, text: str, name: str) -> dict:
    return await publish(c, text, name, standalone=True, prefix=False)


async def test_generate_rag_fetches_every_chunk_and_ratio_one_is_exact(tmp_path, etcd_url):
    lm = load_model("tiny-llama")
    async with cluster(tmp_path, etcd_url, edges=("e1",), model="tiny-llama") as c:
        published = [await publish_standalone(c, d, f"doc{i}") for i, d in enumerate(DOCS)]
        n_chunks = sum(len(m["standalone"]) for m in published)
        assert n_chunks > len(DOCS)  # documents over 256 tokens span several standalone chunks
        docs = [DOCS[2], DOCS[0], DOCS[1]]  # composed in another order than published
        async with KDNClient(edges=[("e1", c.edge_url("e1"))]) as client:
            out = await generate_rag(lm.model, lm.tokenizer, QUERY, docs, client, recompute_ratio=1.0,
                                     system="Answer from the documents.", max_new_tokens=4)
            part = await generate_rag(lm.model, lm.tokenizer, QUERY, docs, client, recompute_ratio=0.15,
                                      max_new_tokens=2)
        r = out.report
        assert r.chunks_fetched == n_chunks and r.chunks_computed == 0 and not r.missing, r.line()
        assert sum(r.encodings.values()) == n_chunks and set(r.encodings) <= {"zstd", "raw"}, r.encodings
        assert set(r.sources) == {"edge:e1/origin"}, r.sources
        assert r.tokens_reused == sum(len(lm.tokenizer.encode(d)) for d in DOCS)
        assert r.tokens_recomputed == r.tokens_reused and r.ttft_ms > 0 and r.new_tokens == 4

        # ratio 1.0: the first-token logits are the full-prefill routine's, bit for bit
        head, tail = rag_frame(lm.tokenizer, QUERY, "Answer from the documents.")
        ids = lm.tokenizer.encode(head) + [t for d in docs for t in lm.tokenizer.encode(d)] + lm.tokenizer.encode(tail)
        assert r.tokens_total == len(ids)
        ref = full_prefill(lm.model, ids)
        assert torch.equal(out.first_logits, ref.logits[-1].float())

        p = part.report
        assert p.chunks_fetched == n_chunks and p.tokens_recomputed == round(0.15 * p.tokens_reused), p.line()


async def test_missing_chunk_is_computed_locally_and_reported(tmp_path, etcd_url):
    lm = load_model("tiny-llama")
    async with cluster(tmp_path, etcd_url, edges=("e1",), model="tiny-llama") as c:
        await publish_standalone(c, DOCS[0], "only")
        async with KDNClient(edges=[c.edge_url("e1")]) as client:
            out = await generate_rag(lm.model, lm.tokenizer, QUERY, [DOCS[0], DOCS[1]], client, recompute_ratio=1.0,
                                     max_new_tokens=1)
        r = out.report
        unpublished = A.standalone_addresses(lm.model_id, "public", lm.tokenizer.encode(DOCS[1]))
        assert r.missing == unpublished and r.chunks_computed == len(unpublished), r.line()
        assert r.chunks_fetched == len(A.standalone_addresses(lm.model_id, "public", lm.tokenizer.encode(DOCS[0])))
        # a local recompute is the same standalone chunk: the answer does not change
        local = await generate_rag(lm.model, lm.tokenizer, QUERY, [DOCS[0], DOCS[1]], None, recompute_ratio=1.0,
                                   max_new_tokens=1)
        assert local.report.chunks_computed == r.chunks_fetched + r.chunks_computed
        assert torch.equal(local.first_logits, out.first_logits)
