"""Follow a registry prefix for a process's lifetime: the one watch loop every view uses.

``Registry.watch(prefix)`` already lists at a revision, watches from the next
one and lists again after a compaction. What every consumer (membership,
policies, the prefetch index, the origins list) also needs is one answer to
"the watch failed": keep serving with what is known, and retry with a backoff
that grows from ``low`` to ``high`` until a handler succeeds again. That is
``follow``.

    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(follow(registry, "nodes/edge/", on_event, what="membership", ready=ready))
    await ready  # the first snapshot is applied (or the first failure raised)
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from kdn.errors import RegistryUnavailable
from kdn.registry.base import Event, Watchable

log = logging.getLogger(__name__)


async def follow(registry: Watchable, prefix: str, on_event: Callable[[Event], Awaitable[None] | None], *, what: str,
                 backoff: tuple[float, float] = (0.5, 10.0), ready: asyncio.Future[None] | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
    """Hand every event under ``prefix`` to ``on_event`` until cancelled; retry a failed watch with backoff.

    ``ready``, when given, is resolved once the first snapshot has been handled, or
    gets the first failure (so a caller that must not start without a view can fail).
    The backoff resets when a handler succeeds on a snapshot: the registry answers again.
    ``on_error`` is told each failure (counters, a view's "stale" flag).
    """
    low, high = backoff
    delay = low
    while True:
        try:
            async for ev in registry.watch(prefix):
                done = on_event(ev)
                if done is not None:
                    await done
                if ev.kind == "snapshot":
                    delay = low
                    if ready is not None and not ready.done():
                        ready.set_result(None)
            if getattr(registry, "_closed", False):  # closed under us: nothing left to follow
                if ready is not None and not ready.done():
                    ready.set_exception(RegistryUnavailable(f"the registry closed the {what} watch before its snapshot"))
                return
            problem = "the watch ended"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- a view must outlive any one failure; it re-lists
            if ready is not None and not ready.done():
                ready.set_exception(e)
                return
            problem = f"{type(e).__name__}: {e}"
        if on_error is not None:
            on_error(problem)
        wait = delay * random.uniform(0.5, 1.0)  # jitter: many followers must not retry in step
        log.warning("%s watch on %s failed (%s); serving with what is known, retrying in %.2f s",
                    what, prefix, problem, wait)
        await asyncio.sleep(wait)
        delay = min(delay * 2, high)


async def stop_tasks(tasks: list[asyncio.Task[None]], *, what: str, timeout: float = 5.0) -> None:
    """Cancel ``tasks`` (followers and their kin) and wait for them, at most ``timeout`` seconds.

    Bounded because a cancellation can be lost below us: a cancelled follower was seen
    still watching (in about one edge teardown in 15, on etcd), and the unbounded wait for
    it hung the whole shutdown. The likely path, not proven: aetcd creates a watch inside
    ``asyncio.wait_for``, which on Python 3.11 returns a result that arrives together with a
    cancel and drops the cancel. What is left is named in the log and ends when the
    registry closes under it (``follow`` returns then).
    """
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    if pending:
        log.warning("%d %s task(s) still running %.0f s after being cancelled: %s", len(pending), what, timeout,
                    ", ".join(sorted(t.get_name() for t in pending)))
