"""Room after a loaded prefix (``CacheBuilder(room=)``, ``room.RoomLayer``): the suffix and generated tokens
are written in place, not concatenated onto the whole prefix, and the result is bit-identical to
transformers' own concatenating cache, within the room and past it, on the host and on the device path."""

from __future__ import annotations

import functools

import pytest
import torch

from kdn.adapters.hf import CacheBuilder, build_cache, continue_from_cache, extract_chunks, load_model
from kdn.adapters.hf.room import RoomLayer
from kdn.errors import InvalidInput
from kdn.format.objects import ObjectView, encode_object, from_torch

C = 32


@functools.cache
def setup(spec: str, encoding: str):
    model = load_model(spec, dtype=torch.bfloat16).model
    ids = torch.randint(0, 400, (3 * C + 9 + 12,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        chunks = list(extract_chunks(model, ids[:3 * C], chunk_tokens=C))
    blobs = [encode_object(kind=c.kind, address="ab" * 32, model_id="cd" * 32, namespace="public", start=c.start,
                           end=c.end, position=c.start, parent=None, tensors=from_torch(c.tensors), encoding=encoding)
             for c in chunks]
    return model, ids, chunks, blobs


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
@pytest.mark.parametrize("encoding", ["raw", "zstd"])
@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-bamba"])
def test_the_suffix_lands_in_the_room_and_decoding_past_it_stays_exact(spec, encoding, staged):
    model, ids, chunks, blobs = setup(spec, encoding)
    builder = CacheBuilder(model, [c.end - c.start for c in chunks], staged=staged, room=16)
    for i, blob in enumerate(blobs):
        builder.add(i, ObjectView(blob))
    cache, n = builder.finish()
    ref, _ = build_cache(model, [c.tensors for c in chunks])  # transformers' own, concatenating
    rooms = [(pos, layer) for pos, layer in enumerate(cache.layers) if isinstance(layer, RoomLayer)]
    assert rooms and all(layer.capacity == n + 16 for _, layer in rooms)
    assert torch.equal(continue_from_cache(model, cache, n, ids[n:n + 9]), continue_from_cache(model, ref, n, ids[n:n + 9]))
    for _, layer in rooms:  # the 9 suffix tokens went into the storage the prefix was loaded into
        assert layer.keys.shape[-2] == n + 9 and layer.keys.data_ptr() == layer._full[0].data_ptr()
    for t in range(n + 9, n + 21):  # 12 decode steps: 7 fit, then the layers fall back to concatenation
        assert torch.equal(continue_from_cache(model, cache, t, ids[t:t + 1]),
                           continue_from_cache(model, ref, t, ids[t:t + 1])), t
    assert all(layer.capacity == 0 for _, layer in rooms)


def test_a_load_cut_short_computes_the_rest_into_the_slots_it_did_not_load():
    model, ids, chunks, blobs = setup("tiny-llama", "raw")
    builder = CacheBuilder(model, [c.end - c.start for c in chunks], room=9)
    for i in (0, 1):  # the third chunk never arrived
        builder.add(i, ObjectView(blobs[i]))
    cache, t = builder.finish(upto=2)
    ref, _ = build_cache(model, [c.tensors for c in chunks[:2]])
    rest = ids[t:3 * C + 9]  # the chunk not loaded, and the suffix: 41 tokens into 32 + 9 of room
    assert torch.equal(continue_from_cache(model, cache, t, rest), continue_from_cache(model, ref, t, rest))
    layer = next(x for x in cache.layers if isinstance(x, RoomLayer))
    assert layer.capacity == 3 * C + 9 and layer.keys.data_ptr() == layer._full[0].data_ptr()


def test_without_room_the_cache_is_transformers_own():
    model, _, chunks, blobs = setup("tiny-llama", "raw")
    builder = CacheBuilder(model, [c.end - c.start for c in chunks])
    for i, blob in enumerate(blobs):
        builder.add(i, ObjectView(blob))
    cache, _ = builder.finish()
    assert not any(isinstance(x, RoomLayer) for x in cache.layers)


def test_a_crop_keeps_writing_in_place_and_a_new_tensor_ends_the_room():
    full_k, full_v = torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)
    layer = RoomLayer(full_k, full_v, 6)
    layer.crop(-2)  # 4 tokens left, still a prefix of the storage
    k, v = layer.update(torch.ones(1, 2, 3, 4), torch.full((1, 2, 3, 4), 2.0))
    assert k.shape[-2] == 7 and k.data_ptr() == full_k.data_ptr() and torch.equal(full_v[0, :, 4:7], v[0, :, 4:7])
    assert layer.capacity == 10
    layer.batch_repeat_interleave(2)  # new tensors: the room cannot be used for them
    k, _ = layer.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert k.shape == (2, 2, 8, 4) and layer.capacity == 0
    small = RoomLayer(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 4)
    k, _ = small.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))  # does not fit: concatenated
    assert k.shape[-2] == 7 and small.capacity == 0
    odd = RoomLayer(torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 9, 4), 4)
    k, _ = odd.update(torch.ones(1, 2, 1, 4, dtype=torch.float64), torch.ones(1, 2, 1, 4, dtype=torch.float64))
    assert odd.capacity == 0  # another dtype is never converted silently into the storage


@pytest.mark.parametrize("room", [-1, 1 << 30, 2.5])
def test_a_bad_room_is_refused(room):
    model, _, chunks, _ = setup("tiny-llama", "raw")
    with pytest.raises(InvalidInput, match="room"):
        CacheBuilder(model, [c.end - c.start for c in chunks], room=room)
