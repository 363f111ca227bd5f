"""A user-space link emulator: an asyncio TCP proxy that adds one-way delay and caps bandwidth per direction.

``tc netem`` is not available here (no kernel module on this project's VM), so the
geo bench and its tests put one of these in front of every server they want
to look "far away":

    link = LinkEmulator(0, "127.0.0.1", 8100, delay_ms=60, mbit=200)
    await link.start()            # listens on 127.0.0.1:link.port
    ...  # talk to link.url instead of http://127.0.0.1:8100
    await link.stop()

Model of one direction of one connection: bytes read from the sender are
paced by a token bucket at ``mbit`` (serialization: a chunk of n bytes leaves
n / rate after the previous one, with a small burst allowance), stamped with
the time they leave, and written to the receiver ``delay_ms`` after that
(propagation). Reading is paced, so a fast sender is slowed by TCP
backpressure, and the queue between the two stages is bounded (at least one
bandwidth-delay product, at most ``max_buffer`` bytes), so a slow receiver
stops the reading too. A request/response over an open connection therefore
costs ``2 * delay_ms`` plus ``size / rate``; a new connection pays one more
round trip first (the TCP handshake it would have paid), unless
``handshake=False``.

``by_source`` maps a peer IP (the connecting socket's source address, e.g.
127.0.2.1 for a process that binds its outgoing sockets there) to its own
``(delay_ms, mbit)``: one listening port can then play the links from several
regions to one server. Bandwidth is per connection (each TCP flow gets
``mbit``), unless ``shared=True``, where all connections of one profile and
direction share one bucket (one bottleneck link).

Faults, at run time: ``set_profile(delay_ms, mbit)`` slows (or speeds) the link, for the
connections already open too (from their next chunk on); ``stall()`` stops forwarding
anything in either direction (connections open, new ones accepted, no byte passes: a
black hole that TCP cannot tell from a slow peer) until ``resume()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["LinkEmulator", "Profile"]

_EOF = object()


@dataclass(frozen=True)
class Profile:
    delay_ms: float  # one way
    mbit: float  # per direction; <= 0 or inf: unlimited

    @property
    def rate(self) -> float:
        """Bytes per second (inf when unlimited)."""
        return self.mbit * 1e6 / 8 if self.mbit and self.mbit > 0 else float("inf")


class _Pacer:
    """A token bucket as a virtual clock: when may the next ``n`` bytes leave?"""

    def __init__(self, rate: float, burst: int, start: float = 0.0) -> None:
        self.rate = rate
        self.burst_s = burst / rate if rate != float("inf") else 0.0
        self.next_free = start

    def reserve(self, n: int, now: float) -> float:
        """Reserve ``n`` bytes of the link; returns when the last of them has left (>= now)."""
        if self.rate == float("inf"):
            self.next_free = max(self.next_free, now)
            return self.next_free
        # Idle time refills the bucket up to ``burst``: the clock may lag ``now`` by at most burst_s.
        begin = max(self.next_free, now - self.burst_s)
        self.next_free = begin + n / self.rate
        return max(self.next_free, now)


@dataclass
class LinkStats:
    connections: int = 0
    active: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    errors: int = 0
    by_profile: dict = field(default_factory=dict)  # Profile -> connections


class LinkEmulator:
    """A TCP proxy ``listen_host:listen_port`` -> ``target_host:target_port`` with delay and a bandwidth cap."""

    def __init__(self, listen_port: int, target_host: str, target_port: int, *, delay_ms: float, mbit: float,
                 listen_host: str = "127.0.0.1", by_source: Mapping[str, tuple[float, float]] | None = None,
                 shared: bool = False, handshake: bool = True, max_buffer: int = 16 << 20,
                 burst_bytes: int = 16 << 10) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target = (target_host, target_port)
        self.default = Profile(float(delay_ms), float(mbit))
        self.by_source = {ip: Profile(float(d), float(m)) for ip, (d, m) in (by_source or {}).items()}
        self.shared = shared
        self.handshake = handshake
        self.max_buffer = max_buffer
        self.burst = burst_bytes
        self.stats = LinkStats()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._shared_pacers: dict[tuple[Profile, str], _Pacer] = {}
        self._flowing = asyncio.Event()
        self._flowing.set()

    # --- faults ------------------------------------------------------------------

    def set_profile(self, delay_ms: float, mbit: float) -> None:
        """The default profile from now on, for open connections too (from their next chunk)."""
        self.default = Profile(float(delay_ms), float(mbit))

    def stall(self) -> None:
        """No byte passes, either way, until ``resume()``; connections stay open, new ones are accepted."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    # --- lifecycle ---------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is None:
            return self.listen_port
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    async def start(self) -> LinkEmulator:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port,
                                                  reuse_address=True, limit=1 << 20)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def __aenter__(self) -> LinkEmulator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def profile_for(self, peer_ip: str | None) -> Profile:
        return self.by_source.get(peer_ip or "", self.default)

    # --- one connection ------------------------------------------------------------

    def _pacer(self, prof: Profile, direction: str, start: float) -> _Pacer:
        if not self.shared:
            return _Pacer(prof.rate, self.burst, start)
        p = self._shared_pacers.get((prof, direction))
        if p is None:
            p = self._shared_pacers[(prof, direction)] = _Pacer(prof.rate, self.burst, start)
        else:
            p.next_free = max(p.next_free, start)
        return p

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        self.stats.connections += 1
        self.stats.active += 1
        peer = cwriter.get_extra_info("peername")
        prof = self.profile_for(peer[0] if peer else None)
        self.stats.by_profile[prof] = self.stats.by_profile.get(prof, 0) + 1
        twriter = None
        try:
            treader, twriter = await asyncio.open_connection(*self.target, limit=1 << 20)
            delay = prof.delay_ms / 1e3
            now = time.perf_counter()
            # A real connection would spend one round trip on the handshake before the first request byte.
            first = now + (2 * delay if self.handshake else 0.0)
            up = self._pacer(prof, "up", first)
            down = self._pacer(prof, "down", now)
            ip = peer[0] if peer else None
            await asyncio.gather(self._pump(creader, twriter, ip, up, "up"),
                                 self._pump(treader, cwriter, ip, down, "down"))
        except (OSError, asyncio.IncompleteReadError):
            self.stats.errors += 1
        except asyncio.CancelledError:
            pass
        finally:
            for w in (cwriter, twriter):
                if w is not None:
                    w.close()
            self.stats.active -= 1
            self._conns.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer_ip: str | None,
                    pacer: _Pacer, direction: str) -> None:
        prof = self.profile_for(peer_ip)
        delay = prof.delay_ms / 1e3
        rate = prof.rate
        # Small reads at low rates keep the pacing fine-grained (~2 ms of link time per read).
        read_size = 65536 if rate == float("inf") else int(min(65536, max(4096, rate * 0.002)))
        bdp = 0 if rate == float("inf") else int(rate * (delay + 0.01))
        slots = max(8, min(self.max_buffer, max(2 * bdp, 256 << 10)) // read_size)
        queue: asyncio.Queue = asyncio.Queue(maxsize=slots)  # bounded: at most slots * read_size bytes
        writer_task = asyncio.create_task(self._deliver(queue, writer, self._flowing))
        try:
            while True:
                try:
                    data = await reader.read(read_size)
                except (ConnectionError, OSError):
                    data = b""
                if not data:
                    await queue.put((time.perf_counter() + delay, _EOF))
                    break
                if (now_prof := self.profile_for(peer_ip)) != prof:  # set_profile() while this connection is open
                    prof, delay = now_prof, now_prof.delay_ms / 1e3
                    if self.shared:
                        # The new profile's own bucket. (Changing the rate of the one this connection shared
                        # would change it for every connection still keyed to the old profile: a connection
                        # opened later under that profile was paced at the other one's rate.)
                        pacer = self._pacer(prof, direction, time.perf_counter())
                    else:
                        pacer.rate = prof.rate
                        pacer.burst_s = self.burst / prof.rate if prof.rate != float("inf") else 0.0
                    read_size = 65536 if prof.rate == float("inf") else int(min(65536, max(4096, prof.rate * 0.002)))
                now = time.perf_counter()
                leave = pacer.reserve(len(data), now)
                if leave - now > 0.0005:
                    await asyncio.sleep(leave - now)
                if direction == "up":
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                await queue.put((leave + delay, data))
                if writer_task.done():
                    break
            await writer_task
        finally:
            if not writer_task.done():
                writer_task.cancel()
                with contextlib.suppress(BaseException):
                    await writer_task

    @staticmethod
    async def _deliver(queue: asyncio.Queue, writer: asyncio.StreamWriter, flowing: asyncio.Event) -> None:
        try:
            while True:
                at, data = await queue.get()  # at: when the bytes arrive at the far end (left + delay)
                await flowing.wait()  # stalled: nothing is delivered; the queue fills and the pump stops reading
                wait = at - time.perf_counter()
                if wait > 0.0002:
                    await asyncio.sleep(wait)
                if data is _EOF:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return
