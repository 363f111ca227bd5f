"""What every server of the origin and the edge runs under: the options each runner passes to aiohttp
(the head deadline, no access log), the body and send deadlines, and aiohttp's log of requests it could
not parse kept to one line each."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from .config import Deadlines
from .keys import DEADLINES, HTTP_METRICS

log = logging.getLogger("kdn.service")  # the name its records had before the split into modules


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


MALFORMED_REQUESTS = _MalformedRequests()


def quiet_malformed_requests() -> None:
    """Install the filter above on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if MALFORMED_REQUESTS not in logger.filters:
        logger.addFilter(MALFORMED_REQUESTS)


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
