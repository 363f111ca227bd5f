"""How many connections a node accepts, and the loop that serves it.

An idle TCP connection costs the server one file descriptor until its head deadline
(``Deadlines.headers``) closes it. Without a cap, a few hundred of them from one host
took every descriptor of an edge (issue #28 item 7): ``/healthz`` timed out, an
uncached read got 503 because no socket was left to fill it from the origin, and the
event loop logged an accept error per try. So a node admits at most ``total``
connections, and at most ``per_peer`` from one address; a connection over either is
closed as it arrives (counted in ``kdn_connections_refused_total{reason}``), before it
costs more than the moment it took. The defaults leave room under the process's
descriptor limit for what the node opens itself (fills, the registry, disk files):
the arithmetic is in docs/operations.md ("Connections and file descriptors").

A TLS connection is counted once its handshake completes (asyncio runs the handshake
under the protocol); a handshake that never completes is closed after
``ssl_handshake_timeout``, set to the head deadline.

``run`` replaces ``aiohttp.web.run_app`` for the origin and the edge: the same runner
and graceful shutdown on SIGINT/SIGTERM, with the gate in front of aiohttp's protocol.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kdn.errors import InvalidInput

log = logging.getLogger(__name__)

RESERVED_MIN = 64  # descriptors kept back for what the node opens itself, at least
ACCEPT_LOG_PER_MINUTE = 20


def descriptor_limit() -> int:
    """This process's soft limit on open files (RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True)
class ConnectionCaps:
    """At most ``total`` connections at once, at most ``per_peer`` of them from one address."""

    total: int
    per_peer: int

    def __post_init__(self) -> None:
        if not (isinstance(self.total, int) and isinstance(self.per_peer, int) and self.total >= 1
                and 1 <= self.per_peer <= self.total):
            raise InvalidInput(f"connection caps must be 1 <= per_peer <= total, got {self.total}/{self.per_peer}")

    @classmethod
    def for_limit(cls, limit: int, *, total: int | None = None, per_peer: int | None = None) -> ConnectionCaps:
        """Caps that fit under a descriptor ``limit``: a quarter of it (at least ``RESERVED_MIN``) stays for the
        node's own files and sockets; one peer may hold half of the rest (an engine host or another edge,
        with its pool, is one peer: it must not be starved, nor starve everyone else)."""
        if total is None:
            total = max(1, limit - max(RESERVED_MIN, limit // 4))
        if per_peer is None:
            per_peer = max(1, total // 2)
        caps = cls(total, min(per_peer, total))
        if caps.total + RESERVED_MIN > limit:
            log.warning("--max-connections %d leaves fewer than %d of the %d file descriptors this process may "
                        "open for its own fills, registry and files (raise `ulimit -n`)", caps.total, RESERVED_MIN,
                        limit)
        return caps


class Gate:
    """Counts open connections, total and by peer address, and admits or refuses each new one."""

    def __init__(self, caps: ConnectionCaps, metrics: CollectorRegistry | None = None, service: str = "node") -> None:
        self.caps = caps
        self.open = 0
        self.by_peer: Tally[str] = Tally()
        self._logged = 0.0
        self._unlogged = 0
        self._refused = self._gauge = None
        if metrics is not None:
            refused = Counter("kdn_connections_refused", "Connections closed as they arrived: over the node's "
                              "cap (reason=total) or over one address's (reason=peer)", ["service", "reason"],
                              registry=metrics)
            self._refused = {r: refused.labels(service, r) for r in ("total", "peer")}
            self._gauge = Gauge("kdn_connections_open", "Connections open now", ["service"],
                                registry=metrics).labels(service)

    def admit(self, peer: str) -> bool:
        reason = ("total" if self.open >= self.caps.total
                  else "peer" if self.by_peer[peer] >= self.caps.per_peer else None)
        if reason is not None:
            if self._refused is not None:
                self._refused[reason].inc()
            self._log_refusal(peer, reason)
            return False
        self.open += 1
        self.by_peer[peer] += 1
        if self._gauge is not None:
            self._gauge.set(self.open)
        return True

    def release(self, peer: str) -> None:
        self.open -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]
        if self._gauge is not None:
            self._gauge.set(self.open)

    def _log_refusal(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        if now - self._logged < 60.0 / ACCEPT_LOG_PER_MINUTE:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last such line)" if self._unlogged else ""
        self._logged, self._unlogged = now, 0
        cap = (f"{self.caps.total} connections open" if reason == "total"
               else f"{self.caps.per_peer} connections from {peer[:64]} open")
        log.warning("connection from %s refused: %s (--max-connections%s)%s", peer[:64], cap,
                    "" if reason == "total" else "-per-peer", more)


class _Admitted(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the gate: over a cap, the transport is closed before
    aiohttp sees it; else every callback goes through, and the close is counted."""

    __slots__ = ("_inner", "_gate", "_peer")

    def __init__(self, inner: asyncio.Protocol, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate
        self._peer: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        name = transport.get_extra_info("peername")
        peer = str(name[0]) if isinstance(name, tuple) and name else str(name)
        if not self._gate.admit(peer):
            if isinstance(transport, asyncio.Transport):
                transport.abort()  # at once: no FIN handshake, no buffered bytes
            else:
                transport.close()
            return
        self._peer = peer
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is None:
            return
        self._gate.release(self._peer)
        self._peer = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._peer is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._peer is not None else None

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def gated(factory: Callable[[], asyncio.Protocol], gate: Gate) -> Callable[[], asyncio.Protocol]:
    """A protocol factory for ``loop.create_server``: ``factory``'s protocols behind ``gate``."""
    return lambda: _Admitted(factory(), gate)


class _AcceptErrors:
    """The loop's exception handler, with accept errors (out of descriptors: ``EMFILE``) logged at most
    ``ACCEPT_LOG_PER_MINUTE`` times a minute, the rest counted into the next line (asyncio logs one with a
    traceback per failed accept). Everything else goes to the default handler as before."""

    def __init__(self) -> None:
        self._window = 0.0
        self._in_window = self._suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept()"):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._window >= 60.0:
            self._window, self._in_window = now, 0
        self._in_window += 1
        if self._in_window > ACCEPT_LOG_PER_MINUTE:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last such line)" if self._suppressed else ""
        self._suppressed = 0
        log.warning("%s: %s%s", context.get("message"), context.get("exception"), more)


async def serve(app: web.Application, host: str, port: int, *, caps: ConnectionCaps, service: str,
                ssl_context: ssl.SSLContext | None = None, metrics: CollectorRegistry | None = None,
                **runner_options: Any) -> tuple[web.AppRunner, asyncio.Server]:
    """Start ``app`` on ``host:port`` behind a connection gate. Stop with ``server.close()`` then
    ``await runner.cleanup()``."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_AcceptErrors())
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    assert runner.server is not None
    handshake = runner_options.get("keepalive_timeout", 30.0)
    server = await loop.create_server(gated(runner.server, Gate(caps, metrics, service)), host, port,
                                      ssl=ssl_context, reuse_address=True, backlog=128,
                                      ssl_handshake_timeout=handshake if ssl_context is not None else None)
    return runner, server


def run(app: web.Application, host: str, port: int, *, caps: ConnectionCaps, service: str,
        ssl_context: ssl.SSLContext | None = None, metrics: CollectorRegistry | None = None,
        **runner_options: Any) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (as ``web.run_app`` does)."""

    async def main() -> None:
        runner, server = await serve(app, host, port, caps=caps, service=service, ssl_context=ssl_context,
                                     metrics=metrics, handle_signals=True, **runner_options)
        log.info("%s listening on %s:%d (at most %d connections, %d per peer)", service, host, port, caps.total,
                 caps.per_peer)
        try:
            await asyncio.Event().wait()  # until a signal: the runner's handler raises GracefulExit
        finally:
            server.close()
            await runner.cleanup()

    try:
        asyncio.run(main())
    except (web.GracefulExit, KeyboardInterrupt):
        pass
