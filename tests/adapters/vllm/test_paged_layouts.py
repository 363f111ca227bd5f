"""Reading K/V back from vLLM's CPU paged cache on every ISA: vec, vec16 and AMX lay a block out differently.

On an Intel Xeon with AMX the producer once refused to start ("cannot read K/V back from the CPU_ATTN
backend (isa amx ...): tried cpu-vec: values differ"): the reader knew only the vec layout. Now the
layout is learned from the backend's own writes. These tests hold the learner against each ISA's layout
on any CPU (reference writers of each layout, below) and against vLLM's own kernel for every ISA this
build of vLLM runs on this CPU (its reshape kernels are plain stores, so the AMX one runs without AMX).
"""

from __future__ import annotations

import pytest
import torch

from kdn.adapters.vllm import paged
from kdn.adapters.vllm.paged import LayoutUnknown, find_reader, learn_cpu_layout

# --- each ISA's block interior, written out (from csrc/cpu/cpu_attn_{vec,amx}.hpp, checked against the op) --


def _vec_index(bs: int, d: int) -> torch.Tensor:
    """vec / vec16: K column-major ``[D, bs]``, then V row-major ``[bs, D]``."""
    o, dd = torch.meshgrid(torch.arange(bs), torch.arange(d), indexing="ij")  # [bs, D] each
    return torch.stack([dd * bs + o, bs * d + o * d + dd])  # [2, bs, D]


def _amx_index(bs: int, d: int) -> torch.Tensor:
    """amx (bf16): K as ``[bs/16, D/2, 16, 2]`` and V as ``[D/16, bs/2, 16, 2]``: VNNI pairs of 16-bit values."""
    o, dd = torch.meshgrid(torch.arange(bs), torch.arange(d), indexing="ij")
    k = (o // 16) * (16 * d) + (dd // 2) * 32 + (o % 16) * 2 + dd % 2
    v = bs * d + (dd // 16) * (bs * 16) + (o // 2) * 32 + (dd % 16) * 2 + o % 2
    return torch.stack([k, v])


REFERENCE = {"vec": _vec_index, "vec16": _vec_index, "amx": _amx_index}


class _Impl:
    def __init__(self, write):
        self._write = write

    def do_kv_cache_update(self, layer, k, v, cache, slot):
        self._write(cache, k, v, slot)


class Layer:
    """What ``paged`` needs of an attention layer: ``impl.do_kv_cache_update`` and the ISA vLLM set on it."""

    def __init__(self, isa: str, write):
        self.isa = isa
        self.impl = _Impl(write)


def reference_writer(isa: str):
    def write(cache, k, v, slot):
        nb, h, bs, d2 = cache.shape
        idx = REFERENCE[isa](bs, d2 // 2)  # [2, bs, D]
        region = cache.view(nb, h, bs * d2)
        b, o = slot // bs, slot % bs
        for i in range(len(slot)):  # a reference: one token at a time
            region[b[i], :, idx[0, o[i]]] = k[i]
            region[b[i], :, idx[1, o[i]]] = v[i]
    return write


def vllm_writer(isa: str):
    import vllm._custom_ops as ops

    def write(cache, k, v, slot):
        nb, h, bs, _ = cache.shape
        kc, vc = cache.view(nb, h, bs * 2, -1).chunk(2, dim=2)  # as CPUAttentionBackendImpl.do_kv_cache_update
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slot, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return write


def _runs_here(isa: str, dtype: torch.dtype) -> bool:
    cache = torch.zeros(1, 1, 32, 128, dtype=dtype)
    try:
        vllm_writer(isa)(cache, torch.ones(1, 1, 64, dtype=dtype), torch.ones(1, 1, 64, dtype=dtype),
                         torch.zeros(1, dtype=torch.int64))
        return True
    except RuntimeError:
        return False


ISA_DTYPES = [("vec", torch.bfloat16), ("vec", torch.float16), ("vec", torch.float32), ("vec16", torch.bfloat16),
              ("amx", torch.bfloat16)]


def _kv(n, h, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g).to(dtype), torch.randn(n, h, d, generator=g).to(dtype)


@pytest.mark.parametrize("isa, dtype", ISA_DTYPES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("bs, d", [(128, 64), (32, 128), (64, 96)])
def test_the_reference_layouts_are_vllm_s(isa, dtype, bs, d):
    """The written-out layouts above are what vLLM's kernel writes (where this build runs that ISA's kernel)."""
    if not _runs_here(isa, dtype):
        pytest.skip(f"this vLLM build has no {isa} kernel for {dtype} on this CPU; the reference stands alone")
    nb, h = 3, 2
    k, v = _kv(2 * bs, h, d, dtype)
    slot = torch.randperm(2 * bs, generator=torch.Generator().manual_seed(2)) + bs  # blocks 1 and 2
    ours, theirs = (torch.zeros(nb, h, bs, 2 * d, dtype=dtype) for _ in range(2))
    reference_writer(isa)(ours, k, v, slot)
    vllm_writer(isa)(theirs, k, v, slot)
    assert torch.equal(ours.view(-1).view(torch.uint8), theirs.view(-1).view(torch.uint8))


@pytest.mark.parametrize("isa, dtype", ISA_DTYPES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("bs, d", [(128, 64), (32, 128)])
def test_the_learned_reader_reads_every_isa_s_layout(isa, dtype, bs, d):
    """On any CPU: the layout learned from a backend's writes reads back exactly what was written."""
    layer = Layer(isa, reference_writer(isa))
    cache = torch.zeros(4, 3, bs, 2 * d, dtype=dtype)
    assert torch.equal(learn_cpu_layout(layer, cache, 3, d), REFERENCE[isa](bs, d))
    name, read = find_reader(layer, cache, 3, d)
    assert name == f"cpu-learned ({isa})"
    k, v = _kv(3 * bs, 3, d, dtype, seed=3)
    slot = torch.randperm(4 * bs, generator=torch.Generator().manual_seed(4))[: 3 * bs]
    reference_writer(isa)(cache, k, v, slot)
    rk, rv = read(cache, slot)
    assert torch.equal(rk, k) and torch.equal(rv, v)


@pytest.mark.parametrize("isa, dtype", ISA_DTYPES, ids=lambda x: str(x).replace("torch.", ""))
def test_the_learned_reader_reads_vllm_s_kernel(isa, dtype):
    if not _runs_here(isa, dtype):
        pytest.skip(f"this vLLM build has no {isa} kernel for {dtype} on this CPU")
    layer = Layer(isa, vllm_writer(isa))
    cache = torch.zeros(5, 2, 128, 128, dtype=dtype)
    _, read = find_reader(layer, cache, 2, 64)
    k, v = _kv(300, 2, 64, dtype, seed=5)
    slot = torch.arange(300) + 200
    paged.write(layer, cache, k, v, slot)
    rk, rv = read(cache, slot)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_a_backend_that_loses_values_is_refused_at_start():
    """A layout that is not one place per value (here: every K lands on one spot) is refused, never misread."""
    def lossy(cache, k, v, slot):
        nb, h, bs, d2 = cache.shape
        region = cache.view(nb, h, bs * d2)
        for i, s in enumerate(slot.tolist()):
            region[s // bs, :, 0] = k[i, :, 0]
            region[s // bs, :, 1 + (s % bs) * (d2 // 2): 1 + (s % bs) * (d2 // 2) + d2 // 2] = v[i]

    layer = Layer("mystery", lossy)
    with pytest.raises(LayoutUnknown, match="isa mystery"):
        find_reader(layer, torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16), 1, 64)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_the_learned_reader_reads_a_strided_cache_as_a_gpu_backend_holds_it(isa):
    """A GPU backend's per-layer cache is a strided view (vLLM's default physical order puts the heads
    outside the blocks), and its write kernel honours the strides. The reader indexes the logical
    ``[blocks, H, bs, 2D]`` cache, so it reads such a view exactly. (It used to flatten the cache first,
    which for a strided view is a copy of the whole layer at every read: right values, GPU memory wasted.)"""
    dtype, bs, d, h, nb = torch.bfloat16, 32, 64, 3, 4
    idx = REFERENCE[isa](bs, d)

    def strided_writer(cache, k, v, slot):  # by logical index, as a stride-honouring kernel does
        for i, s in enumerate(slot.tolist()):
            for x, t in ((0, k), (1, v)):
                p = idx[x, s % bs]
                cache[s // bs, :, p // (2 * d), p % (2 * d)] = t[i]

    layer = Layer(isa, strided_writer)
    _, read = find_reader(layer, torch.zeros(nb, h, bs, 2 * d, dtype=dtype), h, d)
    physical = torch.zeros(nb, bs, h, 2 * d, dtype=dtype)  # heads inside the block's token rows
    cache = physical.permute(0, 2, 1, 3)  # the logical [blocks, H, bs, 2D] view: not contiguous
    assert not cache.is_contiguous()
    k, v = _kv(2 * bs + 5, h, d, dtype, seed=6)
    slot = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(7))[: 2 * bs + 5]
    strided_writer(cache, k, v, slot)
    rk, rv = read(cache, slot)
    assert torch.equal(rk, k) and torch.equal(rv, v)
