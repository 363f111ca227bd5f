"""Load clients (and the dict-backed baseline server) for ``bench/serve.py``.

Run as a separate process by ``bench/serve.py``, one process per measurement
cell, so the client's CPU never lands in the server's accounting. Only the
standard library is imported at the top: the ``lmcache`` client runs under
LMCache's own virtual environment, where neither aiohttp nor kdn exists.

    python bench/serve_clients.py CLIENT --url URL --keys FILE --conc N --duration S --warmup W [--size BYTES]
    python bench/serve_clients.py dict-server --port P --blobs DIR

Clients: ``raw`` (one thread per connection, blocking socket, HTTP/1.1
keep-alive, body read with ``recv_into`` into a buffer allocated once),
``aiohttp`` (``await resp.read()``, N tasks over one session), ``kdn``
(``KDNClient.fetch`` with digest and size known: the real fetch path,
BLAKE3 verification included), ``kdn-recv`` (the same with the BLAKE3 check
stubbed out in this process: the receive path alone), ``redis`` (redis-py
sync with hiredis, one connection per thread), ``redis-raw`` (RESP on a
blocking socket, the value read with ``recv_into`` into a buffer allocated
once, as ``raw`` reads HTTP), ``lmcache`` (LMCache's remote
connector for ``lm://``).

Protocol on stdout: a line ``START`` when the measured window opens, ``END``
when it closes (the parent samples server CPU at both), then one JSON line
with the counts. Requests are counted when they complete inside the window.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Window:
    """The measured window: [t0, t1). Workers run from start until t1, record only completions inside."""

    def __init__(self, warmup: float, duration: float) -> None:
        self.start = time.perf_counter()
        self.duration = duration
        self.t0 = self.start + warmup
        self.t1 = self.t0 + duration

    def wait_and_mark(self) -> None:
        time.sleep(max(0.0, self.t0 - time.perf_counter()))
        _emit("START")
        time.sleep(max(0.0, self.t1 - time.perf_counter()))
        _emit("END")

    async def await_and_mark(self) -> None:
        import asyncio

        await asyncio.sleep(max(0.0, self.t0 - time.perf_counter()))
        _emit("START")
        await asyncio.sleep(max(0.0, self.t1 - time.perf_counter()))
        _emit("END")


class Tally:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.bytes = 0
        self.errors = 0

    def merge(self, others: list["Tally"]) -> "Tally":
        for o in others:
            self.lat.extend(o.lat)
            self.bytes += o.bytes
            self.errors += o.errors
        return self


def _report(t: Tally, window: Window, extra: dict | None = None) -> None:
    lat = sorted(t.lat)

    def pct(p: float) -> float | None:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

    out = {"requests": len(lat), "bytes": t.bytes, "seconds": window.t1 - window.t0, "errors": t.errors,
           "p50_ms": pct(0.50) * 1e3 if lat else None, "p99_ms": pct(0.99) * 1e3 if lat else None}
    out.update(extra or {})
    _emit(json.dumps(out))


# --- raw socket ---------------------------------------------------------------


def _read_head(sock: socket.socket, hview: memoryview, sep: bytes) -> tuple[int, int]:
    """Receive until ``sep`` ends the head: (bytes received, where ``sep`` starts)."""
    n = 0
    while True:
        r = sock.recv_into(hview[n:])
        if not r:
            raise ConnectionError("server closed")
        n += r
        end = hview.obj.find(sep, 0, n)
        if end >= 0:
            return n, end


def _read_body(sock: socket.socket, view: memoryview, hview: memoryview, n: int, start: int, length: int) -> None:
    """The ``length``-byte body into ``view``: what came with the head (from ``start`` to ``n``), then the rest."""
    got = n - start
    view[:got] = hview[start:n]
    while got < length:
        r = sock.recv_into(view[got:length])
        if not r:
            raise ConnectionError("server closed mid-body")
        got += r


def _blocking_worker(host: str, port: int, reqs: list[bytes], size: int, sep: bytes, parse, trailer: int,
                     window: Window, tally: Tally, offset: int) -> None:
    """One connection, one thread, blocking socket: send a request, read the head up to ``sep``, parse
    it (``parse(head) -> body length``), receive the body (and ``trailer`` more bytes) with ``recv_into``
    into one buffer allocated once."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(size + trailer))  # every body lands here: allocated once
    head = bytearray(8192)
    hview = memoryview(head)
    i = offset
    try:
        while True:
            t = time.perf_counter()
            if t >= window.t1:
                return
            sock.sendall(reqs[i % len(reqs)])
            i += 1
            n, end = _read_head(sock, hview, sep)  # whatever follows the head is the start of the body
            length = parse(bytes(head[:end]))
            if length > size:
                raise ConnectionError(f"body of {length} bytes, buffer of {size}")
            _read_body(sock, view, hview, n, end + len(sep), length + trailer)
            done = time.perf_counter()
            if window.t0 <= done < window.t1:
                tally.lat.append(done - t)
                tally.bytes += length
    except OSError:
        tally.errors += 1
    finally:
        sock.close()


def _http_length(head: bytes) -> int:
    hdr = head.lower()
    if not hdr.startswith(b"http/1.1 200"):
        raise ConnectionError(hdr[:60].decode(errors="replace"))
    cl = hdr.find(b"content-length:") + 15
    eol = hdr.find(b"\r\n", cl)
    return int(hdr[cl:eol if eol >= 0 else len(hdr)])


def _raw_worker(host: str, port: int, paths: list[str], size: int, window: Window, tally: Tally, offset: int) -> None:
    """HTTP/1.1 keep-alive GETs, headers parsed by hand, the body received into a buffer allocated once."""
    reqs = [f"GET {p} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode() for p in paths]
    _blocking_worker(host, port, reqs, size, b"\r\n\r\n", _http_length, 0, window, tally, offset)


def run_threads(target, n: int, window: Window, *args) -> Tally:
    tallies = [Tally() for _ in range(n)]
    threads = [threading.Thread(target=target, args=(*args, window, tallies[k], k), daemon=True) for k in range(n)]
    for th in threads:
        th.start()
    window.wait_and_mark()
    for th in threads:
        th.join(timeout=30)
    return Tally().merge(tallies)


# --- aiohttp / kdn ------------------------------------------------------------


async def _aiohttp_main(url: str, paths: list[str], conc: int, window: Window) -> Tally:
    import asyncio

    import aiohttp

    tallies = [Tally() for _ in range(conc)]
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn, auto_decompress=False) as session:
        async def worker(k: int) -> None:
            t_ = tallies[k]
            i = k
            while True:
                t = time.perf_counter()
                if t >= window.t1:
                    return
                try:
                    async with session.get(url + paths[i % len(paths)]) as r:
                        data = await r.read()
                        if r.status != 200:
                            raise aiohttp.ClientError(f"HTTP {r.status}")
                except aiohttp.ClientError:
                    t_.errors += 1
                    continue
                i += 1
                done = time.perf_counter()
                if window.t0 <= done < window.t1:
                    t_.lat.append(done - t)
                    t_.bytes += len(data)

        await asyncio.gather(window.await_and_mark(), *(worker(k) for k in range(conc)))
    return Tally().merge(tallies)


class _AnyDigest:
    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


class _NoHash:
    """Stands in for blake3 in ``kdn-recv``: the receive path without the verification."""

    def __init__(self, *a, **k) -> None:
        pass

    def update(self, data) -> None:  # the client feeds each body segment as it lands
        pass

    def hexdigest(self) -> _AnyDigest:
        return _AnyDigest()


async def _kdn_main(url: str, objects: list[dict], conc: int, window: Window, verify: bool) -> Tally:
    import asyncio

    import kdn.client as kc

    if not verify:
        kc.blake3 = _NoHash
    tallies = [Tally() for _ in range(conc)]
    async with kc.KDNClient(edges=[url], concurrency=conc, max_hedges=0) as client:
        async def worker(k: int) -> None:
            t_ = tallies[k]
            i = k
            while True:
                t = time.perf_counter()
                if t >= window.t1:
                    return
                o = objects[i % len(objects)]
                i += 1
                try:
                    f = await client.fetch(o["address"], encoding="raw", digest=o["digest"], size=o["size"])
                except Exception:
                    t_.errors += 1
                    continue
                done = time.perf_counter()
                if window.t0 <= done < window.t1:
                    t_.lat.append(done - t)
                    t_.bytes += len(f.blob)

        await asyncio.gather(window.await_and_mark(), *(worker(k) for k in range(conc)))
    return Tally().merge(tallies)


# --- asyncio BufferedProtocol: what an asyncio fetch client can do -------------------------


async def _bufproto_main(host: str, port: int, paths: list[str], size: int, conc: int, window: Window) -> Tally:
    """HTTP/1.1 GETs over ``asyncio.BufferedProtocol``: the event loop ``recv_into``s straight into
    the preallocated body buffer (headers into a small one). A candidate receive path for
    ``KDNClient._get`` in place of aiohttp's ``iter_any`` (one copy per chunk)."""
    import asyncio

    loop = asyncio.get_running_loop()

    class Proto(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.head = bytearray(16384)
            self.hview = memoryview(self.head)
            self.body = memoryview(bytearray(size))
            self.reset()

        def reset(self) -> None:
            self.hn = 0
            self.length = -1
            self.got = 0
            self.done = loop.create_future()

        def get_buffer(self, sizehint: int):
            if self.length < 0:
                return self.hview[self.hn:]
            return self.body[self.got:self.length]

        def buffer_updated(self, n: int) -> None:
            if self.length >= 0:
                self.got += n
            else:
                self.hn += n
                end = self.head.find(b"\r\n\r\n", 0, self.hn)
                if end < 0:
                    return
                hdr = bytes(self.head[:end]).lower()
                cl = hdr.find(b"content-length:") + 15
                eol = hdr.find(b"\r\n", cl)
                self.length = int(hdr[cl:eol if eol >= 0 else len(hdr)])
                if not hdr.startswith(b"http/1.1 200") or self.length > len(self.body):
                    self.done.set_exception(ConnectionError(hdr[:60].decode(errors="replace")))
                    return
                extra = self.hn - (end + 4)
                self.body[:extra] = self.hview[end + 4:self.hn]
                self.got = extra
            if self.got >= self.length and not self.done.done():
                self.done.set_result(self.got)

        def connection_lost(self, exc) -> None:
            if not self.done.done():
                self.done.set_exception(ConnectionError("closed"))

    tallies = [Tally() for _ in range(conc)]

    async def worker(k: int) -> None:
        tr, pr = await loop.create_connection(Proto, host, port)
        reqs = [f"GET {p} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode() for p in paths]
        t_ = tallies[k]
        i = k
        try:
            while True:
                t = time.perf_counter()
                if t >= window.t1:
                    return
                pr.reset()
                tr.write(reqs[i % len(reqs)])
                i += 1
                n = await pr.done
                done = time.perf_counter()
                if window.t0 <= done < window.t1:
                    t_.lat.append(done - t)
                    t_.bytes += n
        except ConnectionError:
            t_.errors += 1
        finally:
            tr.close()

    await asyncio.gather(window.await_and_mark(), *(worker(k) for k in range(conc)))
    return Tally().merge(tallies)


# --- redis --------------------------------------------------------------------


def _redis_worker(host: str, port: int, keys: list[str], window: Window, tally: Tally, offset: int) -> None:
    import redis

    r = redis.Redis(host=host, port=port, single_connection_client=True)
    i = offset
    try:
        while True:
            t = time.perf_counter()
            if t >= window.t1:
                return
            data = r.get(keys[i % len(keys)])
            i += 1
            done = time.perf_counter()
            if data is None:
                tally.errors += 1
                continue
            if window.t0 <= done < window.t1:
                tally.lat.append(done - t)
                tally.bytes += len(data)
    except (OSError, redis.RedisError):
        tally.errors += 1
    finally:
        r.close()


def _resp_length(head: bytes) -> int:
    if head[0:1] != b"$" or head[1:2] == b"-":  # a bulk string; "$-1" is a missing key
        raise ConnectionError(head.decode(errors="replace"))
    return int(head[1:])


def _redis_raw_worker(host: str, port: int, keys: list[str], size: int, window: Window, tally: Tally,
                      offset: int) -> None:
    """GET over RESP on a blocking socket, the value (and its CRLF) received into one buffer allocated
    once: Redis read as the ``raw`` HTTP client reads the HTTP servers (redis-py allocates a fresh
    ``bytes`` per reply)."""
    reqs = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k.encode()) for k in keys]
    _blocking_worker(host, port, reqs, size, b"\r\n", _resp_length, 2, window, tally, offset)


# --- LMCache ------------------------------------------------------------------


class LMClient:
    """LMCache's own client for ``lm://`` URLs (``LMCServerConnector``), one connection, one event loop.

    The connector receives into what ``local_cpu_backend.allocate`` hands it
    (LMCache's pinned pool); the stand-in here hands out one buffer allocated
    once, as that pool does after warm-up. Shape: KV_2LTD ``[2, n, 256, 64]``
    bf16 with ``n`` chosen so the chunk has the object's byte size.
    """

    def __init__(self, host: str, port: int, size: int) -> None:
        import asyncio
        from types import SimpleNamespace

        import torch
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector

        self.torch, self.fmt = torch, MemoryFormat.KV_2LTD
        assert size % 65536 == 0, size
        self.shape = torch.Size([2, size // 65536, 256, 64])
        metadata = SimpleNamespace(get_shapes=lambda: [self.shape], get_dtypes=lambda: [torch.bfloat16],
                                   use_mla=False, chunk_size=256, get_num_groups=lambda: 1)
        config = SimpleNamespace(extra_config=None, use_layerwise=False)
        self.buf = memoryview(bytearray(size))
        backend = SimpleNamespace(config=config, metadata=metadata,
                                  allocate=lambda shape, dtype, fmt: SimpleNamespace(byte_array=self.buf))
        self.loop = asyncio.new_event_loop()
        self.conn = LMCServerConnector(host, port, self.loop, backend)

    def key(self, address: str):
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("kdn-bench", 1, 0, int(address[:15], 16), self.torch.bfloat16)

    def put(self, address: str, blob: bytes) -> None:
        from types import SimpleNamespace

        obj = SimpleNamespace(byte_array=memoryview(blob), get_shape=lambda: self.shape,
                              get_dtype=lambda: self.torch.bfloat16, get_memory_format=lambda: self.fmt)
        self.loop.run_until_complete(self.conn.put(self.key(address), obj))

    def get(self, address: str) -> int:
        obj = self.loop.run_until_complete(self.conn.get(self.key(address)))
        return 0 if obj is None else len(obj.byte_array)

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


def _lmcache_main(host: str, port: int, objects: list[dict], blobs: str, conc: int, window: Window) -> Tally:
    size = objects[0]["size"]
    setup = LMClient(host, port, size)
    for o in objects:
        with open(os.path.join(blobs, o["address"]), "rb") as f:
            setup.put(o["address"], f.read())
    assert setup.get(objects[0]["address"]) == size, "LMCache server did not keep the chunk"
    setup.close()
    clients = [LMClient(host, port, size) for _ in range(conc)]  # connect (and import) before the clock

    def worker(window: Window, tally: Tally, k: int) -> None:
        c = clients[k]
        i = k
        try:
            while True:
                t = time.perf_counter()
                if t >= window.t1:
                    return
                o = objects[i % len(objects)]
                i += 1
                n = c.get(o["address"])
                done = time.perf_counter()
                if n != o["size"]:
                    tally.errors += 1
                    continue
                if window.t0 <= done < window.t1:
                    tally.lat.append(done - t)
                    tally.bytes += n
        except OSError:
            tally.errors += 1
        finally:
            c.close()

    window.t0 = time.perf_counter() + window.t0 - window.start
    window.t1 = window.t0 + window.duration
    return run_threads(worker, conc, window)


# --- the dict-backed aiohttp server ---------------------------------------------


def dict_server(port: int, blobs: str, send: str = "response") -> None:
    """``send``: ``stream`` is the baseline (headers sent on their own, then the body as a memoryview: no
    copy, as the edge sends); ``response`` (``web.Response(body=blob)``, which joins headers and body
    into one new ``bytes`` first) is kept as a row; ``sliced:N`` writes N-byte slices with a drain between."""
    from aiohttp import web

    store = {}
    for name in os.listdir(blobs):
        with open(os.path.join(blobs, name), "rb") as f:
            store[name] = f.read()
    slice_n = int(send.split(":")[1]) if send.startswith("sliced:") else 0

    async def get(request: web.Request) -> web.StreamResponse:
        blob = store.get(request.match_info["key"])
        if blob is None:
            raise web.HTTPNotFound()
        if send == "response":
            return web.Response(body=blob)
        view = memoryview(blob)
        resp = web.StreamResponse()
        resp.content_length = len(view)
        await resp.prepare(request)  # a StreamResponse sends its headers now, alone
        if slice_n:
            for i in range(0, len(view), slice_n):
                await resp.write(view[i:i + slice_n])
        else:
            await resp.write(view)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/objects/{key}", get)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["raw", "aiohttp", "kdn", "kdn-recv", "bufproto", "redis", "redis-raw", "lmcache",
                                    "dict-server"])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--objects", help="JSON file: [{address, digest, size}]")
    p.add_argument("--blobs", help="folder of blobs named by address")
    p.add_argument("--send", default="response", help="dict-server: response | stream | sliced:BYTES")
    p.add_argument("--conc", type=int, default=1)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=0.7)
    a = p.parse_args()
    if a.mode == "dict-server":
        dict_server(a.port, a.blobs, a.send)
        return
    with open(a.objects) as f:
        objects = json.load(f)
    size = max(o["size"] for o in objects)
    from urllib.parse import urlsplit

    u = urlsplit(a.url)
    host, port = u.hostname, u.port
    paths = [f"/v1/objects/{o['address']}" for o in objects]
    if a.mode in ("aiohttp", "kdn", "kdn-recv"):
        import aiohttp  # noqa: F401  (imports before the clock starts)
        import kdn.client  # noqa: F401
    window = Window(a.warmup, a.duration)
    if a.mode == "raw":
        t = run_threads(_raw_worker, a.conc, window, host, port, paths, size)
    elif a.mode == "aiohttp":
        import asyncio

        t = asyncio.run(_aiohttp_main(a.url, paths, a.conc, window))
    elif a.mode in ("kdn", "kdn-recv"):
        import asyncio

        t = asyncio.run(_kdn_main(a.url, objects, a.conc, window, verify=a.mode == "kdn"))
    elif a.mode == "bufproto":
        import asyncio

        t = asyncio.run(_bufproto_main(host, port, paths, size, a.conc, window))
    elif a.mode == "redis":
        t = run_threads(_redis_worker, a.conc, window, host, port, [o["address"] for o in objects])
    elif a.mode == "redis-raw":
        t = run_threads(_redis_raw_worker, a.conc, window, host, port, [o["address"] for o in objects], size)
    else:
        t = _lmcache_main(host, port, objects, a.blobs, a.conc, window)
    _report(t, window)


if __name__ == "__main__":
    main()
