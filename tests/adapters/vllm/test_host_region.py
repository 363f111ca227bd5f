"""A raw chunk (a host-tier lease, or an edge's chunk that straddles the load) lands in vLLM's staging by ONE
strided copy of its whole K/V region (#53): the staging laid out in the objects' own tensor order
(``Staging(order=ChunkLoader.stack_order)``), the copy ``ChunkLoader._copy_region``. What it leaves there is what
decoding the chunk layer by layer leaves, bit for bit; a chunk that is not raw in the cache's dtype, layers of
different shapes, or a staging in another order fall back to that layer-by-layer decode (``Staging.put``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from kdn.adapters.vllm.fetching import AttnLayer, ChunkLoader
from kdn.adapters.vllm.meta import LoadJob
from kdn.adapters.vllm.plan import LoadPlan
from kdn.adapters.vllm.stage import Staging
from kdn.chunk import Chunk
from kdn.format.objects import encode_object, from_torch
from kdn.wire.arena import Arena

ADDRESS, MODEL = "ab" * 32, "cd" * 32
LAYERS, H, D = 12, 2, 64  # twelve: the objects' order (L0, L1, L10, L11, L2, ...) is not the layers' order
BOUNDS = ((0, 256), (256, 512), (512, 768))
FIRST, END = 128, 600  # the first and last chunks straddle the load


def loader(dims: list[tuple[int, int]] | None = None) -> ChunkLoader:
    attn = [AttnLayer(f"attn{i}", i, None, *(dims[i] if dims else (H, D))) for i in range(LAYERS)]
    client = SimpleNamespace(decode_speeds=SimpleNamespace(observe=lambda *a: None))
    return ChunkLoader(client=client, model_id=MODEL, namespace="public", stager=ThreadPoolExecutor(1),
                       attn={a.name: a for a in attn}, order=attn, states=[])


def blob(start: int, end: int, encoding: str, dtype: torch.dtype, seed: int,
         dims: list[tuple[int, int]] | None = None) -> tuple[bytes, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    t = {f"L{i}.{x}": torch.randn((dims[i] if dims else (H, D))[0], end - start, (dims[i] if dims else (H, D))[1],
                                  generator=g).to(dtype) for i in range(LAYERS) for x in "kv"}
    return encode_object(kind="kv", address=ADDRESS, model_id=MODEL, namespace="public", start=start, end=end,
                         position=start, parent=None, tensors=from_torch(t), encoding=encoding), t


def stage_all(ld: ChunkLoader, staging: Staging, encoding: str, dtype: torch.dtype, monkeypatch,
              dims: list[tuple[int, int]] | None = None) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Every chunk through ``ChunkLoader._stage`` (what ``_from_host`` runs on a stager thread, from a read-only
    mapping: here read-only bytes too); the tensors each left, and how many layer-by-layer decodes ran."""
    puts = [0]
    put = Staging.put

    def counted(self, *a, **kw):
        puts[0] += 1
        return put(self, *a, **kw)

    monkeypatch.setattr(Staging, "put", counted)
    chunks = tuple(Chunk(ADDRESS, s, e, encoding, "", 1) for s, e in BOUNDS)
    run = SimpleNamespace(staging=staging, job=LoadJob("r", LoadPlan(FIRST, END, chunks), ([],), False))
    want: dict[str, list[torch.Tensor]] = {}
    for i, p in enumerate(chunks):
        body, t = blob(p.start, p.end, encoding, dtype, seed=i, dims=dims)
        f = SimpleNamespace(blob=memoryview(body), source="host", encoding=encoding)  # (bytes: read-only)
        with staging.writing():
            ld._stage_into(staging, run, i, p, f, None)
        lo, hi = max(p.start, FIRST), min(p.end, END)
        for name, x in t.items():
            want.setdefault(name, []).append(x[:, lo - p.start:hi - p.start])
    return {n: torch.cat(v, dim=1) for n, v in want.items()}, puts[0]


def assert_staged(staging: Staging, want: dict[str, list[torch.Tensor]]) -> None:
    for j in range(LAYERS):
        k, v = staging.kv(j)  # [n, H, D]: what the layer's one cache write reads
        assert torch.equal(k, want[f"L{j}.k"].to(staging.dtype).transpose(0, 1))
        assert torch.equal(v, want[f"L{j}.v"].to(staging.dtype).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_raw_chunk_lands_by_one_region_copy_bit_for_bit(dtype, monkeypatch):
    ld = loader()
    assert ld.stack_order is not None and ld.stack_order[:4] == (0, 1, 10, 11)  # the objects' order
    arena = Arena(64 << 20)
    staging = Staging(arena, [(H, D)] * LAYERS, FIRST, END, dtype, order=ld.stack_order)
    want, puts = stage_all(ld, staging, "raw", dtype, monkeypatch)
    assert puts == 0  # no layer decoded alone: each chunk one copy, the straddling ones sliced
    assert_staged(staging, want)
    staging.release()
    assert arena.in_use == 0


@pytest.mark.parametrize("encoding, dtype", [("zstd", torch.bfloat16), ("raw", torch.float32)])
def test_a_chunk_not_raw_in_the_caches_dtype_is_decoded_layer_by_layer(encoding, dtype, monkeypatch):
    """Compressed, or raw fp32 for a bf16 cache: no region of the cache's bytes to copy; decoded (and converted)
    into the same places, the staging in the objects' order all the same."""
    ld = loader()
    staging = Staging(Arena(64 << 20), [(H, D)] * LAYERS, FIRST, END, torch.bfloat16, order=ld.stack_order)
    want, puts = stage_all(ld, staging, encoding, dtype, monkeypatch)
    assert puts == LAYERS * len(BOUNDS)
    assert_staged(staging, want)
    staging.release()


def test_a_staging_in_another_order_is_decoded_layer_by_layer(monkeypatch):
    """A device's staging keeps the layers' own order (its copies go in layer order): no region copy into it."""
    ld = loader()
    staging = Staging(Arena(64 << 20), [(H, D)] * LAYERS, FIRST, END, torch.bfloat16)
    want, puts = stage_all(ld, staging, "raw", torch.bfloat16, monkeypatch)
    assert puts == LAYERS * len(BOUNDS)
    assert_staged(staging, want)
    staging.release()


def test_layers_of_different_shapes_are_decoded_layer_by_layer(monkeypatch):
    dims = [(H, D) if i % 2 else (2 * H, D // 2) for i in range(LAYERS)]
    ld = loader(dims)
    staging = Staging(Arena(64 << 20), dims, FIRST, END, torch.bfloat16, order=ld.stack_order)
    want, puts = stage_all(ld, staging, "raw", torch.bfloat16, monkeypatch, dims=dims)
    assert puts == LAYERS * len(BOUNDS) and staging.stack(FIRST, END) is None
    assert_staged(staging, want)
    staging.release()


def test_a_staging_laid_out_in_another_order_still_names_its_layers_as_before():
    """``order`` moves where each layer lies, never which layer ``put``, ``kv`` and ``runs`` name; a device's
    ``Upload`` (copies in layer order) is refused such a staging."""
    ld = loader()
    st = Staging(Arena(64 << 20), [(H, D)] * LAYERS, 0, 256, torch.bfloat16, order=ld.stack_order)
    offsets = [st.spans[j][0] for j in ld.stack_order]
    assert offsets == sorted(offsets) and offsets[0] == 0 and st.spans[10][0] == st.spans[1][0] + st.spans[1][1]
    assert st.k[10].data_ptr() == st.raw.data_ptr() + st.spans[10][0]
    with pytest.raises(AssertionError, match="layer order"):
        st.upload(torch.device("meta"))
    st.release()
