"""CacheBlend's tensor work: compose standalone chunks, measure KV deviation, pick the tokens to recompute.

CacheBlend (Yao et al., EuroSys'25) reuses the KV of chunks that were each
computed on their own, in any order. Their keys sit at the wrong positions
(fixed by a RoPE shift, ``compose``) and lack the cross-attention to the
chunks before them (fixed by recomputing the few tokens whose KV deviates
most, ``select_tokens``). The layer-by-layer driver that uses these lives with
the engine adapter (``kdn.adapters.hf.blend``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kdn.kernels.rope import rope_of, rope_shift


def n_select(n: int, ratio: float) -> int:
    """How many of ``n`` candidates a ``ratio`` selects: ``round(ratio * n)``, at least 1 when ``ratio > 0``."""
    assert 0.0 <= ratio <= 1.0, ratio
    if ratio == 0.0 or n == 0:
        return 0
    return min(n, max(1, int(math.floor(ratio * n + 0.5))))


def select_tokens(deviation: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending, int64) of the ``n_select(n, ratio)`` tokens with the largest ``deviation`` ``[n]``.

    Ties go to the earlier token, so the choice is deterministic.
    """
    assert deviation.dim() == 1, deviation.shape
    assert bool(torch.isfinite(deviation).all()), "deviation has NaN/inf"
    k = n_select(deviation.numel(), ratio)
    # A stable descending sort keeps equal deviations in index order (topk does not promise that).
    order = torch.sort(deviation.float(), descending=True, stable=True).indices  # [n]
    return torch.sort(order[:k]).values


def select_tokens_ref(deviation: Sequence[float] | torch.Tensor, ratio: float) -> list[int]:
    """Plain-Python reference of ``select_tokens``."""
    dev = [float(x) for x in deviation]
    k = n_select(len(dev), ratio)
    return sorted(sorted(range(len(dev)), key=lambda i: (-dev[i], i))[:k])


def kv_deviation(k_true: torch.Tensor, v_true: torch.Tensor, k_reused: torch.Tensor,
                 v_reused: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 distance of K and V over heads and head dims: ``[.., H, n, D]`` x4 -> ``[n]``."""
    assert k_true.shape == k_reused.shape and v_true.shape == v_reused.shape, (k_true.shape, k_reused.shape)
    dk = (k_true.float() - k_reused.float()).pow(2)  # [.., H, n, D]
    dv = (v_true.float() - v_reused.float()).pow(2)
    dims = [d for d in range(dk.dim()) if d != dk.dim() - 2]
    return dk.sum(dim=dims) + dv.sum(dim=dims)  # [n]


def query_attention(q: torch.Tensor, K: torch.Tensor, positions: torch.Tensor, scale: float,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The attention each key gets from the query tokens, averaged over query heads and tokens: ``[S]``.

    ``q`` ``[1, Hq, t, D]`` (rotated) of the query tokens at ``positions`` ``[t]``; ``K`` ``[1, Hkv, S, D]``
    (rotated; ``Hq`` a multiple of ``Hkv``, grouped-query heads share a key head). Causal: a query sees the
    keys up to its own position. ``bias``: an additive ``[1, Hq, t, S]`` term on the scores (steering: the
    attention the steered model pays). Each query's weights sum to 1, so the result sums to 1 (float32).
    """
    Hq, Hkv = q.shape[1], K.shape[1]
    assert Hq % Hkv == 0 and q.shape[-1] == K.shape[-1], (q.shape, K.shape)
    S = K.shape[2]
    Kq = K.float().repeat_interleave(Hq // Hkv, dim=1)  # [1, Hq, S, D]
    scores = (q.float() @ Kq.transpose(-1, -2)) * scale  # [1, Hq, t, S]
    if bias is not None:
        scores = scores + bias.float()
    seen = torch.arange(S, device=K.device)[None, :] <= positions.to(K.device)[:, None]  # [t, S]
    scores = scores.masked_fill(~seen[None, None], float("-inf"))
    return scores.softmax(dim=-1).mean(dim=(0, 1, 2))  # [S]


def query_attention_ref(q: torch.Tensor, K: torch.Tensor, positions: Sequence[int], scale: float,
                        bias: torch.Tensor | None = None) -> list[float]:
    """Plain reference of ``query_attention``: one query head and token at a time, float64."""
    Hq, Hkv, t = q.shape[1], K.shape[1], q.shape[2]
    S = K.shape[2]
    acc = [0.0] * S
    for h in range(Hq):
        kh = K[0, h // (Hq // Hkv)].double()
        for i in range(t):
            m = int(positions[i]) + 1
            s = (kh[:m] @ q[0, h, i].double()) * scale
            if bias is not None:
                s = s + bias[0, h, i, :m].double()
            w = torch.softmax(s, dim=0)
            for j in range(m):
                acc[j] += float(w[j]) / (Hq * t)
    return acc


def query_weighted(deviation: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The ``deviation-query`` score: ``deviation * sqrt(attention)`` per token (both ``[n]``, float32).

    CacheBlend's deviation says how wrong a reused token's state is; the query's attention says how much
    the answer reads it. The square root keeps the deviation the main term: the product alone ranks a
    token that the question attends to but whose state is nearly right above one that is badly wrong
    (it cost quality in the trial, docs/whitebox.md).
    """
    assert deviation.shape == attention.shape, (deviation.shape, attention.shape)
    return deviation.float() * attention.float().clamp_min(0).sqrt()


def compose(chunks: Sequence[Mapping[str, torch.Tensor] | None], lengths: Sequence[int], rope: Any,
            layers: Sequence[int], *, kv_shape: tuple[int, int], dtype: torch.dtype,
            device: torch.device | str = "cpu",
            starts: Sequence[int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Concatenate standalone chunks into one context: per layer K ``[1, H, S, D]`` (shifted) and V.

    ``chunks[j]`` holds ``L{i}.k`` / ``L{i}.v`` ``[H, lengths[j], D]`` computed at
    positions ``0..lengths[j]-1``, or is ``None`` for a segment computed fresh
    (zeros here: the driver overwrites them). Chunk ``j`` lands at offset
    ``sum(lengths[:j])``; its keys are rotated there. ``starts[j]`` (default 0): the position chunk ``j``'s
    first token was computed at (a slice of a prefix chain, ``kdn.adapters.hf.edits``): its keys turn by
    ``offset - starts[j]``, none when the slice lands where it was computed.

    Every layer's K (and V) is a view of one ``[layers, 1, H, S, D]`` tensor, and a
    chunk's keys are shifted for all layers in one in-place ``rope_shift``, in the
    wider of the chunk's and ``dtype``'s precision: bit for bit
    ``rope_shift(k.to(wider), offset).to(dtype)`` per layer, in a thirtieth of the calls.
    """
    r = rope_of(rope)
    H, D = kv_shape
    S = sum(lengths)
    layers = list(layers)
    if not layers:
        return [], []
    K = torch.empty(len(layers), 1, H, S, D, dtype=dtype, device=device)  # [layers, 1, H, S, D]
    V = torch.empty_like(K)
    off = 0
    for j0, (chunk, n) in enumerate(zip(chunks, lengths)):
        delta = off - (starts[j0] if starts is not None else 0)
        if chunk is None:
            K[:, :, :, off:off + n] = 0
            V[:, :, :, off:off + n] = 0
        else:
            ks = [chunk[f"L{i}.k"] for i in layers]
            vs = [chunk[f"L{i}.v"] for i in layers]
            for j, (k, v) in enumerate(zip(ks, vs)):
                assert tuple(k.shape) == (H, n, D) and tuple(v.shape) == (H, n, D), (k.shape, (H, n, D))
                V[j, 0, :, off:off + n] = v
            dst = K[:, 0, :, off:off + n]  # [layers, H, n, D]
            if delta and torch.promote_types(ks[0].dtype, dtype) != dtype:
                # Rotating after a narrowing cast would round twice: rotate the chunk's own values, then cast.
                dst[:] = rope_shift(torch.stack(ks).to(device), delta, r)
            else:
                for j, k in enumerate(ks):
                    dst[j] = k
                if delta:
                    rope_shift(dst, delta, r, out=dst)  # every layer in one call, in place
        off += n
    return list(K.unbind(0)), list(V.unbind(0))
