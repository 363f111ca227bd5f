"""Tensor codecs: named, paired ``encode``/``decode`` over the C-order bytes of one tensor.

A codec sees bytes, a safetensors dtype string and a shape, never a torch
tensor, so the edge can verify and re-serve objects without importing torch.
The lossless codecs live here:

- ``raw``  -- identity; decoding returns a slice of the input (no copy).
- ``zstd`` -- byte-plane shuffle for 2-, 4- and 8-byte dtypes (all byte 0s,
  then all byte 1s, ...), then one zstd frame (level 1, content size and
  checksum in the frame). 16-bit floats are nearly incompressible as is
  (ratio ~1.1), but their high-byte plane (sign, exponent) is very
  compressible: ~1.46x on bf16 randn, ~1.45x on real KV (docs/benchmarks.md).

Lossy codecs (int8, 4-bit, ...) need tensor math and live in ``kdn.kernels``;
they register themselves here with :func:`register_codec`.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np
import zstandard

from kdn.errors import CodecError, InvalidInput, UnknownCodec

Buffer = bytes | bytearray | memoryview

# safetensors dtype strings -> bytes per element (little-endian on the wire).
_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
DTYPES: frozenset[str] = frozenset(_ITEMSIZE)

_CODEC_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype string (``"BF16"`` -> 2)."""
    try:
        return _ITEMSIZE[dtype]
    except (KeyError, TypeError):
        raise InvalidInput(f"unknown dtype {str(dtype)[:20]!r}: expected one of {sorted(_ITEMSIZE)}") from None


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Byte length of a C-order tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * itemsize(dtype)


@runtime_checkable
class Codec(Protocol):
    """Turns one tensor's bytes into encoded bytes and back.

    ``encode`` returns the encoded bytes and the parameters to record in the
    object header; ``decode`` gets them back and returns exactly
    ``nbytes(dtype, shape)`` bytes, or raises :class:`CodecError`.
    """

    name: str
    lossless: bool

    def encode(self, data: Buffer, dtype: str, shape: tuple[int, ...]) -> tuple[bytes, dict[str, Any]]: ...

    def decode(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict[str, Any], out: memoryview | None = None) -> Buffer:
        """Decoded bytes; with ``out`` (writable, exactly ``nbytes(dtype, shape)`` long) they are written there."""
        ...

    # Optional: ``decode_into(data, dtype, shape, params, dst)`` writes the values into ``dst``, a writable
    # ``<u{itemsize}`` array of ``shape`` with any strides (a slice of an engine's cache tensor). A codec
    # without it is decoded into a fresh buffer and copied: see :func:`decode_into`.


def decode_into(codec: Codec, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict[str, Any],
                dst: np.ndarray) -> None:
    """Decode one tensor straight into ``dst``: a writable array of ``shape`` whose items are
    ``itemsize(dtype)`` bytes, with any strides (say a slice ``[heads, t, head_dim]`` of a
    ``[heads, T, head_dim]`` cache tensor). Saves the intermediate buffer, its page faults and the copy
    a concatenation would make; codecs that cannot write into place are decoded and copied once."""
    width = itemsize(dtype)
    if tuple(dst.shape) != tuple(shape) or dst.itemsize != width or not dst.flags.writeable:
        raise InvalidInput(f"decode target must be writable, of shape {list(shape)} and {width}-byte items; got "
                           f"{list(dst.shape)} of {dst.itemsize}-byte items (writable={dst.flags.writeable})")
    lanes = dst.view(np.dtype(f"<u{width}"))
    into = getattr(codec, "decode_into", None)
    if into is not None:
        into(data, dtype, shape, params, lanes)
        return
    buf = _as_bytes_view(codec.decode(data, dtype, shape, params))
    _check_length(buf, dtype, shape, f"{codec.name} decode")
    np.copyto(lanes, np.frombuffer(buf, lanes.dtype).reshape(shape))


def _as_bytes_view(data: Buffer) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _check_length(mv: memoryview, dtype: str, shape: tuple[int, ...], what: str) -> int:
    want = nbytes(dtype, shape)
    if len(mv) != want:
        raise CodecError(f"{what}: {len(mv)} bytes for {dtype}{list(shape)}, expected {want}")
    return want


def _check_out(out: memoryview, want: int) -> memoryview:
    ov = _as_bytes_view(out)
    if ov.readonly or len(ov) != want:
        raise CodecError(f"output buffer must be writable and {want} bytes, got {len(ov)} (readonly={ov.readonly})")
    return ov


class RawCodec:
    """Identity. ``decode`` returns a memoryview over the input: no copy."""

    name = "raw"
    lossless = True

    def encode(self, data: Buffer, dtype: str, shape: tuple[int, ...]) -> tuple[bytes, dict[str, Any]]:
        mv = _as_bytes_view(data)
        _check_length(mv, dtype, shape, "raw encode")
        return bytes(mv), {}

    def decode(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict[str, Any], out: memoryview | None = None) -> Buffer:
        mv = _as_bytes_view(data)
        _check_length(mv, dtype, shape, "raw decode")
        if out is not None:
            _check_out(out, len(mv))[:] = mv
            return out
        return mv

    def decode_into(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict[str, Any], dst: np.ndarray) -> None:
        mv = _as_bytes_view(data)
        _check_length(mv, dtype, shape, "raw decode")
        np.copyto(dst, np.frombuffer(mv, dst.dtype).reshape(shape))


# zstd contexts are not safe to share between threads; each thread keeps its own.
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("cctx", {})
    if level not in cache:
        # Content size and checksum in the frame: decode checks both, so a
        # corrupted payload raises instead of returning wrong bytes.
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def shuffle_ref(data: Buffer, width: int) -> bytes:
    """Reference byte-plane shuffle (pure Python slicing): plane ``i`` holds byte ``i`` of every value."""
    b = bytes(data)
    return b"".join(b[i::width] for i in range(width))


def unshuffle_ref(planes: Buffer, width: int) -> bytes:
    """Inverse of :func:`shuffle_ref`."""
    p = bytes(planes)
    n = len(p) // width
    out = bytearray(len(p))
    for i in range(width):
        out[i::width] = p[i * n : (i + 1) * n]
    return bytes(out)


def shuffle(data: Buffer, width: int) -> np.ndarray:
    """Byte planes of ``width``-byte values as a fresh ``uint8`` array ``[width * n]``."""
    a = np.frombuffer(data, np.uint8)
    n = a.size // width
    planes = np.empty((width, n), np.uint8)  # planes: [width, n]
    np.copyto(planes, a.reshape(n, width).T)  # a: [n, width]; a strided read is fast enough here (~3.5 GB/s)
    return planes.reshape(-1)


def unshuffle(planes: Buffer | list[Buffer], width: int, out: memoryview | None = None) -> np.ndarray:
    """Inverse of :func:`shuffle`: interleave byte planes back into a fresh ``uint8`` array.

    ``planes`` is the concatenation of the planes, or a list of ``width``
    equal-length planes. A transposing ``np.copyto`` writes with a stride of
    ``width`` bytes and runs at ~0.5 GB/s here; building each value with
    shifts and ors over whole planes runs at ~4 GB/s, so that is what this
    does (in ``<u{width}`` lanes, which is the wire byte order). Writing into
    a reused ``out`` instead of a fresh array saves the page faults of a new
    allocation (decode of real KV: 0.85 -> 1.35 GB/s).
    """
    if isinstance(planes, list):
        p = [np.frombuffer(x, np.uint8) for x in planes]  # p: width x [n]
    else:
        flat = np.frombuffer(planes, np.uint8)
        p = list(flat.reshape(width, flat.size // width))  # p: width x [n]
    n = p[0].size
    lanes = np.dtype(f"<u{width}")
    res = np.empty(n, lanes) if out is None else np.frombuffer(out, lanes)  # res: [n]
    _interleave(p, res)
    return res.view(np.uint8)


def _interleave(planes: list[np.ndarray], res: np.ndarray) -> None:
    """Write values built from byte ``planes`` (plane i = byte i of each value) into ``res``: an array
    of ``<u{len(planes)}`` lanes with any shape and strides; each plane holds ``res.size`` bytes."""
    width = len(planes)
    p = [x.reshape(res.shape) for x in planes]
    if width == 1:
        np.copyto(res, p[0])
        return
    np.left_shift(p[width - 1], 8, out=res, dtype=res.dtype)
    np.bitwise_or(res, p[width - 2], out=res)
    for i in range(width - 3, -1, -1):
        np.left_shift(res, 8, out=res)
        np.bitwise_or(res, p[i], out=res)


class ZstdCodec:
    """Byte-plane shuffle (2-, 4-, 8-byte dtypes), then one zstd frame per plane.

    Params: ``level``, ``shuffle`` (plane count) and ``frames`` (the byte
    length of each plane's frame). One frame per plane, not one for all: on
    real bf16 KV the sign/exponent plane compresses ~2.6x and the mantissa
    plane not at all, and zstd level 1 over the two together reaches 1.41x
    where separate frames reach 1.45x (bench/address_codec.py).
    """

    name = "zstd"
    lossless = True

    def __init__(self, level: int = 1) -> None:
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise InvalidInput(f"zstd level {level!r} out of range [-7, 22]")
        self.level = level

    def encode(self, data: Buffer, dtype: str, shape: tuple[int, ...]) -> tuple[bytes, dict[str, Any]]:
        mv = _as_bytes_view(data)
        _check_length(mv, dtype, shape, "zstd encode")
        width = itemsize(dtype)
        cctx = _compressor(self.level)
        if width == 1 or not len(mv):
            frame = cctx.compress(mv)
            return frame, {"level": self.level, "shuffle": width, "frames": [len(frame)]}
        planes = shuffle(mv, width).reshape(width, -1)  # planes: [width, n]
        frames = [cctx.compress(plane.data) for plane in planes]  # .data: each row's bytes, as a memoryview
        return b"".join(frames), {"level": self.level, "shuffle": width, "frames": [len(f) for f in frames]}

    @staticmethod
    def _split(mv: memoryview, dtype: str, shape: tuple[int, ...], params: dict[str, Any], want: int) -> tuple[int, list[int]]:
        """The shuffle width and the frame lengths the params claim, checked against the payload."""
        width = params.get("shuffle", itemsize(dtype)) if isinstance(params, dict) else None
        if not isinstance(width, int) or isinstance(width, bool) or width not in (1, 2, 4, 8) or want % width:
            raise CodecError(f"zstd: bad shuffle width {str(width)[:20]!r} for {dtype}{list(shape)}")
        frames = params.get("frames", [len(mv)])
        if (
            not isinstance(frames, list)
            or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 0 for f in frames)
            or sum(frames) != len(mv)
            or len(frames) not in (1, width)
        ):
            raise CodecError(f"zstd: frame lengths {str(frames)[:60]} do not split {len(mv)} bytes into 1 or {width} frames")
        return width, frames

    def decode_into(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict[str, Any], dst: np.ndarray) -> None:
        """Each frame decompressed, then the planes interleaved straight into ``dst``: against :meth:`decode`,
        no unshuffled output buffer (the planes go straight into place) and, when ``dst`` is a slice of a cache
        tensor, no concatenation after.

        One-shot ``decompress`` per frame, not a stream reader into a reused buffer: the reader's
        ``readinto`` holds the GIL (two threads decoding took longer than one), while ``decompress`` and
        numpy's ufuncs release it, so objects decode on other cores while the event loop receives."""
        want = nbytes(dtype, shape)
        mv = _as_bytes_view(data)
        width, frames = self._split(mv, dtype, shape, params, want)
        if width != itemsize(dtype) or not want:
            # A width other than the item size (an object from another encoder) is rare: the plain path.
            np.copyto(dst, np.frombuffer(self.decode(mv, dtype, shape, params), dst.dtype).reshape(shape))
            return
        outs = self._frames(mv, frames, want, dtype, shape)
        if len(outs) == 1:  # one frame holding every plane
            planes = list(np.frombuffer(outs[0], np.uint8).reshape(width, want // width))
        else:
            planes = [np.frombuffer(o, np.uint8) for o in outs]
        _interleave(planes, dst)

    def decode(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict[str, Any], out: memoryview | None = None) -> Buffer:
        want = nbytes(dtype, shape)
        if out is not None:
            out = _check_out(out, want)
        mv = _as_bytes_view(data)
        width, frames = self._split(mv, dtype, shape, params, want)
        outs: list[Buffer] = list(self._frames(mv, frames, want, dtype, shape))
        if width == 1 or want == 0:
            joined = outs[0] if len(outs) == 1 else b"".join(outs)
            if out is None:
                return joined
            out[:] = joined
            return out
        return unshuffle(outs if len(outs) > 1 else outs[0], width, out=out).data

    def _frames(self, mv: memoryview, frames: list[int], want: int, dtype: str, shape: tuple[int, ...]) -> list[bytes]:
        """Each frame of the payload decompressed (``want`` bytes in all, split evenly between the frames)."""
        per_frame, outs, offset = want // len(frames), [], 0
        for flen in frames:
            outs.append(self._frame(mv[offset : offset + flen], per_frame, dtype, shape))
            offset += flen
        return outs

    @staticmethod
    def _frame(frame: memoryview, want: int, dtype: str, shape: tuple[int, ...]) -> bytes:
        try:
            size = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd: bad frame header: {e}") from None
        if size != want:
            raise CodecError(f"zstd: frame content size {size} for {dtype}{list(shape)}, expected {want}")
        try:
            # The frame records its content size, so this allocates once, exactly.
            out = _decompressor().decompress(frame, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd: corrupt payload: {e}") from None
        if len(out) != want:  # pragma: no cover - zstd checks the content size itself
            raise CodecError(f"zstd: decoded {len(out)} bytes, expected {want}")
        return out


_REGISTRY: dict[str, Codec] = {}
_REGISTRY_LOCK = threading.Lock()


def register_codec(codec: Codec, *, replace: bool = False) -> None:
    """Make ``codec`` available under ``codec.name``; a different codec under a taken name needs ``replace``."""
    name = getattr(codec, "name", None)
    if not isinstance(name, str) or not _CODEC_NAME.fullmatch(name):
        raise InvalidInput(f"invalid codec name {str(name)[:40]!r}: use 1-32 chars of a-z, 0-9, '_' and '-'")
    if not isinstance(codec, Codec):
        raise InvalidInput(f"codec {name!r} lacks lossless/encode/decode")
    with _REGISTRY_LOCK:
        old = _REGISTRY.get(name)
        if old is not None and old is not codec and not replace:
            raise InvalidInput(f"codec {name!r} is already registered")
        _REGISTRY[name] = codec


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``; :class:`UnknownCodec` if none is."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownCodec(f"unknown codec {str(name)[:40]!r}: registered are {sorted(_REGISTRY)}") from None


def codec_names() -> list[str]:
    """Names of the registered codecs, sorted."""
    return sorted(_REGISTRY)


register_codec(RawCodec())
register_codec(ZstdCodec())
