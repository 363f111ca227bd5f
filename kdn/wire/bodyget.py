"""GET an object body straight into a preallocated buffer (HTTP/1.1 over ``asyncio.BufferedProtocol``).

The fetch client's hot path. aiohttp's client hands over a fresh ``bytes`` per
socket read, which must then be copied into the destination: on loopback that
held the client to ~0.4x of a raw ``recv_into`` client (bench/serve.py). Here
the event loop reads the body directly into the caller's buffer (or, for a
sink of small runs such as ``kdn.wire.scatter``'s 32 KB per head, into a 1 MiB
bounce buffer per connection whose bytes are copied out to their runs while in
cache: one read per run cost more, bench/datapath.py). Only what
the object route needs: ``GET``, a ``Content-Length`` body (no chunked
encoding), keep-alive connections pooled per origin, TLS through the stdlib
context, a bounded header block, and a deadline per request.
"""

from __future__ import annotations

import asyncio
import time
import ssl as _ssl
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable
from urllib.parse import urlsplit

MAX_HEADER = 16 << 10
BOUNCE = 1 << 20  # a connection's read buffer for sinks of small runs ...
BOUNCE_BELOW = 256 << 10  # ... used when the sink's next run is smaller than this
BODY_STATUSES = (200, 206)  # answers whose body is read into the buffer (206: a range of the object)


@runtime_checkable
class Sink(Protocol):
    """Where a body lands, when not in one buffer: ``size`` bytes in all; ``region(offset)`` is a writable
    view for the bytes from ``offset`` on (at least one byte; the reader never writes past ``size``).
    ``kdn.wire.scatter`` receives an object's tensors straight into an engine's memory this way."""

    @property
    def size(self) -> int: ...

    def region(self, offset: int) -> memoryview: ...


class _Flat:
    """One buffer as a sink."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.size = len(view)

    def region(self, offset: int) -> memoryview:
        return self.view[offset:]


class Hasher(Protocol):
    """What ``get`` feeds body segments to (``blake3()``, a ``hashlib`` object, a ``kdn.format.pieces`` verifier).
    An exception from ``update`` (a piece that does not match) ends the request with that exception, and
    drops the connection: no more of a refused body is read. It hashes each run on the receiving thread,
    while the bytes are still in cache."""

    def update(self, data: memoryview, /) -> object: ...


class BodyError(Exception):
    """The response was not a complete 200 with the promised length (the caller fails over)."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    length: int


_NO_BODY = _Flat(memoryview(b""))  # an idle connection's body: nothing may land in it


class Tally:
    """Body bytes landed for one caller's requests (one load's fetches), including requests still in flight
    or given up: what a load cut short at its deadline did move (``kdn.planner`` learns the link from it).
    A hedge's second body counts too."""

    __slots__ = ("bytes", "first")

    def __init__(self) -> None:
        self.bytes = 0
        self.first: float | None = None  # when its first body byte landed (time.perf_counter)


class _Conn(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._bounce: memoryview | None = None  # allocated at the first small-run sink, kept with the connection
        self.head = bytearray(MAX_HEADER)
        self.hview = memoryview(self.head)
        self.closed = False
        self.done: asyncio.Future[Response] | None = None
        self._disarm()

    def _arm(self, body: Sink, hasher: Hasher | None, tally: Tally | None = None) -> asyncio.Future[Response]:
        """Expect one response whose body lands in ``body``; the future resolves with its head."""
        self._reset(body, hasher, tally)
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def _disarm(self) -> None:
        """Idle (pooled): any byte that arrives now is a protocol error."""
        self._reset(_NO_BODY, None)
        self.done = None

    def _reset(self, body: Sink, hasher: Hasher | None, tally: Tally | None = None) -> None:
        self.body = body
        self.tally = tally
        self._bouncing = False  # the last region handed out was the bounce buffer, not the sink's
        self._last = memoryview(b"")  # the region get_buffer handed out last: where the next bytes landed
        self.hasher = hasher  # fed each body segment as it lands, while it is still in cache
        self.hn = 0
        self.resp: Response | None = None
        self.got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # What create_connection hands a stream protocol (plain or TLS) is a full Transport.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes) -> None:
        if self.transport is None:
            raise BodyError("not connected")
        self.transport.write(data)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.resp is None:
            return self.hview[self.hn:]
        if self.got < self.resp.length:
            try:
                region = self.body.region(self.got)[:self.resp.length - self.got]
            except Exception as e:  # noqa: BLE001 -- a sink that refuses the bytes (a head it will not place)
                self._fail(BodyError(f"body refused: {str(e)[:200]}"))
                return memoryview(bytearray(max(sizehint, 1)))
            if not len(region):
                self._fail(BodyError("the sink has no room for the body"))
                return memoryview(bytearray(max(sizehint, 1)))
            left = self.resp.length - self.got
            if len(region) < BOUNCE_BELOW < left:
                # A sink of small runs (kdn.wire.scatter: 32 KB per head of a chunk): one read per run costs a
                # system call and the loop's bookkeeping each. Read into one cache-sized buffer instead and
                # copy the bytes out to their runs (buffer_updated) while they are still in cache.
                if self._bounce is None:
                    self._bounce = memoryview(bytearray(BOUNCE))
                self._bouncing = True
                self._last = self._bounce[:min(left, BOUNCE)]
                return self._last
            self._bouncing = False
            self._last = region
            return region
        return memoryview(bytearray(max(sizehint, 1)))  # bytes past the body: a protocol error

    def buffer_updated(self, n: int) -> None:
        if self.done is None or self.done.done():
            self._fail(BodyError("data outside a response"))
            return
        ok = self._body_updated(n) if self.resp is not None else self._head_updated(n, self.done)
        if ok and self.resp is not None and self.got >= self.resp.length and not self.done.done():
            self.done.set_result(self.resp)

    def _body_updated(self, n: int) -> bool:
        """``n`` body bytes landed in the region handed out last; False if the body stops here."""
        assert self.resp is not None
        if self.got >= self.resp.length:
            self._fail(BodyError("body longer than Content-Length"))
            return False
        placed: list[memoryview] = []
        if self._bouncing and not self._place(self._last[:n], placed):
            return False
        # Hashed here, on this thread, while the bytes are still in cache (in the bounce buffer, before the next
        # read overwrites it).
        return self._landed([self._last[:n]], n)

    def _landed(self, runs: list[memoryview], n: int) -> bool:
        """``n`` body bytes are in place (``runs``, in order): hashed and counted. False if the hasher refused
        them (a piece that does not match): the body stops here."""
        if self.hasher is not None:
            try:
                for run in runs:
                    self.hasher.update(run)
            except Exception as e:  # noqa: BLE001 -- a verifier that refuses a piece: the body stops here
                self._fail(e)
                return False
        self.got += n
        if self.tally is not None:
            if self.tally.first is None:
                self.tally.first = time.perf_counter()
            self.tally.bytes += n
        return True

    def _head_updated(self, n: int, done: asyncio.Future[Response]) -> bool:
        """``n`` more bytes of the head block; once it is whole, the response parsed and the body bytes that
        came in with it placed. False while the head is incomplete, and if the response ends here."""
        self.hn += n
        end = self.head.find(b"\r\n\r\n", 0, self.hn)
        if end < 0:
            if self.hn >= MAX_HEADER:
                self._fail(BodyError("response header block too large"))
            return False
        try:
            self.resp = _parse(bytes(self.head[:end]))
        except (ValueError, IndexError) as e:
            self._fail(BodyError(f"bad response head: {e}"))
            return False
        if self.resp.status not in BODY_STATUSES:
            done.set_result(self.resp)  # the caller reports the status; the connection is dropped
            return False
        if self.resp.length > self.body.size:
            self._fail(BodyError(f"Content-Length {self.resp.length} exceeds the {self.body.size} bytes expected"))
            return False
        extra = self.hn - (end + 4)
        if extra > self.resp.length:
            self._fail(BodyError("body longer than Content-Length"))
            return False
        placed: list[memoryview] = []  # body bytes that came in with the head: placed region by region
        return self._place(self.hview[end + 4:end + 4 + extra], placed) and self._landed(placed, extra)

    def _place(self, data: memoryview, placed: list[memoryview]) -> bool:
        """Copy bytes read into the bounce buffer out to the sink's runs (before they are hashed: a sink may
        act on a verified prefix at once), each run written appended to ``placed``. False: the sink refused
        them (the request failed)."""
        pos, n = 0, len(data)
        while pos < n:
            try:
                dst = self.body.region(self.got + pos)[:n - pos]
            except Exception as e:  # noqa: BLE001 -- as in get_buffer
                self._fail(BodyError(f"body refused: {str(e)[:200]}"))
                return False
            k = len(dst)
            if not k:
                self._fail(BodyError("the sink has no room for the body"))
                return False
            dst[:] = data[pos:pos + k]
            placed.append(dst)
            pos += k
        return True

    def _fail(self, exc: Exception) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(BodyError(f"connection lost: {exc or 'closed by peer'}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _parse(head: bytes) -> Response:
    lines = head.decode("latin-1").split("\r\n")
    proto, status = lines[0].split(" ", 2)[:2]
    if not proto.startswith("HTTP/1."):
        raise ValueError(f"not HTTP/1.x: {lines[0][:40]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip()
        if name == "content-length" and headers.get(name, value) != value:
            # RFC 9112 §6.3: differing lengths are an unrecoverable error (request smuggling's favourite).
            raise ValueError("conflicting Content-Length headers")
        headers[name] = value
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ValueError("chunked bodies are not supported on the object route")
    raw = headers.get("content-length")
    if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 15):
        raise ValueError(f"bad Content-Length {raw[:20]!r}")  # not int()'s '+5', ' 5' or '5_0'
    length = int(raw) if raw is not None else -1
    if int(status) in BODY_STATUSES and length < 0:
        raise ValueError("no Content-Length")
    return Response(int(status), headers, max(length, 0))


_Key = tuple[str, str, int]  # (scheme, host, port): one pool of idle connections each


class BodyGetter:
    """A pool of keep-alive connections; ``get`` fills ``buf`` with one object's body."""

    def __init__(self, *, ssl: _ssl.SSLContext | None, per_host: int = 32, local_addr: str | None = None) -> None:
        self._ssl = ssl
        self._local_addr = (local_addr, 0) if local_addr else None
        self._idle: dict[_Key, list[_Conn]] = defaultdict(list)
        self._per_host = per_host

    async def get(self, url: str, buf: memoryview | Sink, headers: dict[str, str], timeout: float | None, *,
                  hasher: Hasher | None = None, tally: Tally | None = None) -> Response:
        """GET ``url`` into ``buf`` (one buffer, or a ``Sink`` that places the bytes); with ``hasher`` (e.g.
        ``blake3()``), every body byte is also fed to it as it arrives, so verifying costs no second pass; with
        ``tally``, every body byte that lands is counted there too."""
        sink: Sink = _Flat(buf) if isinstance(buf, memoryview) else buf
        u = urlsplit(url)
        tls = u.scheme == "https"
        host, port = u.hostname, u.port or (443 if tls else 80)
        if not host:  # getaddrinfo would take no host for loopback
            raise BodyError(f"no host in URL {url[:80]!r}")
        key: _Key = (u.scheme, host, port)
        target = u.path + (f"?{u.query}" if u.query else "")
        head = [f"GET {target} HTTP/1.1", f"Host: {u.netloc}"] + [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            for attempt in (0, 1):
                conn = self._take(key) if attempt == 0 else None
                reused = conn is not None
                try:
                    if conn is None:
                        _, conn = await loop.create_connection(_Conn, host, port, ssl=self._ssl if tls else None,
                                                               server_hostname=host if tls else None,
                                                               local_addr=self._local_addr)
                    done = conn._arm(sink, hasher, tally)  # a retry follows only a failure before any byte: the hasher is fresh
                    conn.send(request)
                    resp = await done
                    break
                except BodyError:
                    if conn is not None:
                        conn.close()
                    # A pooled connection the server closed meanwhile fails before any byte: retry once fresh.
                    if not (reused and conn is not None and conn.hn == 0):
                        raise
                except BaseException:
                    if conn is not None:
                        conn.close()
                    raise
            else:  # pragma: no cover - the fresh second attempt breaks or raises
                raise BodyError("no attempt left")
        if resp.status in BODY_STATUSES and resp.headers.get("connection", "").lower() != "close":
            self._give(key, conn)
        else:
            conn.close()
        return resp

    def _take(self, key: _Key) -> _Conn | None:
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _give(self, key: _Key, conn: _Conn) -> None:
        conn._disarm()
        idle = self._idle[key]
        if len(idle) < self._per_host:
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
