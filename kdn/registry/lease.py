"""Node leases: ``NodeLease`` keeps a node's registry key alive (refreshed every ``ttl/3``, revoked on close),
on the grant, refresh and revoke primitives of a registry (``KVRegistry``, ``kdn.registry.base``); and
``bounded``, how a registry's shutdown waits for a call that may never end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kdn.errors import RegistryError, RegistryUnavailable

log = logging.getLogger(__name__)


async def bounded(coro: Awaitable[object], seconds: float, what: str) -> None:
    """Run ``coro`` for at most ``seconds``; past that, cancel it and move on without waiting.

    Shutdown must end: ``asyncio.wait_for`` waits for the cancelled task to finish, and a gRPC
    call stuck inside aetcd (a watch cancel, seen in CI) may never finish.
    """
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        log.warning("%s took over %.0f s; abandoned", what, seconds)
    elif not task.cancelled() and task.exception() is not None:
        log.debug("%s failed: %s", what, task.exception())


class NodeLease:
    """A lease that keeps a node's key alive, like etcd's ``concurrency.Session``.

    A background task refreshes the lease every ``ttl/3``. ``done`` is set when
    the lease is lost (the registry says it expired, or refused its refreshes
    for longer than its TTL) or closed; an unreachable registry is waited out.
    ``close()`` revokes it, so the node's key disappears at once rather than
    after the TTL.
    """

    def __init__(
        self,
        lease_id: int,
        ttl: float,
        refresh: Callable[[int], Awaitable[bool]],
        revoke: Callable[[int], Awaitable[None]],
    ) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self.done = asyncio.Event()
        self._refresh = refresh
        self._revoke = revoke
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._keepalive(), name=f"kdn-lease-{lease_id:x}")

    async def _keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ttl
        try:
            while True:
                await asyncio.sleep(self.ttl / 3)
                sent = loop.time()
                try:
                    alive = await self._refresh(self.lease_id)
                except RegistryUnavailable:
                    # Keep trying, past the TTL too: whether the lease outlived the wait is the registry's
                    # to say when it answers (alive, or TTL 0: done). etcd extends every lease by its
                    # whole TTL when a new leader takes over (and when it restarts), so a lease that no
                    # member could refresh during an election is alive after it. Giving up at the TTL,
                    # as this loop did, stopped the one refresh that would have kept it: with the leader
                    # frozen, the extended leases expired on the new leader before the edges' new
                    # registrations landed, and their keys left every ring (0.52 s, 1 run in 2); with it
                    # killed, every edge registered again for nothing (bench/faults.py etcd_member_stopped,
                    # etcd_leader_killed_leases).
                    continue
                except RegistryError:
                    # Refused, or failing otherwise: keep trying while the lease may be alive on the
                    # server; past its TTL the node must know it is out (and register, which says why).
                    if loop.time() >= deadline:
                        return
                    continue
                if not alive:
                    return
                deadline = sent + self.ttl
        finally:
            self.done.set()

    def _stop_keepalive(self) -> None:
        """Stop refreshing without revoking: what a killed node looks like (tests)."""
        self._task.cancel()

    async def close(self) -> None:
        """Stop refreshing and revoke: the node's key is gone when this returns."""
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        await asyncio.wait([self._task])  # does not re-raise the task's CancelledError
        try:
            await self._revoke(self.lease_id)
        finally:
            self.done.set()

    async def __aenter__(self) -> NodeLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
