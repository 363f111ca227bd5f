"""What a request carries in: its bearer token, its JSON body (bounded in size, nesting and time, and
valid Unicode), a lookup's addresses."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web

from kdn.format.address import Address, validate_address
from kdn.auth import AuthError
from kdn.format.store import validate_encoding

from .config import Deadlines
from .keys import DEADLINES, HTTP_METRICS

MAX_JSON_BODY = 1 << 20  # lookup/publish bodies larger than this get 413, not parsed
MAX_LOOKUP_ADDRESSES = 4096


def bearer(request: web.Request) -> str | None:
    """The ``Authorization`` header. One that is not UTF-8 (aiohttp passes such bytes on as lone
    surrogates, which no token is made of and which cannot be hashed) is a 401 here."""
    value = request.headers.get("Authorization")
    if value is not None and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise AuthError("Authorization header is not valid UTF-8", status=401) from None
    return value


async def read_body(request: web.Request, limit: int, what: str = "body") -> bytearray:
    """The request's body, bounded: 413 past ``limit`` bytes (by its Content-Length, before a byte is read, or
    as it arrives), 408 if it has not all arrived within the deadline for bodies (counted in the metrics)."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length,
                                            text=f"{what} larger than {limit} bytes")
    seconds = (request.app.get(DEADLINES) or Deadlines()).body
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body),
                                                        text=f"{what} larger than {limit} bytes")
    except TimeoutError:
        if HTTP_METRICS in request.app:
            request.app[HTTP_METRICS]["body"].inc()
        raise web.HTTPRequestTimeout(text=f"body not received within {seconds:g} s",
                                     headers={"Connection": "close"}) from None
    return body


async def read_json(request: web.Request, limit: int = MAX_JSON_BODY) -> dict[str, Any]:
    """The request's JSON object body, bounded: 413 past ``limit``, 400 if not a JSON object."""
    body = await read_body(request, limit)
    try:
        data = json.loads(body)
    except RecursionError:  # nesting deeper than the parser's stack: not a body any route takes
        raise web.HTTPBadRequest(text="body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="body is not valid JSON") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    if _MAYBE_SURROGATE.search(body) and _has_lone_surrogate(data):
        # JSON can spell them ("\ud800"), but they are not text: encoding one (a tokenizer, msgpack) raises.
        raise web.HTTPBadRequest(text="body has a string that is not valid Unicode (a lone surrogate)")
    return data


# What a lone surrogate can come from in a JSON body: a \uD800-\uDFFF escape, or its UTF-8-style bytes
# (json.loads reads bytes with "surrogatepass"). Only a body with one of them is walked.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(data: object) -> bool:
    stack = [data]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


async def read_addresses(request: web.Request, limit: int = MAX_LOOKUP_ADDRESSES) -> tuple[dict[str, Any], list[Address]]:
    """A lookup-style body: ``{"addresses": [...]}`` with at most ``limit`` valid addresses (400 otherwise)."""
    body = await read_json(request)
    addrs = body.get("addresses")
    if not isinstance(addrs, list) or len(addrs) > limit:
        raise web.HTTPBadRequest(text=f"'addresses' must be a list of at most {limit} addresses")
    if body.get("encoding") is not None:
        validate_encoding(body["encoding"])  # the one optional field both lookups read
    return body, [validate_address(a) for a in addrs]
