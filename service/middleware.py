"""The middlewares both services install: every error a one-line JSON body (``{"error", "detail"}``), never
a stack trace; each request counted and timed by route and status."""

from __future__ import annotations

import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry, Counter, Histogram

from kdn.auth import AuthError
from kdn.errors import (
    InvalidInput,
    KDNError,
    ObjectFormatError,
    RegistryUnavailable,
    UnknownModel,
)

log = logging.getLogger("kdn.service")  # the name its records had before the split into modules


def json_error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                 408: "timeout", 413: "too_large", 415: "unsupported_media_type", 416: "range_not_satisfiable",
                 429: "too_many_requests", 502: "bad_gateway", 503: "unavailable"}


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
