"""Reuse across fine-tunes (adapters/hf/variants.py): the signed base relation, the layer plan measured on a
(base, variant) pair, and a variant loading its base's published chunks through a real client from a stand-in
edge on loopback. Tiny llama models from a config (random init, no download); the variant is the base with the
attention projections of its first two layers perturbed."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from aiohttp.test_utils import TestServer

from kdn.adapters.hf import ByteTokenizer, continue_from_cache, extract_chunks, prefill
from kdn.adapters.hf.cache import build_cache
from kdn.adapters.hf.extract import new_cache
from kdn.adapters.hf.generate import Generation, model_id
from kdn.adapters.hf.variants import (VariantGeneration, agenerate_variant, hidden_entering, measure_groups,
                                      measure_pair, pick_depth, recompute_group, recompute_layers, relation_for)
from kdn.client import KDNClient
from kdn.errors import InvalidInput, ModelMismatch
from kdn.registry import EmbeddedRegistry, find_relation
from kdn.registry.records import BaseRelation
from kdn.registry.signing import SignatureError, Signer, Verifier

import stand_in_edge  # tests/adapters/stand_in_edge.py

C = 64  # chunk tokens
LAYERS = 4
PERTURBED = (0, 1)


def tiny(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=LAYERS, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def perturbed(base, layers=PERTURBED, scale: float = 0.1):
    """The base with noise added to the Q/K/V/O projections of ``layers``: a variant that differs there only."""
    v = copy.deepcopy(base)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i in layers:
            a = v.model.layers[i].self_attn
            for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return v


def toks(seed: int, n: int) -> list[int]:
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_PAIR: list = []


def pair():
    if not _PAIR:
        base = tiny()
        _PAIR.append((base, perturbed(base), ByteTokenizer()))
    return _PAIR[0]


SAMPLES = [(toks(10 + i, 160), toks(20 + i, 24)) for i in range(2)]


# --- the layer plan ---------------------------------------------------------------------------------------------


def test_the_plan_recomputes_the_perturbed_layers():
    base, var, _ = pair()
    m = measure_pair(base, var, SAMPLES)
    assert m.layers == LAYERS and m.samples == 2 and m.tokens == 320
    # the variant's own K/V in every layer is the variant: nothing lost
    assert m.kl[LAYERS] == 0 and m.dnll[LAYERS] == 0 and m.nll[LAYERS] == m.nll_own
    # every layer's K/V differ (the perturbed ones', and the later ones' through what enters them), but the
    # base's K/V hurt in the perturbed layers: that is where the quality goes (KV distance alone does not say it)
    assert all(d > 0.5 for d in m.div_k)
    assert min(m.swap_kl[i] for i in PERTURBED) > 10 * max(m.swap_kl[i] for i in range(2, LAYERS))
    # recomputing the perturbed layers leaves only their drift into the later ones
    assert m.kl[2] < m.kl[1] / 10 and m.kl[1] < m.kl[0]
    budget = 1e-3  # nats a token
    assert m.kl[2] < budget < m.kl[1]
    assert pick_depth(m, budget, "kl") == 2
    assert pick_depth(m, 0.0, "kl") == LAYERS or m.kl[LAYERS - 1] == 0
    assert pick_depth(m, float("inf"), "nll%") == 0
    rel = relation_for(m, "a" * 64, "b" * 64, budget, "kl", name="tiny+noise")
    assert rel.recompute == [0, 1] and rel.depth == 2 and rel.measured["kl"] == round(m.kl[2], 6)
    with pytest.raises(InvalidInput):
        pick_depth(m, 1.0, "bleu")


def test_a_variant_equal_to_its_base_takes_every_layer_from_it():
    base, _, _ = pair()
    m = measure_pair(base, copy.deepcopy(base), SAMPLES[:1])
    assert m.kl == [0.0] * (LAYERS + 1) and m.div_k == [0.0] * LAYERS
    assert pick_depth(m, 0.0, "kl") == 0


def test_recompute_layers_stops_before_layer_k_with_the_full_forwards_states():
    _, var, _ = pair()
    ids = SAMPLES[0][0]
    full = prefill(var, ids, chunk_tokens=None)
    got = recompute_layers(var, ids, 2)
    assert len(got) == 2
    for i, (k, v) in enumerate(got):
        assert torch.equal(k, full.layers[i].keys) and torch.equal(v, full.layers[i].values)
    assert recompute_layers(var, ids, 0) == []
    with pytest.raises(InvalidInput):
        recompute_layers(var, ids, LAYERS + 1)


def test_droidspeak_groups_run_from_the_hidden_states_entering_them():
    base, var, _ = pair()
    ids = SAMPLES[0][0]
    with torch.inference_mode():
        hs = var(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert torch.allclose(hidden_entering(var, ids, 2), hs[2], atol=1e-6, rtol=0)
    # a group run from the model's own hidden states is its own K/V
    own = recompute_layers(var, ids, LAYERS)
    for (k, v), (k2, v2) in zip(recompute_group(var, ids, 1, 3, hidden_entering(var, ids, 1)), own[1:3]):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(InvalidInput):
        recompute_group(var, ids, 2, 2, hs[2])
    # only attention moved: the base's embeddings are the variant's, so group [0, 2) is the first-2 plan, and
    # group [0, L) the variant itself; recomputing the untouched layers instead leaves the damage in place
    m = measure_pair(base, var, SAMPLES)
    g = measure_groups(base, var, SAMPLES, [(0, 2), (2, 4), (0, LAYERS)])
    assert g[(0, 2)][1] == pytest.approx(m.kl[2], rel=1e-9) and g[(0, LAYERS)] == (0.0, 0.0)
    assert g[(2, 4)][1] > 10 * g[(0, 2)][1]


# --- the signed relation ---# --- the signed relation ----------------------------------------------------------------------------------------


def relation(**kw) -> BaseRelation:
    d = dict(variant="a" * 64, base="b" * 64, layers=LAYERS, recompute=[0, 1], metric="kl", budget=0.01,
             measured={"kl": 0.001, "samples": 2}, name="tiny")
    d.update(kw)
    return BaseRelation(**d)


def test_a_relation_verifies_only_as_signed(tmp_path):
    signer = Signer.generate(tmp_path / "pub.key")
    other = Signer.generate(tmp_path / "other.key")
    trusted = Verifier([signer.public])
    rel = signer.sign(relation())
    assert trusted.check(BaseRelation.unpack(rel.pack())) == rel  # survives its wire form
    with pytest.raises(SignatureError, match="unsigned"):
        trusted.check(relation())
    with pytest.raises(SignatureError, match="untrusted"):
        trusted.check(other.sign(relation()))
    for forged in (dict(recompute=[0]), dict(base="c" * 64), dict(budget=1.0), dict(layers=8),
                   dict(measured={"kl": 0.0, "samples": 2}), dict(variant="d" * 64), dict(metric="nll%")):
        with pytest.raises(SignatureError, match="does not match"):
            trusted.check(dataclasses.replace(rel, **forged))


@pytest.mark.parametrize("bad", [dict(variant="b" * 64), dict(variant="xyz"), dict(layers=0),
                                 dict(recompute=[1, 0]), dict(recompute=[0, 0]), dict(recompute=[LAYERS]),
                                 dict(recompute=[-1]), dict(metric="bleu"), dict(budget=-1.0),
                                 dict(budget=float("nan")), dict(measured={"x": float("inf")}),
                                 dict(measured={"x": "y" * 5000}), dict(name="n" * 200), dict(recompute="01")])
def test_a_malformed_relation_is_refused_where_it_is_read(bad):
    with pytest.raises(InvalidInput):
        relation(**bad)
    d = relation().to_dict()
    d.update(bad)
    with pytest.raises(InvalidInput):
        BaseRelation.from_dict(d)


def test_a_relation_names_its_plan_depth():
    assert relation(recompute=[0, 1, 2]).depth == 3 and relation(recompute=[]).depth == 0
    assert relation(recompute=[1, 2]).depth is None


# --- the load path, through a client ------------------------------------------------------------------------------


def published(model, tok, ids):
    """The objects and records an origin of ``model`` would publish for ``ids`` (chunks of C)."""
    return stand_in_edge.published(model, model_id(model, tok), ids, C)


async def edge(addrs, blobs, records) -> TestServer:
    return await stand_in_edge.serve(addrs, blobs, records)


DOC = toks(30, 3 * C)  # three whole chunks, published by the base
QUESTION = toks(31, 9)


@pytest.fixture
async def world(tmp_path):
    base, var, tok = pair()
    server = await edge(*published(base, tok, DOC))
    signer = Signer.generate(tmp_path / "pub.key")
    rel = signer.sign(relation(variant=model_id(var, tok), base=model_id(base, tok)))
    try:
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")]) as client:
            yield dict(base=base, var=var, tok=tok, server=server, client=client, signer=signer, rel=rel,
                       trusted=Verifier([signer.public]))
    finally:
        await server.close()


def expected(w, k: int) -> torch.Tensor:
    """The first logits of the variant reading DOC with the base's chunked K/V in layers [k, L), its own in [0, k)."""
    chunks = [c.tensors for c in extract_chunks(w["base"], DOC, chunk_tokens=C)]
    cache, n = build_cache(w["var"], chunks)
    for i, (kk, vv) in enumerate(recompute_layers(w["var"], DOC, k)):
        cache.layers[i].keys, cache.layers[i].values = kk, vv
    return continue_from_cache(w["var"], cache, n, QUESTION, last=1)[-1].float()


async def test_an_opted_in_variant_loads_the_base_and_recomputes_its_plans_layers(world):
    w = world
    out = await agenerate_variant(w["var"], w["tok"], DOC + QUESTION, w["client"], accept_base=w["rel"],
                                  trusted=w["trusted"], chunk_tokens=C, max_new_tokens=3)
    assert isinstance(out, VariantGeneration)
    r = out.report
    assert (r.tokens_from_base, r.layers_recomputed, r.layers, r.chunks_loaded) == (len(DOC), 2, LAYERS, 3)
    assert r.sources == {"edge:0/memory": 3} and len(out.ids) == 3 == r.new_tokens and r.ttft_ms > 0 and r.line()
    assert w["server"].seen.count("object") == 3
    assert torch.equal(out.first_logits, expected(w, 2))
    # closer to the variant's own reading than taking every layer from the base
    own = continue_from_cache(w["var"], new_cache(w["var"]), 0, DOC + QUESTION, last=1)[-1]
    assert (out.first_logits - own).abs().max() < (expected(w, 0) - own).abs().max()


async def test_a_relation_found_in_the_registry_is_loaded_only_once_passed_on(world, tmp_path):
    """Publisher: put the signed relation in the registry. Consumer: find it under its trusted keys, then opt in."""
    w = world
    async with EmbeddedRegistry(tmp_path / "registry.sqlite3") as reg:
        await reg.put_relation(w["rel"])
        assert await find_relation(reg, w["rel"].variant, Verifier([Signer.generate(tmp_path / "o.key").public])) is None
        found = await find_relation(reg, w["rel"].variant, w["trusted"])
    assert found == w["rel"]
    out = await agenerate_variant(w["var"], w["tok"], DOC + QUESTION, w["client"], chunk_tokens=C, max_new_tokens=1)
    assert "object" not in w["server"].seen  # found is not accepted: without accept_base, no base state
    out = await agenerate_variant(w["var"], w["tok"], DOC + QUESTION, w["client"], accept_base=found,
                                  trusted=w["trusted"], chunk_tokens=C, max_new_tokens=1)
    assert (out.report.tokens_from_base, out.report.layers_recomputed) == (len(DOC), 2)
    assert torch.equal(out.first_logits, expected(w, 2))


async def test_a_plan_of_every_layer_uses_no_base_state_and_is_the_variants_own_prefill(world):
    w = world
    rel = w["signer"].sign(dataclasses.replace(w["rel"], recompute=list(range(LAYERS)), sig={}))
    out = await agenerate_variant(w["var"], w["tok"], DOC + QUESTION, w["client"], accept_base=rel,
                                  trusted=w["trusted"], chunk_tokens=C, max_new_tokens=1)
    assert out.report.tokens_from_base == 0 and "object" not in w["server"].seen
    ref = continue_from_cache(w["var"], prefill(w["var"], DOC, chunk_tokens=None), len(DOC), QUESTION, last=1)
    assert torch.equal(out.first_logits, ref[-1].float())
    one_shot = continue_from_cache(w["var"], new_cache(w["var"]), 0, DOC + QUESTION, last=1)[-1].float()
    assert torch.allclose(out.first_logits, one_shot, atol=1e-5, rtol=1e-4)


async def test_without_opt_in_no_base_state_is_used(world):
    w = world
    out = await agenerate_variant(w["var"], w["tok"], DOC + QUESTION, w["client"], chunk_tokens=C, max_new_tokens=1)
    assert isinstance(out, Generation) and out.report.tokens_reused == 0
    assert "object" not in w["server"].seen  # looked up under its own model id: the base's chunks never match
    own = continue_from_cache(w["var"], new_cache(w["var"]), 0, DOC + QUESTION, last=1)[-1].float()
    assert torch.equal(out.first_logits, own)


async def test_a_forged_unsigned_or_foreign_relation_is_refused_before_any_lookup(world, tmp_path):
    w = world

    async def go(rel, trusted=w["trusted"]):
        return await agenerate_variant(w["var"], w["tok"], DOC + QUESTION, w["client"], accept_base=rel,
                                       trusted=trusted, chunk_tokens=C, max_new_tokens=1)

    with pytest.raises(SignatureError):  # a plan changed after signing
        await go(dataclasses.replace(w["rel"], recompute=[0]))
    with pytest.raises(SignatureError):  # unsigned
        await go(dataclasses.replace(w["rel"], sig={}))
    with pytest.raises(SignatureError):  # signed by a key nobody here trusts
        await go(Signer.generate(tmp_path / "x.key").sign(dataclasses.replace(w["rel"], sig={})))
    with pytest.raises(InvalidInput, match="trusted"):  # no keys at all: never taken on its word
        await go(w["rel"], trusted=None)
    with pytest.raises(ModelMismatch):  # signed, but for another variant of the base
        await go(w["signer"].sign(dataclasses.replace(w["rel"], variant="e" * 64, sig={})))
    with pytest.raises(ModelMismatch):  # a plan for another layer count
        await go(w["signer"].sign(dataclasses.replace(w["rel"], layers=8, recompute=[0, 1], sig={})))
    with pytest.raises(InvalidInput, match="hidden states"):  # a group further in: not runnable here
        await go(w["signer"].sign(dataclasses.replace(w["rel"], recompute=[1, 2], sig={})))
    with pytest.raises(InvalidInput):
        await go({"variant": w["rel"].variant})
    assert w["server"].seen == []
