"""Exact reuse end to end: origin -> edge -> client over HTTP with real etcd, then generation.

The contract (bit for bit, CPU, same dtype): the logits after loading a cached
prefix equal those of the model continuing from its own cache after prefilling
the same prefix with the same chunking. (Against a one-shot prefill they agree
only within float tolerance: chunked and one-shot prefill round differently.)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import EDGE_TOKEN, TENANT_A, TENANT_B, cluster, publish  # noqa: E402
from jobs import publish_and_wait  # noqa: E402

from kdn.adapters.hf import agenerate, continue_from_cache, load_model, prefill, prompt_tokens  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.errors import ModelMismatch  # noqa: E402

DOC = ("The keeper's log for the night of the storm records wind from the north-east, "
       "two ships sighted, and the lamp relit twice after the glass cracked. ") * 12


def reference_logits(model, ids: list[int], n: int) -> torch.Tensor:
    """The model's own path: prefill ids[:n] in chunks of 256, then continue with the rest."""
    cache = prefill(model, ids[:n], chunk_tokens=256)
    return continue_from_cache(model, cache, n, ids[n:], last=1)[-1].float()  # as agenerate computes it


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-bamba", "tiny-falconh1"])
async def test_loaded_prefix_gives_bit_identical_logits(tmp_path, etcd_url, model_name):
    lm = load_model(model_name)
    text = DOC[:1100]
    async with cluster(tmp_path, etcd_url, edges=("e1",), model=model_name) as c:
        m = await publish(c, text)
        question = " What did the keeper record?"
        ids = m["prefix_tokens"] + lm.tokenizer.encode(question)
        async with KDNClient(edges=[("e1", c.edge_url("e1"))]) as client:
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4)
        r = gen.report
        # the whole document is reused: 4 full chunks and the 76-token tail, via the parent's tail list
        assert r.tokens_reused == len(m["prefix_tokens"]) == 1100 and r.chunks_reused == 5
        assert set(r.sources) == {"edge:e1/origin"}
        ref = reference_logits(lm.model, ids, r.tokens_reused)
        assert torch.equal(gen.first_logits, ref), "logits after loading differ from the model's own prefill"
        # and a plain run without the cache agrees within float tolerance (one-shot vs chunked rounding)
        async with KDNClient(edges=[c.edge_url("e1")]) as client:
            plain = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4, use_cache=False)
        assert plain.report.tokens_reused == 0
        torch.testing.assert_close(plain.first_logits, gen.first_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-bamba"])
async def test_a_prompt_that_is_all_cached_reuses_all_but_what_the_next_token_needs(tmp_path, etcd_url, model_name):
    """The prompt is the published document itself: attention KV is loaded whole and cut back one
    token (the next token needs the last position's logits); a hybrid's last chunk cannot be cut
    back, so it is not even fetched, and those tokens are prefilled."""
    lm = load_model(model_name)
    async with cluster(tmp_path, etcd_url, edges=("e1",), model=model_name) as c:
        m = await publish(c, DOC[:1100])
        ids = m["prefix_tokens"]
        async with KDNClient(edges=[("e1", c.edge_url("e1"))]) as client:
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=2)
    r = gen.report
    if model_name == "tiny-llama":
        assert (r.tokens_reused, r.chunks_reused) == (1099, 5)
        cache = prefill(lm.model, ids, chunk_tokens=256)
        cache.crop(len(ids) - 1)
        ref = continue_from_cache(lm.model, cache, len(ids) - 1, ids[-1:], last=1)[-1].float()
    else:
        assert (r.tokens_reused, r.chunks_reused) == (1024, 4) and sum(r.sources.values()) == 4
        ref = reference_logits(lm.model, ids, 1024)
    assert torch.equal(gen.first_logits, ref)


async def test_smollm2_document_plus_question_reuses_the_whole_document(tmp_path, etcd_url):
    from pathlib import Path

    lm = load_model("smollm2-135m")
    text = (Path(__file__).resolve().parents[2] / "kdn/data/docs/harbor-policy.md").read_text()[:3000]
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2"), model="smollm2-135m") as c:
        async with __import__("aiohttp").ClientSession(c.origin_url(),
                                                     headers={"Authorization": "Bearer " + "pub-" + "a" * 28}) as s:
            m = await publish_and_wait(s, {"name": "harbor", "text": text, "template": "chat"}, timeout=300)
        async with KDNClient(edges=[("e1", c.edge_url("e1")), ("e2", c.edge_url("e2"))]) as client:
            manifest = await client.manifest("public", "harbor")
            ids = prompt_tokens(lm.tokenizer, manifest, "What is the nightly hotel limit?")
            assert ids[: len(m["prefix_tokens"])] == m["prefix_tokens"]
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=3)
        assert gen.report.tokens_reused == len(m["prefix_tokens"]), gen.report.line()
        assert torch.equal(gen.first_logits, reference_logits(lm.model, ids, gen.report.tokens_reused))


async def test_foreign_model_is_refused(tmp_path, etcd_url):
    lm = load_model("tiny-llama")
    other = load_model("tiny-qwen2")
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, DOC[:600])
        async with KDNClient(edges=[c.edge_url("e1")]) as client:
            with pytest.raises(ModelMismatch):
                await agenerate(other.model, other.tokenizer, m["prefix_tokens"] + [5], client,
                                model_id_=lm.model_id, max_new_tokens=1)
            # without the false claim, the other model finds nothing: addresses include the model id
            gen = await agenerate(other.model, other.tokenizer, m["prefix_tokens"] + [5], client, max_new_tokens=1)
            assert gen.report.tokens_reused == 0


async def test_tenant_namespace_is_bound_to_the_token(tmp_path, etcd_url):
    lm = load_model("tiny-llama")
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, DOC[:700], namespace="acme", token=TENANT_A)
        ids = m["prefix_tokens"] + [7, 8, 9]
        async with KDNClient(edges=[c.edge_url("e1")], token=TENANT_A) as client:
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, namespace="acme", max_new_tokens=1)
        assert gen.report.tokens_reused == 700  # same tenant: reused
        for token in (TENANT_B, None):
            async with KDNClient(edges=[c.edge_url("e1")], token=token) as client:
                # naming acme's namespace does not help: the edge checks the token, not the field
                gen = await agenerate(lm.model, lm.tokenizer, ids, client, namespace="acme", max_new_tokens=1)
            assert gen.report.tokens_reused == 0
        async with KDNClient(edges=[c.edge_url("e1")], token=EDGE_TOKEN) as client:
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, namespace="public", max_new_tokens=1)
        assert gen.report.tokens_reused == 0  # another namespace: another address space
