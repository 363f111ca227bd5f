"""Server-side HTTP pieces shared by the origin and the edge (aiohttp).

This is the one core module that knows aiohttp's server side; only
``kdn.origin`` and ``kdn.edge`` import it, so ``import kdn`` stays light.
It holds what both services must do the same way: JSON errors with no stack
traces, bearer-token checks, the registry read endpoints, ``/metrics``, and
the headers of an object response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from kdn.address import validate_address, validate_name, validate_namespace
from kdn.auth import AuthError, Grants
from kdn.errors import (
    InvalidInput,
    KDNError,
    ObjectFormatError,
    RegistryUnavailable,
    UnknownModel,
)
from kdn.registry import Registry, open_registry

log = logging.getLogger(__name__)

# `*_created` series double the output and no dashboard reads them.
prometheus_client.disable_created_metrics()

REGISTRY = web.AppKey("registry", Registry)
GRANTS = web.AppKey("grants", Grants)
METRICS = web.AppKey("metrics", CollectorRegistry)
HTTP_METRICS = web.AppKey("http_metrics", dict)

MAX_JSON_BODY = 1 << 20  # lookup/publish bodies larger than this get 413, not parsed


def json_error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                 409: "conflict", 413: "too_large", 415: "unsupported_media_type", 503: "unavailable"}


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every error leaves as ``{"error": code, "detail": ...}``; never a stack trace."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        detail = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        return json_error(e.status, _STATUS_CODES.get(e.status, "error"), detail or e.reason)
    except AuthError as e:
        return json_error(e.status, _STATUS_CODES[e.status], str(e))
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


def metrics_middleware_factory(metrics: CollectorRegistry, service: str):
    requests = Counter("kdn_http_requests", "HTTP requests by route and status", ["service", "route", "status"],
                       registry=metrics)
    latency = Histogram("kdn_http_request_seconds", "HTTP request latency by route", ["service", "route"],
                        registry=metrics, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))

    @web.middleware
    async def metrics_middleware(request: web.Request, handler):
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


async def read_json(request: web.Request, limit: int = MAX_JSON_BODY) -> dict:
    """The request's JSON object body, bounded: 413 past ``limit``, 400 if not a JSON object."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length,
                                            text=f"body larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body),
                                                text=f"body larger than {limit} bytes")
    import json

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="body is not valid JSON") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    return data


def registry_ctx(url: str | None):
    """A ``cleanup_ctx`` entry that opens the registry at ``url`` for the app and closes it at shutdown."""

    async def ctx(app: web.Application):
        reg = open_registry(url)
        app[REGISTRY] = reg
        try:
            yield
        finally:
            await reg.close()

    return ctx


MAX_LOOKUP_ADDRESSES = 4096


async def read_addresses(request: web.Request, limit: int = MAX_LOOKUP_ADDRESSES) -> tuple[dict, list[str]]:
    """A lookup-style body: ``{"addresses": [...]}`` with at most ``limit`` valid addresses (400 otherwise)."""
    body = await read_json(request)
    addrs = body.get("addresses")
    if not isinstance(addrs, list) or len(addrs) > limit:
        raise web.HTTPBadRequest(text=f"'addresses' must be a list of at most {limit} addresses")
    return body, [validate_address(a) for a in addrs]


def bearer(request: web.Request) -> str | None:
    return request.headers.get("Authorization")


# --- registry read endpoints (origin and edge serve the same) --------------


async def get_registry_object(request: web.Request) -> web.Response:
    address = validate_address(request.match_info["address"])
    rec = await request.app[REGISTRY].get_object(address)
    if rec is None:
        raise web.HTTPNotFound(text=f"no object {address}")
    if not _may_read(request, rec.namespace):
        raise web.HTTPNotFound(text=f"no object {address}")  # do not reveal other tenants' objects
    return web.json_response(rec.to_dict())


async def get_registry_manifest(request: web.Request) -> web.Response:
    ns = validate_namespace(request.match_info["namespace"])
    name = validate_name(request.match_info["name"])
    if not _may_read(request, ns):
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    man = await request.app[REGISTRY].get_manifest(ns, name)
    if man is None:
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    return web.json_response(man.to_dict())


def _may_read(request: web.Request, namespace: str) -> bool:
    grants = request.app[GRANTS]
    allowed = grants.namespaces(bearer(request), "read")
    return "*" in allowed or namespace in allowed


async def get_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS])
    resp = web.Response(body=body)
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


def add_common_routes(app: web.Application) -> None:
    app.router.add_get("/v1/registry/objects/{address}", get_registry_object)
    app.router.add_get("/v1/registry/manifests/{namespace}/{name}", get_registry_manifest)
    app.router.add_get("/metrics", get_metrics)


def object_headers(digest: str, source: str, encoding: str, namespace: str = "public") -> dict[str, str]:
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
    }


def not_modified(request: web.Request, digest: str) -> bool:
    """RFC 9110 §13.1.2: If-None-Match with a matching entity tag → 304."""
    inm = request.headers.get("If-None-Match")
    if not inm:
        return False
    tags = [t.strip().removeprefix("W/").strip('"') for t in inm.split(",")]
    return "*" in tags or digest in tags
