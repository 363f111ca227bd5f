"""The attack (#28 item 7): idle connections exhaust a node's file descriptors.

A node admits at most ``total`` connections and ``per_peer`` from one address
(``kdn.service.connections``); what arrives over a cap is closed at once and
counted, so the node keeps answering everyone else. "Other hosts" are
127.0.0.2 and 127.0.0.3: loopback addresses a client socket binds to.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from kdn.errors import InvalidInput
from kdn.service.connections import ConnectionCaps, _AcceptErrors, serve
from ports import free_port


def idle_from(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.connect(("127.0.0.1", port))
    return s


def closed_by_server(s: socket.socket, timeout: float = 2.0) -> bool:
    """Whether the server closed ``s`` (EOF or reset) within ``timeout``; an admitted idle one stays open."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def refused(metrics: CollectorRegistry, reason: str) -> float:
    return metrics.get_sample_value("kdn_connections_refused_total", {"service": "t", "reason": reason}) or 0.0


async def test_idle_connections_from_one_host_do_not_starve_the_rest():
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    metrics = CollectorRegistry()
    port = free_port()
    runner, server = await serve(app, "127.0.0.1", port, caps=ConnectionCaps(total=8, per_peer=4), service="t",
                                 metrics=metrics, keepalive_timeout=30)
    socks: list[socket.socket] = []
    try:
        # One host opens 10 idle connections: 4 are kept (its share), 6 closed as they arrive.
        attacker = [idle_from("127.0.0.2", port) for _ in range(10)]
        socks += attacker
        closed = await asyncio.gather(*(asyncio.to_thread(closed_by_server, s, 1.0) for s in attacker))
        assert sum(closed) == 6 and refused(metrics, "peer") == 6
        assert metrics.get_sample_value("kdn_connections_open", {"service": "t"}) == 4
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
            assert time.monotonic() - t0 < 1.0
        # A second host fills the node's total: now a newcomer from anywhere is closed (reason total).
        second = [idle_from("127.0.0.3", port) for _ in range(4)]
        socks += second
        assert not any(await asyncio.gather(*(asyncio.to_thread(closed_by_server, s, 0.5) for s in second)))
        late = idle_from("127.0.0.4", port)
        socks.append(late)
        assert await asyncio.to_thread(closed_by_server, late) and refused(metrics, "total") == 1
        # The idle ones go: their places free up (the count follows every close).
        for s in attacker + second:
            s.close()
        for _ in range(100):
            if metrics.get_sample_value("kdn_connections_open", {"service": "t"}) == 0:
                break
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
    finally:
        for s in socks:
            s.close()
        server.close()
        await runner.cleanup()


def test_caps_fit_under_the_descriptor_limit_and_bad_ones_are_refused():
    caps = ConnectionCaps.for_limit(256)
    assert caps.total == 192 and caps.per_peer == 96  # 64 descriptors stay for fills, the registry, files
    assert ConnectionCaps.for_limit(1 << 20).total == 3 * (1 << 18)
    assert ConnectionCaps.for_limit(1024, total=100).per_peer == 50
    assert ConnectionCaps.for_limit(1024, total=10, per_peer=50).per_peer == 10
    with pytest.raises(InvalidInput, match="per_peer"):
        ConnectionCaps(total=0, per_peer=0)


def test_accept_errors_are_logged_a_few_times_a_minute(caplog):
    loop = asyncio.new_event_loop()
    try:
        handler = _AcceptErrors()
        with caplog.at_level(logging.WARNING, logger="kdn.service.connections"):
            for _ in range(500):
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(24, "Too many open files")})
        assert len(caplog.records) == 20 and "Too many open files" in caplog.records[0].getMessage()
    finally:
        loop.close()
