"""The engine's loader: turn fetched chunk states back into a transformers cache.

``build_cache`` gives the cache the model would hold after prefilling chunks
``0..k`` itself: attention K/V concatenated along the sequence, Mamba /
linear-attention conv and recurrent states taken from the last chunk (each
chunk's object carries the state as it stands at its end). With lossless
states, generation continues bit-identically (see tests/adapters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kdn.errors import ModelMismatch
from kdn.adapters.hf.extract import LayerSpec, _forward, layer_layout, new_cache


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ModelMismatch(msg)


def _check_names(chunks: Sequence[Mapping[str, torch.Tensor]], layout: list[LayerSpec]) -> None:
    kv_names = {f"L{s.index}.{x}" for s in layout if s.kv for x in ("k", "v")}
    state_names = {st.name for s in layout for st in s.states}
    for c, chunk in enumerate(chunks):
        names = set(chunk)
        last = c == len(chunks) - 1
        # Earlier chunks may leave their (superseded) states out: only the last one's are used.
        missing = kv_names - names if not last else (kv_names | state_names) - names
        extra = names - kv_names - state_names
        _expect(
            not missing and not extra,
            f"chunk {c} does not fit this model ({len(layout)} layers): "
            f"lacks {sorted(missing)[:4]}, has no place for {sorted(extra)[:4]}",
        )


def _chunk_len(c: int, chunk: Mapping[str, torch.Tensor], layout: list[LayerSpec]) -> int:
    """The token count of a chunk: the sequence dim of its K/V, checked against every attention layer."""
    n = None
    for s in layout:
        if not s.kv:
            continue
        for x in ("k", "v"):
            t = chunk[f"L{s.index}.{x}"]
            _expect(
                t.dim() == 3 and (t.shape[0], t.shape[2]) == s.kv,
                f"chunk {c} L{s.index}.{x} has shape {tuple(t.shape)}; this model wants [{s.kv[0]}, n, {s.kv[1]}]",
            )
            n = t.shape[1] if n is None else n
            _expect(t.shape[1] == n, f"chunk {c} L{s.index}.{x} covers {t.shape[1]} tokens, other layers {n}")
    _expect(n is not None, "this model has no attention layer: the token count of a chunk is unknown")
    return int(n)


def build_cache(
    model: Any,
    chunks: Sequence[Mapping[str, torch.Tensor]],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Any, int]:
    """A ``DynamicCache`` equal to the model's own after prefilling chunks ``0..k``, and its token count.

    ``chunks`` are the tensor dicts of consecutive chunks from the first one, as
    ``extract_chunks`` made them. Tensors go to ``device`` (default: the model's)
    and to the dtype the model's own cache uses for them (``dtype`` overrides it
    for K/V and conv states; recurrent states keep the model's own, float32).
    Raises ``ModelMismatch`` when a name, shape or layer layout does not fit.
    """
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    layout = layer_layout(model)
    cache = new_cache(model)
    _expect(len(cache.layers) == len(layout), f"cache has {len(cache.layers)} layers, probe saw {len(layout)}")
    if not chunks:
        return cache, 0
    _check_names(chunks, layout)
    n_tokens = sum(_chunk_len(c, chunk, layout) for c, chunk in enumerate(chunks))
    device = torch.device(device) if device is not None else next(model.parameters()).device
    last = chunks[-1]
    for spec, layer in zip(layout, cache.layers):
        if spec.kv:
            assert isinstance(layer, DynamicLayer)
            kd = dtype or spec.kv_dtype
            k = torch.cat([c[f"L{spec.index}.k"] for c in chunks], dim=1)  # [kv_heads, S, head_dim]
            v = torch.cat([c[f"L{spec.index}.v"] for c in chunks], dim=1)
            k = k.to(device=device, dtype=kd)[None]  # [1, kv_heads, S, head_dim]
            v = v.to(device=device, dtype=kd)[None]
            # Set the documented fields rather than `update`, whose cat onto an
            # empty tensor would copy the whole prefix KV a second time.
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        if spec.states:
            assert isinstance(layer, LinearAttentionCacheLayerMixin)
            for st in spec.states:
                t = last[st.name]
                _expect(tuple(t.shape) == st.shape, f"{st.name} has shape {tuple(t.shape)}; this model wants {list(st.shape)}")
                if st.conv:
                    t = t.to(device=device, dtype=dtype or st.dtype)[None]  # [1, conv_dim, d_conv]
                    # A fresh layer takes this as a prefill: zeros of shape t, then copy.
                    layer.update_conv_state(t, state_idx=st.slot, conv_kernel_size=t.shape[-1])
                else:
                    layer.update_recurrent_state(t.to(device=device, dtype=st.dtype)[None], state_idx=st.slot)
                # Without this flag the next forward treats the layer as empty and ignores the state.
                layer.has_previous_state[st.slot] = True
    return cache, n_tokens


def continue_from_cache(model: Any, cache: Any, n_cached: int, suffix_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Run ``suffix_ids`` at positions ``n_cached..`` on top of ``cache`` (updated in place); logits ``[n, vocab]``."""
    ids = torch.as_tensor(suffix_ids, dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():
        return _forward(model, cache, ids, n_cached, logits=True).logits[0]
