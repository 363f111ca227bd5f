"""One SGLang host page as KDN tensors, in every host layout: views into the pool, never copies.

SGLang's host pool (``pool_host/mha.py``, ``pool_host/mla.py`` in 0.5.23) keeps K/V in one buffer whose
order depends on ``--hicache-mem-layout``. A stored page is layout-free: ``k`` and ``v`` (MHA) or ``kv`` (MLA's
latent) each ``[L, P, H, D]``, layer-major, so a page written by an engine on one layout loads into another.

    MHA  layer_first        kv_buffer [2, L, S, H, D]     page i: kv_buffer[:, :, i:i+P]  -> [2, L, P, H, D]
         page_first         kv_buffer [2, S, L, H, D]     page i: kv_buffer[:, i:i+P]     -> [2, P, L, H, D]
         page_first_direct  kv_buffer [2, S/P, L, P, H, D] page i: kv_buffer[:, i//P]    -> [2, L, P, H, D]
    MLA  layer_first        kv_buffer [L, S, 1, C]        page i: kv_buffer[:, i:i+P]     -> [L, P, 1, C]
         page_first         kv_buffer [S, L, 1, C]        page i: kv_buffer[i:i+P]        -> [P, L, 1, C]
         page_first_direct  kv_buffer [S/P, L, P, 1, C]   page i: kv_buffer[i//P]         -> [L, P, 1, C]

(S: host slots, P: page size, L: layers, H: heads, D: head dim, C: latent width.) The same block, flattened,
is what SGLang's non-zero-copy path hands ``set`` (``get_data_page``) and reads back from ``get``
(``set_from_flat_data_page``), so ``block_of_flat`` gives that path the same views. Other layouts
(``page_head``, ``page_unified``) are refused when the pool is registered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdn.errors import InvalidInput

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_PAGE_MAJOR = ("page_first",)  # layouts whose block puts the page's tokens before its layers


@dataclass(frozen=True)
class PageGeometry:
    """What one page of this pool holds: the shape every stored tensor of it has, and its dtype."""

    layout: str
    mla: bool
    page_size: int
    layers: int
    heads: int
    width: int  # head dim (MHA) or latent width (MLA)
    dtype: torch.dtype

    @property
    def names(self) -> tuple[str, ...]:
        return ("kv",) if self.mla else ("k", "v")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.page_size, self.heads, self.width)  # [L, P, H, D]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """A page's block in the pool's order (what ``get_data_page`` flattens)."""
        L, P, H, D = self.shape
        inner = (P, L, H, D) if self.layout in _PAGE_MAJOR else (L, P, H, D)
        return inner if self.mla else (2, *inner)

    def describe(self) -> dict[str, int | bool]:
        """The layout-free geometry: what a derived model id is made of."""
        return {"mla": self.mla, "page_size": self.page_size, "layers": self.layers, "heads": self.heads,
                "width": self.width}


def geometry_of(pool, *, mla: bool) -> PageGeometry:
    """The page geometry of SGLang host pool ``pool``, read from its buffer's shape; refuses what it cannot map."""
    layout, P, buf = pool.layout, int(pool.page_size), pool.kv_buffer
    if layout not in LAYOUTS:
        raise InvalidInput(f"the KDN storage backend reads host layouts {list(LAYOUTS)}, not {str(layout)[:30]!r}")
    shape = tuple(buf.shape)
    want_ndim = (4 if mla else 5) + (layout == "page_first_direct")
    if len(shape) != want_ndim or (not mla and shape[0] != 2):
        raise InvalidInput(f"an SGLang {'MLA' if mla else 'MHA'} {layout} host buffer of shape {list(shape)}: "
                           "not a layout this backend knows")
    s = shape if mla else shape[1:]
    if layout == "layer_first":
        L, H, D = s[0], s[2], s[3]
    elif layout == "page_first":
        L, H, D = s[1], s[2], s[3]
    else:
        assert s[2] == P, f"page_first_direct buffer {list(shape)} for page size {P}"
        L, H, D = s[1], s[3], s[4]
    return PageGeometry(layout, mla, P, L, H, D, buf.dtype)


def block_at(pool, g: PageGeometry, index: int) -> torch.Tensor:
    """The page starting at host slot ``index``, in the pool's order: a view of ``pool.kv_buffer``."""
    assert index % g.page_size == 0, f"host index {index} is not on a page boundary"
    buf, P = pool.kv_buffer, g.page_size
    if g.layout == "page_first_direct":
        return buf[index // P] if g.mla else buf[:, index // P]  # [L, P, H, D] / [2, L, P, H, D]
    if g.layout == "page_first":
        return buf[index:index + P] if g.mla else buf[:, index:index + P]  # [P, L, H, D] / [2, P, L, H, D]
    return buf[:, index:index + P] if g.mla else buf[:, :, index:index + P]  # [L, P, H, D] / [2, L, P, H, D]


def block_of_flat(g: PageGeometry, flat: torch.Tensor) -> torch.Tensor:
    """A flat page of SGLang's non-zero-copy path as its block (a view)."""
    assert flat.is_contiguous() and flat.numel() == _numel(g.block_shape), \
        f"flat page of {flat.numel()} elements, expected {list(g.block_shape)}"
    return flat.view(g.block_shape)


def tensors_of(g: PageGeometry, block: torch.Tensor) -> dict[str, torch.Tensor]:
    """The page's stored tensors as views of ``block``: each ``[L, P, H, D]``."""
    parts = [block] if g.mla else [block[0], block[1]]
    if g.layout in _PAGE_MAJOR:
        parts = [p.transpose(0, 1) for p in parts]  # [P, L, H, D] -> [L, P, H, D]
    return dict(zip(g.names, parts))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
