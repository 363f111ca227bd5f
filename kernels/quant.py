"""Quantize / dequantize kernels for the lossy KV codecs, each beside a ``*_ref``.

Everything here works on a float32 matrix ``x: [R, C]`` whose **rows** share
quantization parameters and whose **columns** are the values reduced over
(tokens for per-channel keys, head dims for per-token values; the codecs in
``kernels/codecs.py`` move the right axis last). Pairs:

- :func:`quantize_absmax` / :func:`dequantize_absmax` -- symmetric
  round-to-nearest with one float16 scale per row, ``q = round(x / s)`` in
  ``[-qmax, qmax]``. The scale is rounded *up* to float16, so no value clips
  and ``|x - q*s| <= s/2`` holds with the stored scale.
- :func:`quantize_groups` / :func:`dequantize_groups` -- asymmetric (min +
  scale) over groups of ``group`` columns, codes ``[0, 2^bits - 1]``; the min
  is rounded *down* and the scale *up* to float16, so ``|x - x^| <= s/2``.
- :func:`pack_nibbles` / :func:`unpack_nibbles` -- two 4-bit codes per byte,
  low nibble first.
- :func:`delta_quantize` / :func:`delta_dequantize` -- CacheGen-style: rows
  are tokens, every ``group``-th token is an anchor quantized per column;
  the others are deltas against their group's *reconstructed* anchor (so an
  anchor's error never propagates), quantized per column with their own scale.

The fast paths are vectorized torch; each ``*_ref`` is plain numpy with a
Python loop per row (or group), for small inputs in the tests. Fast and ref
give identical codes and scales (same float32 operations in the same order).
"""

from __future__ import annotations

import numpy as np
import torch

from kdn.errors import CodecError

_F16_MAX = 65504.0


def qmax_of(bits: int) -> int:
    """Largest code of a symmetric ``bits``-bit quantizer (8 -> 127, 4 -> 7)."""
    assert 2 <= bits <= 8, bits
    return (1 << (bits - 1)) - 1


# --- float16 parameter rounding ----------------------------------------------


def f16_up(s: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= each float32 in ``s`` (so a scale never shrinks when stored)."""
    h = s.to(torch.float16)
    low = h.to(torch.float32) < s
    return torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def f16_down(m: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= each float32 in ``m`` (so a group minimum never rises when stored)."""
    h = m.to(torch.float16)
    high = h.to(torch.float32) > m
    return torch.where(high, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _f16_up_ref(s: np.float32) -> np.float16:
    h = np.float16(s)
    return np.nextafter(h, np.float16(np.inf)) if np.float32(h) < s else h


def _f16_down_ref(m: np.float32) -> np.float16:
    h = np.float16(m)
    return np.nextafter(h, np.float16(-np.inf)) if np.float32(h) > m else h


def _check_finite(x: torch.Tensor) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise CodecError("lossy codecs take finite values only (found NaN or inf)")
    if x.numel() and float(x.abs().max()) > _F16_MAX * 0.5:
        # Scales and minimums are stored as float16; KV values are nowhere near this.
        raise CodecError(f"values up to {float(x.abs().max()):.3g} exceed the float16 parameter range")


# --- symmetric absmax, one scale per row ---------------------------------------


def quantize_absmax(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [R, C]`` float32 -> codes ``[R, C]`` int8 in ``[-qmax, qmax]`` and scales ``[R]`` float16."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    _check_finite(x)
    qmax = qmax_of(bits)
    amax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])  # amax: [R]
    s16 = f16_up(amax / qmax)  # s16: [R]
    s = s16.to(torch.float32)[:, None]  # s: [R, 1]
    q = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0)  # q: [R, C]
    return q.round_().clamp_(-qmax, qmax).to(torch.int8), s16


def dequantize_absmax(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes ``[R, C]`` and scales ``[R]`` float16 -> float32 ``[R, C]``."""
    return q.to(torch.float32) * scale.to(torch.float32)[:, None]  # [R, C]


def quantize_absmax_ref(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    qmax = qmax_of(bits)
    q = np.zeros(x.shape, np.int8)
    scales = np.zeros(x.shape[0], np.float16)
    for r in range(x.shape[0]):
        amax = np.float32(np.abs(x[r]).max()) if x.shape[1] else np.float32(0)
        s16 = _f16_up_ref(np.float32(amax / np.float32(qmax)))
        scales[r] = s16
        if s16 > 0:
            q[r] = np.clip(np.round(x[r] / np.float32(s16)), -qmax, qmax).astype(np.int8)
    return q, scales


def dequantize_absmax_ref(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    out = np.zeros(q.shape, np.float32)
    for r in range(q.shape[0]):
        out[r] = q[r].astype(np.float32) * np.float32(scale[r])
    return out


# --- asymmetric groups (min + scale) --------------------------------------------


def _pad_cols(x: torch.Tensor, group: int) -> torch.Tensor:
    """Pad ``[R, C]`` to a multiple of ``group`` columns by repeating the last column (min/max unchanged)."""
    c = x.shape[1]
    cp = -(-c // group) * group
    if cp == c:
        return x
    idx = torch.arange(cp).clamp_(max=c - 1)
    return x[:, idx]  # [R, Cp]


def quantize_groups(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x: [R, C]`` -> codes ``[R, Cp]`` uint8 in ``[0, 2^bits-1]`` (``Cp`` = C rounded up to ``group``),
    scales ``[R, G]`` and minimums ``[R, G]`` float16, ``G = Cp / group``."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0, (x.shape, x.dtype)
    _check_finite(x)
    levels = (1 << bits) - 1
    xp = _pad_cols(x, group)  # xp: [R, Cp]
    r, cp = xp.shape
    xg = xp.view(r, cp // group, group)  # xg: [R, G, group]
    mn16 = f16_down(xg.amin(dim=2))  # mn16: [R, G]
    mn = mn16.to(torch.float32)
    s16 = f16_up((xg.amax(dim=2) - mn) / levels)  # s16: [R, G]
    s = s16.to(torch.float32)
    safe = torch.where(s > 0, s, 1.0)[..., None]  # [R, G, 1]
    q = torch.where(s[..., None] > 0, (xg - mn[..., None]) / safe, 0.0)  # q: [R, G, group]
    return q.round_().clamp_(0, levels).to(torch.uint8).view(r, cp), s16, mn16


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cols: int) -> torch.Tensor:
    """Codes ``[R, Cp]``, scales and minimums ``[R, G]`` -> float32 ``[R, cols]``."""
    r, cp = q.shape
    g = scale.shape[1]
    qg = q.view(r, g, cp // g).to(torch.float32)  # qg: [R, G, group]
    x = qg * scale.to(torch.float32)[..., None]
    x += mn.to(torch.float32)[..., None]
    return x.view(r, cp)[:, :cols]  # [R, cols]


def quantize_groups_ref(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    levels = (1 << bits) - 1
    r, c = x.shape
    ng = -(-c // group)
    q = np.zeros((r, ng * group), np.uint8)
    scales = np.zeros((r, ng), np.float16)
    mins = np.zeros((r, ng), np.float16)
    for i in range(r):
        for g in range(ng):
            vals = x[i, g * group : min((g + 1) * group, c)]
            mn16 = _f16_down_ref(np.float32(vals.min()))
            s16 = _f16_up_ref(np.float32((np.float32(vals.max()) - np.float32(mn16)) / np.float32(levels)))
            scales[i, g], mins[i, g] = s16, mn16
            if s16 > 0:
                codes = np.clip(np.round((vals - np.float32(mn16)) / np.float32(s16)), 0, levels)
            else:
                codes = np.zeros(len(vals))
            full = np.full(group, codes[-1])  # the padding repeats the last value's code
            full[: len(vals)] = codes
            q[i, g * group : (g + 1) * group] = full
    return q, scales, mins


def dequantize_groups_ref(q: np.ndarray, scale: np.ndarray, mn: np.ndarray, cols: int) -> np.ndarray:
    r, cp = q.shape
    group = cp // scale.shape[1]
    out = np.zeros((r, cp), np.float32)
    for i in range(r):
        for g in range(scale.shape[1]):
            sl = slice(g * group, (g + 1) * group)
            out[i, sl] = q[i, sl].astype(np.float32) * np.float32(scale[i, g]) + np.float32(mn[i, g])
    return out[:, :cols]


# --- nibble packing --------------------------------------------------------------


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N]`` uint8 in ``[0, 15]`` -> bytes ``[ceil(N/2)]``: element 2i in the low nibble, 2i+1 in the high."""
    assert codes.dim() == 1 and codes.dtype == torch.uint8
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)  # pairs: [N/2, 2]
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: bytes ``[ceil(n/2)]`` -> codes ``[n]`` uint8."""
    assert packed.dim() == 1 and packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    out = torch.stack([packed & 0x0F, packed >> 4], dim=1)  # out: [ceil(n/2), 2]
    return out.view(-1)[:n]


def pack_nibbles_ref(codes: np.ndarray) -> bytes:
    out = bytearray((len(codes) + 1) // 2)
    for i, c in enumerate(codes):
        out[i // 2] |= int(c) << (4 * (i % 2))
    return bytes(out)


def unpack_nibbles_ref(packed: bytes, n: int) -> np.ndarray:
    return np.array([(packed[i // 2] >> (4 * (i % 2))) & 0x0F for i in range(n)], np.uint8)


# --- CacheGen-style anchor + delta ------------------------------------------------


def delta_quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x: [T, C]`` (tokens x channels) -> codes ``[T, C]`` int8, anchor scales ``[C]``, delta scales ``[C]`` float16.

    Row ``t`` with ``t % group == 0`` is an anchor: ``round(x / sa)``. Any other
    row is ``round((x - anchor^) / sd)`` with ``anchor^`` the dequantized anchor
    of its group. Both use ``bits``-bit symmetric codes and per-column scales.
    """
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] > 0, (x.shape, x.dtype)
    _check_finite(x)
    t, c = x.shape
    qmax = qmax_of(bits)
    anchors = x[::group]  # anchors: [A, C]
    qa, sa16 = quantize_absmax(anchors.t().contiguous(), bits)  # qa: [C, A], sa16: [C]
    ahat = dequantize_absmax(qa, sa16).t()  # ahat: [A, C]
    owner = torch.arange(t) // group  # owner: [T]
    delta = x - ahat[owner]  # delta: [T, C]; exactly 0 on anchor rows' own reconstruction aside
    is_anchor = (torch.arange(t) % group == 0)[:, None]  # [T, 1]
    delta = torch.where(is_anchor, 0.0, delta)
    qd, sd16 = quantize_absmax(delta.t().contiguous(), bits)  # qd: [C, T], sd16: [C]
    q = torch.where(is_anchor, qa.t()[owner], qd.t())  # q: [T, C]
    assert int(q.abs().max()) <= qmax
    return q.contiguous(), sa16, sd16


def delta_dequantize(q: torch.Tensor, sa: torch.Tensor, sd: torch.Tensor, group: int) -> torch.Tensor:
    """Codes ``[T, C]``, anchor / delta scales ``[C]`` -> float32 ``[T, C]``."""
    t = q.shape[0]
    qf = q.to(torch.float32)  # qf: [T, C]
    ahat = qf[::group] * sa.to(torch.float32)  # ahat: [A, C]
    owner = torch.arange(t) // group  # owner: [T]
    x = qf * sd.to(torch.float32)  # x: [T, C] (delta part)
    x += ahat[owner]
    x[::group] = ahat  # anchor rows are the anchors themselves
    return x


def delta_quantize_ref(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    t, c = x.shape
    anchor_rows = list(range(0, t, group))
    qa, sa = quantize_absmax_ref(x[anchor_rows].T, bits)  # qa: [C, A]
    ahat = dequantize_absmax_ref(qa, sa).T  # [A, C]
    delta = np.zeros_like(x)
    for r in range(t):
        if r % group:
            delta[r] = x[r] - ahat[r // group]
    qd, sd = quantize_absmax_ref(delta.T, bits)  # qd: [C, T]
    q = qd.T.copy()
    for a, r in enumerate(anchor_rows):
        q[r] = qa[:, a]
    return q, sa, sd


def delta_dequantize_ref(q: np.ndarray, sa: np.ndarray, sd: np.ndarray, group: int) -> np.ndarray:
    t, c = q.shape
    out = np.zeros((t, c), np.float32)
    for r in range(t):
        anchor = q[(r // group) * group].astype(np.float32) * sa.astype(np.float32)
        out[r] = anchor if r % group == 0 else q[r].astype(np.float32) * sd.astype(np.float32) + anchor
    return out
