"""Object format: round trips, zero copy, safetensors interop, and one test per kind of bad blob."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kdn.format import codecs
from kdn.format.codecs import itemsize
from kdn.errors import (
    CodecError,
    CorruptObject,
    DigestMismatch,
    InvalidInput,
    ObjectTooLarge,
    TensorMismatch,
    TruncatedObject,
    UnknownCodec,
    UnsupportedVersion,
)
from kdn.format.objects import (
    MAX_HEADER_BYTES,
    DecodedObject,
    ObjectHeader,
    RawTensor,
    blob_digest,
    decode_object,
    encode_object,
    from_torch,
    one_transfer,
    read_header,
    to_torch,
)

ADDR = "a1" * 32
MODEL = "b2" * 32
PARENT = "c3" * 32
DTYPES = ["BF16", "F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL"]


def fields(**over):
    f = dict(kind="kv", address=ADDR, model_id=MODEL, namespace="public", start=256, end=512, position=256, parent=PARENT)
    f.update(over)
    return f


def hybrid_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.keys": torch.randn(1, 2, 16, 8, generator=g).to(torch.bfloat16),  # [B, H, S, D]
        "layers.0.values": torch.randn(1, 2, 16, 8, generator=g).to(torch.bfloat16),
        "layers.1.conv": torch.randn(1, 24, 4, generator=g).to(torch.bfloat16),  # [B, conv_dim, d_conv]
        "layers.1.ssm": torch.randn(1, 4, 8, 16, generator=g),  # F32 recurrent state
        "empty": torch.zeros(0, 3, dtype=torch.float16),
    }


def blob_of(encoding="zstd", **over) -> bytes:
    return encode_object(**fields(**over), tensors=from_torch(hybrid_tensors()), encoding=encoding)


# --- helpers that rewrite a blob's header -----------------------------------------


def split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", blob)
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict | bytes, data: bytes) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def with_header(blob: bytes, edit) -> bytes:
    header, data = split(blob)
    edit(header)
    return join(header, data)


def with_kdn(blob: bytes, edit) -> bytes:
    def e(header):
        kdn = json.loads(header["__metadata__"]["kdn"])
        edit(kdn)
        header["__metadata__"]["kdn"] = json.dumps(kdn)

    return with_header(blob, e)


# --- round trips ---------------------------------------------------------------------


@st.composite
def raw_tensors(draw):
    out = {}
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        n = math.prod(shape) * itemsize(dtype)
        data = draw(st.binary(min_size=n, max_size=n))
        if dtype == "BOOL":
            data = bytes(b & 1 for b in data)
        out[f"t{i}"] = RawTensor(f"t{i}", dtype, shape, memoryview(data))
    return out


@settings(max_examples=120, deadline=None)
@given(ts=raw_tensors(), encoding=st.sampled_from(["raw", "zstd", "mixed"]), bytearray_blob=st.booleans())
def test_round_trip_any_dtypes_shapes_encodings(ts, encoding, bytearray_blob):
    codec_for = (lambda t: "raw" if t.dtype in ("F32", "BOOL") else "zstd") if encoding == "mixed" else None
    blob = encode_object(**fields(), tensors=ts, encoding=encoding, codec_for=codec_for)
    if bytearray_blob:
        blob = bytearray(blob)
    obj = decode_object(blob, expected_digest=blob_digest(blob))
    assert obj.header == read_header(blob)
    assert obj.tensors.keys() == ts.keys()
    for name, t in ts.items():
        got = obj.tensors[name]
        assert (got.dtype, got.shape, bytes(got.data)) == (t.dtype, t.shape, bytes(t.data))
        want_codec = codec_for(t) if codec_for else encoding
        assert obj.header.tensors[name].codec == want_codec


def test_header_round_trip():
    blob = blob_of(kind="hybrid", start=512, end=700, position=512)
    h = read_header(blob)
    assert isinstance(h, ObjectHeader)
    assert (h.version, h.kind, h.address, h.model_id, h.namespace) == (1, "hybrid", ADDR, MODEL, "public")
    assert (h.start, h.end, h.position, h.n_tokens, h.parent, h.encoding) == (512, 700, 512, 188, PARENT, "zstd")
    ssm = h.tensors["layers.1.ssm"]
    assert (ssm.dtype, ssm.shape, ssm.codec, ssm.params) == ("F32", (1, 4, 8, 16), "zstd", {"level": 1, "shuffle": 4, "frames": ssm.params["frames"]})
    assert len(ssm.params["frames"]) == 4
    standalone = read_header(blob_of(start=0, end=256, position=0, parent=None))
    assert standalone.parent is None and standalone.position == 0


def test_encoding_is_deterministic():
    assert blob_of() == blob_of()
    assert blob_digest(blob_of()) == blob_digest(blob_of())


def test_mixed_dtypes_torch_round_trip_is_bit_identical():
    ts = hybrid_tensors()
    for encoding in ("raw", "zstd"):
        got = to_torch(decode_object(blob_of(encoding)))
        assert got.keys() == ts.keys()
        for name, t in ts.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t), name


def test_from_torch_takes_non_contiguous_and_0d_tensors():
    x = torch.randn(4, 6).to(torch.bfloat16).t()  # x: [6, 4], strided
    ts = {"x": x, "scalar": torch.tensor(3.5, dtype=torch.float64), "flags": torch.tensor([True, False])}
    raw = from_torch(ts)
    assert raw["x"].dtype == "BF16" and raw["x"].shape == (6, 4) and raw["scalar"].shape == ()
    back = to_torch(decode_object(encode_object(**fields(), tensors=raw)))
    assert all(torch.equal(back[k], v) for k, v in ts.items())


def test_raw_decode_does_not_copy_tensor_data():
    blob = blob_of("raw")
    obj = decode_object(blob)
    whole = np.frombuffer(blob, np.uint8)
    for t in obj.tensors.values():
        if len(t.data):
            assert np.shares_memory(whole, np.frombuffer(t.data, np.uint8)), t.name


def test_to_torch_aliasing():
    # zstd output is a fresh writable buffer: the tensor aliases it.
    obj = decode_object(blob_of("zstd"))
    t = to_torch(obj)["layers.0.keys"]
    assert t.data_ptr() == np.frombuffer(obj.tensors["layers.0.keys"].data, np.uint8).ctypes.data
    # raw over a bytearray: aliases the blob.
    blob = bytearray(blob_of("raw"))
    t = to_torch(decode_object(blob))["layers.1.ssm"]
    assert np.shares_memory(np.frombuffer(blob, np.uint8), t.view(torch.uint8).reshape(-1).numpy())
    # raw over immutable bytes: copied, so writing the tensor cannot change the blob.
    blob = blob_of("raw")
    before = bytes(blob)
    t = to_torch(decode_object(blob))["layers.1.ssm"]
    t.add_(1)
    assert blob == before


def test_decoded_object_or_mapping_both_go_to_torch():
    obj = decode_object(blob_of())
    assert isinstance(obj, DecodedObject)
    a, b = to_torch(obj), to_torch(obj.tensors)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("encoding", ["raw", "zstd"])
def test_one_transfer_lands_every_tensor_from_one_buffer(encoding):
    # What to_torch does for a device: one host buffer, one copy, a view per tensor (run on the CPU here).
    tensors = {**hybrid_tensors(), "empty": torch.empty(0, 3, dtype=torch.bfloat16),
               "odd": torch.arange(7, dtype=torch.int8)}  # 7 bytes: the next tensor must still be aligned
    obj = decode_object(encode_object(**fields(), tensors=from_torch(tensors), encoding=encoding))
    want, got = to_torch(obj), one_transfer(obj.tensors, torch.device("cpu"))
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    bases = {got[k].untyped_storage().data_ptr() for k in got}
    assert len(bases) == 1  # every tensor a view of the one copied buffer


def test_encode_rejects_bad_input():
    ts = from_torch(hybrid_tensors())
    with pytest.raises(InvalidInput, match="address"):
        encode_object(**fields(address="XYZ"), tensors=ts)
    with pytest.raises(InvalidInput, match="kind"):
        encode_object(**fields(kind="kvx"), tensors=ts)
    with pytest.raises(InvalidInput, match="end 1 < start 2"):
        encode_object(**fields(start=2, end=1), tensors=ts)
    with pytest.raises(UnknownCodec):
        encode_object(**fields(), tensors=ts, encoding="nope")
    with pytest.raises(InvalidInput, match="expected 8"):
        RawTensor("x", "F32", (2,), memoryview(b"\0" * 7))


# --- interop with the safetensors library --------------------------------------------


def test_blobs_load_with_safetensors_library(tmp_path):
    ts = hybrid_tensors()
    raw_blob = blob_of("raw")
    loaded = st_load(raw_blob)
    assert loaded.keys() == ts.keys()
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in ts.items())

    zstd_blob = blob_of("zstd")
    loaded = st_load(zstd_blob)
    h = read_header(zstd_blob)
    for name, t in loaded.items():
        assert t.dtype == torch.uint8 and t.dim() == 1
        enc = bytes(t.numpy())
        dec = codecs.get_codec("zstd").decode(enc, h.tensors[name].dtype, h.tensors[name].shape, h.tensors[name].params)
        assert bytes(dec) == ts[name].contiguous().view(torch.uint8).numpy().tobytes()

    path = tmp_path / "obj.safetensors"
    path.write_bytes(raw_blob)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["kdn"])["address"] == ADDR
        for name in ts:
            assert torch.equal(f.get_tensor(name), ts[name])


def test_library_written_blob_parses_with_our_reader():
    ts = hybrid_tensors()
    kdn = {
        "v": 1, "kind": "hybrid", "address": ADDR, "model_id": MODEL, "namespace": "public",
        "start": 0, "end": 16, "position": 0, "parent": None, "encoding": "raw",
        "tensors": {n: {"dtype": d.dtype, "shape": list(d.shape), "codec": "raw", "params": {}}
                    for n, d in from_torch(ts).items()},
    }  # fmt: skip
    blob = st_save(ts, metadata={"kdn": json.dumps(kdn)})
    obj = decode_object(blob)
    assert obj.header.kind == "hybrid" and obj.header.n_tokens == 16
    got = to_torch(obj)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in ts.items())


def test_plain_safetensors_file_is_not_a_kdn_object():
    with pytest.raises(CorruptObject, match="__metadata__"):
        read_header(st_save({"x": torch.zeros(2)}))
    with pytest.raises(CorruptObject, match="'kdn'"):
        read_header(st_save({"x": torch.zeros(2)}, metadata={"other": "1"}))


# --- bad blobs: one test each --------------------------------------------------------


def test_truncated_shorter_than_length_prefix():
    with pytest.raises(TruncatedObject, match="5 bytes"):
        read_header(blob_of()[:5])


def test_truncated_inside_header():
    blob = blob_of()
    with pytest.raises(TruncatedObject, match="inside its"):
        read_header(blob[:40])


def test_truncated_inside_data():
    blob = blob_of("raw")
    with pytest.raises(TruncatedObject, match="ends 3 bytes before"):
        decode_object(blob[:-3])


def test_header_length_over_limit():
    blob = struct.pack("<Q", MAX_HEADER_BYTES + 8) + b" " * 64
    with pytest.raises(ObjectTooLarge, match="header length"):
        read_header(blob)


def test_blob_over_max_bytes():
    blob = blob_of()
    with pytest.raises(ObjectTooLarge, match=f"max_bytes={len(blob) - 1}"):
        decode_object(blob, max_bytes=len(blob) - 1)
    with pytest.raises(ObjectTooLarge):
        read_header(blob, max_bytes=100)


def test_header_not_json():
    header, data = split(blob_of())
    with pytest.raises(CorruptObject, match="not valid JSON"):
        read_header(join(b'{"__metadata__": ', data))
    with pytest.raises(CorruptObject, match="JSON list"):
        read_header(join(b"[1, 2]", data))


def test_kdn_header_not_json():
    def edit(h):
        h["__metadata__"]["kdn"] = "{nope"

    with pytest.raises(CorruptObject, match="KDN header is not valid JSON"):
        read_header(with_header(blob_of(), edit))


def test_duplicate_json_keys():
    header, data = split(blob_of("raw"))
    text = json.dumps(header)
    dup = text[:-1] + ', "empty": ' + json.dumps(header["empty"]) + "}"
    with pytest.raises(CorruptObject, match="duplicate JSON key 'empty'"):
        read_header(join(dup.encode(), data))


def test_missing_kdn_field():
    with pytest.raises(CorruptObject, match="missing \\['namespace'\\]"):
        read_header(with_kdn(blob_of(), lambda k: k.pop("namespace")))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("kind", "attn", "kind"),
        ("kind", ["kv"], "kind"),
        ("start", -1, "start"),
        ("end", "512", "end"),
        ("position", True, "position"),
        ("end", 10, "end 10 < start 256"),
        ("namespace", "Bad/NS", "namespace"),
        ("encoding", "", "encoding"),
        ("tensors", [], "tensors"),
    ],
)
def test_odd_kdn_field(field, value, match):
    def edit(k):
        k[field] = value

    with pytest.raises(CorruptObject, match=match):
        read_header(with_kdn(blob_of(), edit))


@pytest.mark.parametrize("field", ["address", "model_id", "parent"])
def test_invalid_address_string(field):
    def edit(k):
        k[field] = "A1" * 32  # uppercase hex is not an address

    with pytest.raises(CorruptObject, match=field):
        read_header(with_kdn(blob_of(), edit))


def test_odd_tensor_entry():
    def edit(k):
        k["tensors"]["layers.1.ssm"]["dtype"] = "F128"

    with pytest.raises(CorruptObject, match="unknown dtype 'F128'"):
        read_header(with_kdn(blob_of(), edit))

    def edit2(h):
        h["layers.1.ssm"]["data_offsets"] = [5]

    with pytest.raises(CorruptObject, match="data_offsets"):
        read_header(with_header(blob_of(), edit2))


def test_tensor_names_disagree():
    def edit(k):
        k["tensors"]["ghost"] = k["tensors"].pop("layers.0.keys")

    with pytest.raises(CorruptObject, match="stored only \\['layers.0.keys'\\], KDN header only \\['ghost'\\]"):
        read_header(with_kdn(blob_of(), edit))


def test_unsupported_version():
    def edit(k):
        k["v"] = 2

    with pytest.raises(UnsupportedVersion, match="version 2"):
        read_header(with_kdn(blob_of(), edit))


def test_data_offsets_out_of_bounds():
    blob = blob_of("raw")
    header, data = split(blob)
    big = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")

    def edit(h):
        h["layers.0.keys"]["data_offsets"] = [big, big + 10_000]

    with pytest.raises(CorruptObject, match="gap|overlap"):
        read_header(with_header(blob, edit))


def test_data_offsets_overlap():
    blob = blob_of("raw")

    def edit(h):
        b, e = h["layers.0.values"]["data_offsets"]
        h["layers.0.values"]["data_offsets"] = [b - 8, e - 8]

    with pytest.raises(CorruptObject, match="overlap"):
        read_header(with_header(blob, edit))


def test_data_not_covered():
    header, data = split(blob_of("raw"))
    with pytest.raises(CorruptObject, match="8 bytes that no tensor covers"):
        read_header(join(header, data + b"\0" * 8))


def test_stored_shape_disagrees_with_byte_length():
    def edit(h):
        h["layers.1.ssm"]["shape"] = [1, 4, 8, 15]

    with pytest.raises(TensorMismatch, match="layers.1.ssm"):
        read_header(with_header(blob_of("raw"), edit))


def test_stored_dtype_disagrees_with_kdn_header():
    def edit(k):
        k["tensors"]["layers.0.keys"]["dtype"] = "F16"  # same size, different dtype

    with pytest.raises(TensorMismatch, match="stored as BF16.*raw F16"):
        read_header(with_kdn(blob_of("raw"), edit))


def test_encoded_tensor_not_stored_as_u8():
    def edit(k):
        k["tensors"]["layers.1.ssm"]["codec"] = "zstd"

    with pytest.raises(TensorMismatch, match="1-D U8"):
        read_header(with_kdn(blob_of("raw"), edit))


def test_decoded_length_differs():
    class Short:
        name = "test-short"
        lossless = True

        def encode(self, data, dtype, shape):
            return bytes(data), {}

        def decode(self, data, dtype, shape, params):
            return bytes(data)[:-1]

    codecs.register_codec(Short())
    try:
        blob = encode_object(**fields(), tensors=from_torch({"x": torch.ones(4)}), encoding="test-short")
        with pytest.raises(TensorMismatch, match="decoded 15 bytes, expected 16"):
            decode_object(blob)
    finally:
        codecs._REGISTRY.pop("test-short", None)


def test_corrupt_encoded_payload_raises_codec_error():
    blob = bytearray(blob_of("zstd"))
    blob[-20] ^= 0xFF  # inside the last tensor's zstd frame
    with pytest.raises(CodecError):
        decode_object(bytes(blob))


def test_unknown_codec_is_readable_but_not_decodable():
    def edit(k):
        k["tensors"]["layers.1.ssm"]["codec"] = "future-codec"

    blob = with_kdn(blob_of("zstd"), edit)
    assert read_header(blob).tensors["layers.1.ssm"].codec == "future-codec"  # an edge can still serve it
    with pytest.raises(UnknownCodec, match="future-codec"):
        decode_object(blob)


def test_digest_mismatch_is_checked_before_parsing():
    blob = blob_of()
    with pytest.raises(DigestMismatch, match="differs"):
        decode_object(blob, expected_digest="0" * 64)
    # Garbage that would fail parsing reports the digest, not the structure.
    with pytest.raises(DigestMismatch):
        decode_object(b"\xff" * 3, expected_digest=blob_digest(blob))


def test_format_doc_example_is_true():
    import contextlib
    import io
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "format.md").read_text()
    script = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    shown = re.search(r"Output:\n\n```text\n(.*?)```", doc, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "docs/format.md", "exec"), {})
    assert out.getvalue() == shown


def test_decode_into_reused_buffer():
    import numpy as np

    from kdn.format.objects import decoded_nbytes

    rng = np.random.default_rng(2)
    tensors = {
        "L0.k": RawTensor("L0.k", "BF16", (2, 5, 8), memoryview(rng.integers(0, 256, 160, dtype=np.uint8).tobytes())),
        "L0.ssm": RawTensor("L0.ssm", "F32", (3, 3), memoryview(rng.integers(0, 256, 36, dtype=np.uint8).tobytes())),
    }
    blob = encode_object(kind="kv", address=ADDR, model_id=MODEL, namespace="public", start=0, end=5, position=0,
                         parent=None, tensors=tensors, encoding="zstd")
    header = read_header(blob)
    buf = bytearray(decoded_nbytes(header))
    for _ in range(2):  # the second decode reuses the buffer
        dec = decode_object(blob, out=buf)
        for name, t in tensors.items():
            assert bytes(dec.tensors[name].data) == bytes(t.data)
            assert np.shares_memory(np.frombuffer(dec.tensors[name].data, np.uint8), np.frombuffer(buf, np.uint8))
    with pytest.raises(InvalidInput):
        decode_object(blob, out=bytearray(8))


def test_a_zstd_bomb_is_refused_before_it_is_decoded():
    """64 MiB of zeros compress to a few KB: the header's claim is checked before any allocation."""
    import numpy as np

    from kdn.format.objects import MAX_EXPANSION, RawTensor, decode_object, encode_object

    zeros = np.zeros(32 << 20, dtype=np.uint16)  # 64 MiB of bf16 zeros
    t = RawTensor("L0.k", "BF16", (1, 32 << 20, 1), memoryview(zeros).cast("B"))
    blob = encode_object(kind="kv", address="aa" * 32, model_id="bb" * 32, namespace="public", start=0, end=1,
                         position=0, parent=None, tensors={"L0.k": t}, encoding="zstd")
    assert len(blob) * MAX_EXPANSION < 64 << 20  # a real bomb: tiny on the wire
    with pytest.raises(ObjectTooLarge, match="decompression bomb"):
        decode_object(blob)
    # an engine that knows its model's chunk size bounds it exactly; a caller that expects it may allow it
    assert decode_object(blob, max_decoded=64 << 20).tensors["L0.k"].shape == (1, 32 << 20, 1)


# --- the cache of validated layouts -------------------------------------------------------------


def test_a_header_read_twice_is_validated_once_and_a_bad_one_every_time(monkeypatch):
    from kdn.format import layout

    calls = []
    validate = layout._validate
    monkeypatch.setattr(layout, "_validate", lambda text, size: calls.append(size) or validate(text, size))
    monkeypatch.setattr(layout, "_LAYOUTS", layout._LayoutCache(1 << 20))
    blob = blob_of("raw")
    first, again = read_header(blob), read_header(bytearray(blob))
    assert first is again and calls == [len(blob)]  # the second read is the first's layout
    # The size is part of what was checked: the same header over fewer data bytes is checked (and refused).
    with pytest.raises(TruncatedObject, match="ends 3 bytes before"):
        decode_object(blob[:-3])
    with pytest.raises(TruncatedObject):
        decode_object(blob[:-3])
    assert calls == [len(blob), len(blob) - 3, len(blob) - 3]  # a refused header is never kept
    # One changed byte of the header is another header: checked, and refused on its own terms.
    bad = with_kdn(blob, lambda k: k.update(start=-1))
    for _ in range(2):
        with pytest.raises(CorruptObject, match="start"):
            read_header(bad)
    assert len(calls) == 5


def test_the_layout_cache_is_bounded_by_its_key_bytes():
    from kdn.format.layout import _LayoutCache, _validate

    blobs = [blob_of("raw", start=256 * i, end=256 * (i + 1), position=256 * i) for i in range(1, 40)]
    n = struct.unpack_from("<Q", blobs[0])[0]
    cache = _LayoutCache(16 * n)  # room for ~16 headers of this size
    for b in blobs:
        (hn,) = struct.unpack_from("<Q", b)
        cache.put(b[8:8 + hn], len(b), _validate(b[8:8 + hn], len(b)))
    assert cache._bytes <= 16 * n and len(cache._items) <= 16
    last = blobs[-1]
    (hn,) = struct.unpack_from("<Q", last)
    assert cache.get(last[8:8 + hn], len(last)) is not None  # the newest stays; the oldest went
    (hn0,) = struct.unpack_from("<Q", blobs[0])
    assert cache.get(blobs[0][8:8 + hn0], len(blobs[0])) is None
