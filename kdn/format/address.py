"""Content addresses: model ids, namespaces, prefix-chain and standalone chunk addresses.

Every address is BLAKE3 over a canonical byte encoding, written as 64 lowercase
hex characters. The encoding (format version 1) is fixed here and documented in
the README; the test vectors in ``tests/core/test_address.py`` pin it.

Canonical encoding, version 1 (``u8``/``u16``/``u32`` are little-endian)::

    str(s)          = u16 len(utf8(s)) || utf8(s)
    tokens(t)       = u32 n || t[0] as u32 || ... || t[n-1] as u32

    model_id        = BLAKE3("kdn/model/v1\\0" || str(architecture) || str(dtype)
                             || str(canonical_json(config_fields))
                             || str(weights_digest) || str(tokenizer_digest))
    a_0             = BLAKE3("kdn/prefix/v1\\0" || raw(model_id) || str(namespace)
                             || tokens(chunk_0))
    a_i             = BLAKE3("kdn/chain/v1\\0" || raw(a_{i-1}) || tokens(chunk_i))
    standalone(c)   = BLAKE3("kdn/standalone/v1\\0" || raw(model_id) || str(namespace)
                             || tokens(c))

``raw(x)`` is the 32 bytes that the hex string ``x`` spells. A partial last
chunk is addressed exactly like a full one (its token count is in the hash).
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, NewType, cast

from blake3 import blake3

from kdn.errors import InvalidAddress, InvalidInput

FORMAT_VERSION = 1
DEFAULT_CHUNK_TOKENS = 256
PUBLIC_NAMESPACE = "public"

Address = NewType("Address", str)
"""64 lowercase hex characters: BLAKE3 of a canonical encoding."""

ModelId = NewType("ModelId", str)
"""An ``Address``-shaped id of a model: architecture, state-changing config, weights, tokenizer, dtype."""

Digest = NewType("Digest", str)
"""BLAKE3 of a blob's bytes, 64 lowercase hex characters: what a signed record promises and a receiver checks."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
# Namespaces and manifest names end up in registry keys and file names: keep
# them to a safe alphabet, no slashes, no dot-dot, bounded length.
_NAMESPACE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_TAG_MODEL = b"kdn/model/v1\0"
_TAG_PREFIX = b"kdn/prefix/v1\0"
_TAG_CHAIN = b"kdn/chain/v1\0"
_TAG_STANDALONE = b"kdn/standalone/v1\0"
_U32_MAX = 0xFFFFFFFF


def validate_address(value: object, *, what: str = "address") -> Address:
    """Return ``value`` as an ``Address`` if it is 64 lowercase hex chars, else raise.

    Call this before an address reaches a path, a registry key or a log line.
    The error message never echoes more than a short, repr-escaped prefix.
    """
    if isinstance(value, str) and len(value) == 64 and _HEX64.fullmatch(value):
        return Address(value)
    shown = repr(value[:16]) + ("..." if len(value) > 16 else "") if isinstance(value, str) else type(value).__name__
    raise InvalidAddress(f"invalid {what} {shown}: expected 64 lowercase hex characters")


def validate_model_id(value: object) -> ModelId:
    return ModelId(validate_address(value, what="model id"))


def validate_digest(value: object) -> Digest:
    """A blob digest: 64 lowercase hex characters (the same alphabet as an address, another meaning)."""
    return Digest(validate_address(value, what="digest"))


def validate_namespace(value: object) -> str:
    """A namespace: 1-63 chars of ``[a-z0-9_-]``, starting with a letter or digit."""
    if isinstance(value, str) and _NAMESPACE.fullmatch(value):
        return value
    raise InvalidInput(f"invalid namespace {str(value)[:70]!r}: use 1-63 chars of a-z, 0-9, '_' and '-'")


def validate_name(value: object) -> str:
    """A manifest name: 1-128 chars of ``[A-Za-z0-9._-]``, not starting with a dot."""
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    raise InvalidInput(f"invalid name {str(value)[:140]!r}: use 1-128 chars of A-Z, a-z, 0-9, '.', '_' and '-'")


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise InvalidInput("string field longer than 65535 bytes")
    return len(b).to_bytes(2, "little") + b


def _token_bytes(tokens: Sequence[int] | object) -> bytes:
    """Little-endian uint32 bytes of a token sequence (list, array, numpy or torch)."""
    if hasattr(tokens, "dtype") and hasattr(tokens, "tolist") and not isinstance(tokens, array):
        # numpy / torch: check range without a Python loop, then cast.
        import numpy as np

        arr = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
        if arr.ndim != 1:
            raise InvalidInput(f"token ids must be one-dimensional, got shape {tuple(arr.shape)}")
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > _U32_MAX):
            raise InvalidInput("token ids must be integers in [0, 2**32)")
        return arr.astype("<u4", copy=False).tobytes()
    # Anything else is taken as an iterable of ints: array() raises TypeError (reported below) if it is not.
    ints = cast("Iterable[int]", tokens)
    try:
        out = array("I", ints)  # 'I' is 4 bytes on every platform CPython supports
    except (OverflowError, TypeError) as e:
        raise InvalidInput(f"token ids must be integers in [0, 2**32): {e}") from None
    if out.itemsize != 4:  # pragma: no cover - exotic platform
        out = array("L", ints)
    if sys.byteorder == "big":  # pragma: no cover
        out.byteswap()
    return out.tobytes()


def _tokens_field(tb: bytes) -> bytes:
    return (len(tb) // 4).to_bytes(4, "little") + tb


def canonical_json(obj: object) -> str:
    """JSON with sorted keys, no whitespace, ASCII only: the same dict always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def model_id(
    *,
    architecture: str,
    dtype: str,
    config_fields: dict[str, Any],
    weights_digest: str,
    tokenizer_digest: str,
) -> ModelId:
    """The id of a model: states are only ever served to the same id.

    ``config_fields`` holds the config entries that change states (layer count,
    head sizes, rope parameters, ...); ``weights_digest`` and
    ``tokenizer_digest`` are hex digests computed by the caller (see
    ``kdn.adapters.hf`` for transformers models).
    """
    h = blake3(_TAG_MODEL)
    for field in (architecture, dtype, canonical_json(config_fields), weights_digest, tokenizer_digest):
        h.update(_str(field))
    return ModelId(h.hexdigest())


def _check_chunk_tokens(chunk_tokens: object) -> None:
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise InvalidInput(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")


def chunk_spans(n_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the chunks covering ``n_tokens``; the last may be partial."""
    _check_chunk_tokens(chunk_tokens)
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def first_address(mid: ModelId, namespace: str, chunk: Sequence[int] | object) -> Address:
    """``a_0``: the address of the first chunk of a prefix chain."""
    h = blake3(_TAG_PREFIX)
    h.update(bytes.fromhex(validate_model_id(mid)))
    h.update(_str(validate_namespace(namespace)))
    h.update(_tokens_field(_token_bytes(chunk)))
    return Address(h.hexdigest())


def next_address(parent: Address, chunk: Sequence[int] | object) -> Address:
    """``a_i = H(a_{i-1}, chunk_i)``."""
    h = blake3(_TAG_CHAIN)
    h.update(bytes.fromhex(validate_address(parent, what="parent address")))
    h.update(_tokens_field(_token_bytes(chunk)))
    return Address(h.hexdigest())


def prefix_addresses(
    mid: ModelId,
    namespace: str,
    tokens: Sequence[int] | object,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    *,
    full_chunks_only: bool = False,
) -> list[Address]:
    """The prefix chain of ``tokens``: one address per chunk, the last possibly partial.

    With ``full_chunks_only`` a trailing partial chunk is left out (what a
    lookup of a prompt wants; partial tails are matched through the parent's
    record instead).
    """
    validate_model_id(mid)
    validate_namespace(namespace)
    _check_chunk_tokens(chunk_tokens)
    tb = memoryview(_token_bytes(tokens))
    step = chunk_tokens * 4
    full = chunk_tokens.to_bytes(4, "little")
    out: list[Address] = []
    parent = b""
    prefix_head = _TAG_PREFIX + bytes.fromhex(mid) + _str(namespace)
    for start in range(0, len(tb), step):
        piece = tb[start : start + step]
        if len(piece) < step:
            if full_chunks_only:
                break
            count = (len(piece) // 4).to_bytes(4, "little")
        else:
            count = full
        # Same bytes as first_address()/next_address(), without per-chunk copies.
        h = blake3(prefix_head) if not parent else blake3(_TAG_CHAIN + parent)
        h.update(count)
        h.update(piece)
        parent = h.digest()
        out.append(Address(parent.hex()))
    return out


def standalone_address(mid: ModelId, namespace: str, chunk: Sequence[int] | object) -> Address:
    """Position-independent address of one chunk, its KV computed at positions 0..n-1."""
    h = blake3(_TAG_STANDALONE)
    h.update(bytes.fromhex(validate_model_id(mid)))
    h.update(_str(validate_namespace(namespace)))
    h.update(_tokens_field(_token_bytes(chunk)))
    return Address(h.hexdigest())


def standalone_addresses(
    mid: ModelId, namespace: str, tokens: Sequence[int] | object, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> list[Address]:
    _check_chunk_tokens(chunk_tokens)
    tb = _token_bytes(tokens)
    step = chunk_tokens * 4
    return [standalone_address(mid, namespace, array("I", tb[s : s + step])) for s in range(0, len(tb), step)]


def blob_digest(data: bytes | bytearray | memoryview) -> Digest:
    """BLAKE3 hex digest of a whole blob (the registry's digest and the HTTP ETag)."""
    return Digest(blake3(data).hexdigest())


def content_address(data: bytes | bytearray | memoryview) -> Address:
    """The address of a model-level object named by its own bytes (a kvtc basis): the BLAKE3 of them, which
    is also its digest."""
    return Address(blake3(data).hexdigest())
