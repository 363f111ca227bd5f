"""SGLang's real classes without its package init, and host pools in SGLang's own buffer shapes.

``import sglang`` runs ``sglang/__init__.py`` (transformers patches, its frontend language: ~8 s and
thousands of modules); the storage interface needs none of it. A bare package object whose ``__path__`` is the
installed wheel's lets Python import ``sglang.srt.mem_cache.hicache_storage`` and
``sglang.srt.mem_cache.storage.backend_factory`` from their files: the same classes, none of the init.
SGLang's host pools themselves (``pool_host/mha.py``) import its kernels and torchvision, so ``HostPool`` is a
stand-in: their ``kv_buffer`` in the shapes ``init_kv_buffer`` allocates, and their ``get_data_page`` /
``set_from_flat_data_page`` / ``get_dummy_flat_data_page`` as SGLang 0.5.23 writes them (copied below), which
is what the backend's copying path meets.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch


def _light_sglang() -> None:
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("sglang is not installed (scripts/setup installs it with --no-deps)", pytrace=False)
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["sglang"] = pkg


_light_sglang()


class HostPool:
    """An SGLang 0.5.23 MHA (``MHATokenToKVPoolHost``) or MLA (``MLATokenToKVPoolHost``) host pool's buffer."""

    def __init__(self, layout: str, *, mla: bool = False, slots: int = 64, page_size: int = 4, layers: int = 3,
                 heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.layout, self.mla, self.size, self.page_size, self.dtype = layout, mla, slots, page_size, dtype
        self.layer_num, self.head_num, self.head_dim = layers, (1 if mla else heads), head_dim
        self.kv_cache_dim = head_dim
        pages = slots // page_size
        if mla:  # pool_host/mla.py init_kv_buffer
            dims = {"layer_first": (layers, slots, 1, head_dim), "page_first": (slots, layers, 1, head_dim),
                    "page_first_direct": (pages, layers, page_size, 1, head_dim)}[layout]
        else:  # pool_host/mha.py init_kv_buffer
            dims = {"layer_first": (2, layers, slots, heads, head_dim), "page_first": (2, slots, layers, heads, head_dim),
                    "page_first_direct": (2, pages, layers, page_size, heads, head_dim)}[layout]
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims, generator=g, dtype=torch.float32).to(dtype)

    # --- SGLang 0.5.23, pool_host/mha.py (MHA) -------------------------------------------------------------

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        assert not self.mla
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        elif self.layout in ["page_first_direct", "page_head"]:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        if flat:
            data_page = data_page.flatten()
        return data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)

    # --- what a test compares: token t's K of layer l, in any layout ----------------------------------------

    def k(self, layer: int, token: int) -> torch.Tensor:
        return self.kv_buffer[0][self._at(layer, token)] if not self.mla else self.kv_buffer[self._at(layer, token)]

    def v(self, layer: int, token: int) -> torch.Tensor:
        assert not self.mla
        return self.kv_buffer[1][self._at(layer, token)]

    def _at(self, layer: int, token: int) -> tuple[int, ...]:
        if self.layout == "layer_first":
            return (layer, token)
        if self.layout == "page_first":
            return (token, layer)
        return (token // self.page_size, layer, token % self.page_size)


@pytest.fixture
def host_pool():
    return HostPool
