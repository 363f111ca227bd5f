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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from kdn.format.address import Address
from kdn.edge.policy_rules import manifest_addresses
from kdn.registry.records import Manifest, Policy

__all__ = ["PolicyStats", "Warm", "WarmRuns"]

log = logging.getLogger("kdn.edge.policies")  # (the engine's log, as before the runs had their own module)

Warm = Callable[..., Awaitable[None]]
"""``warm(addresses, namespace)``: fetch these objects into this edge's tiers now; for a push also
``rate=`` (bytes a second, or None) and ``policy=`` (its name, for progress)."""


@dataclass
class PolicyStats:
    """Counters for ``/metrics`` and tests."""

    applies: int = 0  # rule changes handed to the tiers
    active: dict[str, int] = field(default_factory=dict)  # policies in force here, by kind
    invalid: int = 0  # invalid records seen (each put of one counts)
    warm_runs: int = 0  # warm callbacks started
    warm_done: int = 0  # ... that returned
    warm_failures: int = 0  # ... that raised
    resolve_failures: int = 0  # manifest reads that failed (retried)
    watch_errors: int = 0  # watches that broke and were restarted


class WarmRuns:
    """The warm and push runs of the policies in force here, by policy name.

    ``update`` after every apply starts what is new and cancels what went; each run that ends (or fails)
    calls ``notify``. Counts go to the engine's ``stats`` (``warm_runs``, ``warm_done``, ``warm_failures``).
    """

    def __init__(self, warm: Warm | None, stats: PolicyStats, notify: Callable[[], None]) -> None:
        self._warm = warm
        self._stats = stats
        self._notify = notify
        self._warmed: dict[str, tuple[Policy, tuple[Address, ...]]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def update(self, here: Mapping[str, Policy], resolved: Mapping[str, Manifest]) -> None:
        """Start the runs ``here`` (the policies in force, by name) calls for with ``resolved`` (the published
        manifests, by ``ns/name``) and that did not run for this record and content; cancel removed ones."""
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
            if self._warmed.get(name) == (p, addrs):
                continue  # this record, this content: warmed already
            self._warmed[name] = (p, addrs)
            self._cancel(name)
            self._stats.warm_runs += 1
            self._tasks[name] = asyncio.create_task(self._run(name, list(addrs), m.namespace, p),
                                                    name=f"kdn-warm-{name}")

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
            log.info("warm %s: %d objects of %s in %.2fs", name, len(addresses), namespace, time.monotonic() - t0)
        finally:
            if self._tasks.get(name) is asyncio.current_task():
                del self._tasks[name]
            self._notify()


def _line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0][:200]
