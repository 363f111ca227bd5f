"""The host tier's socket protocol: length-prefixed msgpack maps over a Unix-domain stream socket.

A frame is a 4-byte big-endian length, then that many bytes of one msgpack map. Both sides refuse a frame
over ``MAX_MESSAGE`` before reading it (the host answers ``oversize`` and closes: the rest of the stream
cannot be trusted to be framed). Every request carries ``id`` (an int the caller picks, echoed in the
answer: requests run concurrently and may be answered out of order), ``op``, and ``token`` (the caller's
bearer token; absent: anonymous, which reads ``public`` only, as at the edge)::

    {"id": 1, "op": "hello", "token": T}
      -> {"id": 1, "ok": true, "segment": PATH, "size": N, "device": D, "inode": I, "version": 2}
    {"id": 2, "op": "lookup", "token": T, "addresses": [A, ...], "encoding": E?, "records": true?}
      -> {"id": 2, "ok": true, "prefix": K, "held": [bool, ...], "encodings": [[E, ...], ...],
          "records": [{...} | null, ...]?}   (with ``records``: each held one's signed record, while they fit
          ``RECORDS_BYTES``; an engine's lookup then asks no edge for a chain the host holds whole)
    {"id": 3, "op": "lease", "token": T, "address": A, "encoding": E}
      -> {"id": 3, "ok": true, "lease": L, "offset": O, "length": N, "generation": G, "record": {...},
          "filled": bool}
    {"id": 4, "op": "release", "token": T, "lease": L}  -> {"id": 4, "ok": true}
    {"id": 7, "op": "lease_many", "token": T, "addresses": [A, ...], "encoding": E}   (a load's objects at once)
      -> {"id": 7, "ok": true, "leases": [{"lease": L, "offset": O, ...} | {"error": CODE, "message": M}, ...]}
    {"id": 8, "op": "release_many", "token": T, "leases": [L, ...]}  -> {"id": 8, "ok": true}
    {"id": 5, "op": "warm", "token": T, "addresses": [A, ...], "encoding": E}
      -> {"id": 5, "ok": true, "outcomes": ["held" | "filled" | "absent" | "no-room" | "failed", ...]}
    {"id": 6, "op": "stats", "token": T}  -> {"id": 6, "ok": true, "objects": ..., "used_bytes": ..., ...}

A refusal is ``{"id": ..., "ok": false, "error": CODE, "message": "one line"}`` with a code of ``ERRORS``;
the connection stays open but after ``oversize``. An object of a namespace the token does not grant is
``absent``, word for word as one that is not published.

Every object's blob lies ``STAMP`` bytes into its block of the segment; the block's first 8 bytes hold the
object's ``generation`` (little-endian), a random number the host draws when the object is held and overwrites
with 0 when it gives the block up, before any other object's bytes may land there. A lease answers it. An
engine reads the stamp again after copying a leased object (``Leased.intact``): the same number, and the bytes it
copied were the object's, even if its connection (and so its lease) had ended meanwhile and the host had reused
the block. (On x86 stores become visible in program order and loads are not reordered with loads, so a copy
that saw a byte of the block's next object sees the 0 written before it.)
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from kdn.errors import KDNError

VERSION = 2  # 2: leases answer their object's ``generation`` (the stamp before its blob)
STAMP = 64  # bytes before each blob in its block: the generation word, then padding (blobs stay 64-byte aligned)
MAX_MESSAGE = 1 << 20  # a lookup of ~14k addresses; every answer is smaller than its request or than this
MAX_ADDRESSES = 4096  # per lookup or warm: a 1M-token prompt in 256-token chunks
RECORDS_BYTES = MAX_MESSAGE // 2  # a lookup's records, packed, at most (the rest are null: asked of the edge)
MAX_LEASE_MANY = 16  # per lease_many or release_many: its answer carries each object's signed record (with piece
# digests, ~34 KiB for a Llama-3-8B chunk), and 16 of those stay well inside MAX_MESSAGE
_HEAD = struct.Struct(">I")

ERRORS = {
    "bad-request": "malformed, an unknown op, or a bad field (the message names it)",
    "unauthorized": "an unknown token",
    "absent": "not published, no such encoding, or not the token's namespace (alike, on purpose)",
    "no-room": "the segment cannot hold it now (leases pin the rest): read it from the edge",
    "unavailable": "no source delivered it intact: read it from the edge, or compute",
    "too-many": "the connection's lease or request limit",
    "oversize": "a frame over MAX_MESSAGE (the connection then closes)",
}


class HostError(KDNError):
    """A request the host tier refused: ``code`` is one of ``ERRORS``."""

    def __init__(self, code: str, message: str) -> None:
        assert code in ERRORS, code
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Oversize(HostError):
    def __init__(self, n: int) -> None:
        super().__init__("oversize", f"a frame of {n} bytes is over the {MAX_MESSAGE}-byte limit")


def pack(message: dict[str, Any]) -> bytes:
    """One frame of ``message``."""
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_MESSAGE:
        raise Oversize(len(body))
    return _HEAD.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes; None at a clean end of stream (between frames). Oversize before reading it."""
    try:
        head = await reader.readexactly(_HEAD.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    (n,) = _HEAD.unpack(head)
    if n > MAX_MESSAGE:
        raise Oversize(n)
    return await reader.readexactly(n)


def unpack(frame: bytes) -> dict[str, Any]:
    """A frame's map; HostError bad-request if it is not one."""
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise HostError("bad-request", f"not a msgpack map ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise HostError("bad-request", f"a request is a msgpack map, not {type(message).__name__}")
    return message


def refusal(request_id: object, e: HostError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": e.code, "message": e.message}
