"""Single-flight: concurrent requests for the same key share one fill.

The first caller starts the fill as its own task; later callers await the same
task through ``asyncio.shield``, so a caller that is cancelled (its client hung
up) stops waiting without cancelling the fill for everyone else. The entry is
removed when the fill finishes, success or failure: a failed fill is retried
by the next request, never cached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._calls: dict[Hashable, asyncio.Task[T]] = {}
        self.started = 0  # fills actually run (the rest joined one in flight)
        self.joined = 0

    def __len__(self) -> int:
        """Fills in flight now."""
        return len(self._calls)

    def in_flight(self, key: Hashable) -> bool:
        return key in self._calls

    async def do(self, key: Hashable, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        task = self._calls.get(key)
        if task is None:
            self.started += 1
            task = asyncio.create_task(fn(), name=f"fill-{str(key)[:24]}")
            self._calls[key] = task
            # Removed by the task's own completion, not by the first caller, which
            # may have been cancelled long before the fill ends.
            def forget(t: asyncio.Task[T], k: Hashable = key) -> None:
                if self._calls.get(k) is t:
                    del self._calls[k]

            task.add_done_callback(forget)
        else:
            self.joined += 1
        return await asyncio.shield(task)

    async def close(self) -> None:
        tasks = list(self._calls.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
