"""The origin's producer: run a prefill chunk by chunk and take each chunk's states.

One ``DynamicCache(config=model.config)`` holds every layer kind; after each
chunk we copy out what that chunk adds:

- attention layers (``DynamicLayer``): K and V of the chunk's token range only,
  ``L{i}.k`` / ``L{i}.v`` ``[kv_heads, n, head_dim]`` (batch dim dropped);
- Mamba / linear-attention layers (``LinearAttentionLayer``): the conv and
  recurrent states as they stand at the end of the chunk, ``L{i}.conv`` /
  ``L{i}.ssm`` (``L{i}.conv{j}`` / ``L{i}.ssm{j}`` for a layer's state ``j >= 1``);
- hybrid layers (``LinearAttentionAndFullAttentionLayer``, Zamba2, FalconH1): both.

Each tensor keeps its own dtype (recurrent SSM states stay float32 in a bf16
model). Only the chunk's slice is cloned: the model's own cache grows with the
document, but no second copy of the document's KV is kept here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kdn.format.address import DEFAULT_CHUNK_TOKENS, chunk_spans
from kdn.errors import InvalidInput, ModelMismatch

Kind = Literal["kv", "ssm", "hybrid"]


@dataclass
class ChunkState:
    index: int
    start: int  # token offset of the chunk in the input (its first position is start_position + start)
    end: int
    kind: Kind
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class StateSpec:
    """One conv or recurrent state of a Mamba / linear-attention layer, batch dim dropped."""

    name: str  # L{i}.conv / L{i}.ssm (+ slot number for slot >= 1)
    slot: int  # the layer's state_idx
    conv: bool  # conv state (else recurrent)
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LayerSpec:
    """What one layer of a model's cache holds, batch dim dropped."""

    index: int
    kv: tuple[int, int] | None  # (kv_heads, head_dim) of an attention layer
    kv_dtype: torch.dtype | None
    states: tuple[StateSpec, ...]


def state_names(i: int, j: int) -> tuple[str, str]:
    """Names of the conv and recurrent state ``j`` of layer ``i``."""
    suffix = "" if j == 0 else str(j)
    return f"L{i}.conv{suffix}", f"L{i}.ssm{suffix}"


def kind_of(layout: list[LayerSpec]) -> Kind:
    attn = any(s.kv for s in layout)
    ssm = any(s.states for s in layout)
    return "hybrid" if attn and ssm else ("kv" if attn else "ssm")


# Families whose transformers implementation cannot continue a multi-token forward
# from a cached state; chunked prefill (and so every chunk after the first, and any
# continuation after loading) would be silently wrong. Checked against transformers 5.24.
UNSUPPORTED_FAMILIES = {
    "jamba": "JambaMambaMixer's multi-token path calls mamba_selective_scan without the cached "
    "recurrent state (it starts from zeros); only single-token decode reads it",
}


def new_cache(model: Any) -> Any:
    """A fresh ``DynamicCache`` for ``model``, refusing layer kinds whose states we cannot cut into chunks."""
    from transformers import DynamicCache

    why = UNSUPPORTED_FAMILIES.get(getattr(model.config, "model_type", ""))
    if why:
        raise ModelMismatch(f"{model.config.model_type} models are not supported: {why}")
    from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

    cache = DynamicCache(config=model.config)
    supported = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)
    for i, layer in enumerate(cache.layers):
        # Exact classes only: sliding-window layers keep a rolling window (a chunk's
        # KV is not a slice of it), indexed / dummy / static layers keep other things.
        if type(layer) not in supported:
            raise ModelMismatch(f"layer {i} uses a {type(layer).__name__} cache layer, which KDN does not support yet")
    return cache


def _as_ids(model: Any, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise InvalidInput(f"token ids must be one-dimensional, got shape {tuple(ids.shape)}")
    return ids.to(model.device)


def _forward(model: Any, cache: Any, ids: torch.Tensor, first_position: int, *, logits: bool,
             keep: int | None = None) -> Any:
    # Explicit position_ids: Bamba (and others) do not offset positions by the cache length.
    pos = torch.arange(first_position, first_position + ids.numel(), device=ids.device)[None]  # [1, n]
    keep = keep if logits else 1  # skip the vocab projection of all but the tokens whose logits are wanted
    kw = {} if keep is None else {"logits_to_keep": keep}
    # ``past_key_values=``: transformers 5.24 renamed it ``cache=`` (keeping the old name), but the 5.19
    # that vLLM pins only knows the old one and would silently start from an empty cache of its own.
    return model(input_ids=ids[None], position_ids=pos, past_key_values=cache, use_cache=True, **kw)


def _steps(model: Any, ids: torch.Tensor, chunk_tokens: int | None, start_position: int,
           cache: Any = None) -> Iterator[tuple[int, int, int, Any]]:
    """Prefill ``ids`` chunk by chunk into one cache; yield ``(index, start, end, cache)`` after each chunk."""
    cache = new_cache(model) if cache is None else cache
    spans = chunk_spans(ids.numel(), chunk_tokens or max(ids.numel(), 1))
    for index, (s, e) in enumerate(spans):
        # Inference mode per step, not around the loop: a `with` in a generator
        # stays entered while it is suspended at `yield`, i.e. in the caller's code.
        with torch.inference_mode():
            _forward(model, cache, ids[s:e], start_position + s, logits=False)
        yield index, s, e, cache


def prefill(model: Any, token_ids: list[int] | torch.Tensor, *, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
            start_position: int = 0) -> Any:
    """The cache after prefilling ``token_ids`` in chunks of ``chunk_tokens`` (``None``: one forward pass)."""
    cache = None
    for *_, cache in _steps(model, _as_ids(model, token_ids), chunk_tokens, start_position):
        pass
    return cache if cache is not None else new_cache(model)


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _take(cache: Any, s: int, e: int) -> dict[str, torch.Tensor]:
    """The states chunk ``[s, e)`` added to ``cache`` (cache positions count from the first token)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicLayer):
            assert layer.keys.shape[-2] == e, (layer.keys.shape, e)
            out[f"L{i}.k"] = _clone(layer.keys[0, :, s:e])  # [kv_heads, n, head_dim]
            out[f"L{i}.v"] = _clone(layer.values[0, :, s:e])
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for j in range(layer.number_of_states):
                conv_name, ssm_name = state_names(i, j)
                if layer.is_conv_states_initialized[j]:
                    out[conv_name] = _clone(layer.conv_states[j][0])  # [conv_dim, d_conv]
                if layer.is_recurrent_states_initialized[j]:
                    out[ssm_name] = _clone(layer.recurrent_states[j][0])  # model specific, float32
    return out


def extract_chunks(model: Any, token_ids: list[int] | torch.Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                   start_position: int = 0, cache: Any = None, cached_tokens: int = 0) -> Iterator[ChunkState]:
    """Prefill ``token_ids`` chunk by chunk and yield each chunk's states as it completes.

    ``start_position`` is the position of ``token_ids[0]`` (RoPE offset); chunk
    ``start``/``end`` are offsets into ``token_ids``. To resume a document whose
    first chunks are already stored, pass the cache rebuilt from them
    (``build_cache``) as ``cache`` and its length as ``cached_tokens``; then
    ``token_ids`` are the remaining tokens and ``start_position`` is usually
    ``cached_tokens``.
    """
    ids = _as_ids(model, token_ids)
    kind = kind_of(layer_layout(model))
    for index, s, e, c in _steps(model, ids, chunk_tokens, start_position, cache):
        yield ChunkState(index=index, start=s, end=e, kind=kind, tensors=_take(c, cached_tokens + s, cached_tokens + e))


def standalone_chunk(model: Any, token_ids: list[int] | torch.Tensor) -> ChunkState:
    """One chunk's states computed on its own, at positions ``0..n-1``, with a fresh cache."""
    ids = _as_ids(model, token_ids)
    if ids.numel() == 0:
        raise InvalidInput("a chunk needs at least one token")
    (_, s, e, cache), = _steps(model, ids, None, 0)
    return ChunkState(index=0, start=s, end=e, kind=kind_of(layer_layout(model)), tensors=_take(cache, s, e))


# Layouts are probed once per (model, dtype, device): one-token forward, then read the cache.
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_layout(model: Any) -> list[LayerSpec]:
    """Per layer: attention (kv_heads, head_dim) and conv/recurrent state shapes, from a one-token probe.

    Shapes of Mamba / GatedDeltaNet states are model specific; a probe reads them
    from the model itself instead of re-deriving each family's formulas.
    """
    p = next(model.parameters())
    key = (p.dtype, p.device)
    hit = _LAYOUTS.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    (_, _, _, cache), = _steps(model, torch.zeros(1, dtype=torch.long, device=p.device), None, 0)
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    layout = []
    for i, layer in enumerate(cache.layers):
        kv = kv_dtype = None
        states = []
        if isinstance(layer, DynamicLayer):
            kv, kv_dtype = (layer.keys.shape[1], layer.keys.shape[3]), layer.keys.dtype
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for j in range(layer.number_of_states):
                conv_name, ssm_name = state_names(i, j)
                if layer.is_conv_states_initialized[j]:
                    t = layer.conv_states[j]
                    states.append(StateSpec(conv_name, j, True, tuple(t.shape[1:]), t.dtype))
                if layer.is_recurrent_states_initialized[j]:
                    t = layer.recurrent_states[j]
                    states.append(StateSpec(ssm_name, j, False, tuple(t.shape[1:]), t.dtype))
        layout.append(LayerSpec(index=i, kv=kv, kv_dtype=kv_dtype, states=tuple(states)))
    _LAYOUTS[model] = (key, layout)
    return layout
