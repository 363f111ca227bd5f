"""K/V in and out of vLLM's paged cache, in whatever layout the attention backend keeps it.

Writing goes through the backend itself: ``layer.impl.do_kv_cache_update`` is
the very call vLLM makes to store the K/V it computes (every 0.32 backend has
it), so a loaded token lands exactly where and how a computed one would, on
any backend and CPU ISA. Slots are manager-block slots, ``block_id *
block_size + offset``, as vLLM's own slot mappings are.

Reading (the producer side, steering) needs the layout. vLLM's CPU backend
keeps a ``[blocks, kv_heads, block_size, 2 * head_dim]`` cache whose block
interiors differ by ISA (``vec``/``vec16``: K column-major, then V row-major;
``amx``: K as ``[bs/16, D/2, 16, 2]`` and V as ``[D/16, bs/2, 16, 2]``, VNNI
pairs; others may come), so ``find_reader`` does not guess it: it *learns*
it. It writes tokens whose values are distinct bit patterns into a scratch
block with the backend's own ``do_kv_cache_update`` and records where each
(token, dim) of K and of V landed: a gather index that reads back any ISA's
block, checked on random values before it is trusted. The GPU layouts
(``[2, blocks, bs, H, D]``, ``[blocks, 2, bs, H, D]``) are tried as before.
When nothing reads back exactly (a backend or ISA we have not seen), saving is
refused at start with an error naming the backend, never done wrongly.
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


# Distinct finite, normal bit patterns of each cache dtype (positive and negative), as integers of its
# width: a probe value can be told from every other one and from the zeros of an unwritten slot, and no
# kernel flushes or canonicalises it.
_PATTERNS = {
    torch.bfloat16: (torch.int16, 0x0080, 0x7F80),
    torch.float16: (torch.int16, 0x0400, 0x7C00),
    torch.float32: (torch.int32, 0x00800000, 0x7F800000),
}


def _probe_values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` distinct normal values of ``dtype`` (as ``dtype``), none zero."""
    idt, lo, hi = _PATTERNS[dtype]
    count = min(n, hi - lo)
    pos = torch.arange(lo, lo + count, dtype=torch.int64)
    vals = torch.cat([pos, pos | (1 << (8 * torch.tensor([], dtype=idt).element_size() - 1))])[:n]
    assert len(vals) == n, (dtype, n)
    return vals.to(idt).view(dtype)


def learn_cpu_layout(layer: Any, kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Where the backend puts token ``o``'s K and V inside a ``(block, head)`` region of ``bs * 2D`` values.

    Returns ``index [2, bs, D]`` (int64): ``region[index[0, o, d]]`` is K[o, d], ``region[index[1, o, d]]``
    is V[o, d]. Raises ``LayoutUnknown`` if the backend's writes are not such a placement (a value lost
    or doubled, another head or block touched, heads placed differently).
    """
    nb, h, bs, d2 = kv_cache.shape
    if d2 != 2 * head_dim or h != kv_heads or kv_cache.dtype not in _PATTERNS:
        raise LayoutUnknown(f"cache {tuple(kv_cache.shape)} {kv_cache.dtype} is not [blocks, {kv_heads}, bs, "
                            f"{2 * head_dim}] of a 16- or 32-bit float")
    region = bs * d2
    idt = _PATTERNS[kv_cache.dtype][0]
    index = torch.full((2, bs, head_dim), -1, dtype=torch.int64)
    _, lo, hi = _PATTERNS[kv_cache.dtype]
    per_pass = max(1, min(bs, (2 * (hi - lo)) // d2))  # tokens whose K and V values stay distinct in one pass
    scratch = torch.zeros((2, h, bs, d2), dtype=kv_cache.dtype, device=kv_cache.device)  # block 1 is written
    for a in range(0, bs, per_pass):
        b = min(bs, a + per_pass)
        n = b - a
        vals = _probe_values(kv_cache.dtype, 2 * n * head_dim)  # [2 n D]
        k = vals[: n * head_dim].view(n, 1, head_dim).expand(n, h, head_dim).contiguous()
        v = vals[n * head_dim:].view(n, 1, head_dim).expand(n, h, head_dim).contiguous()
        scratch.zero_()
        write(layer, scratch, k.to(kv_cache.device), v.to(kv_cache.device),
              torch.arange(bs + a, bs + b, dtype=torch.int64, device=kv_cache.device))
        flat = scratch.view(idt).view(2, h, region).cpu().to(torch.int64)  # [2, H, R]
        if flat[0].any() or not all(torch.equal(flat[1, 0], flat[1, i]) for i in range(1, h)):
            raise LayoutUnknown("the backend's write touched another block, or placed heads differently")
        got = flat[1, 0]  # [R]: the bit pattern at each position of one (block, head) region
        want = vals.view(idt).to(torch.int64) & ((1 << (8 * vals.element_size())) - 1)  # [2 n D], unsigned
        got = got & ((1 << (8 * vals.element_size())) - 1)
        order = torch.argsort(want)
        at = torch.searchsorted(want[order], got).clamp(max=len(want) - 1)
        hit = want[order][at] == got  # positions holding a probe value
        if int(hit.sum()) != len(want) or len(torch.unique(got[hit])) != len(want):
            raise LayoutUnknown(f"the backend's write of {n} tokens did not place each value exactly once")
        src = order[at[hit]]  # which probe value sits at each hit position
        where = torch.nonzero(hit).squeeze(1)
        placed = torch.empty(len(want), dtype=torch.int64)
        placed[src] = where
        index[0, a:b] = placed[: n * head_dim].view(n, head_dim)
        index[1, a:b] = placed[n * head_dim:].view(n, head_dim)
    if (index < 0).any() or len(torch.unique(index)) != index.numel():
        raise LayoutUnknown("the learned placement is not one position per value")
    return index


def cpu_reader(index: torch.Tensor) -> Reader:
    """A reader of ``[blocks, H, bs, 2D]`` caches whose block interior ``learn_cpu_layout`` learned."""
    bs = index.shape[1]

    def read(cache: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Indexed as [blocks, H, bs, 2D], never flattened: a GPU backend's per-layer view of the cache is
        # strided (vLLM's default physical layout puts heads outside blocks), and reshape(-1) would copy the
        # whole layer for every read.
        _, h, _, d2 = cache.shape
        idx = index.to(cache.device)
        b, o = slot // bs, slot % bs  # [n]
        heads = torch.arange(h, device=cache.device)[None, :, None]
        out = []
        for x in (0, 1):  # K, V: each value's learned place in its block, as (row, column) of [bs, 2D]
            at = idx[x, o][:, None, :]  # [n, 1, D]
            out.append(cache[b[:, None, None], heads, at // d2, at % d2])  # [n, H, D]
        return out[0], out[1]

    return read


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


CANDIDATES = (  # the GPU backends' layouts (the CPU one is learned: learn_cpu_layout)
    _Candidate("kv-first", _read_kv_first, lambda s: (2, 2, *s[2:]) if len(s) == 5 and s[0] == 2 else None),
    _Candidate("block-first", _read_block_first, lambda s: (2, *s[1:]) if len(s) == 5 and s[1] == 2 else None),
)


def _reads_back(layer: Any, kv_cache: torch.Tensor, shape: tuple[int, ...], read: Reader, kv_heads: int,
                head_dim: int) -> bool:
    """Random K/V written by the backend into a scratch cache of ``shape`` (2 blocks) read back exactly."""
    scratch = torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    bs = shape[2]
    n = 2 * bs  # fill both scratch blocks, every slot, in a shuffled order
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(kv_cache.dtype).to(kv_cache.device)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(kv_cache.dtype).to(kv_cache.device)
    slot = torch.randperm(n, generator=gen).to(kv_cache.device)
    write(layer, scratch, k, v, slot)
    rk, rv = read(scratch, slot)
    return rk.shape == k.shape and torch.equal(rk, k) and torch.equal(rv, v)


def find_reader(layer: Any, kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[str, Reader]:
    """A reader of what the backend writes: a learned CPU layout, or a known GPU one, checked on scratch blocks."""
    tried = []
    if kv_cache.dim() == 4:
        try:
            read = cpu_reader(learn_cpu_layout(layer, kv_cache, kv_heads, head_dim))
            if _reads_back(layer, kv_cache, (2, *kv_cache.shape[1:]), read, kv_heads, head_dim):
                return f"cpu-learned ({getattr(layer, 'isa', '?')})", read
            tried.append("cpu-learned: values differ")
        except (LayoutUnknown, RuntimeError, ValueError, IndexError, TypeError) as e:
            tried.append(f"cpu-learned: {type(e).__name__}: {str(e)[:120]}")
    for cand in CANDIDATES:
        shape = cand.scratch_shape(tuple(kv_cache.shape))
        if shape is None:
            continue
        try:
            if _reads_back(layer, kv_cache, shape, cand.read, kv_heads, head_dim):
                return cand.name, cand.read
            tried.append(f"{cand.name}: values differ")
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            tried.append(f"{cand.name}: {type(e).__name__}")
    backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: type(layer.impl).__name__)()
    raise LayoutUnknown(f"cannot read K/V back from the {backend} backend (isa {getattr(layer, 'isa', '-')}, "
                        f"cache {tuple(kv_cache.shape)}): tried {'; '.join(tried) or 'nothing that fits'}")
