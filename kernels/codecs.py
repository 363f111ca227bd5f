"""Lossy KV codecs (int8, 4-bit groups) and the per-tensor plan of each object-level encoding.

Codecs registered on import (``kdn.format.codecs.get_codec(name)``):

| name | what | bits/value (+ params) |
| --- | --- | --- |
| ``int8-channel`` / ``int8-token`` | symmetric absmax int8, one fp16 scale per channel (reduced over tokens) or per token (reduced over the last dim) | 8 (+16 per row) |
| ``int8z-channel`` / ``int8z-token`` | the same, then zstd level 1 over the payload | ~7.5 |
| ``int4-g{32,64}-{channel,token}`` | asymmetric 4-bit, fp16 scale + fp16 min per group of 32/64 values along the reduced axis, two codes per byte | 4 (+32 per group) |
| ``cachegen-{2..8}`` | anchor + delta per group of tokens, entropy coded (``kernels/cachegen.py``) | ~bits-1.5 |
| ``ans{2..8}-{channel,token}`` | absmax codes (no deltas), entropy coded (``kernels/cachegen.py``) | ~bits-1.5 |
| ``kvtc`` | per-layer PCA basis (a separate basis object), water-filling steps, rANS (``kernels/transform.py``); objects are written by ``encode_kvtc_object``, not by :func:`encoding_plan` | ~1.9-2.8 at 5.7-8.3x |

"channel" reduces over axis ``ndim-2`` (the tokens of ``[kv_heads, n, head_dim]``):
one scale per (head, dim), as keys want (they have outlier channels);
"token" reduces over the last axis: one scale per (head, token), as values
want. A tensor of fewer than 2 dims is reduced over its last axis either way.

Every payload's CRC-32 is in its params (``crc32``), beside ``axis``, ``bits``
and ``group``: decode needs nothing but the header, and a corrupt payload
raises :class:`kdn.errors.CodecError` instead of decoding to wrong values.
Decoding writes the tensor's own dtype (F32, BF16 or F16).

:func:`encoding_plan` maps an object-level encoding name to the ``codec_for``
callable of :func:`kdn.format.objects.encode_object`.
"""

from __future__ import annotations

import re
import warnings
import zlib
from typing import Any

import numpy as np
import torch
import zstandard

from kdn.format.codecs import Buffer, nbytes, register_codec
from kdn.errors import CodecError
from kdn.kernels.quant import (
    dequantize_absmax,
    dequantize_groups,
    pack_nibbles,
    quantize_absmax,
    quantize_groups,
    unpack_nibbles,
)

FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


# --- bytes <-> tensors --------------------------------------------------------------


def _view(data: Buffer) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def tensor_of(data: Buffer, torch_dtype: torch.dtype, count: int) -> torch.Tensor:
    """A 1-D tensor over ``data`` (no copy; read-only buffers too: callers never write to it)."""
    if count == 0:
        return torch.empty(0, dtype=torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we only read
        return torch.frombuffer(data, dtype=torch_dtype, count=count)


def read_float(data: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's values as float32 of ``shape``."""
    return tensor_of(data, FLOAT_DTYPES[dtype], int(np.prod(shape))).to(torch.float32).view(shape)


def write_float(x: torch.Tensor, dtype: str, out: memoryview | None) -> Buffer:
    """``x`` in ``dtype``, into ``out`` (exactly its size, writable) or fresh bytes."""
    want = x.numel() * torch.empty(0, dtype=FLOAT_DTYPES[dtype]).element_size()
    if out is None:
        return x.to(FLOAT_DTYPES[dtype]).contiguous().view(-1).view(torch.uint8).numpy().data.cast("B")
    ov = _view(out)
    if ov.readonly or len(ov) != want:
        raise CodecError(f"output buffer must be writable and {want} bytes, got {len(ov)} (readonly={ov.readonly})")
    if want:
        torch.frombuffer(ov, dtype=FLOAT_DTYPES[dtype]).view(x.shape).copy_(x)
    return out


def reduce_axis(mode: str, ndim: int) -> int:
    """The axis a ``channel`` / ``token`` quantizer reduces over (``ndim-2`` / ``ndim-1``)."""
    if ndim == 0:
        return 0
    return ndim - 2 if mode == "channel" and ndim >= 2 else ndim - 1


def to_rows(x: torch.Tensor, axis: int) -> torch.Tensor:
    """``x`` with ``axis`` moved last, as ``[R, C]`` (contiguous)."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.movedim(axis, -1).reshape(-1, x.shape[axis])  # [H, n, D] -> [H*D, n] for axis 1


def from_rows(rows: torch.Tensor, shape: tuple[int, ...], axis: int) -> torch.Tensor:
    """Inverse of :func:`to_rows`."""
    if len(shape) == 0:
        return rows.reshape(())
    moved = list(shape)
    moved.append(moved.pop(axis))
    return rows.reshape(moved).movedim(-1, axis)


class Reader:
    """Sequential reads from a payload; any over-read or leftover is a :class:`CodecError`."""

    def __init__(self, data: Buffer, what: str) -> None:
        self.mv, self.pos, self.what = _view(data), 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise CodecError(f"{self.what}: payload of {len(self.mv)} bytes ends early (wanted {n} at {self.pos})")
        self.pos += n
        return self.mv[self.pos - n : self.pos]

    def array(self, np_dtype: str, count: int) -> np.ndarray:
        return np.frombuffer(self.take(count * np.dtype(np_dtype).itemsize), np_dtype)

    def done(self) -> None:
        if self.pos != len(self.mv):
            raise CodecError(f"{self.what}: {len(self.mv) - self.pos} stray bytes after the payload")


def int_param(params: dict, key: str, lo: int, hi: int, what: str) -> int:
    v = params.get(key) if isinstance(params, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CodecError(f"{what}: parameter {key}={str(v)[:20]!r} missing or outside [{lo}, {hi}]")
    return v


# --- the shared shape of a lossy codec -------------------------------------------------


class LossyCodec:
    """Checks and integrity around ``_encode`` / ``_decode`` (float32 tensors in, float32 out)."""

    name = "lossy"
    lossless = False

    def encode(self, data: Buffer, dtype: str, shape: tuple[int, ...]) -> tuple[bytes, dict]:
        if dtype not in FLOAT_DTYPES:
            raise CodecError(f"{self.name}: takes F32, BF16 or F16 tensors, not {dtype}")
        mv = _view(data)
        shape = tuple(shape)
        if len(mv) != nbytes(dtype, shape):
            raise CodecError(f"{self.name} encode: {len(mv)} bytes for {dtype}{list(shape)}, expected {nbytes(dtype, shape)}")
        params: dict[str, Any]
        if 0 in shape:
            payload, params = b"", {}
        else:
            payload, params = self._encode(read_float(mv, dtype, shape))
        params["crc32"] = zlib.crc32(payload)
        return payload, params

    def decode(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict, out: memoryview | None = None) -> Buffer:
        if dtype not in FLOAT_DTYPES:
            raise CodecError(f"{self.name}: decodes to F32, BF16 or F16, not {dtype}")
        mv = _view(data)
        shape = tuple(shape)
        crc = int_param(params, "crc32", 0, 0xFFFFFFFF, self.name)
        if zlib.crc32(mv) != crc:
            raise CodecError(f"{self.name}: payload CRC-32 mismatch (corrupt or truncated payload)")
        if 0 in shape:
            if len(mv):
                raise CodecError(f"{self.name}: {len(mv)} payload bytes for an empty tensor")
            x = torch.empty(0, dtype=torch.float32)  # not of `shape`: its other dims may overflow int64
        else:
            x = self._decode(mv, shape, params)
        return write_float(x, dtype, out)

    def _encode(self, x: torch.Tensor) -> tuple[bytes, dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _decode(self, mv: memoryview, shape: tuple[int, ...], params: dict) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class Int8Codec(LossyCodec):
    """Symmetric absmax int8 along one axis; payload = fp16 scales ``[R]`` || int8 codes ``[R, C]`` (optionally zstd)."""

    def __init__(self, mode: str, zstd_level: int | None = None) -> None:
        assert mode in ("channel", "token")
        self.mode, self.zstd_level = mode, zstd_level
        self.name = f"int8{'z' if zstd_level is not None else ''}-{mode}"

    def _encode(self, x: torch.Tensor) -> tuple[bytes, dict]:
        axis = reduce_axis(self.mode, x.dim())
        q, s16 = quantize_absmax(to_rows(x, axis), 8)  # q: [R, C], s16: [R]
        payload = s16.numpy().tobytes() + q.numpy().tobytes()
        params = {"axis": axis, "bits": 8}
        if self.zstd_level is not None:
            payload = zstandard.ZstdCompressor(level=self.zstd_level, write_content_size=True).compress(payload)
            params["zstd"] = self.zstd_level
        return payload, params

    def _decode(self, mv: memoryview, shape: tuple[int, ...], params: dict) -> torch.Tensor:
        axis = int_param(params, "axis", 0, max(len(shape) - 1, 0), self.name)
        int_param(params, "bits", 8, 8, self.name)
        if "zstd" in params:
            int_param(params, "zstd", -7, 22, self.name)
            want = int(np.prod(shape)) + 2 * (int(np.prod(shape)) // (shape[axis] if shape else 1))
            try:
                if zstandard.frame_content_size(mv) != want:
                    raise CodecError(f"{self.name}: zstd frame holds the wrong number of bytes")
                mv = _view(zstandard.ZstdDecompressor().decompress(mv))
            except zstandard.ZstdError as e:
                raise CodecError(f"{self.name}: corrupt zstd frame: {e}") from None
        c = shape[axis] if shape else 1
        r = int(np.prod(shape)) // c
        rd = Reader(mv, self.name)
        s16 = tensor_of(rd.take(2 * r), torch.float16, r)  # [R]
        q = tensor_of(rd.take(r * c), torch.int8, r * c).view(r, c)  # [R, C]
        rd.done()
        return from_rows(dequantize_absmax(q, s16), shape, axis)


class GroupCodec(LossyCodec):
    """Asymmetric ``bits``-bit codes over groups along one axis.

    Payload = fp16 scales ``[R, G]`` || fp16 mins ``[R, G]`` || codes ``[R, Cp]`` packed two per byte.
    """

    def __init__(self, bits: int, group: int, mode: str) -> None:
        assert bits == 4 and mode in ("channel", "token") and group >= 1
        self.bits, self.group, self.mode = bits, group, mode
        self.name = f"int{bits}-g{group}-{mode}"

    def _encode(self, x: torch.Tensor) -> tuple[bytes, dict]:
        axis = reduce_axis(self.mode, x.dim())
        q, s16, mn16 = quantize_groups(to_rows(x, axis), self.bits, self.group)  # q: [R, Cp]; s16, mn16: [R, G]
        payload = s16.numpy().tobytes() + mn16.numpy().tobytes() + pack_nibbles(q.reshape(-1)).numpy().tobytes()
        return payload, {"axis": axis, "bits": self.bits, "group": self.group}

    def _decode(self, mv: memoryview, shape: tuple[int, ...], params: dict) -> torch.Tensor:
        axis = int_param(params, "axis", 0, max(len(shape) - 1, 0), self.name)
        int_param(params, "bits", 4, 4, self.name)
        group = int_param(params, "group", 1, 1 << 16, self.name)
        c = shape[axis] if shape else 1
        r = int(np.prod(shape)) // c
        g = -(-c // group)
        rd = Reader(mv, self.name)
        s16 = tensor_of(rd.take(2 * r * g), torch.float16, r * g).view(r, g)  # [R, G]
        mn16 = tensor_of(rd.take(2 * r * g), torch.float16, r * g).view(r, g)
        n = r * g * group
        packed = tensor_of(rd.take((n + 1) // 2), torch.uint8, (n + 1) // 2)
        rd.done()
        q = unpack_nibbles(packed, n).view(r, g * group)  # [R, Cp]
        return from_rows(dequantize_groups(q, s16, mn16, c), shape, axis)


# --- object-level encodings -> per-tensor codecs ------------------------------------------

_KV_NAME = re.compile(r"L(\d+)\.([kv])")
for _mode in ("channel", "token"):
    register_codec(Int8Codec(_mode), replace=True)
    register_codec(Int8Codec(_mode, zstd_level=1), replace=True)
    for _g in (32, 64):
        register_codec(GroupCodec(4, _g, _mode), replace=True)
