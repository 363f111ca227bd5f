"""Server-side HTTP pieces shared by the origin and the edge (aiohttp).

It lives outside the core (``kdn/``, which holds no server): only
``kdn.origin``, ``kdn.edge`` and ``kdn up`` import it.
It holds what both services must do the same way: JSON errors with no stack
traces, bearer-token checks, the registry read endpoints, ``/metrics``, and
the headers of an object response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from kdn.address import Address, Digest, validate_address, validate_digest, validate_name, validate_namespace
from kdn.auth import AuthError, Grants, may_read
from kdn.fetch import HOP
from kdn.errors import (
    InvalidInput,
    KDNError,
    ObjectFormatError,
    RegistryUnavailable,
    UnknownModel,
)
from kdn.registry import Manifest, ObjectRecord, Registry, open_registry
from kdn.store import validate_encoding

log = logging.getLogger(__name__)

# `*_created` series double the output and no dashboard reads them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream

REGISTRY = web.AppKey("registry", Registry)


class RecordSource(Protocol):
    """Where a server reads object records from: its registry, or (an edge) its record cache."""

    async def get_object(self, address: Address) -> ObjectRecord | None: ...
    async def get_objects(self, addresses: list[Address]) -> list[ObjectRecord | None]: ...


RECORDS = web.AppKey("records", RecordSource)  # absent: the registry


class ManifestBodies(Protocol):
    """Where a server reads the whole manifest a registry pointer names (``Manifest.body``): an origin's own
    records store, or (an edge) the origins."""

    async def get_manifest_body(self, namespace: str, name: str, digest: Digest) -> Manifest | None: ...


MANIFEST_BODIES = web.AppKey("manifest_bodies", ManifestBodies)  # absent: pointers are not followed
GRANTS = web.AppKey("grants", Grants)
METRICS = web.AppKey("metrics", CollectorRegistry)
HTTP_METRICS = web.AppKey("http_metrics", dict)

MAX_JSON_BODY = 1 << 20  # lookup/publish bodies larger than this get 413, not parsed


@dataclass(frozen=True)
class Deadlines:
    """How long a peer may take. A request's head must arrive within ``headers`` seconds of the
    connection opening or of the previous response (else the connection is closed: it is also how
    long an idle keep-alive connection stays open); a request body within ``body`` seconds (408
    after); a response of N bytes must be taken within ``send_grace + N / min_send_rate`` seconds,
    or its connection is aborted. Without them a trickled head or body holds a connection, and a
    stalled reader its response and the tier entry it pins, forever."""

    headers: float = 30.0
    body: float = 30.0
    send_grace: float = 10.0
    min_send_rate: float = float(1 << 20)  # bytes per second

    def __post_init__(self) -> None:
        if not (self.headers > 0 and self.body > 0 and self.send_grace > 0 and self.min_send_rate > 0):
            raise InvalidInput(f"deadlines must be positive, got {self}")

    def send(self, size: int) -> float:
        return self.send_grace + size / self.min_send_rate


@dataclass
class NodeConfig:
    """What an origin and an edge are both configured with: where they listen and advertise, who may
    call them, the registry, their lease, TLS, durability and deadlines. ``OriginConfig`` and
    ``EdgeConfig`` add their own fields (and their own ``node_id`` and ``port`` defaults)."""

    registry: str | None = None  # etcd URL(s) or file: path; None = the embedded default
    host: str = "127.0.0.1"
    port: int = 8000
    node_id: str = "node"
    url: str | None = None  # advertised URL; default http(s)://host:port
    token_file: str | None = None  # who may do what here (kdn.auth)
    lease_ttl: float = 10.0  # the registry lease that lists this node while it lives
    fsync: bool = True  # blobs and indexes reach the disk before they are acknowledged
    tls_cert: str | None = None
    tls_key: str | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)  # request heads and bodies, responses
    max_connections: int | None = None  # None: from the descriptor limit (service/connections.py)
    max_connections_per_peer: int | None = None  # None: half of max_connections
    admission: str | None = None  # an operator's signed admission of this node (kdn node admit): in its record

    def connection_caps(self) -> Any:
        """The ``ConnectionCaps`` this node serves under, fitted to this process's descriptor limit."""
        from .connections import ConnectionCaps, descriptor_limit

        return ConnectionCaps.for_limit(descriptor_limit(), total=self.max_connections,
                                        per_peer=self.max_connections_per_peer)

    @property
    def advertised_url(self) -> str:
        return self.url or f"{'https' if self.tls_cert else 'http'}://{self.host}:{self.port}"

    def record_extra(self, role: str, region: str) -> dict[str, Any]:
        """What this node's registry record carries besides its name: its admission (``--admission``), read
        and checked here so that a node that would be left out says so at start, not by going unused."""
        if not self.admission:
            return {}
        import time

        from kdn.registry import Admission, NodeRecord

        try:
            adm = Admission.from_dict(json.loads(Path(self.admission).read_text()))
        except OSError as e:
            raise InvalidInput(f"cannot read --admission {self.admission!r}: {e.strerror}") from None
        except ValueError as e:
            raise InvalidInput(f"--admission {self.admission!r} is not an admission (kdn node admit): {e}") from None
        me = NodeRecord(role=role, region=region, node_id=self.node_id, url=self.advertised_url)
        if not adm.names(me):
            raise InvalidInput(f"--admission names {adm.role} {adm.region}/{adm.node_id} at {adm.url}, not this "
                               f"node ({role} {region}/{self.node_id} at {self.advertised_url})")
        if adm.expires <= time.time():
            raise InvalidInput(f"--admission {self.admission!r} has expired: admit this node again (kdn node admit)")
        if not adm.sig:
            raise InvalidInput(f"--admission {self.admission!r} is not signed")
        return {"admission": adm.to_dict()}


DEADLINES = web.AppKey("deadlines", Deadlines)


def server_options(app: web.Application) -> dict[str, Any]:
    """What every runner of ``app`` passes to aiohttp (``web.run_app``, ``AppRunner``, ``TestServer``).

    ``keepalive_timeout`` is the head deadline: aiohttp arms it when a connection opens and after each
    response, and closes the connection if no whole request head has arrived by then, however slowly
    bytes trickle in. No access log: at thousands of object reads a second it cost 3-4% of the edge's
    CPU (bench/serve.py profile); per-route counts and latencies are in /metrics."""
    quiet_malformed_requests()
    return {"keepalive_timeout": app[DEADLINES].headers, "access_log": None}


class _MalformedRequests(logging.Filter):
    """aiohttp answers a request it cannot parse (a bad header line, a line too long, a bad chunk) with
    its own 400 and logs ``Error handling request`` at ERROR with a traceback: anyone on the network
    could fill an operator's logs with tracebacks. Those records become one WARNING line each, at most
    ``per_minute`` a minute (the rest counted into the next line); every other record passes as is."""

    def __init__(self, per_minute: int = 20) -> None:
        super().__init__()
        self.per_minute = per_minute
        self.reset()

    def reset(self) -> None:
        """Start a fresh minute (tests)."""
        self._window, self._in_window, self._suppressed = 0.0, 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self._window >= 60.0:
            self._window, self._in_window = now, 0
        self._in_window += 1
        if self._in_window > self.per_minute:
            self._suppressed += 1
            return False
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        more = f" ({self._suppressed} more since the last such line)" if self._suppressed else ""
        self._suppressed = 0
        record.msg, record.args = "refused a malformed request from %s (HTTP 400): %s%s", (
            peer, " ".join(str(getattr(exc, "message", exc)).split())[:200], more)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_MALFORMED = _MalformedRequests()


def quiet_malformed_requests() -> None:
    """Install the filter above on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if _MALFORMED not in logger.filters:
        logger.addFilter(_MALFORMED)


def install_deadlines(app: web.Application, deadlines: Deadlines, metrics: CollectorRegistry, service: str) -> None:
    """Give ``app`` its deadlines and the counter of requests they cut off."""
    app[DEADLINES] = deadlines
    c = Counter("kdn_http_deadline_exceeded", "Requests cut off by a deadline: a body not received in time "
                "(kind=body), a response not taken in time (kind=send)", ["service", "kind"], registry=metrics)
    app[HTTP_METRICS] = {"body": c.labels(service, "body"), "send": c.labels(service, "send")}


async def send_within(request: web.Request, size: int, send: Awaitable[object]) -> bool:
    """Await ``send`` (the writing of a ``size``-byte response) within its deadline. If the reader
    stalls past it, abort the connection, count it, and return False."""
    deadlines = request.app.get(DEADLINES) or Deadlines()
    try:
        async with asyncio.timeout(deadlines.send(size)):
            await send
        return True
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        if HTTP_METRICS in request.app:
            request.app[HTTP_METRICS]["send"].inc()
        log.info("%s %s: reader took more than %.1f s for %d bytes; connection aborted",
                 request.method, request.path, deadlines.send(size), size)
        return False


Sent = Literal["sent", "cut", "gone"]


def byte_range(request: web.Request, size: int, digest: Digest) -> tuple[int, int] | None:
    """The one byte range ``[first, end)`` a GET asks for (RFC 9110 §14), or None for the whole body.

    A single range only (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``); a header this does not take (several
    ranges, another unit, bad syntax) is ignored, as the RFC allows, and the whole body is sent. With
    ``If-Range``, the range holds only if it names this blob's (strong) ETag. A range that starts past the
    end is a 416 with ``Content-Range: bytes */size``. Pieces of a blob (``kdn.pieces``) are ranges: a
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


def json_error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                 408: "timeout", 409: "conflict", 413: "too_large", 415: "unsupported_media_type",
                 416: "range_not_satisfiable", 503: "unavailable"}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as ``{"error": code, "detail": ...}``; never a stack trace."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        detail = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        resp = json_error(e.status, _STATUS_CODES.get(e.status, "error"), detail or e.reason)
        for name in ("Allow", "Content-Range"):  # a 405 names the methods it takes, a 416 the size (RFC 9110)
            if name in e.headers:
                resp.headers[name] = e.headers[name]
        if e.headers.get("Connection", "").lower() == "close":
            # A body cut off by its deadline: answer, then close at once (aiohttp would otherwise
            # linger up to 10 s reading the rest of the body, which is what the deadline refused).
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:
                request.transport.close()
        return resp
    except AuthError as e:
        resp = json_error(e.status, _STATUS_CODES[e.status], str(e))
        if e.status == 401:  # how to authenticate (RFC 9110 11.6.1, RFC 6750 3)
            resp.headers["WWW-Authenticate"] = ('Bearer realm="kdn", error="invalid_token"'
                                                if request.headers.get("Authorization") else 'Bearer realm="kdn"')
        return resp
    except (InvalidInput, UnknownModel) as e:
        return json_error(400, "bad_request", str(e))
    except ObjectFormatError as e:
        return json_error(502, "bad_object", str(e))
    except RegistryUnavailable as e:
        return json_error(503, "registry_unavailable", str(e))
    except KDNError as e:
        log.warning("request %s %s failed: %s", request.method, request.path, e)
        return json_error(503, "unavailable", str(e))
    except ConnectionError:
        # The client hung up mid-response (a hedged fetch whose twin won): nothing to answer.
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return json_error(500, "internal", "internal error; see the server log")


def metrics_middleware_factory(metrics: CollectorRegistry, service: str) -> Middleware:
    requests = Counter("kdn_http_requests", "HTTP requests by route and status", ["service", "route", "status"],
                       registry=metrics)
    latency = Histogram("kdn_http_request_seconds", "HTTP request latency by route", ["service", "route"],
                        registry=metrics, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))

    @web.middleware
    async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            requests.labels(service, route, str(status)).inc()
            latency.labels(service, route).observe(time.perf_counter() - t0)

    return metrics_middleware


async def read_json(request: web.Request, limit: int = MAX_JSON_BODY) -> dict[str, Any]:
    """The request's JSON object body, bounded: 413 past ``limit``, 400 if not a JSON object."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length,
                                            text=f"body larger than {limit} bytes")
    seconds = (request.app.get(DEADLINES) or Deadlines()).body
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body),
                                                        text=f"body larger than {limit} bytes")
    except TimeoutError:
        if HTTP_METRICS in request.app:
            request.app[HTTP_METRICS]["body"].inc()
        raise web.HTTPRequestTimeout(text=f"body not received within {seconds:g} s",
                                     headers={"Connection": "close"}) from None
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


def registry_ctx(url: str | None) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` entry that opens the registry at ``url`` for the app and closes it at shutdown."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        reg = open_registry(url)
        app[REGISTRY] = reg
        try:
            yield
        finally:
            await reg.close()

    return ctx


MAX_LOOKUP_ADDRESSES = 4096


async def read_addresses(request: web.Request, limit: int = MAX_LOOKUP_ADDRESSES) -> tuple[dict[str, Any], list[Address]]:
    """A lookup-style body: ``{"addresses": [...]}`` with at most ``limit`` valid addresses (400 otherwise)."""
    body = await read_json(request)
    addrs = body.get("addresses")
    if not isinstance(addrs, list) or len(addrs) > limit:
        raise web.HTTPBadRequest(text=f"'addresses' must be a list of at most {limit} addresses")
    if body.get("encoding") is not None:
        validate_encoding(body["encoding"])  # the one optional field both lookups read
    return body, [validate_address(a) for a in addrs]


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


# --- registry read endpoints (origin and edge serve the same) --------------


MAX_RECORDS = 1024  # records one POST /v1/records may ask for (~1.4 KB each, signed with pieces)


def records_of(app: web.Application) -> RecordSource:
    """The app's record source: an edge's record cache where it set one, else its registry."""
    src = app.get(RECORDS)
    return src if src is not None else app[REGISTRY]


async def hold_no(request: web.Request, since: float) -> None:
    """Before answering "no" (absent, or not yours): wait as the app's record source says, where it caches
    records for every tenant (an edge: ``RecordCache.hold``), so that the answer's timing tells nothing."""
    hold = getattr(records_of(request.app), "hold", None)
    if hold is not None and "*" not in request.app[GRANTS].namespaces(bearer(request), "read"):
        await hold(since)  # (a caller that may read every namespace, a peer edge, has nothing kept from it)


async def get_registry_object(request: web.Request) -> web.Response:
    address = validate_address(request.match_info["address"])
    t0 = time.monotonic()
    rec = await records_of(request.app).get_object(address)
    if rec is None or not _may_read(request, rec.namespace, rec.kind):
        await hold_no(request, t0)
        raise web.HTTPNotFound(text=f"no object {address}")  # do not reveal other tenants' objects
    return web.json_response(rec.to_dict())


async def post_records(request: web.Request) -> web.Response:
    """Many object records in one request (an edge asking its origin, where records live beside the blobs):
    ``{"addresses": [...]}`` in, ``{"records": [record or null, ...]}`` out, in order; a record the caller
    may not read is null, as an absent one is."""
    _, addrs = await read_addresses(request, MAX_RECORDS)
    t0 = time.monotonic()
    src = records_of(request.app)
    if HOP in request.headers and getattr(src, "takes_hop", False):  # an edge asking its region's owner
        recs = await src.get_objects(list(addrs), hop=True)  # type: ignore[call-arg]  # (RecordCache)
    else:
        recs = await src.get_objects(list(addrs))
    out = [r.to_dict() if r is not None and _may_read(request, r.namespace, r.kind) else None for r in recs]
    if None in out:
        await hold_no(request, t0)
    return web.json_response({"records": out})


async def get_registry_manifest(request: web.Request) -> web.Response:
    ns = validate_namespace(request.match_info["namespace"])
    name = validate_name(request.match_info["name"])
    if not _may_read(request, ns):
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    asked = request.query.get("body")  # one body by its digest (an edge following a pointer it read)
    if asked is not None:
        man = await _manifest_body(request.app, ns, name, validate_digest(asked))
        if man is None or (man.namespace, man.name) != (ns, name):
            raise web.HTTPNotFound(text=f"no body {asked[:16]} of manifest {ns}/{name}")
        return web.json_response(man.to_dict())
    man = await request.app[REGISTRY].get_manifest(ns, name)
    if man is not None and man.body is not None:  # a pointer (records beside the blobs): its whole manifest
        whole = await _manifest_body(request.app, ns, name, man.body)
        if whole is None or not man.points_at(whole):
            raise web.HTTPBadGateway(text=f"manifest {ns}/{name} v{man.version}: its body {man.body[:16]} "
                                          "could not be read from the origins")
        man = whole
    if man is None:
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    return web.json_response(man.to_dict())


async def _manifest_body(app: web.Application, namespace: str, name: str, digest: Digest) -> Manifest | None:
    bodies = app.get(MANIFEST_BODIES)
    if bodies is None:
        reg = app[REGISTRY]
        get = getattr(reg, "get_manifest_body", None)  # an origin's records store (kdn.registry.split)
        return await get(digest) if get is not None else None
    return await bodies.get_manifest_body(namespace, name, digest)


def _may_read(request: web.Request, namespace: str, kind: str | None = None) -> bool:
    grants = request.app[GRANTS]
    return may_read(grants.namespaces(bearer(request), "read"), namespace, kind)


async def get_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS])
    resp = web.Response(body=body)
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


def add_common_routes(app: web.Application) -> None:
    app.router.add_get("/v1/registry/objects/{address}", get_registry_object)
    app.router.add_post("/v1/records", post_records)
    app.router.add_get("/v1/registry/manifests/{namespace}/{name}", get_registry_manifest)
    app.router.add_get("/metrics", get_metrics)


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
