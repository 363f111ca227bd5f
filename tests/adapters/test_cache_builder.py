"""CacheBuilder: objects decoded straight into their slices of the cache equal build_cache's concatenation.

The builder is what ``agenerate`` loads with (``fetch_prefix(into=builder.add)``); ``build_cache`` is
the reference it must match bit for bit, for every family, both lossless encodings, a partial tail,
chunks added out of order and from several threads, and an object dtype that differs from the model's.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools

import pytest
import torch

from kdn.adapters.hf import CacheBuilder, build_cache, continue_from_cache, extract_chunks, load_model
from kdn.errors import ModelMismatch
from kdn.format.objects import ObjectView, decode_object, encode_object, from_torch, to_torch

C = 32
N = C * 3 + C // 2  # three whole chunks and a partial tail
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-bamba", "tiny-falconh1", "tiny-zamba2"]


@functools.cache
def tiny(spec: str, dtype: torch.dtype = torch.float32):
    return load_model(spec, dtype=dtype)


def blobs_of(model, n: int = N, encoding: str = "zstd") -> list[bytes]:
    ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(3))
    out = []
    for ch in extract_chunks(model, ids, chunk_tokens=C):
        out.append(encode_object(kind=ch.kind, address="a" * 64, model_id="b" * 64, namespace="public",
                                 start=ch.start, end=ch.end, position=ch.start, parent=None,
                                 tensors=from_torch(ch.tensors), encoding=encoding))
    return out


def counts(blobs: list[bytes]) -> list[int]:
    return [h.end - h.start for h in (ObjectView(b).header for b in blobs)]


def assert_same_cache(a, b) -> None:
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            x, y = getattr(la, name, None), getattr(lb, name, None)
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), name
            elif isinstance(x, dict | list):
                items = x.items() if isinstance(x, dict) else enumerate(x)
                for k, t in items:
                    assert torch.equal(t, y[k]), f"{name}[{k}]"


@pytest.mark.parametrize("encoding", ["zstd", "raw"])
@pytest.mark.parametrize("spec", FAMILIES)
def test_builder_equals_build_cache_out_of_order_and_threaded(spec, encoding):
    lm = tiny(spec)
    blobs = blobs_of(lm.model, encoding=encoding)
    ref, n_ref = build_cache(lm.model, [to_torch(decode_object(b)) for b in blobs])
    builder = CacheBuilder(lm.model, counts(blobs))
    order = list(reversed(range(len(blobs))))
    with cf.ThreadPoolExecutor(3) as ex:
        list(ex.map(lambda i: builder.add(i, ObjectView(blobs[i])), order))
    cache, n = builder.finish()
    assert n == n_ref == N
    assert_same_cache(cache, ref)
    ids = torch.randint(0, 512, (4,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.inference_mode():
        assert torch.equal(continue_from_cache(lm.model, cache, n, ids), continue_from_cache(lm.model, ref, n, ids))


def test_a_raw_chunk_lands_by_one_copy_of_its_region():
    """Layers of one shape share one stack in the objects' tensor order: a raw chunk (here read-only bytes, as a
    host-tier mapping is) lands by one copy, not one per tensor; a compressed one is decoded tensor by tensor."""
    lm = tiny("tiny-llama")
    for encoding, one_copy in (("raw", True), ("zstd", False)):
        blobs = blobs_of(lm.model, encoding=encoding)
        b = CacheBuilder(lm.model, counts(blobs))
        for i, blob in enumerate(blobs):
            b.add(i, ObjectView(memoryview(blob)))
        assert b.region_copies == (len(blobs) if one_copy else 0), encoding
        (cache, n), (ref, _) = b.finish(), build_cache(lm.model, [to_torch(decode_object(x)) for x in blobs])
        assert n == N
        assert_same_cache(cache, ref)


def test_objects_of_another_dtype_are_converted_into_place():
    bf16 = tiny("tiny-llama", torch.bfloat16)
    fp32 = tiny("tiny-llama", torch.float32)
    blobs = blobs_of(bf16.model)
    ref, _ = build_cache(fp32.model, [to_torch(decode_object(b)) for b in blobs])
    builder = CacheBuilder(fp32.model, counts(blobs))
    for i, b in enumerate(blobs):
        builder.add(i, ObjectView(b))
    cache, _ = builder.finish()
    assert cache.layers[0].keys.dtype == torch.float32
    assert_same_cache(cache, ref)


def test_an_object_that_does_not_fit_is_refused():
    lm = tiny("tiny-llama")
    blobs = blobs_of(lm.model)
    other = blobs_of(tiny("tiny-qwen2").model)  # other head count and layer count
    b = CacheBuilder(lm.model, counts(blobs))
    with pytest.raises(ModelMismatch, match="does not fit|shape"):
        b.add(0, ObjectView(other[0]))
    with pytest.raises(ModelMismatch, match="covers 16 tokens, the prefix expects 32"):
        b.add(0, ObjectView(blobs[3]))  # the tail where a whole chunk belongs
    with pytest.raises(ModelMismatch, match="outside"):
        b.add(4, ObjectView(blobs[0]))
    b.add(0, ObjectView(blobs[0]))
    with pytest.raises(ModelMismatch, match="twice"):
        b.add(0, ObjectView(blobs[0]))
    with pytest.raises(ModelMismatch, match=r"chunks \[1, 2, 3\] of the prefix were never added"):
        b.finish()


def test_a_layout_that_fitted_one_model_is_checked_again_for_another():
    """Whether an object's tensors fit a model is worked out once per layout (the same header read again
    comes back as the same ``Layout``): what fitted tiny-qwen2 (one K/V head) is still refused by tiny-llama
    (two), whose layer names are the same."""
    from kdn.format.objects import read_layout

    qwen, llama = tiny("tiny-qwen2"), tiny("tiny-llama")
    blob = blobs_of(qwen.model)[0]
    CacheBuilder(qwen.model, counts(blobs_of(qwen.model))).add(0, ObjectView(blob))
    assert read_layout(blob, len(blob)) is ObjectView(blob).layout  # the one it was checked in
    for _ in range(2):  # (and a refusal is never kept)
        with pytest.raises(ModelMismatch, match="shape"):
            CacheBuilder(llama.model, counts(blobs_of(llama.model))).add(0, ObjectView(blob))


def test_a_hybrid_needs_the_states_in_its_last_chunk():
    lm = tiny("tiny-bamba")
    blobs = blobs_of(lm.model)
    kv_only = []
    for blob in blobs:  # the same objects without their conv/recurrent states
        obj = decode_object(blob)
        h = obj.header
        kv_only.append(encode_object(kind=h.kind, address=h.address, model_id=h.model_id, namespace=h.namespace,
                                     start=h.start, end=h.end, position=h.position, parent=h.parent,
                                     tensors={k: v for k, v in obj.tensors.items() if k.endswith((".k", ".v"))}))
    b = CacheBuilder(lm.model, counts(blobs))
    b.add(0, ObjectView(kv_only[0]))  # an earlier chunk may leave its superseded states out
    with pytest.raises(ModelMismatch, match="lacks"):
        b.add(3, ObjectView(kv_only[3]))


def test_a_hybrid_s_last_states_do_not_alias_the_receive_buffer():
    """A raw object's tensors alias its body, and the client hands the body's buffer back when ``add``
    returns: the states the builder keeps from the last chunk must be its own copy."""
    lm = tiny("tiny-bamba")
    blobs = blobs_of(lm.model, encoding="raw")
    builder = CacheBuilder(lm.model, counts(blobs))
    bufs = [bytearray(b) for b in blobs]
    for i, buf in enumerate(bufs):
        builder.add(i, ObjectView(buf))
    kept = {k: t.clone() for k, t in builder.last.items()}
    bufs[-1][:] = bytes(len(bufs[-1]))  # the buffer reused by the next fetch
    assert kept and all(torch.equal(builder.last[k], t) for k, t in kept.items())


def test_a_closed_builder_refuses_late_chunks():
    """A load given up at its deadline closes its builder: a worker thread's late add is refused (it would
    write into slots the cache now uses for the tokens computed instead), and finish closes it too."""
    from kdn.errors import KDNError

    lm = tiny("tiny-llama")
    blobs = blobs_of(lm.model, encoding="raw")
    builder = CacheBuilder(lm.model, counts(blobs))
    builder.add(0, ObjectView(blobs[0]))
    cache, t = builder.finish(upto=1)
    assert t == C
    with pytest.raises(KDNError, match="given up"):
        builder.add(1, ObjectView(blobs[1]))
    with pytest.raises(ModelMismatch, match="given up"):
        builder.place(2, ObjectView(blobs[2]).layout)
