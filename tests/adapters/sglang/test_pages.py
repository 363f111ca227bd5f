"""A host page as layout-free tensors: the views name the tokens SGLang's own slices name, in every layout."""

from __future__ import annotations

import pytest
import torch

from kdn.adapters.sglang.pages import block_at, block_of_flat, geometry_of, tensors_of
from kdn.errors import InvalidInput

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_name_the_right_tokens(host_pool, layout, mla):
    pool = host_pool(layout, mla=mla)
    g = geometry_of(pool, mla=mla)
    assert g.shape == (3, 4, 1 if mla else 2, 8)
    page = tensors_of(g, block_at(pool, g, 8))  # the page of tokens 8..11
    for name, t in page.items():
        assert t.shape == g.shape and t.data_ptr() != 0
        for layer in range(3):
            for j in range(4):
                want = pool.v(layer, 8 + j) if name == "v" else pool.k(layer, 8 + j)
                assert torch.equal(t[layer, j], want)
    # a view, never a copy: a write lands in the pool
    page[g.names[0]][1, 2].fill_(7)
    assert bool((pool.k(1, 10) == 7).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_page_of_sglangs_copying_path(host_pool, layout):
    pool = host_pool(layout)
    g = geometry_of(pool, mla=False)
    flat = pool.get_data_page(12).contiguous()  # SGLang's own slice, flattened
    assert torch.equal(tensors_of(g, block_of_flat(g, flat))["v"], tensors_of(g, block_at(pool, g, 12))["v"])


def test_unknown_layout_refused(host_pool):
    pool = host_pool("layer_first")
    pool.layout = "page_head"
    with pytest.raises(InvalidInput, match="page_head"):
        geometry_of(pool, mla=False)
