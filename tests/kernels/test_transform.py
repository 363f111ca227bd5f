"""The kvtc transform codec: basis object, allocation, fast vs reference, error bounds, bounded decoding, objects."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

import kdn.kernels  # noqa: F401  (registers the codecs)
from kdn.format.codecs import get_codec
from kdn.errors import CodecError, InvalidInput
from kdn.kernels import transform as tf
from kdn.kernels.rope import Rope, rope_shift_ref
from kdn.format.objects import decode_object, to_torch

H, D, LAYERS = 2, 8, 3
C = H * D


def make_basis(seed: int = 0, sinks: int = 4) -> tf.Basis:
    """A small random basis: random orthonormal columns, decreasing variances, random metric and alpha."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(LAYERS):
        pair = []
        for j in range(2):
            u, _ = np.linalg.qr(rng.standard_normal((C, C)))
            var = np.sort(rng.gamma(1.0, 1.0, C) * np.exp(-0.3 * np.arange(C)))[::-1]
            pair.append(tf.LayerBasis(rng.standard_normal(C).astype(np.float32), rng.uniform(0.5, 2.0, C).astype(np.float32),
                                      var.astype(np.float32), u.astype(np.float32), float(rng.uniform(0.1, 3.0))))
        layers.append(tuple(pair))
    inv = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    return tf.Basis("ab" * 32, LAYERS, H, D, inv, tuple(layers), sinks)


def kv_like(basis: tf.Basis, layer: int, kind: str, n: int, position: int, seed: int = 1) -> torch.Tensor:
    """A tensor ``[H, n, D]`` drawn from the basis' own model (post-RoPE for K), as bf16-representable float32."""
    g = torch.Generator().manual_seed(seed)
    lb = basis.get(layer, kind)
    y = torch.randn(n, C, generator=g, dtype=torch.float64) * torch.from_numpy(np.sqrt(lb.var.astype(np.float64)))
    r = (y @ torch.from_numpy(lb.basis.astype(np.float64)).T) / torch.from_numpy(lb.scale.astype(np.float64))
    r = r + torch.from_numpy(lb.mean.astype(np.float64))
    x = r.float().view(n, H, D)
    if kind == "k":
        x = tf.rotate(x, torch.arange(position, position + n), basis.inv_freq, 1)
    return x.permute(1, 0, 2).to(torch.bfloat16).float().contiguous()


def test_basis_round_trips_and_is_orthonormal():
    b = make_basis()
    data = b.to_bytes()
    back = tf.Basis.from_bytes(data)
    assert back.to_bytes() == data and back.address == b.address and len(b.address) == 64
    for pair in back.layers:
        for lb in pair:
            assert np.allclose(lb.basis.T @ lb.basis, np.eye(C), atol=1e-5)
            assert (np.diff(lb.var) <= 0).all()


def test_fitted_style_basis_is_orthonormal():
    """fit_basis' own PCA step (eigh of a weighted covariance) gives orthonormal, sorted columns."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((500, C)) @ rng.standard_normal((C, C))
    s = rng.uniform(0.5, 2, C)
    var, vec = np.linalg.eigh(np.cov(x.T) * s[:, None] * s[None])
    vec = vec[:, np.argsort(var)[::-1]].astype(np.float32)
    assert np.allclose(vec.T @ vec, np.eye(C), atol=1e-5)


def test_allocation_respects_the_budget_and_is_monotone():
    b = make_basis()
    total = 2 * LAYERS * C
    prev_kept = -1
    for bits in (0.25, 0.5, 1.0, 2.0, 4.0):
        a = tf.allocate(b, bits)
        assert a.est_bits <= bits + 1e-9
        assert a.est_bits >= 0.97 * bits  # the bisection does not leave budget on the table
        kept = sum(m for p in a.kept for m in p)
        assert prev_kept <= kept <= total
        prev_kept = kept
        # Water-filling: a coefficient is kept iff alpha * var > theta.
        for pair, ms in zip(b.layers, a.kept):
            for lb, m in zip(pair, ms):
                assert m == int((lb.alpha * lb.var.astype(np.float64) > a.theta).sum())
    with pytest.raises(InvalidInput):
        tf.allocate(b, 0.0)


def test_gaussian_code_entropy_matches_a_histogram():
    rng = np.random.default_rng(0)
    for r in (0.2, 1.0, 3.0, 10.0):
        q = np.round(rng.standard_normal(400_000) * r)
        _, cnt = np.unique(q, return_counts=True)
        p = cnt / cnt.sum()
        assert abs(-(p * np.log2(p)).sum() - tf.gaussian_code_entropy(np.array([r]))[0]) < 0.02


def test_rotate_matches_rope_reference():
    b = make_basis()
    x = torch.randn(5, H, D)
    pos = torch.arange(7, 12)
    fast = tf.rotate(x, pos, b.inv_freq, 1)
    rope = Rope(torch.from_numpy(b.inv_freq).float())
    shifted = rope_shift_ref(x.permute(1, 0, 2).double(), 9, rope)  # [H, n, D]: every token moved 9 positions
    assert torch.allclose(tf.rotate(x, torch.full((5,), 9), b.inv_freq, 1).double(), shifted.permute(1, 0, 2), atol=1e-5)
    ref = torch.stack([torch.from_numpy(tf._rotate_row_ref(x[t].double().numpy(), int(pos[t]), b.inv_freq, 1)) for t in range(5)])
    assert torch.allclose(fast.double(), ref, atol=1e-5)
    assert torch.allclose(tf.rotate(fast, pos, b.inv_freq, -1), x, atol=1e-5)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("position,n", [(0, 40), (2, 5), (300, 33), (0, 3)])
@pytest.mark.parametrize("bits,rho", [(0.5, 0.5), (2.0, 0.5), (6.0, 0.5), (2.0, 0.3)])
def test_round_trip_matches_reference_within_the_bound(kind, position, n, bits, rho):
    b = make_basis()
    layer = 1
    theta = tf.allocate(b, bits).theta
    x = kv_like(b, layer, kind, n, position)
    payload, params = tf.encode_tensor(b, layer, kind, x, position, theta, "BF16", rho)
    y = tf.decode_tensor(payload, "BF16", (H, n, D), params, basis=b)
    ns = params["sinks"]
    assert ns == max(0, min(n, 4 - position))
    assert torch.equal(y[:, :ns], x[:, :ns])  # sinks exact
    codes = tf.transform_codes_ref(b, layer, kind, x.numpy(), position, theta, rho)
    ref = tf.reconstruct_ref(b, layer, kind, codes, x[:, :ns].double().numpy(), position, theta)
    # Fast (float32) and reference (float64) reconstructions agree, up to a code flipped at a rounding tie.
    lb = b.get(layer, kind)
    m, step = tf.kept_and_step(lb, theta)
    tie = step / float(lb.scale.min())  # one code step in value units, worst case
    diff = (y.double() - torch.from_numpy(ref)).abs()
    assert (diff <= 1e-3 * (1 + x.abs().double()) + tie * 1.01).all()
    assert float((diff > 1e-3 * (1 + x.abs().double())).double().mean()) < 0.02
    # Error bound (weighted space, per token): kept coefficients within (1 - rho) step (step / 2 when rounding),
    # dropped ones lose their value.
    w_err = torch.zeros(n)
    for t in range(ns, n):
        row, rec = x[:, t].double().numpy(), y[:, t].double().numpy()
        if kind == "k":
            row = tf._rotate_row_ref(row, position + t, b.inv_freq, -1)
            rec = tf._rotate_row_ref(rec, position + t, b.inv_freq, -1)
        wx = (row.reshape(-1) - lb.mean) * lb.scale
        yy = lb.basis.astype(np.float64).T @ wx
        bound = math.sqrt(m * ((1 - rho) * step) ** 2 + float((yy[m:] ** 2).sum()))
        w_err[t] = float(np.linalg.norm((rec.reshape(-1) - row.reshape(-1)) * lb.scale))
        assert w_err[t] <= bound * 1.001 + 1e-4


def test_more_bits_less_error_and_more_bytes():
    b = make_basis()
    x = kv_like(b, 2, "v", 200, 10)
    sizes, errs = [], []
    for bits in (0.5, 1.0, 2.0, 4.0):
        theta = tf.allocate(b, bits).theta
        payload, params = tf.encode_tensor(b, 2, "v", x, 10, theta)
        y = tf.decode_tensor(payload, "BF16", (H, 200, D), params, basis=b)
        sizes.append(len(payload))
        errs.append(float(((y - x) ** 2).mean()))
    assert sizes == sorted(sizes) and errs == sorted(errs, reverse=True)
    # The measured rate is near this layer's estimate: Gaussian data, as the allocation assumed (a Laplace
    # model on Gaussian codes costs a few % more), plus one scale byte per kept coefficient.
    lb = b.get(2, "v")
    m, step = tf.kept_and_step(lb, tf.allocate(b, 2.0).theta)
    est = float(tf.gaussian_code_entropy(np.sqrt(lb.var[:m].astype(np.float64)) / step).sum()) * 200 / 8 + m
    assert est * 0.9 < sizes[2] < est * 1.1 + 8


def _codec_round_trip(b, position=0, n=20):
    x = kv_like(b, 0, "k", n, position)
    theta = tf.allocate(b, 2.0).theta
    payload, params = tf.encode_tensor(b, 0, "k", x, position, theta)
    params["crc32"] = zlib.crc32(payload)
    return x, payload, params


def test_registered_codec_decodes_and_checks_everything():
    b = make_basis()
    tf.register_basis(b)
    codec = get_codec("kvtc")
    shape = (H, 20, D)
    x, payload, params = _codec_round_trip(b)
    dec = codec.decode(payload, "BF16", shape, params)
    y = torch.frombuffer(bytearray(dec), dtype=torch.bfloat16).view(shape).float()
    assert torch.equal(y, tf.decode_tensor(payload, "BF16", shape, params).to(torch.bfloat16).float())
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 0x40
    for bad in (bytes(flipped), payload[:-1], payload + b"\0", b""):
        with pytest.raises(CodecError):
            codec.decode(bad, "BF16", shape, params)
    # CRC-consistent but malformed payloads or params: CodecError, never another exception.
    for bad in (payload[: len(payload) // 2], payload + b"\0" * 8, bytes(flipped), payload[:-4]):
        try:
            codec.decode(bad, "BF16", shape, {**params, "crc32": zlib.crc32(bad)})
        except CodecError:
            pass
    bad_params = [
        {**params, "basis": "00" * 32}, {**params, "layer": LAYERS}, {**params, "kv": "q"}, {**params, "pos": -1},
        {**params, "sinks": 3}, {**params, "theta": -1.0}, {**params, "theta": "1"}, {**params, "layer": True},
        {k: v for k, v in params.items() if k != "theta"},
    ]
    for bp in bad_params:
        with pytest.raises(CodecError):
            codec.decode(payload, "BF16", shape, bp)
    for bad_shape in ((H + 1, 20, D), (H, 20, D + 1), (H * 20 * D,)):
        with pytest.raises(CodecError):
            codec.decode(payload, "BF16", bad_shape, params)
    with pytest.raises(CodecError):
        codec.encode(x.numpy().tobytes(), "F32", shape)  # only through encode_kvtc_object


def test_basis_parsing_is_bounded_and_strict():
    b = make_basis()
    data = b.to_bytes()
    with pytest.raises(CodecError):
        tf.Basis.from_bytes(data, max_bytes=len(data) - 1)
    cases = [data[:-1], data + b"\0", b"NOTBASIS" + data[8:], data[:10], b""]
    hlen = int.from_bytes(data[8:12], "little")
    head = data[12 : 12 + hlen]
    for old, new in [(b'"n_layers":3', b'"n_layers":9'), (b'"kv_heads":2', b'"kv_heads":99999'),
                     (b'"v":1', b'"v":2'), (b'"head_dim":8', b'"head_dim":"8"')]:
        assert old in head
        h2 = head.replace(old, new)
        cases.append(data[:8] + len(h2).to_bytes(4, "little") + h2 + data[12 + hlen :])
    cases.append(data[:8] + (1 << 31).to_bytes(4, "little") + data[12:])  # header length beyond the object
    bad_alpha = head.replace(b'"alpha":[[', b'"alpha":[[-')
    cases.append(data[:8] + len(bad_alpha).to_bytes(4, "little") + bad_alpha + data[12 + hlen :])
    nan = bytearray(data)
    nan[-4:] = np.float32(np.nan).tobytes()
    cases.append(bytes(nan))
    for bad in cases:
        with pytest.raises(CodecError):
            tf.Basis.from_bytes(bad)


def test_unloaded_basis_is_a_clear_error():
    b = make_basis(seed=7)
    x, payload, params = _codec_round_trip(b)
    with pytest.raises(CodecError, match="not loaded"):
        get_codec("kvtc").decode(payload, "BF16", (H, 20, D), params)


def test_object_round_trip_keeps_states_lossless():
    b = make_basis(seed=5)
    tf.register_basis(b)
    theta = tf.allocate(b, 3.0).theta
    tensors = {}
    for i in range(LAYERS):
        for kind in "kv":
            tensors[f"L{i}.{kind}"] = kv_like(b, i, kind, 24, 256, seed=i).to(torch.bfloat16)
    tensors["L1.conv"] = torch.randn(4, 3).to(torch.bfloat16)
    blob = tf.encode_kvtc_object(b, theta, tensors=tensors, position=256, kind="hybrid", address="cd" * 32,
                                 model_id="ab" * 32, namespace="public", start=256, end=280, parent="ef" * 32)
    obj = decode_object(blob)
    assert obj.header.encoding == "kvtc" and obj.header.tensors["L0.k"].codec == "kvtc"
    assert obj.header.tensors["L1.conv"].codec == "zstd"
    back = to_torch(obj)
    assert torch.equal(back["L1.conv"], tensors["L1.conv"])
    for name in tensors:
        if name != "L1.conv":
            err = (back[name].float() - tensors[name].float()).pow(2).mean()
            assert back[name].dtype == torch.bfloat16 and err < tensors[name].float().var()


def test_entropy_model_parameters_are_exact():
    """The decoder rebuilds the encoder's Laplace parameters from bytes, bit for bit: a table, not exp2."""
    u = np.arange(256, dtype=np.uint8)
    s = tf.scales_of(u)
    assert np.allclose(s, 2.0 ** ((u.astype(np.float64) - 64) / 8), rtol=1e-15, atol=0)
    assert (s[::8] == 2.0 ** (np.arange(32) - 8.0)).all()
    assert (tf.means_of(np.arange(-128, 128).astype(np.int8)) * 16 == np.arange(-128, 128)).all()


def test_object_decodes_into_a_reused_buffer_and_by_name():
    b = make_basis(seed=6)
    tf.register_basis(b)
    theta = tf.allocate(b, 2.0).theta
    tensors = {f"L{i}.{k}": kv_like(b, i, k, 9, 0, seed=i).to(torch.bfloat16) for i in range(LAYERS) for k in "kv"}
    blob = tf.encode_kvtc_object(b, theta, tensors=tensors, position=0, kind="kv", address="cd" * 32,
                                 model_id="ab" * 32, namespace="public", start=0, end=9, parent=None)
    fresh = to_torch(decode_object(blob))
    again = to_torch(decode_object(blob, out=bytearray(1 << 16)))
    assert all(torch.equal(fresh[n], again[n]) for n in fresh)
    one = to_torch(decode_object(blob, names=["L2.k"]))
    assert list(one) == ["L2.k"] and torch.equal(one["L2.k"], fresh["L2.k"])
