"""vLLM answers a RAG prompt whose documents were published alone: their chunks composed at question time.

One CDN on loopback: a transformers origin (SmolLM2-135M, fp32) publishes three documents with
``"standalone": true`` and nothing else; engine "eb" reads them through an edge with the connector's
``blend`` setting on. Each request names its documents' spans (``kdn.adapters.vllm.blend``); the
reference is KDN's own blend (``kdn.adapters.hf.blend.blend_prefill``) run here on the same weights
through transformers, and vLLM's own prefill of the same prompt.
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import PUBLISH, Cluster, Engine, document, http_json, kv_config, salt, wait_http

QUERY = "Which keeper relit the lamp after the storm?"
SYSTEM = "Answer from the documents below."
DOCS = [document(21, 1200), document(22, 1700), document(23, 1000)]  # 250-400 tokens each
UNPUBLISHED = document(24, 1200)
MODEL = "smollm2-135m"


def publish_standalone(c: Cluster, text: str, name: str) -> dict:
    import time

    job = http_json("POST", f"{c.origins['hf']}/v1/publish",
                    {"name": name, "text": text, "prefix": False, "standalone": True}, PUBLISH)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job = http_json("GET", f"{c.origins['hf']}/v1/jobs/{job.get('job') or job['id']}", token=PUBLISH)
        if job["state"] == "done":
            return job["manifest"]
        assert job["state"] != "failed", job
        time.sleep(0.05)
    raise AssertionError(f"publish of {name} did not finish")


@pytest.fixture(scope="module")
def world(module_tmp):
    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.models import model_folder

    folder = str(model_folder(MODEL, "float32"))
    c = Cluster(module_tmp)
    engines: list[Engine] = []
    try:
        proc, url = c.origin("hf", MODEL, dtype="float32")
        eb = Engine("eb", module_tmp, model=folder, dtype="float32", max_model_len=2048,
                    kv=kv_config(edges=[c.edge_url], blend=True, plan=False, lookup_timeout=5, load_timeout=20))
        engines.append(eb)
        wait_http(proc, url + "/healthz")
        c.edge(url)
        for i, d in enumerate(DOCS):
            publish_standalone(c, d, f"d{i}")
        eb.wait_ready()
        yield {"eb": eb, "lm": load_model(MODEL, dtype="float32")}
    finally:
        for e in engines:
            e.close()
        c.stop()


def reference(lm, ids: list[int], spans, published: set[int], ratio: float, n_tokens: int, end: int):
    """KDN's own blend of the same prompt through transformers: the first ``n_tokens`` greedy tokens after
    blending ``[0, end)`` (as the connector writes it) and computing ``[end, len(ids))`` on top."""
    from kdn.adapters.hf.blend import Segment, blend_cache, blend_prefill
    from kdn.adapters.hf.extract import standalone_chunk
    from kdn.format.address import chunk_spans

    segs, pos = [], 0
    for j, (s, e) in enumerate(spans):
        if s > pos:
            segs.append(Segment(ids[pos:s]))
        for a, b in chunk_spans(e - s, 256):
            toks = ids[s + a:s + b]
            segs.append(Segment(toks, standalone_chunk(lm.model, toks).tensors if j in published else None))
        pos = e
    segs.append(Segment(ids[pos:]))
    with torch.inference_mode():
        b = blend_prefill(lm.model, segs, recompute_ratio=ratio, n_logits=1)
        b.keys = [k[:, :, :end] for k in b.keys]
        b.values = [v[:, :, :end] for v in b.values]
        b.n_tokens = end
        cache = blend_cache(lm.model, b)
        out = lm.model(torch.tensor([ids[end:]]), past_key_values=cache, use_cache=True)
        logp = out.logits[0, -1].float().log_softmax(-1)
        toks, lps = [int(logp.argmax())], [float(logp.max())]
        cache = out.past_key_values
        for _ in range(n_tokens - 1):
            out = lm.model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
            logp = out.logits[0, -1].float().log_softmax(-1)
            toks.append(int(logp.argmax()))
            lps.append(float(logp.max()))
            cache = out.past_key_values
    return toks, lps


def prompt(lm, docs):
    from kdn.adapters.vllm.blend import rag_prompt

    return rag_prompt(lm.tokenizer, QUERY, docs, system=SYSTEM)


def blend_totals(eb) -> dict:
    return eb.stats()["totals"].get("blend", {})


def test_a_rag_prompt_blends_its_documents_as_kdns_own_blend_does(world):
    from kdn.adapters.vllm.blend import blend_params

    eb, lm = world["eb"], world["lm"]
    ids, spans = prompt(lm, [DOCS[2], DOCS[0], DOCS[1]])  # an order no publisher knew
    end = (len(ids) - 1) // 128 * 128
    plain = eb.generate([ids], salt=salt(), load=False, max_tokens=8)[0]
    before = blend_totals(eb)
    kdn, s = blend_params(spans, ratio=0.15)
    got = eb.generate([ids], salt=s + salt(), kdn=[kdn], max_tokens=8)[0]
    after = blend_totals(eb)
    assert got["cached"] == end, "vLLM took the blend's tokens as loaded, up to the last whole block"
    assert after.get("written", 0) - before.get("written", 0) == end
    assert after["reused"] - before.get("reused", 0) == sum(e - s_ for s_, e in spans)  # every document's tokens
    recomputed = after.get("recomputed", 0) - before.get("recomputed", 0)
    assert 0 < recomputed < after["reused"] - before.get("reused", 0)
    toks, lps = reference(lm, ids, spans, {0, 1, 2}, 0.15, 8, end)
    assert got["tokens"] == toks, "vLLM's blend answers as KDN's own blend of the same prompt"
    assert got["logprobs"] == pytest.approx(lps, abs=2e-3)
    assert got["logprobs"] != plain["logprobs"]  # (it did not just prefill)


def test_with_the_last_layer_as_check_layer_the_blend_is_vllms_own_prefill(world):
    """Every token runs every layer below the check layer and the check layer's K/V: with the last layer as
    the check layer the blended cache is the true one, made by KDN's driver through vLLM's own modules."""
    from kdn.adapters.vllm.blend import blend_params

    eb, lm = world["eb"], world["lm"]
    ids, spans = prompt(lm, [DOCS[1], DOCS[2]])
    plain = eb.generate([ids], salt=salt(), load=False, max_tokens=8)[0]
    kdn, s = blend_params(spans, ratio=0.15, check_layer=lm.model.config.num_hidden_layers - 1)
    got = eb.generate([ids], salt=s + salt(), kdn=[kdn], max_tokens=8)[0]
    assert got["cached"] == (len(ids) - 1) // 128 * 128
    assert got["tokens"] == plain["tokens"] and got["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-4)


def test_ratio_one_is_vllms_own_prefill_bit_for_bit(world):
    from kdn.adapters.vllm.blend import blend_params

    eb, lm = world["eb"], world["lm"]
    ids, spans = prompt(lm, DOCS)
    plain = eb.generate([ids], salt=salt(), load=False, max_tokens=8)[0]
    kdn, s = blend_params(spans, ratio=1.0)
    before = blend_totals(eb)
    got = eb.generate([ids], salt=s + salt(), kdn=[kdn], max_tokens=8)[0]
    assert got["cached"] == 0 and blend_totals(eb) == before
    assert got["tokens"] == plain["tokens"] and got["logprobs"] == plain["logprobs"]


def test_a_document_the_kdn_lacks_is_computed_fresh_in_the_blend(world):
    from kdn.adapters.vllm.blend import blend_params

    eb, lm = world["eb"], world["lm"]
    ids, spans = prompt(lm, [DOCS[1], UNPUBLISHED])
    end = (len(ids) - 1) // 128 * 128
    kdn, s = blend_params(spans, ratio=0.15)
    before = blend_totals(eb)
    got = eb.generate([ids], salt=s + salt(), kdn=[kdn], max_tokens=8)[0]
    after = blend_totals(eb)
    assert got["cached"] == end
    assert after["reused"] - before.get("reused", 0) == spans[0][1] - spans[0][0]  # the published one only
    toks, lps = reference(lm, ids, spans, {0}, 0.15, 8, end)
    assert got["tokens"] == toks and got["logprobs"] == pytest.approx(lps, abs=2e-3)


def test_a_blend_vllm_partly_cached_reads_that_part_back_and_blends_the_rest(world):
    """With the last layer as check layer a blend's cache is the true one (test above), so a blend whose first
    blocks vLLM's prefix cache holds must answer as vLLM's own prefill too: the part read back is used as is."""
    from kdn.adapters.vllm.blend import blend_params

    eb, lm = world["eb"], world["lm"]
    last = lm.model.config.num_hidden_layers - 1
    ids1, spans1 = prompt(lm, [DOCS[0], DOCS[1]])
    kdn1, s = blend_params(spans1, check_layer=last)
    mine = s + salt()
    eb.generate([ids1], salt=mine, kdn=[kdn1], max_tokens=1)
    # The same head and first document, then another: vLLM's prefix cache holds the first blocks.
    ids2, spans2 = prompt(lm, [DOCS[0], DOCS[2]])
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b) // 128 * 128
    end = (len(ids2) - 1) // 128 * 128
    plain = eb.generate([ids2], salt=salt(), load=False, max_tokens=8)[0]
    before = blend_totals(eb)
    got = eb.generate([ids2], salt=mine, kdn=[blend_params(spans2, check_layer=last)[0]], max_tokens=8)[0]
    after = blend_totals(eb)
    assert shared >= 128 and got["cached"] == end
    assert after["written"] - before["written"] == end - shared, "only what vLLM's cache lacked is written"
    assert got["tokens"] == plain["tokens"] and got["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-4)


def test_a_blend_without_its_salt_or_with_bad_spans_runs_unblended(world):
    from kdn.adapters.vllm.blend import blend_params

    eb, lm = world["eb"], world["lm"]
    ids, spans = prompt(lm, DOCS[:2])
    plain = eb.generate([ids], salt=salt(), load=False, max_tokens=4)[0]
    kdn, _ = blend_params(spans)
    bad = {"blend": {"documents": [[5, 2]]}}
    refused = eb.stats()["blend_refused"]
    outs = [eb.generate([ids], salt=salt(), kdn=[kdn], max_tokens=4)[0],  # no blend salt
            eb.generate([ids], salt=salt() + "-" + blend_params(spans)[1], kdn=[bad], max_tokens=4)[0]]
    assert eb.stats()["blend_refused"] == refused + 2
    for o in outs:
        assert o["cached"] == 0 and o["tokens"] == plain["tokens"] and o["logprobs"] == plain["logprobs"]
