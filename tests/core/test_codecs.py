"""Codec contract (every lossless codec) plus the zstd shuffle against its reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn.format import codecs
from kdn.format.codecs import (
    Codec,
    RawCodec,
    ZstdCodec,
    codec_names,
    get_codec,
    itemsize,
    register_codec,
    shuffle,
    shuffle_ref,
    unshuffle,
    unshuffle_ref,
)
from kdn.errors import CodecError, InvalidInput, UnknownCodec

DTYPES = ["BF16", "F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL"]
# The lossless codecs registered (raw and zstd today), from the registry: one added later is tested unnamed.
LOSSLESS = [n for n in codec_names() if get_codec(n).lossless]
assert set(LOSSLESS) >= {"raw", "zstd"}

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    n = math.prod(shape) * itemsize(dtype)
    data = draw(st.binary(min_size=n, max_size=n))
    if dtype == "BOOL":
        data = bytes(b & 1 for b in data)
    return dtype, shape, data


@pytest.mark.parametrize("name", LOSSLESS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=tensors())
def test_lossless_round_trip_is_exact(name, t):
    dtype, shape, data = t
    codec = get_codec(name)
    assert isinstance(codec, Codec) and codec.lossless
    enc, params = codec.encode(data, dtype, shape)
    out = codec.decode(enc, dtype, shape, params)
    assert bytes(out) == data
    assert len(out) == len(data)


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_odd_length_tensors(name, dtype):
    codec = get_codec(name)
    rng = np.random.default_rng(0)
    for shape in [(0,), (3, 0, 2), (), (1,), (7,), (3, 5, 1)]:
        data = rng.integers(0, 2 if dtype == "BOOL" else 256, math.prod(shape) * itemsize(dtype), dtype=np.uint8).tobytes()
        enc, params = codec.encode(data, dtype, shape)
        assert bytes(codec.decode(enc, dtype, shape, params)) == data


@pytest.mark.parametrize("name", LOSSLESS)
def test_encode_rejects_wrong_length(name):
    with pytest.raises(CodecError, match="expected 12"):
        get_codec(name).encode(b"\0" * 10, "F32", (3,))


def test_raw_decode_does_not_copy():
    buf = bytearray(range(64))
    out = RawCodec().decode(memoryview(buf)[16:48], "F32", (8,), {})
    assert isinstance(out, memoryview)
    assert np.shares_memory(np.frombuffer(out, np.uint8), np.frombuffer(buf, np.uint8))


@pytest.mark.parametrize("width", [2, 4, 8])
@given(data=st.binary(max_size=400))
def test_shuffle_matches_reference(width, data):
    data = data[: len(data) // width * width]
    assert shuffle(data, width).tobytes() == shuffle_ref(data, width)
    assert unshuffle(shuffle_ref(data, width), width).tobytes() == data
    assert unshuffle_ref(shuffle_ref(data, width), width) == data


def test_shuffle_puts_byte_planes_in_order():
    # Two little-endian u16 values 0x0201, 0x0403: plane 0 = low bytes, plane 1 = high bytes.
    assert shuffle(b"\x01\x02\x03\x04", 2).tobytes() == b"\x01\x03\x02\x04"


def test_zstd_compresses_real_bf16():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g).to(torch.bfloat16)  # x: [64, 1024]
    data = x.view(torch.uint8).numpy().tobytes()
    enc, params = get_codec("zstd").encode(data, "BF16", tuple(x.shape))
    assert params["level"] == 1 and params["shuffle"] == 2 and len(params["frames"]) == 2
    assert sum(params["frames"]) == len(enc)
    assert len(data) / len(enc) > 1.3  # ~1.46 measured; without the shuffle ~1.1
    plain, _ = ZstdCodec().encode(data, "U8", (len(data),))
    assert len(enc) < len(plain)
    assert bytes(get_codec("zstd").decode(enc, "BF16", tuple(x.shape), params)) == data


def _zstd_sample():
    rng = np.random.default_rng(1)
    data = (rng.standard_normal(300).astype(np.float32) * 4).astype(np.float16).tobytes()
    enc, params = get_codec("zstd").encode(data, "F16", (300,))
    return data, enc, params


def test_zstd_corrupt_payload_raises_at_every_byte():
    data, enc, params = _zstd_sample()
    for i in range(len(enc)):
        for bit in (0, 3, 7):
            bad = bytearray(enc)
            bad[i] ^= 1 << bit
            try:
                out = get_codec("zstd").decode(bytes(bad), "F16", (300,), params)
            except CodecError:
                continue
            # A flip that zstd cannot see must still give the exact bytes (e.g. an unused bit).
            assert bytes(out) == data, f"byte {i} bit {bit}: wrong bytes returned"


@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=8))
def test_zstd_truncated_or_extended_payload_raises(cut, junk):
    data, enc, params = _zstd_sample()
    cut %= len(enc)
    with pytest.raises(CodecError):
        get_codec("zstd").decode(enc[:cut], "F16", (300,), params)
    if junk:
        with pytest.raises(CodecError):
            get_codec("zstd").decode(enc + junk, "F16", (300,), params)


def test_zstd_wrong_declared_shape_raises():
    data, enc, params = _zstd_sample()
    with pytest.raises(CodecError, match="content size 300 for F16"):
        get_codec("zstd").decode(enc, "F16", (301,), params)
    with pytest.raises(CodecError, match="shuffle"):
        get_codec("zstd").decode(enc, "F16", (300,), {"shuffle": 3})


def test_registry():
    assert {"raw", "zstd"} <= set(codec_names())
    with pytest.raises(UnknownCodec, match="nope"):
        get_codec("nope")
    with pytest.raises(InvalidInput, match="already registered"):
        register_codec(ZstdCodec(level=3))
    register_codec(get_codec("zstd"))  # the same object again is fine

    class Upper:
        name = "test-upper"
        lossless = True

        def encode(self, data, dtype, shape):
            return bytes(data), {}

        def decode(self, data, dtype, shape, params):
            return data

    try:
        register_codec(Upper())
        assert get_codec("test-upper").name == "test-upper"
    finally:
        codecs._REGISTRY.pop("test-upper", None)
    with pytest.raises(InvalidInput, match="codec name"):
        register_codec(type("Bad", (Upper,), {"name": "Bad Name"})())


def test_itemsize():
    assert [itemsize(d) for d in ["BF16", "F32", "F64", "BOOL"]] == [2, 4, 8, 1]
    with pytest.raises(InvalidInput, match="unknown dtype"):
        itemsize("F128")


def test_codec_modules_import_no_torch():
    import subprocess
    import sys

    code = "import sys, kdn.format.codecs, kdn.format.objects; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("dtype,shape", [("BF16", (3, 17, 8)), ("F32", (5, 7)), ("U8", (33,)), ("F64", (4,)), ("F16", (0,))])
@pytest.mark.parametrize("name", ["raw", "zstd"])
def test_decode_into_reused_buffer_equals_fresh_decode(name, dtype, shape):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, codecs.nbytes(dtype, shape), dtype=np.uint8).tobytes()
    codec = get_codec(name)
    enc, params = codec.encode(data, dtype, shape)
    out = bytearray(b"\xaa" * len(data))
    got = codec.decode(enc, dtype, shape, params, out=memoryview(out))
    assert bytes(got) == data and bytes(out) == data


def test_decode_into_wrong_sized_buffer_raises():
    data = bytes(range(64))
    enc, params = get_codec("zstd").encode(data, "F16", (32,))
    with pytest.raises(CodecError, match="output buffer"):
        get_codec("zstd").decode(enc, "F16", (32,), params, out=memoryview(bytearray(63)))
    with pytest.raises(CodecError, match="output buffer"):
        get_codec("zstd").decode(enc, "F16", (32,), params, out=memoryview(bytes(64)))  # read-only


# --- decode_into: straight into a strided slice of a larger tensor (an engine's cache) ----------------


def _slot(width: int, shape: tuple[int, ...], pad: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """A zeroed ``[shape[0], shape[1] + 2 * pad, ...]`` array and its middle slice along dim 1 (strided)."""
    big = np.zeros((shape[0], shape[1] + 2 * pad, *shape[2:]), dtype=f"<u{width}")
    return big, big[:, pad:pad + shape[1]]


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_into_a_strided_slice_equals_decode_and_leaves_the_rest_alone(name, dtype):
    codec, width, shape = get_codec(name), itemsize(dtype), (3, 16, 8)
    raw = np.random.default_rng(5).integers(0, 256, size=math.prod(shape) * width, dtype=np.uint8).tobytes()
    enc, params = codec.encode(raw, dtype, shape)
    big, dst = _slot(width, shape)
    assert not dst.flags.c_contiguous
    codecs.decode_into(codec, enc, dtype, shape, params, dst)
    assert np.array_equal(dst, np.frombuffer(raw, f"<u{width}").reshape(shape))
    assert not big[:, :5].any() and not big[:, -5:].any()


def test_decode_into_falls_back_to_decode_and_copy_for_a_codec_without_it():
    class Doubling:  # a codec with decode only: each byte stored twice
        name, lossless = "doubling-test", True

        def encode(self, data, dtype, shape):
            return bytes(b for b in bytes(data) for _ in range(2)), {}

        def decode(self, data, dtype, shape, params, out=None):
            return bytes(data)[::2]

    raw = bytes(range(96))
    codec = Doubling()
    enc, params = codec.encode(raw, "BF16", (3, 16))
    big, dst = _slot(2, (3, 16))
    codecs.decode_into(codec, enc, "BF16", (3, 16), params, dst)
    assert dst.tobytes() == raw


def test_decode_into_refuses_a_target_of_the_wrong_shape_item_size_or_read_only():
    z = get_codec("zstd")
    enc, params = z.encode(bytes(64), "BF16", (4, 8))
    for bad in (np.zeros((4, 9), np.uint16), np.zeros((4, 8), np.uint32), np.zeros((4, 8), np.uint16)[:, ::-1][:, :8]):
        if bad.shape == (4, 8) and bad.dtype == np.uint16:
            bad.flags.writeable = False
        with pytest.raises(InvalidInput, match="decode target"):
            codecs.decode_into(z, enc, "BF16", (4, 8), params, bad)


def test_zstd_decode_into_refuses_a_bad_checksum_and_bytes_after_a_frame():
    z = get_codec("zstd")
    raw = np.random.default_rng(2).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    enc, params = z.encode(raw, "BF16", (2048,))
    f0 = params["frames"][0]
    flipped = bytearray(enc)
    flipped[f0 - 1] ^= 1  # the last byte of the first frame: its checksum
    with pytest.raises(CodecError, match="checksum"):
        codecs.decode_into(z, bytes(flipped), "BF16", (2048,), params, np.empty(2048, np.uint16))
    trailing = enc[:f0] + b"\x00\x01\x02" + enc[f0:]
    bad = dict(params, frames=[f0 + 3, params["frames"][1]])
    with pytest.raises(CodecError):
        z.decode(trailing, "BF16", (2048,), bad)  # the plain path refuses it too
    with pytest.raises(CodecError):
        codecs.decode_into(z, trailing, "BF16", (2048,), bad, np.empty(2048, np.uint16))
    short = dict(params, frames=[f0 - 1, params["frames"][1] + 1])
    with pytest.raises(CodecError):
        codecs.decode_into(z, enc, "BF16", (2048,), short, np.empty(2048, np.uint16))
