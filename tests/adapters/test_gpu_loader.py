"""The loader's device path (CacheBuilder onto a device: one copy per chunk, then one placing it): exact.

On the CPU the staged path runs with the CPU as its "device" (the copies are plain tensor copies), in
every run; on CUDA, where there is one, the same checks run against the device's own chunked prefill, with
page-locked arena buffers and a copy stream. Elsewhere the CUDA cases are skipped: there is no GPU here.
"""

from __future__ import annotations

import pytest
import torch

from kdn.adapters.hf import CacheBuilder, continue_from_cache, extract_chunks, load_model, prefill
from kdn.format.objects import ObjectView, encode_object, from_torch

CHUNK = 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device on this machine"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("encoding", ["raw", "zstd"])
def test_a_staged_load_onto_the_device_continues_bit_identically(device, family, dtype, encoding):
    from kdn.kernels.pinned import host_arena

    model = load_model(family, dtype=dtype).model.to(device)
    ids = torch.randint(0, 400, (3 * CHUNK + 9,), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.inference_mode():
        chunks = list(extract_chunks(model, ids, chunk_tokens=CHUNK))[:3]
        own = continue_from_cache(model, prefill(model, ids[:3 * CHUNK], chunk_tokens=CHUNK), 3 * CHUNK,
                                  ids[3 * CHUNK:])
    arena = host_arena(64 << 20)
    builder = CacheBuilder(model, [c.end - c.start for c in chunks], device=device, staged=True, arena=arena)
    assert not builder.placeable(0)  # nothing is received straight into device memory
    for i, c in enumerate(chunks):
        blob = encode_object(kind=c.kind, address="ab" * 32, model_id="cd" * 32, namespace="public", start=c.start,
                             end=c.end, position=c.start, parent=None,
                             tensors=from_torch({k: v.to("cpu") for k, v in c.tensors.items()}), encoding=encoding)
        lease = arena.take(len(blob))  # as the client holds a body: in an arena buffer (pinned on a GPU host)
        lease.view[:] = blob
        builder.add(i, ObjectView(lease.view))
        lease.release()  # the chunk is on the device: the buffer is free at once
    cache, n = builder.finish()
    assert n == 3 * CHUNK and builder.h2d_bytes > 0
    assert builder.device_copies == 2 * len(chunks)  # per chunk: one onto the device, one placing every layer
    got = continue_from_cache(model, cache, n, ids[3 * CHUNK:])
    assert torch.equal(got, own)
