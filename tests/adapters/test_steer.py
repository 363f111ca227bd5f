"""kdn.adapters.hf.steer: attention steering from an emphasis map, on a tiny random-init model.

What it must do: nothing at all when off or at alpha = 1 (bit-identical logits, also once the model's
attention is wrapped); move the steered heads' attention toward the emphasized spans and leave other
heads' and other layers' alone; act the same on KV loaded from chunks, on a plain prefill and in a blend.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kdn.adapters.hf import build_cache, extract_chunks, load_model
from kdn.adapters.hf.extract import _forward, new_cache
from kdn.adapters.hf.generate import _steer_plan
from kdn.adapters.hf.rag import Segment, blend_prefill
from kdn.adapters.hf.steer import Steer, attention_to, head_scores, plan, steering
from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput, ModelMismatch

C = 32
DOC = 96  # document tokens (positions 0..95), then a 12-token question
SPANS = ((40, 48),)


@functools.cache
def tiny(spec: str = "tiny-llama"):
    return load_model(spec, dtype=torch.float32).model


def ids(n: int = DOC + 12, seed: int = 3) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def emap(**kw) -> EmphasisMap:
    base = dict(spans=SPANS, region=(0, DOC), alpha=0.01, heads=((1, 0), (1, 2)))
    return EmphasisMap(**{**base, **kw})


def logits(model, x: list[int], st: Steer | None = None) -> torch.Tensor:
    with torch.inference_mode(), steering(model, st):
        return _forward(model, new_cache(model), torch.tensor(x), 0, logits=True).logits[0]


def test_alpha_one_or_no_map_is_no_plan_and_changes_nothing():
    model = tiny()
    x = ids()
    before = logits(model, x)
    assert plan(model, emap(alpha=1.0)) is None and plan(model, None) is None
    assert plan(model, emap(spans=())) is None
    assert plan(model, emap(), alpha=1.0) is None
    st = plan(model, emap())  # installs the wrapper on first use ...
    with steering(model, st):
        pass
    assert model.config._attn_implementation.startswith("kdn_steer_")
    assert torch.equal(logits(model, x), before)  # ... which is inert without a plan: bit-identical
    assert torch.equal(logits(model, x, None), before)


def test_a_zero_bias_plan_matches_the_unsteered_model():
    """The steered path itself (a float mask with a zero bias) computes what the plain path does."""
    model = tiny()
    x = ids()
    st = plan(model, emap())
    assert st is not None
    zero = Steer(st.heads, torch.zeros_like(st.key_bias), st.query_from, 1.0)
    torch.testing.assert_close(logits(model, x, zero), logits(model, x), rtol=1e-5, atol=1e-5)


def test_steering_moves_attention_to_the_spans_in_steered_heads_only():
    model = tiny()
    x = ids()
    st = plan(model, emap())
    pos = [i for s, e in SPANS for i in range(s, e)]
    with torch.inference_mode(), attention_to(model, last_rows=4) as off:
        _forward(model, new_cache(model), torch.tensor(x), 0, logits=False)
    off = dict(off)
    with torch.inference_mode(), steering(model, st), attention_to(model, last_rows=4) as on:
        _forward(model, new_cache(model), torch.tensor(x), 0, logits=False)
    s_off, s_on = head_scores(off, pos), head_scores(on, pos)  # [layers, heads]
    for la, h in [(1, 0), (1, 2)]:
        assert s_on[la, h] > 0.3 and s_on[la, h] > 4 * s_off[la, h], (la, h, s_off[la, h], s_on[la, h])
    # Layer 0 runs before any steered layer: untouched; unsteered heads of layer 1 see the same inputs.
    torch.testing.assert_close(s_on[0], s_off[0])
    torch.testing.assert_close(s_on[1, [1, 3]], s_off[1, [1, 3]])
    # Only the queries after the document are steered: the document's own rows are not.
    st_late = plan(model, emap(), query_from=len(x))
    assert torch.equal(logits(model, x, st_late)[:-1], logits(model, x)[:-1])


def test_steering_on_loaded_kv_equals_steering_on_a_prefill():
    """Only the new queries change, so loading the document's KV from chunks and steering the question
    gives what a chunked prefill of everything with the same plan gives -- bit for bit."""
    model = tiny()
    x = ids()
    st = plan(model, emap())
    chunks = [c.tensors for c in extract_chunks(model, x[:DOC], chunk_tokens=C)]
    with torch.inference_mode(), steering(model, st):
        cache, n = build_cache(model, chunks)
        loaded = _forward(model, cache, torch.tensor(x[n:]), n, logits=True).logits[0]
        own = new_cache(model)
        for s in range(0, DOC, C):
            _forward(model, own, torch.tensor(x[s:s + C]), s, logits=False)
        computed = _forward(model, own, torch.tensor(x[DOC:]), DOC, logits=True).logits[0]
    assert torch.equal(loaded, computed)
    assert not torch.allclose(loaded, logits(model, x)[DOC:], atol=1e-3)  # and steering did change them


def test_blend_takes_the_same_plan():
    """blend_prefill at recompute ratio 1 runs every token: with a plan, it matches the steered model."""
    model = tiny()
    x = ids()
    st = plan(model, emap())
    b = blend_prefill(model, [Segment(x)], recompute_ratio=1.0, n_logits=12, steer=st)
    torch.testing.assert_close(b.logits, logits(model, x, st)[-12:], rtol=1e-4, atol=1e-4)
    plain = blend_prefill(model, [Segment(x)], recompute_ratio=1.0, n_logits=12)
    assert not torch.allclose(b.logits, plain.logits, atol=1e-3)


def test_a_partial_blend_recomputes_what_the_steered_question_reads():
    """deviation-query weighs tokens by the question's attention at the check layer as the steered model
    pays it: with the check layer's heads steered to a span, more of the span is recomputed."""
    from kdn.adapters.hf import standalone_chunk

    model = tiny()
    x = ids()
    segs = [Segment(x[:48], standalone_chunk(model, x[:48]).tensors),
            Segment(x[48:DOC], standalone_chunk(model, x[48:DOC]).tensors), Segment(x[DOC:])]
    # A span in the second chunk: the first sits at its own positions with nothing before it, so its
    # composed states are exact (no deviation, nothing to recompute there, steered or not).
    st = plan(model, emap(spans=((60, 68),)))  # heads (1, 0) and (1, 2): layer 1 is the check layer

    def in_span(b) -> int:
        return sum(60 <= t < 68 for t in b.recomputed.tolist())

    plain = blend_prefill(model, segs, recompute_ratio=0.1, n_logits=12)
    steered = blend_prefill(model, segs, recompute_ratio=0.1, n_logits=12, steer=st)
    assert plain.recomputed.numel() == steered.recomputed.numel()
    assert in_span(steered) > in_span(plain)
    kv = blend_prefill(model, segs, recompute_ratio=0.1, n_logits=12, steer=st, selection="deviation-kv")
    assert torch.equal(kv.recomputed, blend_prefill(model, segs, recompute_ratio=0.1, n_logits=12,
                                                     selection="deviation-kv").recomputed)  # no question weight


def test_shifted_plan_steers_the_same_tokens_later():
    model = tiny()
    st = plan(model, emap())
    moved = st.shifted(5)
    assert moved.query_from == st.query_from + 5
    assert torch.equal(moved.key_bias[5:], st.key_bias) and not moved.key_bias[:5].any()


def test_off_by_default_on_per_request_or_per_manifest():
    model = tiny()
    m = emap().to_dict()
    assert _steer_plan(model, m, None, None, None, DOC + 12) is None  # default: off
    assert _steer_plan(model, m, True, None, None, DOC + 12) is not None  # per request
    on = {**m, "default_on": True}
    assert _steer_plan(model, on, None, None, None, DOC + 12) is not None  # per manifest
    assert _steer_plan(model, on, False, None, None, DOC + 12) is None  # the request wins
    with pytest.raises(InvalidInput, match="needs the manifest"):
        _steer_plan(model, None, True, None, None, DOC + 12)
    with pytest.raises(InvalidInput, match="covers"):
        _steer_plan(model, m, True, None, None, DOC - 1)


def test_heads_that_the_model_lacks_are_refused():
    model = tiny()
    with pytest.raises(ModelMismatch, match="not in this model"):
        plan(model, emap(heads=((99, 0),)))
    with pytest.raises(InvalidInput, match="alpha"):
        plan(model, emap(), alpha=0.0)


def test_compose_moves_each_documents_map_to_its_place():
    from kdn.adapters.hf.rag import compose_emphasis

    a = EmphasisMap(spans=((2, 4),), region=(0, 10), alpha=0.1, heads=((1, 1),))
    b = EmphasisMap(spans=((0, 1), (5, 6)), region=(0, 8), default_on=True)
    m = compose_emphasis([a, None, b], starts=[3, 13, 20], lengths=[10, 7, 8])
    assert m is not None and m.region == (3, 28) and m.spans == ((5, 7), (20, 21), (25, 26))
    assert m.alpha == 0.1 and m.heads == ((1, 1),) and m.default_on
    assert compose_emphasis([None, None], [0, 5], [5, 5]) is None


async def test_generate_rag_steers_when_asked():
    from kdn.adapters.hf import ByteTokenizer, generate_rag

    model, tok = tiny(), ByteTokenizer()
    docs = ["The gate code is 7781. " * 2, "Nothing to see in this one at all. " * 2]
    maps = [EmphasisMap(spans=((4, 20),), region=(0, len(tok.encode(docs[0]))), heads=((1, 0), (1, 1))), None]
    kw = dict(max_new_tokens=2, recompute_ratio=0.15)
    plain = await generate_rag(model, tok, "What is the code?", docs, None, **kw)
    off = await generate_rag(model, tok, "What is the code?", docs, None, emphasis=maps, **kw)  # off by default
    on = await generate_rag(model, tok, "What is the code?", docs, None, emphasis=maps, steer=True, **kw)
    assert torch.equal(off.first_logits, plain.first_logits)
    assert not torch.allclose(on.first_logits, plain.first_logits, atol=1e-4)
    with pytest.raises(InvalidInput, match="2 documents"):
        await generate_rag(model, tok, "q", docs, None, emphasis=maps[:1], steer=True, **kw)


def test_a_one_shot_prefill_steers_only_the_rows_after_the_knowledge():
    """One forward over document + question (the split path: plain rows, then biased rows) gives the
    document rows of the unsteered model and the question rows of a steered continuation."""
    model = tiny()
    x = ids()
    st = plan(model, emap())
    one = logits(model, x, st)
    torch.testing.assert_close(one[:DOC], logits(model, x)[:DOC], rtol=1e-5, atol=1e-5)
    with torch.inference_mode(), steering(model, st):
        cache = new_cache(model)
        _forward(model, cache, torch.tensor(x[:DOC]), 0, logits=False)
        cont = _forward(model, cache, torch.tensor(x[DOC:]), DOC, logits=True).logits[0]
    torch.testing.assert_close(one[DOC:], cont, rtol=1e-4, atol=1e-4)
