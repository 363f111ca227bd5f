"""One engine connection: frames in, each request run as a task of its own and answered when done (in any
order, by ``id``), its leases ended with it.

Bad input never takes the host down and rarely the connection: a frame that is not a map, an unknown op or a
bad field is answered with ``bad-request`` and the next frame is read. Only a frame over ``MAX_MESSAGE`` ends
the connection (after its refusal): its bytes are not read, so what follows is not framed. At most
``MAX_IN_FLIGHT`` requests run at once per connection; past that a request is refused, not queued.

When the connection ends (a close, a crash, ``kill -9``, or the host stopping), its requests still running
are cancelled and waited for, and only then are its leases handed back: a lease request cancelled after it
pinned has put its pin in the table already (``Ops.lease``), so nothing it pinned outlives the connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kdn.host.leases import Leases
from kdn.host.ops import Ops
from kdn.wire.host import HostError, Oversize, pack, read_frame, refusal, unpack
from kdn.host.store import HostStore

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64


class Session:
    def __init__(self, ops: Ops, store: HostStore, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.ops, self.reader, self.writer = ops, reader, writer
        self.leases = Leases(store)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sending = asyncio.Lock()  # one frame written (and drained) at a time

    async def run(self) -> None:
        """Serve the connection until it ends; then end its requests and leases."""
        try:
            while (frame := await self._frame()) is not None:
                try:
                    request = unpack(frame)
                except HostError as e:  # framed, so the next frame is read as usual
                    await self._send(refusal(None, e))
                    continue
                rid = request.get("id")
                if len(self._tasks) >= MAX_IN_FLIGHT:
                    await self._send(refusal(rid, HostError("too-many", f"{MAX_IN_FLIGHT} requests in flight on "
                                                                       "this connection: wait for answers")))
                    continue
                task = asyncio.create_task(self._one(rid, request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await self._end()

    async def _frame(self) -> bytes | None:
        """The next frame; None: the connection is over (closed, cut, or an oversize frame refused)."""
        try:
            return await read_frame(self.reader)
        except Oversize as e:
            await self._send(refusal(None, e))
            return None
        except (asyncio.IncompleteReadError, ConnectionError):  # cut mid-frame: the engine went away
            return None

    async def _one(self, rid: object, request: dict[str, Any]) -> None:
        try:
            if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
                rid = None
                raise HostError("bad-request", "id must be an integer")
            answer = {"id": rid, **await self.ops.answer(self.leases, request)}
        except HostError as e:
            answer = refusal(rid, e)
        except Exception as e:  # a bug, not the caller's fault: said, logged with its stack, never silent
            log.exception("host tier: %s request failed", str(request.get("op"))[:24])
            answer = refusal(rid, HostError("unavailable", f"internal error ({type(e).__name__})"))
        await self._send(answer)

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            frame = pack(message)
        except HostError as e:
            frame = pack(refusal(message.get("id"), e))
        async with self._sending:
            try:
                self.writer.write(frame)
                await self.writer.drain()
            except ConnectionError:
                pass  # the engine went away: the read loop sees it next and ends the session

    async def _end(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.leases.close()  # after the tasks: none of them can pin anything now
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass  # reset by a dead engine: closed all the same
