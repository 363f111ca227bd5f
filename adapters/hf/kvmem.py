"""Where a ``CacheBuilder``'s K/V live: host tensors from the arena, or one stack per device, and the copy stream.

Split from ``cache.py`` (the builder): how the memory is laid out and owned, not how chunks land in it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from kdn.adapters.hf.extract import LayerSpec

if TYPE_CHECKING:  # pragma: no cover
    from kdn.wire.arena import Arena


@functools.cache
def side_stream(device: torch.device) -> Any:
    """The stream a device's loads copy on: one per device (a stream per builder would each keep its own
    cached copy buffers in the caching allocator)."""
    return torch.cuda.Stream(device)


def device_tensors(layout: list[LayerSpec], order: Sequence[str], tokens: int, device: torch.device
                    ) -> tuple[torch.Tensor | None, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Each attention layer's ``[1, kv_heads, tokens, head_dim]`` K and V on the device. When every layer
    has one shape and dtype they are slices of one ``[2 x layers, kv_heads, tokens, head_dim]`` stack, in
    ``order`` (the order an object stores them in): a chunk's K/V region is then placed by one copy."""
    specs = [s for s in layout if s.kv and s.kv_dtype is not None]
    if len({(s.kv, s.kv_dtype) for s in specs}) != 1:
        return None, {s.index: (torch.empty((1, s.kv[0], tokens, s.kv[1]), dtype=s.kv_dtype, device=device),
                                torch.empty((1, s.kv[0], tokens, s.kv[1]), dtype=s.kv_dtype, device=device))
                      for s in specs if s.kv is not None}
    heads, dim = cast(tuple[int, int], specs[0].kv)
    stack = torch.empty((len(order), heads, tokens, dim), dtype=specs[0].kv_dtype, device=device)
    slot = {nm: p for p, nm in enumerate(order)}
    return stack, {s.index: (stack[slot[f"L{s.index}.k"]][None], stack[slot[f"L{s.index}.v"]][None]) for s in specs}


def kv_tensors(layout: list[LayerSpec], tokens: int, arena: Arena | None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's ``[1, kv_heads, tokens, head_dim]`` K and V, fresh or in one arena lease.

    Fresh memory pays for every page on first touch: for SmolLM2 at 8k tokens (189 MB) writing into fresh
    tensors took 70-84 ms against 17-26 ms reused, here. From an arena, the tensors are views of one
    buffer; the lease goes back when the last of them is garbage (the engine's cache dropped them: at the
    end of the generation, or at its first new token past the builder's room, where the layer concatenates
    into fresh memory), never while a view lives.
    """
    specs = [(s.index, s.kv, s.kv_dtype) for s in layout if s.kv and s.kv_dtype is not None]
    if arena is None:
        return {i: (torch.empty((1, kv[0], tokens, kv[1]), dtype=dt), torch.empty((1, kv[0], tokens, kv[1]), dtype=dt))
                for i, kv, dt in specs}
    sizes = [kv[0] * tokens * kv[1] * torch.empty(0, dtype=dt).element_size() for _, kv, dt in specs]
    lease = arena.take(2 * sum(sizes))
    # torch keeps the numpy array its storage was made from alive until the storage dies (every view of it,
    # however derived); the array's finalizer hands the lease back then. (A finalizer on the base tensor
    # would fire at once: views hold the storage, not the tensor object.)
    owner = np.frombuffer(lease.view, dtype=np.uint8)
    weakref.finalize(owner, lease.release)
    base = torch.from_numpy(owner)
    del owner
    out, off = {}, 0
    for (i, kv, dt), size in zip(specs, sizes):
        pair = []
        for _ in range(2):
            pair.append(base[off:off + size].view(dt).view(1, kv[0], tokens, kv[1]))
            off += size
        out[i] = (pair[0], pair[1])
    return out


def lanes(t: torch.Tensor) -> Any:
    """A numpy view of ``t``'s memory as unsigned integers of its item size (any strides; numpy has no bf16)."""
    lane = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[t.element_size()]
    return t.view(lane).numpy()
