"""Room after a loaded prefix: the suffix and the generated tokens written in place, never concatenated.

transformers' ``DynamicLayer.update`` concatenates: the first forward after a
load copies the whole loaded prefix's K/V into fresh memory (SmolLM2 at 8k
tokens: 189 MB, 30-50 ms on this project's 2-core VM with warm pages and far
more with cold ones), and every decode step copies it all again. A
``CacheBuilder`` made with ``room`` allocates each layer's K/V with that many
tokens of room after the prefix, and the cache it finishes holds a
``RoomLayer`` per plain attention layer: new tokens are written into the room
while they fit; past it (or once anything replaced the layer's tensors: a
batch reorder, an offload) the layer concatenates as transformers' own does.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class RoomLayer(DynamicLayer):  # type: ignore[misc]  # (transformers is untyped)
    """A ``DynamicLayer`` whose K/V are the first ``n`` tokens of ``[B, H, capacity, D]`` storage."""

    def __init__(self, keys_full: torch.Tensor, values_full: torch.Tensor, n: int) -> None:
        super().__init__()
        assert keys_full.shape == values_full.shape and keys_full.dim() == 4, (keys_full.shape, values_full.shape)
        assert 0 <= n <= keys_full.shape[-2], (n, keys_full.shape)
        self.lazy_initialization(keys_full, values_full)
        self._full: tuple[torch.Tensor, torch.Tensor] | None = (keys_full, values_full)
        self.keys, self.values = keys_full[..., :n, :], values_full[..., :n, :]

    @property
    def capacity(self) -> int:
        """Tokens this layer holds before it falls back to concatenation (0 once it has)."""
        return self._full[0].shape[-2] if self._full is not None else 0

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the new tokens go into the room: the layer's tensors are still a prefix of the storage
        (a crop keeps them so; anything that made new tensors does not), and they fit."""
        if self._full is None or self.keys is None or self.values is None:
            return False
        fk, fv = self._full
        k, v = self.keys, self.values
        return (k.data_ptr() == fk.data_ptr() and v.data_ptr() == fv.data_ptr()
                and k.stride() == fk.stride() and v.stride() == fv.stride()
                and k.shape[:-2] == fk.shape[:-2] == key_states.shape[:-2] == value_states.shape[:-2]
                and k.shape[-1] == key_states.shape[-1] and v.shape[-1] == value_states.shape[-1]
                and key_states.dtype == fk.dtype and value_states.dtype == fv.dtype
                and key_states.shape[-2] == value_states.shape[-2]
                and k.shape[-2] + key_states.shape[-2] <= fk.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(key_states, value_states):
            self._full = None  # concatenation from here on (the storage goes when nothing views it)
            return super().update(key_states, value_states, *args, **kwargs)
        assert self._full is not None  # (_fits checked it)
        fk, fv = self._full
        a = self.keys.shape[-2]
        b = a + key_states.shape[-2]
        fk[..., a:b, :].copy_(key_states)
        fv[..., a:b, :].copy_(value_states)
        self.keys, self.values = fk[..., :b, :], fv[..., :b, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._full = None
        super().reset()


def install(cache: Any, position: int, keys_full: torch.Tensor, values_full: torch.Tensor, n: int) -> None:
    """Layer ``position`` of ``cache`` (a plain ``DynamicLayer``) replaced by a ``RoomLayer`` over the storage."""
    assert type(cache.layers[position]) is DynamicLayer, type(cache.layers[position])
    cache.layers[position] = RoomLayer(keys_full, values_full, n)
