"""Quantize/dequantize kernels: fast (torch) vs ``*_ref`` (numpy loops), and their error bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdn.kernels import quant

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def matrices(draw, min_rows=1, min_cols=1):
    r = draw(st.integers(min_rows, 6))
    c = draw(st.integers(min_cols, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-6, 1e-3, 1.0, 40.0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * magnitude  # x: [R, C]
    if draw(st.booleans()):
        x[:, 0] *= 25  # an outlier column, as keys have
    if draw(st.booleans()):
        x = x.to(torch.bfloat16).to(torch.float32)  # bf16-representable values
    if draw(st.booleans()):
        x[0] = 0.0  # an all-zero row: scale 0
    return x


def _tol(x: torch.Tensor) -> torch.Tensor:
    return 2e-7 * x.abs() + 1e-12  # float32 arithmetic slack on top of the quantization bound


@SETTINGS
@given(matrices(), st.sampled_from([8, 6, 4, 3, 2]))
def test_absmax_fast_matches_ref_and_is_bounded(x, bits):
    q, s = quant.quantize_absmax(x, bits)  # q: [R, C], s: [R]
    q_ref, s_ref = quant.quantize_absmax_ref(x.numpy(), bits)
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(s.numpy(), s_ref)
    y = quant.dequantize_absmax(q, s)
    np.testing.assert_allclose(y.numpy(), quant.dequantize_absmax_ref(q_ref, s_ref), rtol=1e-6, atol=0)
    sf = s.to(torch.float32)[:, None]
    assert (q.abs() <= quant.qmax_of(bits)).all()
    assert ((x - y).abs() <= sf / 2 + _tol(x)).all()  # round to nearest, never clipped
    # The stored scale is the smallest float16 >= absmax / qmax: the bound is as tight as fp16 allows.
    assert (sf[:, 0] >= x.abs().amax(1) / quant.qmax_of(bits)).all()


@SETTINGS
@given(matrices(), st.sampled_from([32, 64, 5]))
def test_groups_fast_matches_ref_and_is_bounded(x, group):
    q, s, mn = quant.quantize_groups(x, 4, group)
    q_ref, s_ref, mn_ref = quant.quantize_groups_ref(x.numpy(), 4, group)
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(s.numpy(), s_ref)
    np.testing.assert_array_equal(mn.numpy(), mn_ref)
    c = x.shape[1]
    y = quant.dequantize_groups(q, s, mn, c)  # y: [R, C]
    np.testing.assert_allclose(y.numpy(), quant.dequantize_groups_ref(q_ref, s_ref, mn_ref, c), rtol=1e-6, atol=1e-12)
    bound = (s.to(torch.float32) / 2).repeat_interleave(group, dim=1)[:, :c]
    assert ((x - y).abs() <= bound + _tol(x) + 2e-7 * mn.to(torch.float32).abs().repeat_interleave(group, 1)[:, :c]).all()


@SETTINGS
@given(st.lists(st.integers(0, 15), max_size=67))
def test_nibbles_fast_matches_ref_and_round_trips(codes):
    a = np.array(codes, np.uint8)
    packed = quant.pack_nibbles(torch.from_numpy(a))
    assert packed.numpy().tobytes() == quant.pack_nibbles_ref(a)
    np.testing.assert_array_equal(quant.unpack_nibbles(packed, len(a)).numpy(), a)
    np.testing.assert_array_equal(quant.unpack_nibbles_ref(bytes(packed.numpy()), len(a)), a)


@SETTINGS
@given(matrices(), st.sampled_from([8, 5, 4, 3, 2]), st.sampled_from([1, 4, 16]))
def test_delta_fast_matches_ref_and_is_bounded(x, bits, group):
    q, sa, sd = quant.delta_quantize(x, bits, group)  # q: [T, C]; sa, sd: [C]
    q_ref, sa_ref, sd_ref = quant.delta_quantize_ref(x.numpy(), bits, group)
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(sa.numpy(), sa_ref)
    np.testing.assert_array_equal(sd.numpy(), sd_ref)
    y = quant.delta_dequantize(q, sa, sd, group)
    np.testing.assert_allclose(y.numpy(), quant.delta_dequantize_ref(q_ref, sa_ref, sd_ref, group), rtol=1e-6, atol=1e-12)
    bound = (sd.to(torch.float32) / 2).expand_as(x).clone()
    bound[::group] = sa.to(torch.float32) / 2  # anchor tokens: the anchor scale
    assert ((x - y).abs() <= bound + 4 * _tol(x)).all()


def test_f16_rounding_directions():
    v = torch.tensor([0.0, 1e-9, 1.0 / 3, 1000.1, 65000.0])
    up, down = quant.f16_up(v).to(torch.float32), quant.f16_down(v).to(torch.float32)
    assert (up >= v).all() and (down <= v).all()
    assert up[1] > 0  # a tiny positive scale never rounds to zero
    for x, u, d in zip(v.numpy(), up.numpy(), down.numpy()):
        assert np.float32(quant._f16_up_ref(np.float32(x))) == u
        assert np.float32(quant._f16_down_ref(np.float32(x))) == d


def test_non_finite_values_are_refused():
    from kdn.errors import CodecError

    for bad in (float("nan"), float("inf"), 1e6):
        with pytest.raises(CodecError):
            quant.quantize_absmax(torch.tensor([[1.0, bad]]))
