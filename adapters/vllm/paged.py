"""K/V in and out of vLLM's paged cache, in whatever layout the attention backend keeps it.

Writing goes through the backend itself: ``layer.impl.do_kv_cache_update`` is
the very call vLLM makes to store the K/V it computes (every 0.32 backend has
it), so a loaded token lands exactly where and how a computed one would, on
any backend and CPU ISA. Slots are manager-block slots, ``block_id *
block_size + offset``, as vLLM's own slot mappings are.

Reading (the producer side) needs the layout spelled out. ``find_reader``
tries the layouts we know on a scratch cache written by the backend's own
``do_kv_cache_update`` and keeps the one that reads back every value exactly;
when none does (a backend or ISA we have not seen), saving is refused at
start with an error naming the backend, never done wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdn.errors import KDNError


class LayoutUnknown(KDNError):
    """The attention backend keeps K/V in a layout this connector cannot read."""


def slots(block_ids: Sequence[int], lo: int, hi: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Cache slots of token positions ``[lo, hi)`` of a request whose block table is ``block_ids``."""
    pos = torch.arange(lo, hi, dtype=torch.int64)  # [n]
    table = torch.as_tensor(list(block_ids), dtype=torch.int64)
    idx = pos // block_size
    if len(pos) and int(idx[-1]) >= len(table):
        raise IndexError(f"block table of {len(table)} blocks does not reach token {hi - 1}")
    return (table[idx] * block_size + pos % block_size).to(device)  # [n]


def write(layer: Any, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` ``[n, kv_heads, head_dim]`` at ``slot_mapping`` ``[n]`` the way the backend does."""
    assert k.shape == v.shape and k.dim() == 3 and slot_mapping.shape == (k.shape[0],), (k.shape, slot_mapping.shape)
    layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slot_mapping)


Reader = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _cpu_split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    # CPU_ATTN, ISA vec/vec16: cache [blocks, H, bs, 2D]; within one (block, head) the bs*2D values
    # are K column-major [D, bs] followed by V row-major [bs, D] (csrc/cpu/cpu_attn_vec.hpp).
    nb, h, bs, d2 = cache.shape
    d = d2 // 2
    flat = cache.view(nb, h, 2, bs * d)
    return flat[:, :, 0].view(nb, h, d, bs), flat[:, :, 1].view(nb, h, bs, d), bs


def _read_cpu_vec(cache: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc, bs = _cpu_split(cache)  # kc [nb, H, D, bs], vc [nb, H, bs, D]
    b, o = slot // bs, slot % bs
    return kc[b, :, :, o], vc[b, :, o, :]  # [n, H, D] each


def _read_kv_first(cache: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # FlashAttention / Triton: [2, blocks, bs, H, D]
    bs = cache.shape[2]
    b, o = slot // bs, slot % bs
    return cache[0, b, o], cache[1, b, o]


def _read_block_first(cache: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # FlashInfer: [blocks, 2, bs, H, D]
    bs = cache.shape[2]
    b, o = slot // bs, slot % bs
    return cache[b, 0, o], cache[b, 1, o]


@dataclass(frozen=True)
class _Candidate:
    name: str
    read: Reader
    scratch_shape: Callable[[tuple[int, ...]], tuple[int, ...] | None]  # the real shape -> a 2-block shape


def _cpu_shape(s: tuple[int, ...]) -> tuple[int, ...] | None:
    return (2, *s[1:]) if len(s) == 4 and s[3] % 2 == 0 else None


CANDIDATES = (
    _Candidate("cpu-vec", _read_cpu_vec, _cpu_shape),
    _Candidate("kv-first", _read_kv_first, lambda s: (2, 2, *s[2:]) if len(s) == 5 and s[0] == 2 else None),
    _Candidate("block-first", _read_block_first, lambda s: (2, *s[1:]) if len(s) == 5 and s[1] == 2 else None),
)


def find_reader(layer: Any, kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[str, Reader]:
    """The reader whose layout matches what the backend writes, checked on scratch blocks."""
    tried = []
    for cand in CANDIDATES:
        shape = cand.scratch_shape(tuple(kv_cache.shape))
        if shape is None:
            continue
        scratch = torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        bs = shape[2]
        n = 2 * bs  # fill both scratch blocks, every slot
        gen = torch.Generator(device="cpu").manual_seed(0)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(kv_cache.dtype).to(kv_cache.device)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(kv_cache.dtype).to(kv_cache.device)
        slot = torch.arange(n, dtype=torch.int64, device=kv_cache.device)
        try:
            write(layer, scratch, k, v, slot)
            rk, rv = cand.read(scratch, slot)
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            tried.append(f"{cand.name}: {type(e).__name__}")
            continue
        if rk.shape == k.shape and torch.equal(rk, k) and torch.equal(rv, v):
            return cand.name, cand.read
        tried.append(f"{cand.name}: values differ")
    backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: type(layer.impl).__name__)()
    raise LayoutUnknown(f"cannot read K/V back from the {backend} backend (isa {getattr(layer, 'isa', '-')}, "
                        f"cache {tuple(kv_cache.shape)}): tried {'; '.join(tried) or 'nothing that fits'}")
