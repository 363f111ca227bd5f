"""An object's header and layout, read from its head and fully validated: no codec runs, nothing is decoded.

The container (``docs/format.md``)::

    u64 N || N bytes of JSON header, space-padded to a multiple of 8 || data

``read_header`` and ``read_layout`` check every field of the safetensors header and of the KDN header in it
(``__metadata__["kdn"]``) and that the tensors' byte ranges tile the data section, before a reader trusts any
of it; a layout that passed is kept by its header text and blob size (``_LayoutCache``), so the same header
read again costs a dictionary look-up. Encoding and decoding are ``kdn/format/objects.py``'s, which re-exports what
is here.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kdn.format.address import Address, ModelId, validate_address, validate_namespace
from kdn.format.codecs import DTYPES, Buffer, itemsize
from kdn.errors import (
    CorruptObject,
    InvalidAddress,
    InvalidInput,
    ObjectFormatError,
    ObjectTooLarge,
    TensorMismatch,
    TruncatedObject,
    UnsupportedVersion,
)

__all__ = ["DEFAULT_MAX_OBJECT_BYTES", "FORMAT_VERSION", "KDN_KEY", "KINDS", "MAX_HEADER_BYTES", "MAX_NDIM",
           "META_KEY", "SHAPE_RULE", "Layout", "ObjectHeader", "Stack", "TensorInfo", "as_view", "blob_namespace",
           "check_header_fields", "check_tensor_name", "head_length", "layout_of", "read_header", "read_layout",
           "shape_ok"]

T = TypeVar("T")

FORMAT_VERSION = 1
KINDS = frozenset({"kv", "ssm", "hybrid"})
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_OBJECT_BYTES = 1 << 30
META_KEY = "__metadata__"  # safetensors' entry for string metadata
KDN_KEY = "kdn"  # the KDN header's key in it


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

    # Facts of the header alone, computed once: a header is read again with every load of its object (it is
    # kept with its layout, ``_LayoutCache``), and these were per-object Python on an engine's load path.
    @functools.cached_property
    def codecs(self) -> frozenset[str]:
        """The codecs its tensors are stored with."""
        return frozenset(t.codec for t in self.tensors.values())

    @functools.cached_property
    def decoded_nbytes(self) -> int:
        """Bytes its tensors decode to, each 64-byte aligned (the size of a ``decode`` ``out`` buffer)."""
        return sum((math.prod(t.shape) * itemsize(t.dtype) + 63) & ~63 for t in self.tensors.values())



@dataclass(frozen=True)
class Layout:
    """Where an object's tensors lie: its validated header and each tensor's byte range."""

    header: ObjectHeader
    data_start: int  # offset of the data section in the blob
    offsets: dict[str, tuple[int, int]]  # name -> [begin, end) within the data section

    # What readers derive from this layout alone, by what they compared it against (``derived``).
    _derived: dict[Hashable, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def span(self, name: str) -> tuple[int, int]:
        """Tensor ``name``'s ``[begin, end)`` in the blob (absolute offsets)."""
        b, e = self.offsets[name]
        return self.data_start + b, self.data_start + e

    def stack(self, order: tuple[str, ...]) -> Stack | None:
        """Where tensors ``order`` lie as one strided stack (an engine's K/V, landed by one copy), where they are
        raw, of one dtype and 3-D shape, at one stride; else None. Found once per layout (``derived``)."""
        return self.derived(("stack", order), lambda: _stack_of(self, order))

    def derived(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, once per layout and ``key``: a fact a reader derives from this layout alone (where an
        engine's K/V lie in it; whether it fits a model), keyed by everything it was compared against. The
        same layout comes back with every load of its object (``_LayoutCache``), so a prefix read again pays
        its checks once, not per object and load. A ``compute`` that raises leaves nothing kept."""
        try:
            return cast(T, self._derived[key])
        except KeyError:
            got = self._derived[key] = compute()
            return got


@dataclass(frozen=True)
class Stack:
    """Tensors of one dtype and ``[heads, n, dim]`` shape in a blob: bytes ``[lo, hi)``, one every ``stride``."""

    dtype: str
    item: int
    heads: int
    n: int
    dim: int
    lo: int
    hi: int
    stride: int


def _stack_of(layout: Layout, order: tuple[str, ...]) -> Stack | None:
    h = layout.header
    if not order or any(nm not in h.tensors for nm in order):
        return None
    infos = [h.tensors[nm] for nm in order]
    first = infos[0]
    if len(first.shape) != 3 or any(t.codec != "raw" or t.dtype != first.dtype or t.shape != first.shape
                                    for t in infos):
        return None
    heads, n, dim = first.shape
    item = itemsize(first.dtype)
    spans = [layout.span(nm) for nm in order]
    lo, size = spans[0][0], heads * n * dim * item
    stride = spans[1][0] - lo if len(spans) > 1 else size
    if stride < size or stride % item or any(b != lo + p * stride or e - b != size for p, (b, e) in enumerate(spans)):
        return None
    return Stack(first.dtype, item, heads, n, dim, lo, spans[-1][1], stride)


def check_tensor_name(name: object, exc: type[Exception]) -> None:
    """A tensor name is a non-empty string of at most 256 characters, not ``META_KEY``; else ``exc``."""
    if not isinstance(name, str) or not name or name == META_KEY or len(name) > 256:
        raise exc(f"invalid tensor name {str(name)[:64]!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_NDIM = 64  # numpy's own limit
SHAPE_RULE = f"a list of at most {MAX_NDIM} non-negative ints whose non-zero dims multiply to < 2**63"


def shape_ok(shape: object) -> bool:
    """``SHAPE_RULE``: what numpy and torch can hold. A zero-size [0, 2**64] or [0, 10**4000] overflowed
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


def check_header_fields(h: ObjectHeader) -> None:
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
    if KDN_KEY not in meta:
        raise CorruptObject(f"__metadata__ has no {KDN_KEY!r} entry: not a KDN object")
    k = _loads(meta[KDN_KEY], "KDN header")
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
        check_tensor_name(name, CorruptObject)
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "codec", "params"}:
            raise CorruptObject(f"KDN tensor {name[:64]!r}: expected fields dtype, shape, codec, params")
        dtype, shape, codec, params = t["dtype"], t["shape"], t["codec"], t["params"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CorruptObject(f"KDN tensor {name[:64]!r}: unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not shape_ok(shape):
            raise CorruptObject(f"KDN tensor {name[:64]!r}: shape {repr(shape)[:40]} is not {SHAPE_RULE}")
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
    check_header_fields(h)
    return h


def as_view(blob: Buffer) -> memoryview:
    """``blob`` as a flat memoryview of bytes (format ``B``, one dimension), without a copy."""
    mv = blob if isinstance(blob, memoryview) else memoryview(blob)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def head_length(first8: Buffer) -> int:
    """The length of the blob's head (8 + header) from its first 8 bytes; ObjectTooLarge past the limit."""
    (n,) = struct.unpack_from("<Q", as_view(first8), 0)
    if n > MAX_HEADER_BYTES:
        raise ObjectTooLarge(f"header length {n} exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    return 8 + int(n)


def read_layout(head: Buffer, size: int, *, max_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> Layout:
    """The layout of a blob of ``size`` bytes from its head alone (its first ``head_length`` bytes), fully
    validated as :func:`read_header` does: what a receiver needs to place the tensors before they arrive."""
    return layout_of(as_view(head), max_bytes, size=size)


def layout_of(mv: memoryview, max_bytes: int, size: int | None = None) -> Layout:
    """The validated layout of the blob ``mv`` (of ``size`` bytes, ``len(mv)`` by default, where ``mv`` holds
    at least its head): from the cache of checked layouts, or checked here and kept."""
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


def _validate(text: bytes, size: int) -> Layout:
    """Parse and check the header JSON ``text`` of a blob of ``size`` bytes (``layout_of``'s uncached part)."""
    n = len(text)
    top = _loads(text, "safetensors header")
    header = _parse_kdn(top.pop(META_KEY, None))
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
        if not isinstance(e["shape"], list) or not shape_ok(e["shape"]):
            raise CorruptObject(f"tensor {name[:64]!r}: stored shape {repr(e['shape'])[:40]} is not {SHAPE_RULE}")
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
    return Layout(header, 8 + n, offsets)


class _LayoutCache:
    """Validated layouts by header text and blob size, least recently used dropped past ``max_bytes`` of keys.

    Checking a header field by field costs ~1 ms of Python for a 30-layer model's ~10 KB header (60
    tensors), on whatever thread reads the object: 32 ms of an 8k-token SmolLM2 load, on the event loop's
    thread when a raw object is received in place (``kdn.wire.scatter``). The same objects are read again and
    again (that is what a cache of them is for), with byte-identical headers, and parsing is a pure
    function of (header text, blob size): the second read of a header takes the layout the first one
    checked. Only layouts that passed every check are kept; a reader never changes a ``Layout``'s fields,
    only adds what it derived from them (``Layout.derived``, a pure function of the layout). Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[bytes, int], Layout] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, text: bytes, size: int) -> Layout | None:
        with self._lock:
            got = self._items.get((text, size))
            if got is not None:
                self._items.move_to_end((text, size))
            return got

    def put(self, text: bytes, size: int, layout: Layout) -> None:
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
    return layout_of(as_view(blob), max_bytes).header


def blob_namespace(blob: Buffer) -> str | None:
    """The namespace written into a blob's own header by whoever made it; None for a blob that is not a KV
    object (a kvtc basis). Who may read a blob is decided from this where the blob's maker is trusted."""
    mv = as_view(blob)
    try:
        return layout_of(mv, max(len(mv), 8)).header.namespace
    except (ObjectFormatError, InvalidInput):
        return None
