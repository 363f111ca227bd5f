"""The object-body GET path against real sockets that answer well, badly, or not at all."""

from __future__ import annotations

import asyncio

import pytest

from kdn.wire.bodyget import BodyError, BodyGetter, Tally

BODY = bytes(range(256)) * 4000  # 1 MB


async def serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def good(body: bytes = BODY, extra_headers: bytes = b""):
    connections = {"n": 0, "requests": 0}

    async def handler(reader, writer):
        connections["n"] += 1
        try:
            while True:
                await read_request(reader)
                connections["requests"] += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-KDN-Source: memory\r\n%s\r\n"
                             % (len(body), extra_headers))
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return handler, connections


async def test_reads_into_the_buffer_and_reuses_the_connection():
    handler, stats = good()
    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        for _ in range(3):
            buf = bytearray(len(BODY))
            r = await g.get(url + "/v1/objects/x?encoding=zstd", memoryview(buf), {"Authorization": "Bearer t"}, 5)
            assert r.status == 200 and r.headers["x-kdn-source"] == "memory" and bytes(buf) == BODY
        assert stats["n"] == 1 and stats["requests"] == 3
    finally:
        g.close()
        server.close()


@pytest.mark.parametrize("response,match", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
    (b"HTTP/1.1 200 OK\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", "exceeds"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "connection lost"),
    (b"garbage\r\n\r\n", "bad response"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 20000, "too large"),
])
async def test_bad_responses_raise_body_error(response, match):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(response)
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        with pytest.raises(BodyError, match=match):
            await g.get(url + "/o", memoryview(bytearray(1000)), {}, 5)
    finally:
        g.close()
        server.close()


async def test_non_200_status_is_returned_not_pooled():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        r = await g.get(url + "/o", memoryview(bytearray(10)), {}, 5)
        assert r.status == 404 and not any(g._idle.values())
    finally:
        g.close()
        server.close()


async def test_a_pooled_connection_closed_by_the_server_is_retried_fresh():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
        await writer.drain()
        writer.close()  # no keep-alive on the server side

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        for _ in range(3):
            buf = bytearray(3)
            await g.get(url + "/o", memoryview(buf), {}, 5)
            assert bytes(buf) == b"abc"
    finally:
        g.close()
        server.close()


async def test_timeout_closes_the_connection():
    async def handler(reader, writer):
        await read_request(reader)
        await asyncio.sleep(5)

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        with pytest.raises(TimeoutError):
            await g.get(url + "/o", memoryview(bytearray(3)), {}, 0.2)
        assert not any(g._idle.values())
    finally:
        g.close()
        server.close()


class Runs:
    """A sink of small runs over one buffer, in a shuffled order (as kdn.wire.scatter's per-head runs are)."""

    def __init__(self, size: int, run: int) -> None:
        import random

        self.size, self.run = size, run
        self.mem = bytearray(-(-size // run) * run)  # whole runs: any run may land in any slot
        order = list(range(0, size, run))
        random.Random(3).shuffle(order)
        self.where = dict(zip(range(0, size, run), order))  # body offset of a run -> where it lands in mem
        self.asked = 0

    def region(self, offset: int) -> memoryview:
        self.asked += 1
        start = offset // self.run * self.run
        dst = self.where[start]
        return memoryview(self.mem)[dst + offset - start:dst + min(self.run, self.size - start)]

    def body(self) -> bytes:
        return b"".join(bytes(self.mem[self.where[s]:self.where[s] + min(self.run, self.size - s)])
                        for s in range(0, self.size, self.run))


@pytest.mark.parametrize("run", [7, 4096, 32 << 10, 300 << 10])
async def test_a_sink_of_small_runs_gets_every_byte_in_its_place_and_the_hasher_all_in_order(run, monkeypatch):
    """Runs smaller than BOUNCE_BELOW are read through one bounce buffer and copied out; larger ones directly."""
    from blake3 import blake3

    from kdn.wire import bodyget

    copied = []
    place = bodyget._Conn._place
    monkeypatch.setattr(bodyget._Conn, "_place", lambda self, data, placed: copied.append(len(data)) or place(self, data, placed))
    handler, _ = good()
    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        sink, h = Runs(len(BODY), run), blake3()
        r = await g.get(url + "/o", sink, {}, 5, hasher=h)
        assert r.status == 200 and sink.body() == BODY and h.digest() == blake3(BODY).digest()
        if run < bodyget.BOUNCE_BELOW:  # read through the bounce buffer: far fewer reads than runs
            assert sum(copied) >= len(BODY) - bodyget.BOUNCE_BELOW and len(copied) < len(BODY) / run / 2
        else:  # large runs are read straight into place (a short remainder of one may take the bounce)
            assert sum(copied) < len(BODY)
        copied.clear()
        flat = bytearray(len(BODY))
        await g.get(url + "/o", memoryview(flat), {}, 5)
        # one buffer: never through the bounce (only the body bytes that came in with the head are copied out)
        assert flat == BODY and sum(copied) <= bodyget.MAX_HEADER
    finally:
        g.close()
        server.close()


async def test_a_small_run_sink_that_refuses_mid_body_fails_the_request():
    """The refusal comes while bytes read into the bounce buffer are copied out (``_place``), and fails the
    request with the sink's reason."""
    class Refusing(Runs):
        placing = False

        def region(self, offset):
            if offset >= 500_000:
                raise ValueError(f"no place for these bytes (while copying out: {Refusing.placing})")
            return super().region(offset)

    handler, _ = good()
    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        from kdn.wire import bodyget

        place = bodyget._Conn._place

        def placing(self, data, placed):
            Refusing.placing = True
            try:
                return place(self, data, placed)
            finally:
                Refusing.placing = False

        bodyget._Conn._place = placing
        try:
            with pytest.raises(BodyError, match=r"body refused: no place .*while copying out: True"):
                await g.get(url + "/o", Refusing(len(BODY), 4096), {}, 5)
        finally:
            bodyget._Conn._place = place
    finally:
        g.close()
        server.close()


async def test_a_tally_counts_its_own_requests_body_bytes_even_of_one_given_up():
    """What a load cut short at its deadline did move (kdn.planner learns the link's speed from it), and
    only that load's: another request's bytes on the same getter count in its own tally."""
    async def handler(reader, writer):
        while True:
            path = (await read_request(reader)).split(b" ")[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY))
            writer.write(BODY if path == b"/whole" else BODY[:1000])  # /part: 1,000 bytes, then nothing
            await writer.drain()
            if path != b"/whole":
                await asyncio.sleep(5)

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    mine, other = Tally(), Tally()
    try:
        await g.get(url + "/whole", memoryview(bytearray(len(BODY))), {}, 5, tally=mine)
        assert mine.bytes == len(BODY)
        part = asyncio.ensure_future(g.get(url + "/part", memoryview(bytearray(len(BODY))), {}, 0.5, tally=mine))
        await g.get(url + "/whole", memoryview(bytearray(len(BODY))), {}, 5, tally=other)  # meanwhile, another's
        with pytest.raises(TimeoutError):
            await part
        assert mine.bytes == len(BODY) + 1000  # the head's bytes are not counted, the body's are
        assert other.bytes == len(BODY)
        await g.get(url + "/whole", memoryview(bytearray(len(BODY))), {}, 5)  # no tally: nothing counted
        assert (mine.bytes, other.bytes) == (len(BODY) + 1000, len(BODY))
    finally:
        g.close()
        server.close()


@pytest.mark.parametrize("head", [
    b"Content-Length: 1000\r\nContent-Length: 1001\r\n",  # two lengths: which body is this?
    b"Content-Length: +1000\r\n",  # int() would take these
    b"Content-Length: 1_000\r\n",
])
async def test_ambiguous_content_lengths_are_refused(head):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n" + b"x" * 1000)
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        with pytest.raises(BodyError, match="Content-Length"):
            await g.get(url + "/v1/objects/x", memoryview(bytearray(1001)), {}, 5)
    finally:
        g.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("late", [b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nxyz", b"x"])
async def test_a_pooled_connection_holding_unsolicited_bytes_is_not_reused(late):
    """A server (or a path) that sends bytes while the connection sits idle in the pool could once have them
    read as the head of the next response: a forged answer to a request not yet sent."""
    sent_late = asyncio.Event()
    connections = {"n": 0}

    async def handler(reader, writer):
        connections["n"] += 1
        try:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
            await writer.drain()
            if connections["n"] == 1:
                await asyncio.sleep(0.05)
                writer.write(late)  # unasked, while the client holds the connection idle
                await writer.drain()
                sent_late.set()
            while True:
                await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server, url = await serve(handler)
    g = BodyGetter(ssl=None)
    try:
        buf = bytearray(3)
        await g.get(url + "/o", memoryview(buf), {}, 5)
        await asyncio.wait_for(sent_late.wait(), 5)
        await asyncio.sleep(0.05)
        buf = bytearray(3)
        r = await g.get(url + "/o", memoryview(buf), {}, 5)
        assert r.status == 200 and bytes(buf) == b"abc"  # the real answer, not the planted "xyz"
        assert connections["n"] == 2  # the dirty connection was dropped, a fresh one used
    finally:
        g.close()
        server.close()


async def test_a_url_without_a_host_is_refused_not_sent_to_loopback():
    # getaddrinfo takes a missing host for loopback: "http://:PORT/..." reached a local server, while
    # the client's aiohttp session (registry reads) refused the same source URL as invalid.
    handler, stats = good()
    server, url = await serve(handler)
    port = url.rsplit(":", 1)[1]
    g = BodyGetter(ssl=None)
    try:
        with pytest.raises(BodyError, match="no host"):
            await g.get(f"http://:{port}/o", memoryview(bytearray(len(BODY))), {}, 5)
        assert stats["n"] == 0
    finally:
        g.close()
        server.close()
