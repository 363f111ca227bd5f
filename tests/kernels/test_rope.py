"""RoPE shift: a chunk computed alone at 0..n-1, shifted by p, equals the chunk computed alone at p..p+n-1.

Attention is relative, so a chunk computed on its own has the same hidden
states wherever it starts: the claim checked here is that the keys of every
layer (not just layer 0) move by the shift alone, within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from kdn.adapters.hf import extract_chunks, load_model, standalone_chunk
from kdn.errors import ModelMismatch
from kdn.kernels.rope import Rope, rope_of, rope_shift, rope_shift_ref

_MODELS: dict[str, object] = {}


def model(name: str, dtype=torch.float32):
    key = (name, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(name, dtype=dtype).model
    return _MODELS[key]


def shifted_vs_direct(m, ids: list[int], p: int) -> dict[str, float]:
    """Over all layers: max |shift(K alone at 0..) - K alone at p..| and max |K|; the same for V (no shift)."""
    alone = standalone_chunk(m, ids).tensors
    (direct,) = list(extract_chunks(m, ids, chunk_tokens=len(ids), start_position=p))
    out = {"k_err": 0.0, "k_max": 0.0, "v_err": 0.0, "v_max": 0.0}
    for name, t0 in alone.items():
        want = direct.tensors[name]
        x = name[-1]  # values carry no position: equal up to the hidden states' rounding
        got = rope_shift(t0, p, m) if x == "k" else t0
        out[f"{x}_err"] = max(out[f"{x}_err"], (got - want).abs().max().item())
        out[f"{x}_max"] = max(out[f"{x}_max"], want.abs().max().item())
    return out


def check(r: dict[str, float], p: int) -> None:
    # fp32: the model's own cos(p * inv_freq) carries ~p * 6e-8 of absolute angle error, and
    # through the layers the hidden states of the two runs drift apart by rounding alone.
    tol = 2e-5 * max(1.0, p / 100)
    assert r["k_err"] <= tol * r["k_max"] and r["v_err"] <= tol * r["v_max"], r


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("p", [1, 37, 1000, 3000])
def test_shift_equals_direct_computation_in_every_layer(name, p):
    m = model(name)
    ids = [(7 * i + 3) % 500 + 3 for i in range(96)]
    r = shifted_vs_direct(m, ids, p)
    print(f"{name} p={p}: all layers, max |shift(K) - K direct| = {r['k_err']:.2e} (max |K| {r['k_max']:.2f}), "
          f"max |V - V direct| = {r['v_err']:.2e}")
    check(r, p)


@pytest.mark.slow
@pytest.mark.parametrize("p", [100, 2000])
def test_shift_equals_direct_smollm2(p):
    m = model("smollm2-135m", torch.float32)
    ids = list(range(1000, 1200))
    r = shifted_vs_direct(m, ids, p)
    print(f"smollm2 fp32 p={p}: all 30 layers, max |shift(K) - K direct| = {r['k_err']:.2e} "
          f"(max |K| {r['k_max']:.2f}), max |V - V direct| = {r['v_err']:.2e} (max |V| {r['v_max']:.2f})")
    check(r, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shift_matches_ref(dtype):
    r = Rope(1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)))
    k = torch.randn(2, 5, 33, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    for delta in (0, 1, 17, 4000):
        fast, ref = rope_shift(k, delta, r), rope_shift_ref(k, delta, r)
        assert fast.dtype == dtype and fast.shape == k.shape
        tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-6}[dtype]
        torch.testing.assert_close(fast.double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 8])
def test_shift_is_the_models_formula_bit_for_bit_and_works_in_place(dtype, rot):
    """k * cos + rotate_half(k) * sin, as the model writes it (transformers' apply_rotary_pos_emb), in the
    working precision: the halves computed apart (a - b for a + (-b)) give the same bits; out=keys too."""
    r = Rope(1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot)))
    k = torch.randn(3, 2, 41, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    for delta in (1, 17, 4000, -300):
        ang = float(delta) * r.inv_freq.double()
        ang = torch.cat((ang, ang))
        work = torch.promote_types(dtype, torch.float32)
        x = k[..., :rot].to(work)
        half = torch.cat((-x[..., rot // 2:], x[..., :rot // 2]), dim=-1)
        want = torch.cat(((x * ang.cos().to(work) + half * ang.sin().to(work)).to(dtype), k[..., rot:]), dim=-1)
        assert torch.equal(rope_shift(k, delta, r), want)
        inplace = k.clone()
        assert rope_shift(inplace, delta, r, out=inplace) is inplace
        assert torch.equal(inplace, want)
        strided = torch.zeros(3, 2, 50, 16, dtype=dtype)  # a slice of a longer context, as compose writes it
        strided[:, :, 5:46] = k
        rope_shift(strided[:, :, 5:46], delta, r, out=strided[:, :, 5:46])
        assert torch.equal(strided[:, :, 5:46], want) and not strided[:, :, :5].any() and not strided[:, :, 46:].any()


def test_shifts_compose_and_keep_norms():
    r = Rope(1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))
    k = torch.randn(3, 20, 64, dtype=torch.float64)
    torch.testing.assert_close(rope_shift(rope_shift(k, 300, r), -300, r), k)
    torch.testing.assert_close(rope_shift(k, 5, r).norm(dim=-1), k.norm(dim=-1))


def test_partial_rotary_leaves_the_tail_alone():
    r = Rope(1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))  # rotates 8 of 16 dims
    k = torch.randn(4, 16, dtype=torch.float64)
    out = rope_shift(k, 9, r)
    assert torch.equal(out[:, 8:], k[:, 8:])
    torch.testing.assert_close(out, rope_shift_ref(k, 9, r))


def test_config_path_matches_the_models_own_frequencies():
    for name in ("tiny-llama", "tiny-qwen2"):
        m = model(name)
        torch.testing.assert_close(rope_of(m.config).inv_freq, rope_of(m).inv_freq)


def test_unknown_rope_is_refused():
    from transformers import LlamaConfig, GPT2Config

    with pytest.raises(ModelMismatch, match="dynamic"):
        rope_of(LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    with pytest.raises(ModelMismatch, match="gpt2"):
        rope_of(GPT2Config())
