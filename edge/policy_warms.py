"""The runs of an edge's ``warm`` and ``push`` policies: when each starts, is cancelled, and how it is counted.

The policy engine (``edge/policies.py``) only decides *when*; the server's ``warm(addresses, namespace)``
callback does the fetching (for a push also ``rate=``, bytes a second or None, and ``policy=``, its name).

Warm dedup: a warm runs once per (policy record, manifest addresses). A
manifest re-published with other addresses, or a policy record that changed
(another manifest, or ``kdn policy set`` run again, which stamps
``extra.set_at``) warms again; a watch that re-lists after a reconnect or a
compaction does not. A new warm of a policy cancels its previous one still in
flight, and removing the policy cancels it too, so the callback must tolerate
cancellation. A failed warm is logged and counted (``stats.warm_failures``),
never retried on its own and never fatal.

Scheduled warms and pushes (``Policy.schedule``) run once per window, ahead of it by the time their bytes
need (``lead_s``): ``LEAD_MARGIN`` times the longest of the bytes at the link's speed (measured where the
edge hands one, else ``ASSUMED_BPS``), the bytes at the push's own ``rate_bytes``, and the last run of the
policy here; never less than ``LEAD_FLOOR_S``. The bytes (``manifest_bytes``) are the manifest's objects at
their largest encodings, as their records say. The run is cancelled if the window ends first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kdn.errors import KDNError
from kdn.format.address import Address
from kdn.edge.policy_rules import manifest_addresses
from kdn.registry.records import Manifest, ObjectRecord, Policy

__all__ = ["ASSUMED_BPS", "LEAD_FLOOR_S", "LEAD_MARGIN", "Clock", "PolicyStats", "WallClock", "Warm", "WarmRuns",
           "lead_s", "manifest_bytes"]

log = logging.getLogger("kdn.edge.policies")  # (the engine's log, as before the runs had their own module)

Warm = Callable[..., Awaitable[None]]
"""``warm(addresses, namespace)``: fetch these objects into this edge's tiers now; for a push also
``rate=`` (bytes a second, or None) and ``policy=`` (its name, for progress)."""


class Clock(Protocol):
    """The time scheduled policies are read on: ``now()``, seconds since the epoch; ``sleep_until(t)``, which
    returns at ``t`` or earlier (the engine reads ``now()`` again and sleeps on if it is early)."""

    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class WallClock:
    """This machine's time. A sleep lasts at most ``NAP_S``: the wall clock may be set meanwhile (NTP, an
    operator), and a sleep measured on the monotonic clock would then wake early or late by the jump."""

    NAP_S = 60.0

    def now(self) -> float:
        return time.time()

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(min(max(t - time.time(), 0.0), self.NAP_S))


# A scheduled run starts at least this long before its window: time for the engine to wake, the records to be
# read and the first fills' round trips, whatever the bytes.
LEAD_FLOOR_S = 60.0
# ... and half as long again as the bytes need: a link shared with readers, or measured on a good minute.
LEAD_MARGIN = 1.5
# The link speed assumed where the edge has measured none: 100 Mbit/s, a slow inter-region path (bench/geo.py
# links run at 1 Gbit/s), so an unmeasured push starts early rather than late.
ASSUMED_BPS = 12_500_000.0
# The bytes assumed for a token whose object record cannot be read: a Llama-3-8B-shaped fp16 token's K/V
# (32 layers x K and V x 8 heads x 128 x 2 bytes), large for the small models, so the guess errs early.
ASSUMED_TOKEN_BYTES = 128 << 10


def lead_s(nbytes: int, *, link: Callable[[int], float] | None = None, rate: int | None = None,
           took: float | None = None) -> float:
    """How long before its window a scheduled warm or push of ``nbytes`` starts: ``link(n)``, the seconds
    this edge expects ``n`` bytes of fills to take (None: at ``ASSUMED_BPS``); ``rate``, the push's own pace
    in bytes a second; ``took``, the seconds its last run here took. The longest of those, times
    ``LEAD_MARGIN``, and at least ``LEAD_FLOOR_S``."""
    need = link(nbytes) if link is not None else nbytes / ASSUMED_BPS
    if rate:
        need = max(need, nbytes / rate)
    if took is not None:
        need = max(need, took)
    return max(LEAD_FLOOR_S, LEAD_MARGIN * need) if math.isfinite(need) else LEAD_FLOOR_S


async def manifest_bytes(m: Manifest, sources: Sequence) -> int:
    """The bytes a fill of ``m``'s objects moves: each object at its largest encoding, its record read from
    the first of ``sources`` (``get_objects``: the origins' records, the registry) that has it. An object
    none has, or a source that fails, is counted at the largest size read, or with none read at
    ``chunk_tokens`` x ``ASSUMED_TOKEN_BYTES``: a guess that errs early."""
    addrs = list(manifest_addresses(m))
    sizes: dict[Address, int] = {}
    for source in sources:
        todo = [a for a in addrs if a not in sizes]
        if not todo:
            break
        try:
            got: list[ObjectRecord | None] = await source.get_objects(todo)
        except (KDNError, OSError, ValueError) as e:
            log.info("sizes of %s: records unreadable (%s); counted as a guess", m.ref, _line(e))
            continue
        for a, rec in zip(todo, got):
            if rec is not None and rec.encodings:
                sizes[a] = max(e.size for e in rec.encodings.values())
    unknown = len(addrs) - len(sizes)
    guess = max(sizes.values(), default=m.chunk_tokens * ASSUMED_TOKEN_BYTES)
    return sum(sizes.values()) + unknown * guess


@dataclass
class PolicyStats:
    """Counters for ``/metrics`` and tests."""

    applies: int = 0  # rule changes handed to the tiers
    active: dict[str, int] = field(default_factory=dict)  # policies in force here, by kind
    invalid: int = 0  # invalid records seen (each put of one counts)
    warm_runs: int = 0  # warm callbacks started
    warm_done: int = 0  # ... that returned
    warm_failures: int = 0  # ... that raised
    scheduled_runs: int = 0  # warm callbacks started for a window of a scheduled warm or push
    resolve_failures: int = 0  # manifest reads that failed (retried)
    watch_errors: int = 0  # watches that broke and were restarted


class WarmRuns:
    """The warm and push runs of the policies in force here, by policy name.

    ``update`` after every apply starts what is new and cancels what went; each run that ends (or fails)
    calls ``notify``. Counts go to the engine's ``stats`` (``warm_runs``, ``warm_done``, ``warm_failures``).
    ``lead(p)``: how long ahead of its window a scheduled one starts, from its manifest's bytes (``size``)
    at ``link``'s speed and what its last run here took.
    """

    def __init__(self, warm: Warm | None, stats: PolicyStats, notify: Callable[[], None], *,
                 link: Callable[[int], float] | None = None) -> None:
        self._warm = warm
        self._stats = stats
        self._notify = notify
        self._link = link
        self._warmed: dict[str, tuple[Policy, tuple[Address, ...], float | None]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._took: dict[str, float] = {}  # policy -> seconds its last run that ended took
        self._sizes: dict[str, tuple[tuple[Address, ...], int]] = {}  # ref -> (its addresses, their bytes)

    async def size(self, manifests: Mapping[str, Manifest | None], sources: Sequence) -> None:
        """Read the bytes of ``manifests`` (the ones scheduled policies here name, by ref; None: not
        published) from ``sources``, once per content; forget the others."""
        for ref in self._sizes.keys() - manifests.keys():
            del self._sizes[ref]
        for ref, m in sorted(manifests.items()):
            if m is None:
                continue  # not published yet: its lead is the floor's until it is
            addrs = manifest_addresses(m)
            if ref not in self._sizes or self._sizes[ref][0] != addrs:
                self._sizes[ref] = (addrs, await manifest_bytes(m, sources))

    def lead(self, p: Policy) -> float:
        """How long before its window a scheduled warm or push ``p`` starts here (a pin: 0)."""
        if p.kind not in ("warm", "push") or p.manifest is None:
            return 0.0
        nbytes = self._sizes[p.manifest][1] if p.manifest in self._sizes else 0
        return lead_s(nbytes, link=self._link, rate=p.extra.get("rate_bytes"), took=self._took.get(p.name))

    def update(self, here: Mapping[str, Policy], resolved: Mapping[str, Manifest],
               windows: Mapping[str, float] | None = None) -> None:
        """Start the runs ``here`` (the policies in force now, by name) calls for with ``resolved`` (the
        published manifests, by ``ns/name``) and that did not run for this record and content (and, for a
        scheduled one, this window: ``windows`` has its start); cancel the ones that went (removed, or a
        scheduled one whose window ended)."""
        windows = windows or {}
        warms = {n: p for n, p in here.items() if p.kind in ("warm", "push")}
        for name in list(self._warmed):
            if name not in warms:  # removed, or no longer for this region
                del self._warmed[name]
                self._cancel(name)
        if self._warm is None:
            return
        for name, p in sorted(warms.items()):
            m = resolved.get(p.manifest) if p.manifest is not None else None
            if m is None:
                continue  # not published yet: warms when it is
            addrs = manifest_addresses(m)
            run = (p, addrs, windows.get(name))
            if self._warmed.get(name) == run:
                continue  # this record, this content (this window): warmed already
            self._warmed[name] = run
            self._cancel(name)
            self._stats.warm_runs += 1
            if p.schedule is not None:
                self._stats.scheduled_runs += 1
            self._tasks[name] = asyncio.create_task(self._run(name, list(addrs), m.namespace, p),
                                                    name=f"kdn-warm-{name}")

    def forget(self, names) -> None:
        """Keep what the last runs took for these policy names only (the others are gone from the registry)."""
        for name in self._took.keys() - set(names):
            del self._took[name]

    def take_tasks(self) -> list[asyncio.Task[None]]:
        """The runs in flight, handed over (to be stopped) and forgotten here."""
        tasks, self._tasks = list(self._tasks.values()), {}
        return tasks

    def _cancel(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def _run(self, name: str, addresses: list[Address], namespace: str, p: Policy) -> None:
        t0 = time.monotonic()
        if self._warm is None:
            return
        try:
            if p.kind == "push":
                await self._warm(addresses, namespace, rate=p.extra.get("rate_bytes"), policy=name)
            else:
                await self._warm(addresses, namespace)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed warm costs a later miss, never the engine
            self._stats.warm_failures += 1
            log.warning("warm %s (%d objects of %s) failed: %s", name, len(addresses), namespace, _line(e))
        else:
            self._stats.warm_done += 1
            took = self._took[name] = time.monotonic() - t0
            log.info("warm %s: %d objects of %s in %.2fs", name, len(addresses), namespace, took)
        finally:
            if self._tasks.get(name) is asyncio.current_task():
                del self._tasks[name]
            self._notify()


def _line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0][:200]
