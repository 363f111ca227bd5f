"""The client's prefix bookkeeping (token counts, dropping the last objects) and the checks an object passes
before ``fetch_prefix`` hands it to an engine's loader (``into``): no network, real objects."""

from __future__ import annotations

import numpy as np
import pytest

import kdn.kernels  # noqa: F401  (registers the lossy codecs)
from kdn.client.checked import decode_checked
from kdn.client import Fetched, Lookup
from kdn.errors import DigestMismatch, ObjectTooLarge
from kdn.format.objects import RawTensor, encode_object

MODEL, OTHER = "b" * 64, "c" * 64


def lookup(n_addresses: int, tokens: int, chunk: int = 256) -> Lookup:
    addrs = [f"{i + 1:064x}" for i in range(n_addresses)]
    return Lookup(model_id=MODEL, namespace="public", addresses=addrs, tokens=tokens, chunk_tokens=chunk,
                  records=[{"n": i} for i in range(n_addresses)], cold=set(addrs[-1:]),
                  sources=["memory"] * n_addresses)


def test_token_counts_are_whole_chunks_then_the_tail():
    assert lookup(3, 768).token_counts() == [256, 256, 256]
    assert lookup(4, 3 * 256 + 76).token_counts() == [256, 256, 256, 76]
    assert lookup(0, 0).token_counts() == []


def test_head_keeps_the_first_objects_and_what_belongs_to_them():
    hit = lookup(4, 3 * 256 + 76)
    h = hit.head(3)
    assert h.addresses == hit.addresses[:3] and h.tokens == 768 and h.token_counts() == [256] * 3
    assert h.records == hit.records[:3] and h.sources == hit.sources[:3]
    assert h.cold == set()  # the dropped tail was the cold one
    assert hit.head(4) == hit and hit.head(0).tokens == 0


def test_a_lookups_objects_are_chunks_with_their_span_encoding_and_source():
    """``Lookup.chunk``: the one type the planner, the vLLM load plan and the prefix fetch share (kdn/chunk.py)."""
    from kdn.errors import InvalidInput
    from kdn.format.pieces import MIN_PIECE_BYTES, Pieces
    from kdn.registry.records import ObjectRecord

    hit = lookup(4, 3 * 256 + 76)
    hit.sources[1] = "origin"
    d1, d2 = "d" * 64, "e" * 64
    d = {"address": hit.addresses[0], "model_id": MODEL, "namespace": "public", "kind": "kv", "start": 0, "end": 256,
         "parent": None, "standalone": False, "origin": "o",
         "encodings": {"raw": {"name": "raw", "size": 2 * MIN_PIECE_BYTES, "digest": "a" * 64,
                               "piece_bytes": MIN_PIECE_BYTES, "pieces": [d1, d2]},
                       "zstd": {"name": "zstd", "size": 100, "digest": "b" * 64}}}
    rec = ObjectRecord.from_dict(d)
    c = hit.chunk(0, rec, "raw")
    assert (c.address, c.start, c.end, c.tokens, c.encoding, c.digest, c.size) == \
        (hit.addresses[0], 0, 256, 256, "raw", "a" * 64, 2 * MIN_PIECE_BYTES)
    assert c.pieces == Pieces(MIN_PIECE_BYTES, (d1, d2)) and c.tier == "memory" and not c.cold and not c.host
    tail = hit.chunk(3, rec, "zstd", warm=False)
    assert (tail.start, tail.end, tail.tokens, tail.size, tail.pieces) == (768, 844, 76, 100, None) and tail.cold
    assert hit.chunk(1, rec, "zstd").cold  # the entry edge must fill it (its tier), not known warm
    assert not hit.chunk(1, rec, "zstd", warm=True).cold  # known warm: its read costs only this link
    bad = {**d, "encodings": {"raw": {**d["encodings"]["raw"], "pieces": [d1]}}}
    with pytest.raises(InvalidInput):  # piece digests that cannot describe the blob: no record is read of them
        ObjectRecord.from_dict(bad)


def blob(address: str, *, model: str = MODEL, encoding: str = "zstd", n: int = 4096) -> bytes:
    data = np.random.default_rng(1).standard_normal(n).astype(np.float32).tobytes()
    return encode_object(kind="kv", address=address, model_id=model, namespace="public", start=0, end=16,
                         position=0, parent=None, encoding=encoding,
                         codec_for=None if encoding == "zstd" else (lambda t: "int8-token"),
                         tensors={"L0.k": RawTensor("L0.k", "F32", (4, 16, n // 64), memoryview(data))})


def test_into_gets_only_objects_that_passed_every_check():
    hit = lookup(1, 16)
    a = hit.addresses[0]
    handed: list[int] = []

    def into(i, view):
        handed.append(i)

    obj = decode_checked(Fetched(a, "zstd", bytearray(blob(a)), "edge", 0.0), hit, None, None, 0, into)
    assert handed == [0] and obj.tensors == {} and obj.header.address == a
    # another model's object, a lossy one when lossless was asked, one over its decode bound: never handed on
    with pytest.raises(DigestMismatch, match="claims model"):
        decode_checked(Fetched(a, "zstd", bytearray(blob(a, model=OTHER)), "edge", 0.0), hit, None, None, 0, into)
    with pytest.raises(DigestMismatch, match="lossy"):
        decode_checked(Fetched(a, "int8", bytearray(blob(a, encoding="int8")), "edge", 0.0), hit, None, None, 0,
                        into)
    with pytest.raises(ObjectTooLarge):
        decode_checked(Fetched(a, "zstd", bytearray(blob(a)), "edge", 0.0), hit, None, 1024, 0, into)
    assert handed == [0]
