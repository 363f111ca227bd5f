"""An edge's view of the live edges: every region's members, and the hash ring of its own region.

An edge registers itself under ``nodes/edge/{region}/{node_id}`` with a lease
and watches ``nodes/edge/`` (all regions: a miss may be filled from another
region's edge). The watch's snapshot replaces the view; puts and deletes update
it; a node whose lease expires (it died, or lost the registry for longer than
its TTL) arrives as a delete.

Two things keep it alive through a registry outage:

- the watch is retried with backoff (``kdn.registry.follow``); meanwhile the edge keeps serving with the
  last view it had (a stale ring costs at worst an extra hop or a refetch,
  never a wrong byte: objects are content-addressed and verified);
- when its own lease is lost (``lease.done``), the edge registers again with a
  new lease, so it comes back into everyone's ring when the registry does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import replace

from kdn.format.address import Address
from kdn.errors import InvalidInput, KDNError, RegistryError
from kdn.registry import Event, NodeLease, NodeRecord, Registry, follow
from kdn.registry.follow import stop_tasks
from kdn.ring import Ring

__all__ = ["EDGE_PREFIX", "Membership"]

log = logging.getLogger(__name__)

EDGE_PREFIX = "nodes/edge/"
ADMISSION_RECHECK_S = 30.0  # how often admissions are checked again for expiry (--require-admission)


class Membership:
    """The live edges as this edge sees them; ``start()`` it, ``close()`` it.

    ``nodes`` maps node id to record over all regions (node ids are expected to
    be unique across regions); ``ring`` is a ``Ring`` of the live edges of
    ``me.region``, replaced (never mutated) when that set changes, so a caller
    holding it keeps a consistent view.
    """

    def __init__(
        self,
        registry: Registry,
        me: NodeRecord,
        *,
        ttl: float = 10.0,
        vnodes: int = 320,
        backoff: tuple[float, float] = (0.1, 5.0),
        admitters=None,
        on_unadmitted=None,
        recheck_s: float = ADMISSION_RECHECK_S,
    ) -> None:
        if not isinstance(me, NodeRecord) or me.role != "edge":
            raise InvalidInput(f"Membership is for edge nodes, got {me!r}")
        self.registry = registry
        self.me = me
        self.ttl = ttl
        self.vnodes = vnodes
        self.nodes: dict[str, NodeRecord] = {}
        self.ring = Ring(vnodes=vnodes)
        self.lease: NodeLease | None = None
        self.revision = 0  # registry revision of the view
        self.generation = 0  # changes of the view (a reader recomputes what it derives from it when this moves)
        self.reregistrations = 0
        self._backoff = backoff
        self._by_key: dict[str, NodeRecord] = {}  # "nodes/edge/{region}/{id}" -> record
        self._local: dict[str, NodeRecord] = {}  # my region: id -> record
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # kdn.registry.signing.Verifier of the operator keys (--require-admission): another node's record counts only
        # with an admission one of them signed that names it (kdn.registry.signing.unadmitted); this edge's own always.
        self.admitters = admitters
        self.unadmitted = 0  # node records left out for that (tests)
        self.on_unadmitted = on_unadmitted  # the edge's counter
        self.recheck_s = recheck_s  # admissions are checked again this often (they expire)
        self._warned: set[str] = set()

    # lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Register, read the first snapshot, then follow changes in the background.

        Raises ``RegistryError`` if the registry cannot be reached now: an edge
        that never joined should fail to start, not serve alone.
        """
        self.lease = await self.registry.register_node(self.me, self.ttl)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        watch = loop.create_task(follow(self.registry, EDGE_PREFIX, self._apply, what=f"edge {self.me.node_id} membership",
                                        backoff=self._backoff, ready=ready),
                                 name=f"kdn-membership-watch-{self.me.node_id}")
        try:
            await ready  # the first snapshot is applied, or the first failure raised
        except BaseException:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            with contextlib.suppress(RegistryError):
                await self.lease.close()
            raise
        self._tasks = [
            watch,
            loop.create_task(self._stay_registered(), name=f"kdn-membership-lease-{self.me.node_id}"),
        ]
        if self.admitters is not None:
            self._tasks.append(loop.create_task(self._recheck_admissions(),
                                                name=f"kdn-membership-admissions-{self.me.node_id}"))

    async def close(self) -> None:
        """Stop following and revoke the lease: the others drop this edge at once."""
        self._closing = True
        await self._stop_tasks()
        if self.lease is not None:
            try:
                await self.lease.close()
            except RegistryError as e:
                # Unreachable registry: the key goes when the lease's TTL runs out.
                log.warning(
                    "edge %s: could not revoke its lease on close (%s); it expires in %.0fs", self.me.node_id, e, self.ttl
                )

    async def __aenter__(self) -> Membership:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _kill(self) -> None:
        """Stop everything without revoking: what a SIGKILLed edge looks like to the others (tests)."""
        self._closing = True
        if self.lease is not None:
            self.lease._stop_keepalive()
        await self._stop_tasks()

    async def _stop_tasks(self, timeout: float = 5.0) -> None:
        # Bounded: cancelling a watch makes the registry client cancel it on
        # the server, and a wedged client must not hang the edge's shutdown.
        await stop_tasks(self._tasks, what=f"edge {self.me.node_id} membership", timeout=timeout)
        self._tasks = []

    # queries ----------------------------------------------------------------

    def owner(self, address: Address) -> NodeRecord | None:
        """The edge of my region that owns ``address``; None when the region has none."""
        node_id = self.ring.owner(address)
        return None if node_id is None else self._local[node_id]

    def preference(self, address: Address, n: int | None = None) -> list[NodeRecord]:
        """Edges of my region in the order to try for ``address``: owner first."""
        return [self._local[i] for i in self.ring.preference(address, n)]

    def is_me(self, node_id: str) -> bool:
        return node_id == self.me.node_id

    def peers(self, region: str | None = None) -> list[NodeRecord]:
        """Live edges other than me, of all regions or one, sorted by (region, node id)."""
        return [
            r
            for r in _sorted(self._by_key.values())
            if (region is None or r.region == region) and not (r.region == self.me.region and self.is_me(r.node_id))
        ]

    def regions(self) -> dict[str, list[NodeRecord]]:
        """Live edges by region (me included while my key is live), sorted."""
        out: dict[str, list[NodeRecord]] = {}
        for r in _sorted(self._by_key.values()):
            out.setdefault(r.region, []).append(r)
        return out

    async def wait_for(self, predicate: Callable[[Membership], bool], timeout: float | None = None) -> None:
        """Return once ``predicate(self)`` holds, re-checking after each change; TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                # No await between the check and taking the event: a change
                # cannot slip in between (one event loop, _notify swaps events).
                await self._changed.wait()

    async def advertise(self, extra: dict[str, object]) -> None:
        """Rewrite this edge's node record with ``extra``'s fields added (under its lease; the next
        re-registration carries them too). Raises ``RegistryError`` when the registry does not take it."""
        self.me = replace(self.me, extra={**self.me.extra, **extra})
        if self.lease is not None and not self.lease.done.is_set():
            await self.registry.update_node(self.me, self.lease)

    # background -------------------------------------------------------------

    async def _stay_registered(self) -> None:
        """Re-register whenever the lease is lost (expired behind our back, or the registry was down past the TTL)."""
        low, high = self._backoff
        while True:
            old = self.lease
            assert old is not None
            await old.done.wait()
            if self._closing:
                return
            log.warning("edge %s: lease %x lost; registering again", self.me.node_id, old.lease_id)
            delay = low
            while True:
                try:
                    self.lease = await self.registry.register_node(self.me, self.ttl)
                    break
                except RegistryError as e:
                    wait = delay * random.uniform(0.5, 1.0)
                    log.warning("edge %s: re-registering failed (%s); retrying in %.2fs", self.me.node_id, e, wait)
                    await asyncio.sleep(wait)
                    delay = min(delay * 2, high)
            self.reregistrations += 1
            log.warning("edge %s: registered again with lease %x", self.me.node_id, self.lease.lease_id)
            # Tidy the old lease if the server still has it. Our key now belongs
            # to the new lease (the put above rebound it), so revoking the old
            # one deletes nothing.
            with contextlib.suppress(RegistryError):
                await old.close()
            self._notify()

    # the view ---------------------------------------------------------------

    def _apply(self, ev: Event) -> None:
        if ev.kind == "snapshot":
            self._by_key = {k: rec for k, v in ev.items.items() if (rec := self._decode(k, v)) is not None}
        elif ev.key is not None:
            rec = self._decode(ev.key, ev.value) if ev.kind == "put" else None
            if rec is None:
                self._by_key.pop(ev.key, None)
            else:
                self._by_key[ev.key] = rec
        self.revision = max(self.revision, ev.revision)
        self._rebuild()

    def _rebuild(self) -> None:
        self.generation += 1
        self.nodes = {r.node_id: r for r in _sorted(self._by_key.values())}
        local = {r.node_id: r for r in self._by_key.values() if r.region == self.me.region}
        if local.keys() != self._local.keys():
            self.ring = Ring(sorted(local), vnodes=self.vnodes)
        self._local = local
        self._notify()

    def _decode(self, key: str, value: bytes | None) -> NodeRecord | None:
        parts = key.split("/")
        if len(parts) != 4 or parts[0] != "nodes" or parts[1] != "edge" or value is None:
            return None
        try:
            rec = NodeRecord.unpack(value)
        except (KDNError, ValueError, TypeError) as e:
            log.warning("edge %s: ignoring unreadable node record %r: %s", self.me.node_id, key, e)
            return None
        if (rec.role, rec.region, rec.node_id) != ("edge", parts[2], parts[3]):
            log.warning("edge %s: ignoring node record %r that names %s/%s", self.me.node_id, key, rec.region, rec.node_id)
            return None
        if self.admitters is not None and not self._is_me(rec):
            from kdn.registry.signing import unadmitted

            why = unadmitted(rec, self.admitters)
            if why is not None:
                self.unadmitted += 1
                if self.on_unadmitted is not None:
                    self.on_unadmitted()
                if key not in self._warned and len(self._warned) < 1024:
                    self._warned.add(key)
                    log.warning("edge %s: leaving out node %s at %s: %s", self.me.node_id, key, rec.url[:80], why)
                return None
        return rec

    def _is_me(self, rec: NodeRecord) -> bool:
        """This edge's own record (its whole identity: another region's record under my id is not me)."""
        return (rec.role, rec.region, rec.node_id, rec.url) == (self.me.role, self.me.region, self.me.node_id,
                                                               self.me.url)

    async def _recheck_admissions(self) -> None:
        """Admissions expire while their nodes stay up (a lease's keepalive rewrites nothing): drop those."""
        from kdn.registry.signing import unadmitted

        while True:
            await asyncio.sleep(self.recheck_s)
            if hasattr(self.admitters, "refresh"):  # an operator's revocation list (kdn.registry.signing.Admitters)
                self.admitters.refresh()
            expired = [k for k, r in self._by_key.items()
                       if not self._is_me(r) and unadmitted(r, self.admitters) is not None]
            if expired:
                for k in expired:
                    log.warning("edge %s: leaving out node %s: its admission is no longer valid", self.me.node_id, k)
                    del self._by_key[k]
                    self.unadmitted += 1
                    if self.on_unadmitted is not None:
                        self.on_unadmitted()
                self._rebuild()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _sorted(records: Iterable[NodeRecord]) -> list[NodeRecord]:
    return sorted(records, key=lambda r: (r.region, r.node_id))
