"""The host tier follows its region's operator policies (``kdn host serve --region R``): a push to R, or a warm
of R, fills its manifest's objects into the segment ahead of the engines; a pin of R keeps them from eviction;
a scheduled pin, warm or push holds on its schedule, as on the region's edges.

None of the following is the host's own: the edge's ``PolicyEngine`` (edge/policies.py) watches ``policies/``
and ``manifests/``, decides which policies hold here and when (signatures with ``--operator-keys``, schedules
and their leads, warm dedup and cancellation) and starts each warm or push run. The host hands it two things:

- ``Pins``, where the engine's rules land: their pinned addresses become the store's pin set
  (``HostStore.set_pins``: kept from eviction, bounded by the budget). TTL and quota rules are an edge tier's
  (its entries expire, its namespaces are capped); the host's budget is one cache for its engines, and takes
  neither.
- ``PolicyWarm``, the warm callback: each object through the host's own fill path (``Filler``: verified once,
  its block reserved within the budget), in the encoding engines lease first, at a push's rate.

Read-only: the host opens the registry without a lease and writes nothing to it. A registry that cannot be
reached makes the watches retry with backoff; the host serves its engines meanwhile with what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kdn.client.hosted import PREFERRED
from kdn.edge.policies import PolicyEngine
from kdn.edge.policy_rules import Rules
from kdn.edge.policy_warms import ASSUMED_BPS
from kdn.errors import DigestMismatch, SourceError
from kdn.format.address import Address
from kdn.host.config import HostConfig
from kdn.host.fill import Absent, Filler
from kdn.host.store import HostStore, NoRoom

if TYPE_CHECKING:  # pragma: no cover
    from kdn.client.client import KDNClient
    from kdn.registry.base import KVRegistry

log = logging.getLogger(__name__)

WARM_FILLS = 4  # fills one policy run keeps going (as the warm op's: each is one fetch from the edges)


class Pins:
    """The engine's rules as the host store takes them (``kdn.edge.policies.Ruled``): the pinned addresses."""

    def __init__(self, store: HostStore) -> None:
        self.store = store

    def apply_policy(self, fn: Rules) -> None:
        self.store.set_pins(fn.pinned)

    def set_quotas(self, quotas: dict[str, int]) -> None:
        """Not applied: a quota caps a namespace in an edge's tiers; the host's budget is its engines' alone."""


class PolicyWarm:
    """The engine's ``warm(addresses, namespace, rate=, policy=)``: fill each object not held yet, through the
    host's fills, in the first of ``PREFERRED`` (what engines lease first) that its signed record has. An object
    that cannot be had is an outcome, not a failure of the run: a miss later, served by the edges."""

    def __init__(self, filler: Filler, store: HostStore) -> None:
        self.filler, self.store = filler, store
        self.outcomes: Counter[str] = Counter()  # objects of every run: filled, held, absent, no-room, failed

    async def __call__(self, addresses: list[Address], namespace: str, *, rate: int | None = None,
                       policy: str | None = None) -> None:
        todo, t0, started = iter(addresses), time.monotonic(), 0
        seen: Counter[str] = Counter()

        async def pace(size: int) -> None:
            # A push's rate: a fill starts once the bytes started before it fit the rate (the edge's pacing).
            nonlocal started
            if rate:
                wait, started = started / rate - (time.monotonic() - t0), started + size
                if wait > 0:
                    await asyncio.sleep(wait)

        async def worker() -> None:
            for address in todo:
                outcome = await self._one(address, pace)
                seen[outcome] += 1
                self.outcomes[outcome] += 1

        async with asyncio.TaskGroup() as group:  # (a worker's bug, or a cancel, stops them all)
            for _ in range(WARM_FILLS):
                group.create_task(worker())
        log.info("%s of %d objects of %s into the host tier: %s", policy or "warm", len(addresses), namespace,
                 ", ".join(f"{n} {k}" for k, n in sorted(seen.items())))

    async def _one(self, address: Address, pace: Callable[[int], Awaitable[None]]) -> str:
        if self.store.encodings(address):
            return "held"  # in some encoding already: an engine leases what is held (kdn.client.hosted)
        try:
            rec = await self.filler.record(address)
        except SourceError:
            return "failed"
        enc = next((e for e in PREFERRED if e in rec.encodings), None) if rec is not None else None
        if rec is None or enc is None:
            return "absent"
        key = (address, enc)
        await pace(rec.encodings[enc].size)
        try:
            await self.filler.fill(key, rec)
        except NoRoom:
            return "no-room"  # (a pinned one is logged and counted by the store)
        except Absent:
            return "absent"
        except (SourceError, DigestMismatch):
            return "failed"
        return "filled"


class HostPolicies:
    """The policies of ``config.region`` followed for one host tier: ``await HostPolicies.start(...)``, then
    ``await close()``. ``engine`` is the edge's engine (its ``stats``, ``active``, ``clock`` for tests)."""

    def __init__(self, engine: PolicyEngine, registry: KVRegistry, warm: PolicyWarm) -> None:
        self.engine, self.registry, self.warm = engine, registry, warm

    @classmethod
    async def start(cls, config: HostConfig, store: HostStore, filler: Filler,
                    client: KDNClient | None) -> HostPolicies:
        """Follow ``config.region``'s policies from ``config.registry``. ``client``: the host's client of its
        edges, which reads the manifests a registry pointer names and the records a schedule's lead is sized
        by, and measures the link (None: a test's upstream; pointers then name nothing)."""
        from kdn.registry.url import open_registry

        assert config.region is not None
        registry = open_registry(config.registry)  # (nothing contacted yet: the watches retry until it answers)
        verifier = None
        if config.operator_keys is not None:
            from kdn.registry.signing import Verifier

            verifier = Verifier.from_file(config.operator_keys)
        bodies = None
        if client is not None:
            from kdn.edge.records import OriginRecords

            # The edges answer the origins' record and manifest-body reads (kdn.service), with the host's token.
            urls = [*config.edges, *([config.origin] if config.origin else [])]
            bodies = OriginRecords(client.session, lambda: urls, lambda url: client.net.headers, timeout=config.timeout)
        warm = PolicyWarm(filler, store)
        engine = PolicyEngine(registry, config.region, [Pins(store)], warm=warm, verifier=verifier, bodies=bodies,
                              link=_link(client) if client is not None else None)
        try:
            await engine.start()
        except BaseException:
            await registry.close()
            raise
        return cls(engine, registry, warm)

    def stats(self) -> dict[str, int]:
        s = self.engine.stats
        return {"policies": sum(s.active.values()), "policy_applies": s.applies, "warm_runs": s.warm_runs,
                "warm_failures": s.warm_failures, "warmed": self.warm.outcomes["filled"]}

    async def close(self) -> None:
        """Stop following (runs in flight are cancelled; the pins last applied stay), then the registry."""
        await self.engine.close()
        await self.registry.close()


def _link(client: KDNClient) -> Callable[[int], float]:
    """The seconds the host expects ``n`` bytes of fills to take, from what its fills measured (a scheduled push
    starts that long ahead of its window); unmeasured: at the engine's assumed speed."""

    def seconds(nbytes: int) -> float:
        measured = client.routing.estimates.least_measured(nbytes)
        return measured if measured is not None else nbytes / ASSUMED_BPS

    return seconds
