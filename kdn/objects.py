"""The object format: one self-describing safetensors blob per (address, encoding).

Layout (safetensors, little-endian)::

    u64 N || N bytes of JSON header, space-padded to a multiple of 8 || data

    header = {"__metadata__": {"kdn": <compact JSON of the KDN header>},
              name: {"dtype": D, "shape": [...], "data_offsets": [begin, end]}, ...}

A tensor whose codec is ``raw`` is stored as itself; any other codec stores a
1-D ``U8`` tensor of encoded bytes, so every safetensors reader can open the
container. The KDN header (``__metadata__["kdn"]``) records, per tensor, the
decoded dtype and shape, the codec and its parameters; see ``docs/format.md``.

This module has its own small reader and writer, so verifying and serving an
object needs no torch, and decoding a ``raw`` object is zero-copy over the
blob. Only :func:`to_torch` and :func:`from_torch` import torch, inside.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdn import address as _address
from kdn.address import Address, Digest, ModelId, canonical_json, validate_address, validate_namespace
from kdn.codecs import DTYPES, Buffer, get_codec, itemsize
from kdn.errors import (
    CorruptObject,
    DigestMismatch,
    InvalidAddress,
    InvalidInput,
    ObjectFormatError,
    ObjectTooLarge,
    TensorMismatch,
    TruncatedObject,
    UnsupportedVersion,
)

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

FORMAT_VERSION = 1
KINDS = frozenset({"kv", "ssm", "hybrid"})
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_OBJECT_BYTES = 1 << 30
# Decoding is bounded before anything is allocated: by the caller's limit (an engine knows the exact
# size its model's chunk decodes to), else by MAX_EXPANSION x the blob's own size, with a floor for
# small objects. Legitimate codecs expand 1-5x (zstd ~1.45x, int4 ~3.5x, cachegen ~4.6x); a 17 KB
# zstd object that claimed 512 MiB of zeros once decoded in full.
MAX_EXPANSION = 16
MIN_DECODED_CAP = 16 << 20
_META_KEY = "__metadata__"
_KDN_KEY = "kdn"


@dataclass(frozen=True)
class TensorInfo:
    """What the KDN header says about one tensor: its decoded dtype and shape, and how it is encoded."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ObjectHeader:
    """The KDN header of an object (``__metadata__["kdn"]``)."""

    version: int
    kind: str
    address: Address
    model_id: ModelId
    namespace: str
    start: int
    end: int
    position: int  # position of the first token's KV: == start in a prefix chain, 0 for a standalone chunk
    parent: Address | None
    encoding: str
    tensors: dict[str, TensorInfo]

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


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
        if not _shape_ok(shape):
            raise InvalidInput(f"tensor {self.name!r}: shape {str(list(shape))[:60]} is not {_SHAPE_RULE}")
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
        _check_header_fields(header)
    except CorruptObject as e:
        raise InvalidInput(str(e)) from None
    entries = []
    infos: dict[str, dict[str, Any]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, RawTensor):
            raise InvalidInput(f"tensor {str(name)[:64]!r}: expected a RawTensor, got {type(t).__name__}")
        _check_name(name, InvalidInput)
        codec_name = codec_for(t) if codec_for is not None else encoding
        dtype, shape, data, params = _stored(t, codec_name)
        infos[name] = {"dtype": t.dtype, "shape": list(t.shape), "codec": codec_name, "params": params}
        entries.append((itemsize(dtype), name, dtype, shape, data))
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
    # Widest dtype first (as safetensors itself does): the data section starts
    # 8-byte aligned, so every tensor then starts aligned to its item size.
    entries.sort(key=lambda e: (-e[0], e[1]))
    meta: dict[str, Any] = {_META_KEY: {_KDN_KEY: canonical_json(kdn)}}
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


# --- reader ------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where an object's tensors lie: its validated header and each tensor's byte range."""

    header: ObjectHeader
    data_start: int  # offset of the data section in the blob
    offsets: dict[str, tuple[int, int]]  # name -> [begin, end) within the data section

    def span(self, name: str) -> tuple[int, int]:
        """Tensor ``name``'s ``[begin, end)`` in the blob (absolute offsets)."""
        b, e = self.offsets[name]
        return self.data_start + b, self.data_start + e


_Layout = Layout


def _check_name(name: object, exc: type[Exception]) -> None:
    if not isinstance(name, str) or not name or name == _META_KEY or len(name) > 256:
        raise exc(f"invalid tensor name {str(name)[:64]!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_NDIM = 64  # numpy's own limit
_SHAPE_RULE = f"a list of at most {MAX_NDIM} non-negative ints whose non-zero dims multiply to < 2**63"


def _shape_ok(shape: object) -> bool:
    """``_SHAPE_RULE``: what numpy and torch can hold. A zero-size [0, 2**64] or [0, 10**4000] overflowed
    them (and the decoded-size message), and a 100k-dim shape made every message that names it 300 KB."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        return False
    n = 1
    for d in shape:
        if not _is_int(d) or d < 0:
            return False
        n *= d or 1
        if n >> 63:
            return False
    return True


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise CorruptObject(f"duplicate JSON key {dup[:64]!r} in header")
    return d


def _loads(text: bytes | str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except CorruptObject:
        raise
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptObject(f"{what} is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(obj, dict):
        raise CorruptObject(f"{what} is a JSON {type(obj).__name__}, expected an object")
    return obj


def _check_header_fields(h: ObjectHeader) -> None:
    """Field checks shared by the writer (as InvalidInput) and the reader (as CorruptObject)."""
    if not isinstance(h.kind, str) or h.kind not in KINDS:
        raise CorruptObject(f"kind {str(h.kind)[:20]!r} is not one of {sorted(KINDS)}")
    try:
        validate_address(h.address, what="address")
        validate_address(h.model_id, what="model_id")
        if h.parent is not None:
            validate_address(h.parent, what="parent")
    except InvalidAddress as e:
        raise CorruptObject(str(e)) from None
    try:
        validate_namespace(h.namespace)
    except InvalidInput as e:
        raise CorruptObject(str(e)) from None
    for name in ("start", "end", "position"):
        v = getattr(h, name)
        if not _is_int(v) or not 0 <= v < 1 << 63:  # int64, as token positions are; and short in messages
            raise CorruptObject(f"{name} {str(v)[:20]!r} is not a non-negative int below 2**63")
    if h.end < h.start:
        raise CorruptObject(f"end {h.end} < start {h.start}")
    if not isinstance(h.encoding, str) or not h.encoding or len(h.encoding) > 32:
        raise CorruptObject(f"encoding {str(h.encoding)[:40]!r} is not a short non-empty string")


def _parse_kdn(meta: object) -> ObjectHeader:
    if meta is None:
        raise CorruptObject("header has no __metadata__: not a KDN object")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptObject("__metadata__ must map strings to strings")
    if _KDN_KEY not in meta:
        raise CorruptObject(f"__metadata__ has no {_KDN_KEY!r} entry: not a KDN object")
    k = _loads(meta[_KDN_KEY], "KDN header")
    v = k.get("v")
    if not _is_int(v):
        raise CorruptObject(f"KDN header field 'v' is {str(v)[:20]!r}, expected an int")
    if v != FORMAT_VERSION:
        raise UnsupportedVersion(f"KDN format version {str(v)[:20]}; this code reads version {FORMAT_VERSION}")
    want = {"v", "kind", "address", "model_id", "namespace", "start", "end", "position", "parent", "encoding", "tensors"}
    missing, extra = want - k.keys(), k.keys() - want
    if missing or extra:
        raise CorruptObject(f"KDN header fields: missing {sorted(missing)}, unexpected {sorted(extra)[:8]}")
    raw_tensors = k["tensors"]
    if not isinstance(raw_tensors, dict):
        raise CorruptObject("KDN header field 'tensors' is not an object")
    infos: dict[str, TensorInfo] = {}
    for name, t in raw_tensors.items():
        _check_name(name, CorruptObject)
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "codec", "params"}:
            raise CorruptObject(f"KDN tensor {name[:64]!r}: expected fields dtype, shape, codec, params")
        dtype, shape, codec, params = t["dtype"], t["shape"], t["codec"], t["params"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CorruptObject(f"KDN tensor {name[:64]!r}: unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not _shape_ok(shape):
            raise CorruptObject(f"KDN tensor {name[:64]!r}: shape {str(shape)[:40]} is not {_SHAPE_RULE}")
        if not isinstance(codec, str) or not codec or len(codec) > 32:
            raise CorruptObject(f"KDN tensor {name[:64]!r}: codec {str(codec)[:40]!r} is not a short string")
        if not isinstance(params, dict):
            raise CorruptObject(f"KDN tensor {name[:64]!r}: params is not an object")
        infos[name] = TensorInfo(name, dtype, tuple(shape), codec, params)
    h = ObjectHeader(
        version=v,
        kind=k["kind"],
        address=k["address"],
        model_id=k["model_id"],
        namespace=k["namespace"],
        start=k["start"],
        end=k["end"],
        position=k["position"],
        parent=k["parent"],
        encoding=k["encoding"],
        tensors=infos,
    )
    _check_header_fields(h)
    return h


def _as_view(blob: Buffer) -> memoryview:
    mv = blob if isinstance(blob, memoryview) else memoryview(blob)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def head_length(first8: Buffer) -> int:
    """The length of the blob's head (8 + header) from its first 8 bytes; ObjectTooLarge past the limit."""
    (n,) = struct.unpack_from("<Q", _as_view(first8), 0)
    if n > MAX_HEADER_BYTES:
        raise ObjectTooLarge(f"header length {n} exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    return 8 + int(n)


def read_layout(head: Buffer, size: int, *, max_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> Layout:
    """The layout of a blob of ``size`` bytes from its head alone (its first ``head_length`` bytes), fully
    validated as :func:`read_header` does: what a receiver needs to place the tensors before they arrive."""
    return _layout(_as_view(head), max_bytes, size=size)


def _layout(mv: memoryview, max_bytes: int, size: int | None = None) -> _Layout:
    size = len(mv) if size is None else size
    if size > max_bytes:
        raise ObjectTooLarge(f"blob of {size} bytes exceeds max_bytes={max_bytes}")
    if size < 8:
        raise TruncatedObject(f"blob of {size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", mv, 0)
    if n > MAX_HEADER_BYTES:
        raise ObjectTooLarge(f"header length {n} exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    if size < 8 + n:
        raise TruncatedObject(f"blob of {size} bytes ends inside its {n}-byte header")
    text = bytes(mv[8 : 8 + n])
    known = _LAYOUTS.get(text, size)
    if known is not None:
        return known
    layout = _validate(text, size)
    _LAYOUTS.put(text, size, layout)
    return layout


def _validate(text: bytes, size: int) -> _Layout:
    """Parse and check the header JSON ``text`` of a blob of ``size`` bytes (``_layout``'s uncached part)."""
    n = len(text)
    top = _loads(text, "safetensors header")
    header = _parse_kdn(top.pop(_META_KEY, None))
    data_len = size - 8 - n

    offsets: dict[str, tuple[int, int]] = {}
    for name, e in top.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CorruptObject(f"tensor entry {name[:64]!r}: expected fields dtype, shape, data_offsets")
        off = e["data_offsets"]
        if not (isinstance(off, list) and len(off) == 2 and all(_is_int(o) for o in off) and 0 <= off[0] <= off[1] < 1 << 64):
            raise CorruptObject(f"tensor {name[:64]!r}: data_offsets {str(off)[:60]} are not [begin, end] with 0 <= begin <= end < 2**64")
        if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
            raise CorruptObject(f"tensor {name[:64]!r}: unknown stored dtype {str(e['dtype'])[:20]!r}")
        if not isinstance(e["shape"], list) or not _shape_ok(e["shape"]):
            raise CorruptObject(f"tensor {name[:64]!r}: stored shape {str(e['shape'])[:40]} is not {_SHAPE_RULE}")
        offsets[name] = (off[0], off[1])

    if offsets.keys() != header.tensors.keys():
        only_st = sorted(offsets.keys() - header.tensors.keys())[:4]
        only_kdn = sorted(header.tensors.keys() - offsets.keys())[:4]
        raise CorruptObject(f"tensor names differ: stored only {only_st}, KDN header only {only_kdn}")

    # Offsets must tile [0, total) with no gap and no overlap (safetensors' own rule).
    pos = 0
    for name, (b, e) in sorted(offsets.items(), key=lambda kv: kv[1]):
        if b != pos:
            what = "overlap" if b < pos else "gap"
            raise CorruptObject(f"tensor {name[:64]!r}: data_offsets [{b}, {e}] {what} at byte {pos} of the data")
        pos = e
    if pos > data_len:
        raise TruncatedObject(f"blob ends {pos - data_len} bytes before its tensor data ({pos} bytes) does")
    if pos < data_len:
        raise CorruptObject(f"data section has {data_len - pos} bytes that no tensor covers")

    for name, (b, e) in offsets.items():
        st = top[name]
        info = header.tensors[name]
        stored_len = math.prod(st["shape"]) * itemsize(st["dtype"])
        if stored_len != e - b:
            raise TensorMismatch(
                f"tensor {name[:64]!r}: stored {st['dtype']}{st['shape']} is {stored_len} bytes, data_offsets span {e - b}"
            )
        if info.codec == "raw":
            if st["dtype"] != info.dtype or tuple(st["shape"]) != info.shape:
                raise TensorMismatch(
                    f"tensor {name[:64]!r}: stored as {st['dtype']}{st['shape']}, header says raw {info.dtype}{list(info.shape)}"
                )
        elif st["dtype"] != "U8" or len(st["shape"]) != 1:
            raise TensorMismatch(
                f"tensor {name[:64]!r}: codec {info.codec!r} needs a 1-D U8 tensor, stored as {st['dtype']}{st['shape']}"
            )
    return _Layout(header, 8 + n, offsets)


class _LayoutCache:
    """Validated layouts by header text and blob size, least recently used dropped past ``max_bytes`` of keys.

    Checking a header field by field costs ~1 ms of Python for a 30-layer model's ~10 KB header (60
    tensors), on whatever thread reads the object: 32 ms of an 8k-token SmolLM2 load, on the event loop's
    thread when a raw object is received in place (``kdn.scatter``). The same objects are read again and
    again (that is what a cache of them is for), with byte-identical headers, and parsing is a pure
    function of (header text, blob size): the second read of a header takes the layout the first one
    checked. Only layouts that passed every check are kept; ``Layout`` and what it holds are never
    mutated by a reader. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[bytes, int], _Layout] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, text: bytes, size: int) -> _Layout | None:
        with self._lock:
            got = self._items.get((text, size))
            if got is not None:
                self._items.move_to_end((text, size))
            return got

    def put(self, text: bytes, size: int, layout: _Layout) -> None:
        if len(text) > self.max_bytes // 16:  # a huge header is not worth most of the budget
            return
        with self._lock:
            if (text, size) in self._items:
                return
            self._items[(text, size)] = layout
            self._bytes += len(text)
            while self._bytes > self.max_bytes:
                (old, _), _ = self._items.popitem(last=False)
                self._bytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


_LAYOUTS = _LayoutCache(8 << 20)  # ~800 headers of a 30-layer model


def read_header(blob: Buffer, *, max_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> ObjectHeader:
    """Parse and fully validate an object's structure without decoding its payload (no torch)."""
    return _layout(_as_view(blob), max_bytes).header


def blob_namespace(blob: Buffer) -> str | None:
    """The namespace written into a blob's own header by whoever made it; None for a blob that is not a KV
    object (a kvtc basis). Who may read a blob is decided from this where the blob's maker is trusted."""
    mv = _as_view(blob)
    try:
        return _layout(mv, max(len(mv), 8)).header.namespace
    except (ObjectFormatError, InvalidInput):
        return None


def decoded_nbytes(header: ObjectHeader) -> int:
    """Bytes an ``out`` buffer for :func:`decode_object` needs (each tensor 64-byte aligned)."""
    return sum(_align64(math.prod(t.shape) * itemsize(t.dtype)) for t in header.tensors.values())


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
    mv = _as_view(blob)
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
        self._mv = _as_view(blob)
        self._layout = _layout(self._mv, max_bytes)
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
            buf = _as_view(out)
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
            dv = _as_view(data)
            if len(dv) != want:
                raise TensorMismatch(f"tensor {name[:64]!r}: codec {info.codec!r} decoded {len(dv)} bytes, expected {want}")
            tensors[name] = RawTensor(name, info.dtype, info.shape, dv)
        return tensors

    def decode_into(self, name: str, dst: np.ndarray) -> None:
        """Decode tensor ``name`` straight into ``dst``: a writable numpy array of the tensor's shape and
        item size, any strides (an engine's cache slice). Codecs that cannot write into place decode
        and copy once (:func:`kdn.codecs.decode_into`)."""
        from kdn.codecs import decode_into

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


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
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
    content-addressed blob. With a non-CPU ``device`` the transfer is the copy.
    """
    import torch

    raw = obj.tensors if isinstance(obj, DecodedObject) else obj
    dev = torch.device(device) if device is not None else torch.device("cpu")
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
        t = t.reshape(rt.shape)
        out[name] = t if dev.type == "cpu" else t.to(dev)
    return out


def _address_of(mv: memoryview) -> int:
    import numpy as np

    return np.frombuffer(mv, np.uint8).ctypes.data
