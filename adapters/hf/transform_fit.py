"""Fit a ``kvtc`` basis (``kdn.kernels.transform``) for a Hugging Face attention model on calibration text.

Three passes over calibration windows (each a context starting at position 0):

1. Statistics: per layer, the sum and Gram matrix (float64) of un-rotated K
   rows and of V rows (``[C]`` per token, C = kv_heads * head_dim, sink
   tokens excluded: they are stored exactly), and each query head's mean
   square per dim (a forward hook on ``q_proj``: pre-RoPE queries).
2. Metric and PCA: K's ``scale`` is the root of the query energy reading each
   key dim (summed over the query heads sharing the kv head, averaged over the
   RoPE pair, since a relative rotation mixes the pair); V's, the root of the
   squared ``o_proj`` column norms over those heads. Each is normalized to
   RMS 1. The basis is the eigenvectors of the weighted covariance.
3. Sensitivity ``alpha`` per layer and kind: isotropic Gaussian noise of
   variance ``sigma2`` per coefficient is added to that one tensor on every
   non-sink token of a held-out calibration context; ``alpha`` is the mean
   KL(exact || noisy) over the next tokens divided by ``C * sigma2``.

Only Llama-style (``rotate_half``) RoPE families are supported (``kernels/rope.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kdn.adapters.hf.cache import build_cache, continue_from_cache
from kdn.kernels.rope import rope_of
from kdn.kernels.transform import DEFAULT_SINKS, Basis, LayerBasis, rotate


def _attn_layers(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


class _Stats:
    def __init__(self, n_layers: int, c: int, q_dims: int) -> None:
        self.n = 0
        self.s = np.zeros((n_layers, 2, c))
        self.g = np.zeros((n_layers, 2, c, c))
        self.q2 = np.zeros((n_layers, q_dims))
        self.nq = 0


def collect(model: Any, windows: Sequence[torch.Tensor], sink_tokens: int = DEFAULT_SINKS) -> _Stats:
    """Pass 1 over ``windows`` (1-D token id tensors, each prefilled from position 0)."""
    cfg = model.config
    layers = _attn_layers(model)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    c = cfg.num_key_value_heads * hd
    st = _Stats(len(layers), c, cfg.num_attention_heads * hd)
    inv = rope_of(model).inv_freq.double().numpy()
    hooks = []
    for i, attn in enumerate(layers):
        def hook(mod, inp, out, i=i):
            q = out[0, sink_tokens:].double().numpy()  # [n, Hq * D], pre-RoPE
            st.q2[i] += (q * q).sum(0)
        hooks.append(attn.q_proj.register_forward_hook(hook))
    try:
        for ids in windows:
            with torch.no_grad():
                out = model(ids[None], use_cache=True)
            n = ids.numel() - sink_tokens
            st.n += n
            st.nq += n
            for i, layer in enumerate(out.past_key_values.layers):
                k = layer.keys[0].float().permute(1, 0, 2)[sink_tokens:]  # [n, H, D]
                k = rotate(k, torch.arange(sink_tokens, ids.numel()), inv, -1).reshape(n, c).double().numpy()
                v = layer.values[0].float().permute(1, 0, 2)[sink_tokens:].reshape(n, c).double().numpy()
                for j, x in enumerate((k, v)):
                    st.s[i, j] += x.sum(0)
                    st.g[i, j] += x.T @ x
    finally:
        for h in hooks:
            h.remove()
    return st


def metrics(model: Any, st: _Stats) -> np.ndarray:
    """``[n_layers, 2, C]`` scales (K: query energy; V: o_proj column norms), RMS 1 each."""
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = st.q2.shape[1] // hq
    half = rope_of(model).rot_dim // 2
    out = np.zeros((st.s.shape[0], 2, hkv * hd))
    for i, attn in enumerate(_attn_layers(model)):
        q2 = (st.q2[i] / st.nq).reshape(hkv, hq // hkv, hd).sum(1)  # [Hkv, D]
        pair = q2.copy()
        pair[:, :half] = pair[:, half : 2 * half] = 0.5 * (q2[:, :half] + q2[:, half : 2 * half])
        wo = attn.o_proj.weight.detach().double().numpy()  # [hidden, Hq * D]
        col = (wo * wo).sum(0).reshape(hkv, hq // hkv, hd).sum(1)  # [Hkv, D]
        for j, m in enumerate((pair, col)):
            m = np.maximum(m.reshape(-1), 1e-12 * m.max())
            out[i, j] = np.sqrt(m / m.mean())
    return out


def fit_basis(model: Any, model_id: str, windows: Sequence[torch.Tensor], alpha_windows: Sequence[torch.Tensor], *,
              sink_tokens: int = DEFAULT_SINKS, alpha_context: int = 512, alpha_next: int = 128,
              sigma2_frac: float = 0.02, seed: int = 0, alpha_model: Any = None) -> Basis:
    """Passes 1-3: a complete basis. ``alpha_windows`` hold >= alpha_context + alpha_next tokens each.

    ``alpha_model``: the model pass 3 runs (default ``model``). A float32 copy of a bf16 model is better:
    in bf16, any change to the cache moves the logits by bf16 rounding noise (KL ~0.0015 nats on
    SmolLM2-135M whatever the change), which swamps the sensitivity of the less sensitive layers.
    """
    cfg = model.config
    st = collect(model, windows, sink_tokens)
    scales = metrics(model, st)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for i in range(st.s.shape[0]):
        pair = []
        for j in range(2):
            mean = st.s[i, j] / st.n
            cov = st.g[i, j] / st.n - np.outer(mean, mean)
            s = scales[i, j]
            var, vec = np.linalg.eigh(cov * s[:, None] * s[None])
            order = np.argsort(var)[::-1]
            pair.append(LayerBasis(mean.astype(np.float32), s.astype(np.float32),
                                   np.maximum(var[order], 0).astype(np.float32), vec[:, order].astype(np.float32), 1.0))
        layers.append((pair[0], pair[1]))
    inv = rope_of(model).inv_freq.double().numpy()
    basis = Basis(model_id, len(layers), cfg.num_key_value_heads, hd, inv, tuple(layers), sink_tokens)
    alpha = measure_alpha(alpha_model if alpha_model is not None else model, basis, alpha_windows,
                          context=alpha_context, nxt=alpha_next, sigma2_frac=sigma2_frac, seed=seed)
    return with_alpha(basis, alpha)


def with_alpha(basis: Basis, alpha: np.ndarray) -> Basis:
    """``basis`` with the sensitivities ``alpha`` ``[n_layers, 2]``."""
    return Basis(basis.model_id, basis.n_layers, basis.kv_heads, basis.head_dim, basis.inv_freq,
                 tuple((LayerBasis(k.mean, k.scale, k.var, k.basis, float(alpha[i, 0])),
                        LayerBasis(v.mean, v.scale, v.var, v.basis, float(alpha[i, 1])))
                       for i, (k, v) in enumerate(basis.layers)), basis.sink_tokens)


def _kl(exact: torch.Tensor, logits: torch.Tensor) -> float:
    lp = torch.log_softmax(logits.float(), -1)
    return float((exact.exp() * (exact - lp)).sum(-1).mean())


def measure_alpha(model: Any, basis: Basis, windows: Sequence[torch.Tensor], *, context: int, nxt: int,
                  sigma2_frac: float, seed: int) -> np.ndarray:
    """Pass 3: ``[n_layers, 2]`` KL per unit coefficient noise variance (see the module docstring)."""
    from kdn.adapters.hf.extract import extract_chunks

    g = torch.Generator().manual_seed(seed)
    c = basis.channels
    acc = np.zeros((basis.n_layers, 2))
    for ids in windows:
        ctx, cont = ids[:context], ids[context : context + nxt]
        (chunk,) = list(extract_chunks(model, ctx, chunk_tokens=context))
        exact_cache, n = build_cache(model, [chunk.tensors])
        exact = torch.log_softmax(continue_from_cache(model, exact_cache, n, cont).float(), -1)
        ns = basis.sink_tokens
        for i in range(basis.n_layers):
            for j, kind in enumerate("kv"):
                lb = basis.get(i, kind)
                sigma2 = sigma2_frac * float(lb.var.mean())
                noise = torch.randn(context - ns, c, generator=g, dtype=torch.float64) * sigma2**0.5  # [n, C] coefficients
                dw = noise @ torch.from_numpy(lb.basis.astype(np.float64)).T / torch.from_numpy(lb.scale.astype(np.float64))
                dx = dw.float().view(-1, basis.kv_heads, basis.head_dim)  # [n, H, D]
                if kind == "k":
                    dx = rotate(dx, torch.arange(ns, context), basis.inv_freq, 1)
                name = f"L{i}.{kind}"
                t = dict(chunk.tensors)
                noisy = t[name].float().clone()
                noisy[:, ns:] += dx.permute(1, 0, 2)
                t[name] = noisy.to(chunk.tensors[name].dtype)
                cache, n = build_cache(model, [t])
                kl = _kl(exact, continue_from_cache(model, cache, n, cont))
                acc[i, j] += max(kl, 1e-12) / (c * sigma2)
    return acc / len(windows)
