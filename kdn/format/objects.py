"""The object format: one self-describing safetensors blob per (address, encoding).

Layout (safetensors, little-endian)::

    u64 N || N bytes of JSON header, space-padded to a multiple of 8 || data

    header = {"__metadata__": {"kdn": <compact JSON of the KDN header>},
              name: {"dtype": D, "shape": [...], "data_offsets": [begin, end]}, ...}

A tensor whose codec is ``raw`` is stored as itself; any other codec stores a
1-D ``U8`` tensor of encoded bytes, so every safetensors reader can open the
container. The KDN header (``__metadata__["kdn"]``) records, per tensor, the
decoded dtype and shape, the codec and its parameters; see ``docs/format.md``.

This module has its own small writer, and its reader (the header and layout, parsed and validated, are
``kdn/format/layout.py``'s, re-exported here), so verifying and serving an object needs no torch, and decoding a
``raw`` object is zero-copy over the blob. Only :func:`to_torch` and :func:`from_torch` import torch, inside.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kdn.format import address as _address
from kdn.format.address import Address, Digest, ModelId, canonical_json
from kdn.format.codecs import DTYPES, Buffer, get_codec, itemsize
from kdn.errors import CorruptObject, DigestMismatch, InvalidInput, ObjectTooLarge, TensorMismatch
from kdn.format.layout import (
    DEFAULT_MAX_OBJECT_BYTES,
    FORMAT_VERSION,
    KDN_KEY,
    KINDS,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    META_KEY,
    SHAPE_RULE,
    Layout,
    ObjectHeader,
    TensorInfo,
    as_view,
    blob_namespace,
    check_header_fields,
    check_tensor_name,
    head_length,
    layout_of,
    read_header,
    read_layout,
    shape_ok,
)

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

# What kdn.format.layout holds is re-exported: ``from kdn.format.objects import X`` is the object format's one import.
__all__ = ["DEFAULT_MAX_OBJECT_BYTES", "FORMAT_VERSION", "KINDS", "MAX_EXPANSION", "MAX_HEADER_BYTES", "MAX_NDIM",
           "MIN_DECODED_CAP", "DecodedObject", "Layout", "ObjectHeader", "ObjectView", "RawTensor", "TensorInfo",
           "blob_digest", "blob_namespace", "decode_object", "decoded_nbytes", "encode_object", "from_torch",
           "head_length", "raw_region", "read_header", "read_layout", "to_torch", "torch_dtype"]

# Decoding is bounded before anything is allocated: by the caller's limit (an engine knows the exact
# size its model's chunk decodes to), else by MAX_EXPANSION x the blob's own size, with a floor for
# small objects. Legitimate codecs expand 1-5x (zstd ~1.45x, int4 ~3.5x, cachegen ~4.6x); a 17 KB
# zstd object that claimed 512 MiB of zeros once decoded in full.
MAX_EXPANSION = 16
MIN_DECODED_CAP = 16 << 20


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: ``data`` holds its C-order little-endian bytes (a flat ``B`` memoryview)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def __post_init__(self) -> None:
        # Valid by construction: a RawTensor's bytes always match its dtype and shape.
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise InvalidInput(f"tensor {self.name!r}: unknown dtype {str(self.dtype)[:20]!r}")
        shape = tuple(self.shape)
        if not shape_ok(shape):
            raise InvalidInput(f"tensor {self.name!r}: shape {str(list(shape))[:60]} is not {SHAPE_RULE}")
        mv = self.data if isinstance(self.data, memoryview) else memoryview(self.data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        want = math.prod(shape) * itemsize(self.dtype)
        if len(mv) != want:
            raise InvalidInput(f"tensor {self.name!r}: {len(mv)} bytes for {self.dtype}{list(shape)}, expected {want}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data", mv)


@dataclass(frozen=True)
class DecodedObject:
    header: ObjectHeader
    tensors: dict[str, RawTensor]


def blob_digest(blob: Buffer) -> Digest:
    """BLAKE3 hex digest of a whole blob: the registry's digest and the HTTP ETag."""
    return _address.blob_digest(blob)


# --- writer ------------------------------------------------------------------


def _stored(t: RawTensor, codec_name: str) -> tuple[str, tuple[int, ...], bytes | memoryview, dict[str, Any]]:
    """(stored dtype, stored shape, stored bytes, params) of one tensor under ``codec_name``."""
    if codec_name == "raw":
        return t.dtype, t.shape, t.data, {}
    codec = get_codec(codec_name)
    enc, params = codec.encode(t.data, t.dtype, t.shape)
    return "U8", (len(enc),), enc, params


def encode_object(
    *,
    kind: str,
    address: Address,
    model_id: ModelId,
    namespace: str,
    start: int,
    end: int,
    position: int,
    parent: Address | None,
    tensors: Mapping[str, RawTensor],
    encoding: str = "zstd",
    codec_for: Callable[[RawTensor], str] | None = None,
) -> bytes:
    """Serialize tensors and their KDN header into one safetensors blob.

    ``encoding`` names the object-level encoding; each tensor uses the codec
    of the same name unless ``codec_for`` picks one per tensor (``"raw"``
    stores a tensor as is). The same inputs always give the same bytes.
    """
    header = ObjectHeader(
        version=FORMAT_VERSION,
        kind=kind,
        address=address,
        model_id=model_id,
        namespace=namespace,
        start=start,
        end=end,
        position=position,
        parent=parent,
        encoding=encoding,
        tensors={},
    )
    try:
        check_header_fields(header)
    except CorruptObject as e:
        raise InvalidInput(str(e)) from None
    entries, infos = _stored_tensors(tensors, encoding, codec_for)
    kdn = {
        "v": FORMAT_VERSION,
        "kind": kind,
        "address": address,
        "model_id": model_id,
        "namespace": namespace,
        "start": start,
        "end": end,
        "position": position,
        "parent": parent,
        "encoding": encoding,
        "tensors": infos,
    }
    return _container(kdn, entries)


_Entry = tuple[int, str, str, tuple[int, ...], bytes | memoryview]  # (item size, name, stored dtype, shape, bytes)


def _stored_tensors(tensors: Mapping[str, RawTensor], encoding: str, codec_for: Callable[[RawTensor], str] | None
                    ) -> tuple[list[_Entry], dict[str, dict[str, Any]]]:
    """Each tensor encoded (in name order): its container entry, and what the KDN header says of it."""
    entries: list[_Entry] = []
    infos: dict[str, dict[str, Any]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, RawTensor):
            raise InvalidInput(f"tensor {str(name)[:64]!r}: expected a RawTensor, got {type(t).__name__}")
        check_tensor_name(name, InvalidInput)
        codec_name = codec_for(t) if codec_for is not None else encoding
        dtype, shape, data, params = _stored(t, codec_name)
        infos[name] = {"dtype": t.dtype, "shape": list(t.shape), "codec": codec_name, "params": params}
        entries.append((itemsize(dtype), name, dtype, shape, data))
    return entries, infos


def _container(kdn: dict[str, Any], entries: list[_Entry]) -> bytes:
    """The safetensors blob of the KDN header ``kdn`` and the tensors' ``entries``."""
    # Widest dtype first (as safetensors itself does): the data section starts
    # 8-byte aligned, so every tensor then starts aligned to its item size.
    entries.sort(key=lambda e: (-e[0], e[1]))
    meta: dict[str, Any] = {META_KEY: {KDN_KEY: canonical_json(kdn)}}
    offset = 0
    for _, name, dtype, shape, data in entries:
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(meta, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    head += b" " * (-len(head) % 8)
    if len(head) > MAX_HEADER_BYTES:
        raise InvalidInput(f"header of {len(head)} bytes exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    # One join: a single allocation and one copy of each tensor's bytes.
    return b"".join([struct.pack("<Q", len(head)), head, *(e[-1] for e in entries)])


# --- reader (the header and layout: kdn/format/layout.py) ----------------------------


def decoded_nbytes(header: ObjectHeader) -> int:
    """Bytes an ``out`` buffer for :func:`decode_object` needs (each tensor 64-byte aligned)."""
    return header.decoded_nbytes


def _align64(n: int) -> int:
    return (n + 63) & ~63


def decode_object(
    blob: Buffer,
    *,
    expected_digest: Digest | None = None,
    max_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
    out: bytearray | memoryview | None = None,
    names: Collection[str] | None = None,
    max_decoded: int | None = None,
) -> DecodedObject:
    """Verify, parse and decode an object into raw tensors.

    With ``expected_digest`` the blob's BLAKE3 is checked before anything is
    parsed. ``raw`` tensors are zero-copy views into ``blob`` (keep it alive and
    unchanged); other codecs return fresh buffers, or, with ``out`` (at least
    :func:`decoded_nbytes` bytes, reused across calls on a hot path), views
    into ``out``. With ``names``, only those tensors are decoded; a name the
    object lacks raises ``TensorMismatch``. What the header says the tensors
    decode to is checked against ``max_decoded`` (default: ``MAX_EXPANSION`` x
    the blob, at least ``MIN_DECODED_CAP``) before anything is allocated
    (``ObjectTooLarge``). A codec that finds its payload corrupt raises
    :class:`kdn.errors.CodecError`.
    """
    mv = as_view(blob)
    if len(mv) > max_bytes:
        raise ObjectTooLarge(f"blob of {len(mv)} bytes exceeds max_bytes={max_bytes}")
    if expected_digest is not None:
        got = blob_digest(mv)
        if got != expected_digest:
            raise DigestMismatch(f"blob digest {got[:16]}... differs from expected {str(expected_digest)[:16]}...")
    view = ObjectView(mv, max_bytes=max_bytes, max_decoded=max_decoded)
    return DecodedObject(view.header, view.decode(names, out=out))


class ObjectView:
    """A parsed, validated object whose tensors are decoded on demand (an engine loading layer by layer).

    The header and layout are checked once, here; :meth:`decode` then costs
    only the codec work of the tensors asked for. Keep ``blob`` alive and
    unchanged while the view and any ``raw`` tensor from it are in use.
    """

    def __init__(self, blob: Buffer, *, max_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
                 max_decoded: int | None = None) -> None:
        self._mv = as_view(blob)
        self._layout = layout_of(self._mv, max_bytes)
        need = decoded_nbytes(self._layout.header)
        cap = max_decoded if max_decoded is not None else min(max_bytes, max(MIN_DECODED_CAP, MAX_EXPANSION * len(self._mv)))
        if need > cap:
            raise ObjectTooLarge(f"object decodes to {need} bytes, over the {cap}-byte limit for a "
                                 f"{len(self._mv)}-byte blob (a decompression bomb, or a model it was not made for)")

    @property
    def header(self) -> ObjectHeader:
        return self._layout.header

    @property
    def layout(self) -> Layout:
        """Where each tensor's bytes lie in the blob (``Layout.span``)."""
        return self._layout

    @property
    def buffer(self) -> memoryview:
        """The blob's bytes (a view; for raw tensors, the tensors themselves)."""
        return self._mv

    def decode(self, names: Collection[str] | None = None, *, out: bytearray | memoryview | None = None) -> dict[str, RawTensor]:
        """The tensors ``names`` (all of them by default), decoded; see :func:`decode_object`."""
        layout, mv = self._layout, self._mv
        buf = None
        if out is not None:
            buf = as_view(out)
            need = decoded_nbytes(layout.header)
            if buf.readonly or len(buf) < need:
                raise InvalidInput(f"decode buffer must be writable and >= {need} bytes, got {len(buf)}")
        wanted = layout.header.tensors
        if names is not None:
            missing = [n for n in names if n not in wanted]
            if missing:
                raise TensorMismatch(f"object has no tensor {str(missing[0])[:64]!r}")
            wanted = {n: wanted[n] for n in names}
        tensors: dict[str, RawTensor] = {}
        pos = 0
        for name, info in wanted.items():
            b, e = layout.offsets[name]
            payload = mv[layout.data_start + b : layout.data_start + e]
            want = math.prod(info.shape) * itemsize(info.dtype)
            codec = get_codec(info.codec)
            if buf is not None and info.codec != "raw":
                data = codec.decode(payload, info.dtype, info.shape, info.params, out=buf[pos : pos + want])
                pos += _align64(want)
            else:
                data = codec.decode(payload, info.dtype, info.shape, info.params)
            dv = as_view(data)
            if len(dv) != want:
                raise TensorMismatch(f"tensor {name[:64]!r}: codec {info.codec!r} decoded {len(dv)} bytes, expected {want}")
            tensors[name] = RawTensor(name, info.dtype, info.shape, dv)
        return tensors

    def decode_into(self, name: str, dst: np.ndarray) -> None:
        """Decode tensor ``name`` straight into ``dst``: a writable numpy array of the tensor's shape and
        item size, any strides (an engine's cache slice). Codecs that cannot write into place decode
        and copy once (:func:`kdn.format.codecs.decode_into`)."""
        from kdn.format.codecs import decode_into

        layout, mv = self._layout, self._mv
        info = layout.header.tensors.get(name)
        if info is None:
            raise TensorMismatch(f"object has no tensor {str(name)[:64]!r}")
        b, e = layout.offsets[name]
        decode_into(get_codec(info.codec), mv[layout.data_start + b : layout.data_start + e], info.dtype, info.shape,
                    info.params, dst)


# --- torch bridge (torch imported only here) ---------------------------------

_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}


@functools.cache
def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``), cached: loaders ask per
    tensor on their hot path."""
    import torch

    return getattr(torch, _TORCH_DTYPES[st_dtype])  # type: ignore[no-any-return]


def from_torch(tensors: Mapping[str, torch.Tensor]) -> dict[str, RawTensor]:
    """Raw tensors from torch tensors (any device; bf16 included).

    A contiguous CPU tensor is not copied: its ``RawTensor.data`` aliases the
    tensor's memory, so do not modify the tensor until the object is encoded.
    """
    import torch

    by_torch = {getattr(torch, v): k for k, v in _TORCH_DTYPES.items()}
    out: dict[str, RawTensor] = {}
    for name, t in tensors.items():
        if t.dtype not in by_torch:
            raise InvalidInput(f"tensor {str(name)[:64]!r}: unsupported torch dtype {t.dtype}")
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        # Viewing as uint8 is a reinterpretation (numpy has no bfloat16).
        data = flat.view(torch.uint8).numpy().data  # a memoryview over the tensor's memory
        out[name] = RawTensor(name, by_torch[t.dtype], tuple(t.shape), data)
    return out


def to_torch(obj: DecodedObject | Mapping[str, RawTensor], *, device: str | int | torch.device | None = None) -> dict[str, torch.Tensor]:
    """Torch tensors from raw tensors, with their own dtypes (bf16 included).

    Aliasing: on the CPU a tensor aliases the decoded bytes when their buffer is
    writable and aligned (the fresh output of ``zstd``, or a ``raw`` object
    decoded from a ``bytearray`` blob) -- no copy. A read-only buffer (a
    ``raw`` object decoded from ``bytes``) is copied once: torch tensors are
    writable, and writing through an alias would change an immutable,
    content-addressed blob. With a non-CPU ``device`` the one transfer (``one_transfer``) is the copy.
    """
    import torch

    raw = obj.tensors if isinstance(obj, DecodedObject) else obj
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu":
        return one_transfer(raw, dev)
    out: dict[str, torch.Tensor] = {}
    for name, rt in raw.items():
        dtype = getattr(torch, _TORCH_DTYPES[rt.dtype])
        if len(rt.data) == 0:
            out[name] = torch.empty(rt.shape, dtype=dtype, device=dev)
            continue
        aligned = _address_of(rt.data) % itemsize(rt.dtype) == 0
        if not aligned or (rt.data.readonly and dev.type == "cpu"):
            t = torch.frombuffer(bytearray(rt.data), dtype=dtype)
        else:
            with warnings.catch_warnings():
                # Read-only buffer about to be copied to the device: the alias never escapes.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                t = torch.frombuffer(rt.data, dtype=dtype)
        out[name] = t.reshape(rt.shape)
    return out


def raw_region(view: ObjectView, order: Sequence[str], dtype: torch.dtype, n: int) -> torch.Tensor | None:
    """A chunk's raw K/V as one ``[len(order), kv_heads, n, head_dim]`` view of the object's own bytes (no
    copy), where its tensors are raw ``dtype`` of one shape, stored in ``order`` at one stride (back to back,
    or padded alike); else None. Read-only bytes (a host-tier mapping) stay read-only: only read from it.
    Where they lie is found once per layout (``Layout.derived``): a prefix loaded again pays nothing for it."""
    import torch

    st = view.layout.stack(tuple(order))
    if st is None or torch_dtype(st.dtype) != dtype or st.n != n:
        return None
    region = view.buffer[st.lo:st.hi]
    if _address_of(region) % st.item:
        return None
    with warnings.catch_warnings():  # a read-only mapping: the view is only ever read (copied from)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(region, dtype=dtype)
    return flat.as_strided((len(order), st.heads, n, st.dim), (st.stride // st.item, n * st.dim, st.dim, 1))


def one_transfer(raw: Mapping[str, RawTensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of an object onto ``device`` in one copy: their bytes gathered into one host buffer (each
    64-byte aligned), that buffer copied over once, and each tensor a view of its part there. (One copy per
    tensor is 64 small copies a chunk for an 8B model, each paying a transfer's fixed cost.)"""
    import numpy as np
    import torch

    parts, size = [], 0
    for name, rt in raw.items():
        parts.append((name, rt, size))
        size += _align64(len(rt.data))
    host = torch.empty(max(size, 1), dtype=torch.uint8)
    lanes = host.numpy()
    for _, rt, at in parts:
        lanes[at:at + len(rt.data)] = np.frombuffer(rt.data, dtype=np.uint8)
    on = host.to(device)
    return {name: on[at:at + len(rt.data)].view(getattr(torch, _TORCH_DTYPES[rt.dtype])).reshape(rt.shape)
            for name, rt, at in parts}


def _address_of(mv: memoryview) -> int:
    import numpy as np

    return np.frombuffer(mv, np.uint8).ctypes.data
