"""CacheBlend: token selection, and blending standalone chunks in any order (tiny-llama / tiny-qwen2; SmolLM2 slow)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kdn.adapters.hf import build_cache, continue_from_cache, load_model, standalone_chunk
from kdn.adapters.hf.rag import Segment, blend_cache, blend_prefill, chunk_start_tokens, full_prefill, kv_share
from kdn.errors import InvalidInput, ModelMismatch
from kdn.kernels.blend import (compose, kv_deviation, n_select, query_attention, query_attention_ref, query_weighted,
                               select_tokens, select_tokens_ref)
from kdn.kernels.rope import rope_shift

_MODELS: dict[str, object] = {}


def model(name: str):
    if name not in _MODELS:
        _MODELS[name] = load_model(name, dtype=torch.float32).model
    return _MODELS[name]


def toks(seed: int, n: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, vocab, (n,), generator=g)).tolist()


HEAD, DOC_A, DOC_B, DOC_C, QUERY = toks(1, 12), toks(2, 70), toks(3, 45), toks(4, 90), toks(5, 9)


def segments(m, docs, *, head=HEAD, query=QUERY):
    return [Segment(head)] + [Segment(d, standalone_chunk(m, d).tensors) for d in docs] + [Segment(query)]


# --- select_tokens ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False, width=32), max_size=60), st.floats(0, 1))
def test_select_tokens_matches_ref(dev, ratio):
    got = select_tokens(torch.tensor(dev, dtype=torch.float32), ratio)
    assert got.tolist() == select_tokens_ref(dev, ratio)
    assert got.numel() == n_select(len(dev), ratio)


def test_select_tokens_ties_and_bounds():
    d = torch.tensor([1.0, 5.0, 5.0, 0.0, 5.0])
    assert select_tokens(d, 0.4).tolist() == [1, 2]  # ties -> earlier tokens
    assert select_tokens(d, 0.0).tolist() == []
    assert select_tokens(d, 1.0).tolist() == [0, 1, 2, 3, 4]
    assert select_tokens(d, 0.01).tolist() == [1]  # any ratio > 0 recomputes at least one token
    with pytest.raises(AssertionError):
        select_tokens(torch.tensor([1.0, float("nan")]), 0.5)


def test_kv_deviation_is_per_token():
    k = torch.zeros(1, 2, 4, 3)
    k2 = k.clone()
    k2[0, 1, 2, 0] = 2.0
    assert kv_deviation(k2, k, k, k).tolist() == [0.0, 0.0, 4.0, 0.0]


# --- blending --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_full_recompute_is_bit_identical_to_the_routines_full_prefill(name):
    m = model(name)
    for docs in ([DOC_A, DOC_B, DOC_C], [DOC_C, DOC_A, DOC_B]):  # any order
        segs = segments(m, docs)
        ids = [t for s in segs for t in s.ids]
        b = blend_prefill(m, segs, recompute_ratio=1.0, n_logits=len(QUERY))
        ref = full_prefill(m, ids, n_logits=len(QUERY))
        assert b.recomputed.numel() == b.n_reused == sum(map(len, docs))
        assert torch.equal(b.logits, ref.logits)
        for i in range(len(b.keys)):
            assert torch.equal(b.keys[i], ref.keys[i]) and torch.equal(b.values[i], ref.values[i])
        # and the routine agrees with the model's own forward
        with torch.inference_mode():
            own = m(input_ids=torch.tensor([ids])).logits[0, -len(QUERY):]
        err = (ref.logits - own).abs().max().item()
        print(f"{name}: routine vs model forward, max |dlogit| = {err:.2e}")
        torch.testing.assert_close(ref.logits, own, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float64)])
def test_compose_is_each_chunk_shifted_alone_then_cast(src, dst):
    """One in-place shift over every layer equals one rope_shift per layer in the wider of the two precisions,
    then the cast: a narrowing cast comes after the shift, a widening one before it."""
    m = model("tiny-llama")
    chunks = [standalone_chunk(m, d).tensors for d in (DOC_A, DOC_B, DOC_C)]
    chunks = [{n: t.to(src) for n, t in c.items()} for c in chunks]
    lengths = [len(HEAD), len(DOC_A), len(DOC_B), len(DOC_C)]
    H, D = chunks[0]["L0.k"].shape[0], chunks[0]["L0.k"].shape[2]
    layers = range(m.config.num_hidden_layers)
    ks, vs = compose([None, *chunks], lengths, m, layers, kv_shape=(H, D), dtype=dst)
    for i in layers:
        assert ks[i].shape == (1, H, sum(lengths), D) and ks[i].dtype == dst
        assert not ks[i][0, :, :len(HEAD)].any() and not vs[i][0, :, :len(HEAD)].any()  # the fresh head: zeros
        off = len(HEAD)
        for c, n in zip(chunks, lengths[1:]):
            wide = torch.promote_types(src, dst)
            assert torch.equal(ks[i][0, :, off:off + n], rope_shift(c[f"L{i}.k"].to(wide), off, m).to(dst))
            assert torch.equal(vs[i][0, :, off:off + n], c[f"L{i}.v"].to(dst))
            off += n


def test_partial_recompute_groups_queries_by_position_band():
    from kdn.adapters.hf.blend import _groups

    # queries spread over the context: one group per band of S/8 positions that holds any
    assert _groups(torch.tensor([0, 1, 130, 131, 520, 1023]), 1024) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    # a question at the end (a compose-only blend): one call, not eight
    assert _groups(torch.arange(1000, 1041), 1041) == [(0, 41)]
    assert _groups(torch.arange(16), 16) == [(i, i + 2) for i in range(0, 16, 2)]
    # few queries take one band (a call's fixed cost outweighs the masked keys), many take up to eight
    from kdn.adapters.hf.blend import _Bands

    few = _Bands.of(torch.tensor([0, 1, 130, 131, 520, 1023]), 1024)
    assert [(a, b, m) for a, b, m, _ in few.calls] == [(0, 6, 1024)] and not few.whole
    assert few.calls[0][3].tolist()[2][:132] == [True] * 131 + [False]  # each query sees the keys up to its own
    many = _Bands.of(torch.arange(0, 2048, 2), 2048)
    assert len(many.calls) == 8 and _Bands.of(torch.arange(16), 16).whole


def test_ratio_zero_is_pure_composition():
    m = model("tiny-llama")
    docs = [DOC_B, DOC_A]
    segs = segments(m, docs, head=[5])
    segs[0] = Segment([5], standalone_chunk(m, [5]).tensors)  # a reused head: nothing but the query is fresh
    b = blend_prefill(m, segs, recompute_ratio=0.0)
    assert b.recomputed.numel() == 0
    # the cache holds the shifted chunks untouched
    off = 1
    for d, s in zip(docs, segs[1:]):
        for i in range(len(b.keys)):
            assert torch.equal(b.keys[i][0, :, off:off + len(d)], rope_shift(s.kv[f"L{i}.k"], off, m))
            assert torch.equal(b.values[i][0, :, off:off + len(d)], s.kv[f"L{i}.v"])
        off += len(d)
    # and the query's logits are the model's own, continuing from a cache of the shifted chunks
    chunks = [{n: (rope_shift(t, o, m) if n.endswith(".k") else t) for n, t in s.kv.items()}
              for s, o in zip(segs[:-1], (0, 1, 1 + len(docs[0])))]
    cache, n = build_cache(m, chunks)
    own = continue_from_cache(m, cache, n, QUERY)[-1]
    torch.testing.assert_close(b.logits[-1], own, atol=1e-4, rtol=1e-4)


def test_partial_recompute_touches_only_the_selected_tokens():
    m = model("tiny-llama")
    segs = segments(m, [DOC_A, DOC_C])
    zero = blend_prefill(m, segs, recompute_ratio=0.0)
    b = blend_prefill(m, segs, recompute_ratio=0.2, check_layer=0, selection="deviation")
    reused = b.n_reused
    assert b.recomputed.numel() == round(0.2 * reused)
    sel = set(b.recomputed.tolist())
    untouched = [t for t in range(len(HEAD), len(HEAD) + reused) if t not in sel]
    last = len(b.keys) - 1  # deeper than the check layer: unselected reused rows stay composed
    assert torch.equal(b.keys[last][:, :, untouched], zero.keys[last][:, :, untouched])
    assert not torch.equal(b.keys[last][:, :, sorted(sel)], zero.keys[last][:, :, sorted(sel)])


def test_blended_cache_continues_generation():
    m = model("tiny-qwen2")
    segs = segments(m, [DOC_B, DOC_A])
    b = blend_prefill(m, segs, recompute_ratio=1.0)
    cache = blend_cache(m, b)
    ids = [t for s in segs for t in s.ids]
    nxt = int(b.logits[-1].argmax())
    got = continue_from_cache(m, cache, b.n_tokens, [nxt])[-1]
    with torch.inference_mode():
        own = m(input_ids=torch.tensor([ids + [nxt]])).logits[0, -1]
    torch.testing.assert_close(got, own, atol=1e-4, rtol=1e-4)


def test_refusals():
    m = model("tiny-llama")
    with pytest.raises(InvalidInput, match="fresh"):
        blend_prefill(m, [Segment(DOC_A, standalone_chunk(m, DOC_A).tensors)])
    with pytest.raises(InvalidInput):
        blend_prefill(m, segments(m, [DOC_A]), recompute_ratio=1.5)
    with pytest.raises(ModelMismatch):
        blend_prefill(load_model("tiny-bamba").model, [Segment(QUERY)])


@pytest.mark.slow
def test_smollm2_full_recompute_is_exact():
    m = model("smollm2-135m")
    segs = segments(m, [toks(7, 300, 49000), toks(8, 200, 49000)], head=toks(9, 20, 49000), query=toks(10, 8, 49000))
    ids = [t for s in segs for t in s.ids]
    b = blend_prefill(m, segs, recompute_ratio=1.0, n_logits=8)
    ref = full_prefill(m, ids, n_logits=8)
    assert torch.equal(b.logits, ref.logits)
    with torch.inference_mode():
        own = m(input_ids=torch.tensor([ids])).logits[0, -8:]
    print(f"smollm2 fp32: routine vs model forward, max |dlogit| = {(ref.logits - own).abs().max().item():.2e}")
    torch.testing.assert_close(ref.logits, own, atol=2e-3, rtol=2e-3)


# --- other selections: chunk-start (EPIC-style) and the cheaper deviation-kv check ------------------


def test_chunk_start_picks_the_first_tokens_of_every_reused_chunk():
    m = model("tiny-llama")
    docs = [DOC_A, DOC_B, DOC_C]  # 70, 45, 90 tokens after a 12-token head
    segs = segments(m, docs)
    assert chunk_start_tokens(segs, 0.1) == [*range(12, 19), *range(82, 87), *range(127, 136)]
    b = blend_prefill(m, segs, recompute_ratio=0.1, selection="chunk-start")
    assert b.recomputed.tolist() == chunk_start_tokens(segs, 0.1)
    L = len(b.keys)
    assert b.layer_tokens == 21 * L and b.recompute_share == pytest.approx(21 / 205)
    # nothing else is touched in any layer: the other reused rows stay composed, from layer 0 on
    zero = blend_prefill(m, segs, recompute_ratio=0.0)
    rest = [t for t in range(12, 12 + 205) if t not in set(b.recomputed.tolist())]
    for i in (0, L - 1):
        assert torch.equal(b.keys[i][:, :, rest], zero.keys[i][:, :, rest])
        assert not torch.equal(b.keys[i][:, :, b.recomputed], zero.keys[i][:, :, b.recomputed])


@pytest.mark.parametrize("selection", ["chunk-start", "deviation-kv", "deviation", "deviation-query"])
def test_every_selection_at_ratio_one_is_the_full_prefill(selection):
    m = model("tiny-qwen2")
    segs = segments(m, [DOC_C, DOC_A, DOC_B])
    ids = [t for s in segs for t in s.ids]
    b = blend_prefill(m, segs, recompute_ratio=1.0, selection=selection, n_logits=len(QUERY))
    ref = full_prefill(m, ids, n_logits=len(QUERY))
    assert b.recomputed.numel() == b.n_reused
    assert torch.equal(b.logits, ref.logits)  # ratio 1 needs no check layer: every token in every layer
    for i in range(len(b.keys)):
        assert torch.equal(b.keys[i], ref.keys[i]) and torch.equal(b.values[i], ref.values[i])
    assert b.layer_tokens == b.n_reused * len(b.keys) and b.recompute_share == 1.0
    with torch.inference_mode():  # and that is the model's own prefill, within float rounding
        own = m(input_ids=torch.tensor([ids])).logits[0, -len(QUERY):]
    torch.testing.assert_close(b.logits, own, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_deviation_kv_is_cacheblend_with_a_cheaper_check(ratio):
    m = model("tiny-llama")
    segs = segments(m, [DOC_A, DOC_C])
    full = blend_prefill(m, segs, recompute_ratio=ratio, check_layer=1, selection="deviation")
    kv = blend_prefill(m, segs, recompute_ratio=ratio, check_layer=1, selection="deviation-kv")
    assert torch.equal(kv.recomputed, full.recomputed)  # the same check-layer K/V, so the same choice
    R, L = kv.n_reused, len(kv.keys)
    r = kv.recomputed.numel()
    assert r == round(ratio * R)
    assert full.layer_tokens == R * 2 + r * (L - 2)
    assert kv.layer_tokens == pytest.approx(R * 1 + R * kv_share(m.model.layers[1]) + r * (L - 1))
    assert kv.recompute_share < full.recompute_share
    # the same cache and logits: the check layer's output of unselected tokens is never used
    torch.testing.assert_close(kv.logits, full.logits, atol=1e-4, rtol=1e-4)
    for i in range(L):
        torch.testing.assert_close(kv.keys[i], full.keys[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.values[i], full.values[i], atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidInput, match="check_layer"):
        blend_prefill(m, segs, check_layer=0, selection="deviation-kv")
    with pytest.raises(InvalidInput, match="selection"):
        blend_prefill(m, segs, selection="random")


# --- deviation-query: the deviation weighted by how much the query reads each token -------------------


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_query_attention_matches_ref(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    S, t, D = 23, 5, 8
    q = torch.randn(1, hq, t, D, generator=g)
    K = torch.randn(1, hkv, S, D, generator=g)
    pos = torch.tensor([10, 14, 20, 21, 22])  # queries need not be contiguous; each sees keys up to itself
    a = query_attention(q, K, pos, 0.35)
    ref = query_attention_ref(q, K, pos.tolist(), 0.35)
    torch.testing.assert_close(a, torch.tensor(ref, dtype=torch.float32), atol=1e-6, rtol=1e-5)
    assert float(a.sum()) == pytest.approx(1.0, abs=1e-5)
    assert torch.all(a[23 - 1:] > 0) and float(a[pos[-1] + 1:].sum()) == 0.0
    # a steering bias (here: keys 3..5 favoured by every head) moves the weight as the steered model would
    bias = torch.zeros(1, hq, 5, S)
    bias[..., 3:6] = 4.0
    ab = query_attention(q, K, pos, 0.35, bias)
    torch.testing.assert_close(ab, torch.tensor(query_attention_ref(q, K, pos.tolist(), 0.35, bias),
                                                 dtype=torch.float32), atol=1e-6, rtol=1e-5)
    assert float(ab[3:6].sum()) > float(a[3:6].sum()) + 0.2


def test_query_weighted_keeps_the_deviation_the_main_term():
    d = torch.tensor([4.0, 1.0, 0.0, 9.0])
    a = torch.tensor([0.25, 1.0, 1.0, 0.0])
    assert query_weighted(d, a).tolist() == [2.0, 1.0, 0.0, 0.0]
    # a token the query never reads is never worth recomputing for it, however wrong its state
    assert select_tokens(query_weighted(d, a), 0.5).tolist() == [0, 1]


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_deviation_query_picks_by_deviation_times_root_attention(ratio):
    # A random-init model's attention is near uniform, which would make the query's weight a constant:
    # sharpen the check layer's queries (a copy of the model) so that it is not.
    m = copy.deepcopy(model("tiny-llama"))
    c = 1
    with torch.no_grad():
        m.model.layers[c].self_attn.q_proj.weight.mul_(40)
    segs = segments(m, [DOC_A, DOC_B, DOC_C])
    b = blend_prefill(m, segs, recompute_ratio=ratio, check_layer=c, selection="deviation-query")
    kv = blend_prefill(m, segs, recompute_ratio=ratio, check_layer=c, selection="deviation-kv")
    assert b.layer_tokens == pytest.approx(kv.layer_tokens)  # the same check work, the query's q aside
    # The reference, from the model's own forward: the check layer's true K/V and the query's queries.
    ids = [t for s in segs for t in s.ids]
    S, nq = len(ids), len(QUERY)
    lay = m.model.layers[c]
    attn = lay.self_attn
    with torch.inference_mode():
        hs = m(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[c]  # layer c's input
        pos = torch.arange(S)[None]
        cos, sin = m.model.rotary_emb(hs, position_ids=pos)
        x = lay.input_layernorm(hs)
        D = attn.head_dim

        def rot(y):  # [1, H, S, D] with the model's formula
            h = D // 2
            return y * cos[:, None] + torch.cat((-y[..., h:], y[..., :h]), dim=-1) * sin[:, None]

        k = rot(attn.k_proj(x).view(1, S, -1, D).transpose(1, 2))
        v = attn.v_proj(x).view(1, S, -1, D).transpose(1, 2)
        q = rot(attn.q_proj(x).view(1, S, -1, D).transpose(1, 2))[:, :, S - nq:]
    reused = torch.tensor([i for i in range(len(HEAD), S - nq)])
    Kc, Vc = compose([s.kv for s in segs], [len(s.ids) for s in segs], m, [c],
                     kv_shape=(attn.config.num_key_value_heads, D), dtype=torch.float32)
    d = kv_deviation(k[:, :, reused], v[:, :, reused], Kc[0][:, :, reused], Vc[0][:, :, reused])
    a = query_attention(q, k, torch.arange(S - nq, S), attn.scaling)[reused]
    want = reused[select_tokens(query_weighted(d, a), ratio)]
    got = b.recomputed
    assert got.numel() == want.numel() == n_select(reused.numel(), ratio)
    # The model's forward and the blend's routine round differently; allow one near-tie to swap.
    assert len(set(got.tolist()) ^ set(want.tolist())) <= 2
    assert not torch.equal(got, kv.recomputed)  # and the query changed the choice
    with pytest.raises(InvalidInput, match="check_layer"):
        blend_prefill(m, segs, check_layer=0, selection="deviation-query")


@pytest.mark.parametrize("ratio", [0.0, 0.2])
def test_upto_leaves_the_wanted_rows_as_a_whole_blend_does(ratio):
    """An engine that computes the prompt's last tokens itself wants the K/V below ``upto`` only: the tokens
    past it serve the check as the question and run no further, and every row below it is the same."""
    m = model("tiny-llama")
    segs = segments(m, [DOC_A, DOC_B, DOC_C])
    S = sum(len(s.ids) for s in segs)
    upto = S - len(QUERY) // 2  # halfway through the question
    whole = blend_prefill(m, segs, recompute_ratio=ratio, n_logits=0)
    cut = blend_prefill(m, segs, recompute_ratio=ratio, n_logits=0, upto=upto)
    assert torch.equal(whole.recomputed, cut.recomputed)  # the same selection: the whole question was its query
    for a, b in zip(whole.keys + whole.values, cut.keys + cut.values):  # (fewer queries a call: rounding only)
        torch.testing.assert_close(a[:, :, :upto], b[:, :, :upto], rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidInput, match="upto"):
        blend_prefill(m, segs, n_logits=1, upto=upto)
