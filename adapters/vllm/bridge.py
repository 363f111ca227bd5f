"""One asyncio loop on a daemon thread, owned by a connector, for a synchronous engine to call into.

vLLM calls its connector from plain threads (the scheduler loop, the model
runner); KDN's fetch client and registry are asyncio. Each connector instance
owns one ``LoopThread``: coroutines are submitted from the engine's thread and
their ``concurrent.futures.Future`` is waited on with a deadline, so a stuck
network call costs the engine at most that deadline. ``close()`` cancels what
is still running, closes the loop's resources, and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the future resolves with its result or exception."""
        if self._closed:
            raise RuntimeError("the KDN connector's loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def run(self, coro: Awaitable[T], timeout: float) -> T:
        """Run ``coro`` and wait for it; past ``timeout`` it is cancelled and ``TimeoutError`` raised."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout:g} s") from None

    def close(self, cleanup: Callable[[], Awaitable[Any]] | None = None, timeout: float = 5.0) -> None:
        """Run ``cleanup`` (closing sessions, registries), cancel every other task, stop and join."""
        if self._closed:
            return
        self._closed = True

        async def _shutdown() -> None:
            if cleanup is not None:
                try:
                    await asyncio.wait_for(cleanup(), timeout)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 -- shutting down: nothing to report to
                    pass
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout + 2)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
