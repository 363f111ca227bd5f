"""An object response, as the origin and the edge both answer: its headers, a conditional GET's 304, one
byte range (206, 416), and the body written as it is within its send deadline."""

from __future__ import annotations

from typing import Literal

from aiohttp import web

from kdn.format.address import Digest

from .server import send_within

Sent = Literal["sent", "cut", "gone"]


def byte_range(request: web.Request, size: int, digest: Digest) -> tuple[int, int] | None:
    """The one byte range ``[first, end)`` a GET asks for (RFC 9110 §14), or None for the whole body.

    A single range only (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``); a header this does not take (several
    ranges, another unit, bad syntax) is ignored, as the RFC allows, and the whole body is sent. With
    ``If-Range``, the range holds only if it names this blob's (strong) ETag. A range that starts past the
    end is a 416 with ``Content-Range: bytes */size``. Pieces of a blob (``kdn.format.pieces``) are ranges: a
    consumer verifies each piece it asked for against the signed record's piece digests."""
    text = request.headers.get("Range")
    if text is None or request.method != "GET":
        return None
    if_range = request.headers.get("If-Range")
    if if_range is not None and if_range.strip() != f'"{digest}"':
        return None  # the validator names another version (or a date): the whole, current body
    unit, _, spec = text.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec or len(spec) > 64:
        return None
    lo, dash, hi = spec.strip().partition("-")
    lo, hi = lo.strip(), hi.strip()
    if not dash or not (lo.isdigit() or hi.isdigit()) or (lo and not lo.isdigit()) or (hi and not hi.isdigit()):
        return None
    if not lo:  # the last ``hi`` bytes
        n = int(hi)
        if n == 0:
            raise _unsatisfiable(size)
        return max(size - n, 0), size
    first = int(lo)
    if hi and int(hi) < first:
        return None  # invalid: ignored
    if first >= size:
        raise _unsatisfiable(size)
    return first, min(int(hi) + 1 if hi else size, size)


def _unsatisfiable(size: int) -> web.HTTPRequestRangeNotSatisfiable:
    return web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"},
                                              text=f"the range starts past the {size}-byte object")


def ranged(resp: web.StreamResponse, rng: tuple[int, int] | None, size: int) -> None:
    """Make ``resp`` a 206 for ``rng`` of a ``size``-byte body (else the whole body, 200)."""
    if rng is None:
        resp.content_length = size
        return
    resp.set_status(206)
    resp.headers["Content-Range"] = f"bytes {rng[0]}-{rng[1] - 1}/{size}"
    resp.content_length = rng[1] - rng[0]


async def send_body(request: web.Request, data: bytes | bytearray | memoryview, headers: dict[str, str], *,
                    head: bool = False, rng: tuple[int, int] | None = None) -> tuple[web.StreamResponse, Sent]:
    """Write an object body as it is, within its send deadline; what the origin and the edge's memory
    tier both answer a GET with. Returns the response and how it went: ``sent``; ``cut`` (a stalled
    reader, aborted by ``send_within``); ``gone`` (the reader hung up, e.g. its hedged twin won).

    A ``StreamResponse`` writes its headers on their own and then the body as is. A
    ``web.Response(body=...)`` would join headers and body into one new ``bytes`` first (aiohttp on
    Python < 3.12.9): a full copy of every object, which halved 4 MiB throughput (bench/serve.py)."""
    resp = web.StreamResponse(headers=headers)
    ranged(resp, rng, memoryview(data).nbytes)
    body = data if rng is None else memoryview(data)[rng[0]:rng[1]]

    async def send() -> None:
        await resp.prepare(request)
        if not head:
            await resp.write(body)
        await resp.write_eof()

    try:
        ok = await send_within(request, memoryview(body).nbytes, send())
    except ConnectionError:
        return resp, "gone"
    return resp, "sent" if ok else "cut"


def object_headers(digest: Digest, source: str, encoding: str, namespace: str = "public") -> dict[str, str]:
    """Headers of an object response: content-addressed blobs never change (RFC 8246 immutable).

    Only the ``public`` namespace may sit in shared caches; a tenant's object is ``private`` (a proxy
    between the edge and a tenant must not hand it to the next caller) and varies by credential.
    """
    shared = namespace == "public"
    return {
        "ETag": f'"{digest}"',
        "Cache-Control": f"{'public' if shared else 'private'}, max-age=31536000, immutable",
        **({} if shared else {"Vary": "Authorization"}),
        "X-KDN-Source": source,
        "X-KDN-Encoding": encoding,
        "Content-Type": "application/vnd.kdn.object+safetensors",
        "Accept-Ranges": "bytes",
    }


def not_modified(request: web.Request, digest: Digest) -> bool:
    """RFC 9110 §13.1.2: If-None-Match with a matching entity tag → 304."""
    inm = request.headers.get("If-None-Match")
    if not inm:
        return False
    tags = [t.strip().removeprefix("W/").strip('"') for t in inm.split(",")]
    return "*" in tags or digest in tags
