"""Operator policies on an edge: pin, warm, TTL and quota rules kept in the registry, applied live.

Operators know what is hot. They say so with records under ``policies/``
(``kdn policy set``), and every edge follows them through a watch:

- ``pin`` (manifest ``ns/name``): every cached entry whose address is in the
  manifest (prefix chain and standalone chunks) is never evicted, in every
  tier, including entries that arrive later.
- ``warm`` (manifest): fetch the manifest's objects now, ahead of demand. The
  engine only decides *when*; the server's ``warm(addresses, namespace)``
  callback does the fetching.
- ``push`` (manifest; ``extra.regions``, none: every region; ``extra.rate_bytes``):
  a warm for the named regions, sent ahead of their first reader, at most
  ``rate_bytes`` a second per edge, its progress counted per policy. The
  callback gets ``rate=`` and ``policy=``. An edge that restarts mid-push runs it
  again and skips what its tiers kept (the disk tier survives restarts); a
  reader asking for an object the push is filling joins that fill.
- ``ttl`` (``ttl_s``, scoped by ``namespace`` and/or ``manifest``, global if
  neither): an entry may be dropped ``ttl_s`` after it was inserted. Several
  matching rules: the smallest wins. A pin beats a TTL (the tier's rule).
- ``quota`` (``namespace``, ``quota_bytes``): a hard byte cap for that
  namespace in each tier, so one tenant cannot push another's data out.
  Several for one namespace: the smallest wins.
- ``upper`` (``region``): that region is the upper tier (origin shield). Every
  other region's owner edges fill through its owner of the object instead of
  asking the origin (``kdn.edge.fill``), so the origin serves about one fill
  per object whatever the number of regions. Several: each region uses the
  one it measures fastest, the others next, the origin last (and the origin
  serves about one fill per object per upper region).

A policy applies here if its ``region`` is None or this edge's region; an
``upper`` policy holds for every edge (its region names the tier, not a scope).

Schedules (``Policy.schedule``: ``kdn policy set --at '0 8 * * 1-5' --tz Europe/Berlin --for 2h``; the
windows are ``kdn/registry/schedule.py``'s): a scheduled ``pin`` pins only inside its windows; a scheduled
``warm`` or ``push`` runs once per window, starting ahead of it by the time its bytes need at this edge's
link speed (``edge/policy_warms.py``, ``lead_s``), and pins its manifest from then until the window ends, then
releases it. The engine reads the time from ``clock`` (wall time: windows are in time zones; tests step a
fake one) after every change, and wakes when the next scheduled policy's state changes (``phases``).

What "apply" means (the one rule function each tier gets, re-ruling what it holds; quotas replaced whole;
nothing re-applied that did not change): ``edge/policy_rules.py``.

Manifests that do not exist yet: the engine also watches ``manifests/`` (a
watch, not a timer). A put of a manifest some policy names resolves it, and
a delete unresolves it (its pins go, since the addresses are no longer known).

Warm dedup (once per policy record and manifest content), cancellation and the counts of warm and push
runs: ``edge/policy_warms.py``. The records themselves (what each kind needs, ``kdn policy set``'s
options, signed tombstones, ``kdn policy ls``'s rows): ``kdn/registry/policy_records.py``.

Signed policies (an edge with ``--operator-keys``): only a policy one of those
keys signed applies, and a registry writer without one must not undo it either.
So removing one is a signed record too, a tombstone (``kdn policy rm
--operator-key``: the policy's fields with ``extra.deleted``); a key deleted
without one leaves the policy in force here (logged), and a signed policy older
(by its signed ``extra.set_at``) than the newest seen under its name is a replay
and skipped. What the edge has seen lives in its process: an edge started
after such a deletion or replay does not know what came before (docs/security.md).

Invalid records (not msgpack, bad fields, a ``pin`` without a manifest, a key
that disagrees with the record's name) are logged, listed in ``invalid`` and
skipped; a registry that cannot be reached makes the watches retry with
backoff. Neither stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from kdn.format.address import Address, validate_name
from kdn.registry.policy_records import POLICIES, is_tombstone, set_at, validate_policy
from kdn.edge.policy_rules import Phase, Rules, phase, rules_for
from kdn.edge.policy_warms import Clock, PolicyStats, WallClock, Warm, WarmRuns
from kdn.errors import InvalidInput, KDNError, RegistryUnavailable
from kdn.registry.follow import follow, stop_tasks
from kdn.registry.records import Manifest, Policy

log = logging.getLogger(__name__)

MANIFESTS = "manifests/"


class Ruled(Protocol):  # what the engine calls of a tier: an edge's (GovernedTier), a host's pins (host/policies.py)
    def apply_policy(self, fn: Rules) -> None: ...
    def set_quotas(self, quotas: dict[str, int]) -> None: ...


class PolicyEngine:
    """Follows ``policies/`` (and ``manifests/``) in the registry and applies them to this edge's tiers.

    ``await start()`` launches the watches and returns at once; the first
    snapshot is applied as soon as the registry answers (``ready``). With
    ``manifest_feed=True`` the engine does not watch ``manifests/`` itself:
    its owner, which follows that prefix anyway (the edge's one manifest view),
    hands it each event through ``feed_manifests``. ``clock``: what scheduled policies are read on
    (``WallClock`` by default; tests step one). ``link(n)``: the seconds this edge expects ``n`` bytes of
    fills to take, for a scheduled push's lead (None: an assumed speed, ``policy_warms.ASSUMED_BPS``).
    """

    def __init__(
        self,
        registry,
        region: str,
        tiers: Sequence[Ruled],
        *,
        warm: Warm | None = None,
        retry_s: float = 0.5,
        max_retry_s: float = 30.0,
        manifest_feed: bool = False,
        verifier=None,
        bodies=None,
        clock: Clock | None = None,
        link: Callable[[int], float] | None = None,
    ) -> None:
        self._registry = registry
        self.clock: Clock = clock or WallClock()  # public: a test may step another in before a schedule is set
        # Where the whole manifest a registry pointer names is read (``Manifest.body``: an origin with
        # ``--records store``): ``get_manifest_body(namespace, name, digest)``; None: pointers name nothing.
        self._bodies = bodies
        # kdn.registry.signing.Verifier of the operator keys (--operator-keys): a policy none of them signed is skipped,
        # so a registry writer without an operator key can neither pin nor expire what it likes.
        self._verifier = verifier
        self._manifest_feed = manifest_feed
        self.region = validate_name(region)
        self._tiers = list(tiers)
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        # Registry state, as the watches last told it.
        self._records: dict[str, Policy] = {}  # valid policies, every region, by name
        # With a verifier: per name, the newest signed set_at seen (policies and tombstones), so an older signed
        # record replayed under the name is refused; and the names whose keys went without a tombstone.
        self._newest: dict[str, tuple[float, bool]] = {}  # name -> (set_at, a tombstone)
        self._kept: set[str] = set()
        self._invalid: dict[str, str] = {}  # key -> why it is skipped
        self._manifests: dict[str, Manifest | None] = {}  # refs some policy names -> record (None: not published)
        self._snapshots: set[str] = set()
        # What was applied.
        self._rules: Rules | None = None
        self._quotas: dict[str, int] | None = None
        # Public views, replaced whole at each apply so a reader never sees half a change.
        self._policies: dict[str, Policy] = {}
        self._active: dict[str, Policy] = {}
        self._pinned: frozenset[Address] = frozenset()
        self._upper: frozenset[str] = frozenset()
        self._unresolved: frozenset[str] = frozenset()
        self._invalid_view: dict[str, str] = {}
        self._phases: dict[str, Phase] = {}
        self._ready = False
        self.stats = PolicyStats()
        self._warms = WarmRuns(warm, self.stats, self._notify, link=link)
        self._queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue(maxsize=256)
        self._tasks: list[asyncio.Task[None]] = []
        self._retry: asyncio.TimerHandle | None = None
        self._timer: asyncio.Task[None] | None = None  # wakes when a scheduled policy's state changes next
        self._wake_at: float | None = None
        self._changed = asyncio.Event()
        self._closed = False

    # --- views -------------------------------------------------------------

    @property
    def policies(self) -> dict[str, Policy]:
        """Every valid policy in the registry, whatever its region, by name."""
        return self._policies

    @property
    def active(self) -> dict[str, Policy]:
        """The policies in force on this edge (its region, or none)."""
        return self._active

    @property
    def invalid(self) -> dict[str, str]:
        """Registry keys of the records that were skipped, and why."""
        return self._invalid_view

    @property
    def upper_regions(self) -> frozenset[str]:
        """The regions named upper tiers by ``upper`` policies (every region sees the same)."""
        return self._upper

    @property
    def pinned_addresses(self) -> frozenset[Address]:
        return self._pinned

    @property
    def unresolved(self) -> frozenset[str]:
        """Manifests that a pin, warm or ttl policy in force names but that are not published (yet)."""
        return self._unresolved

    @property
    def phases(self) -> dict[str, Phase]:
        """The scheduled policies in force here, by name: the window open or next, whether each holds now."""
        return self._phases

    @property
    def ready(self) -> bool:
        """Both watches have delivered their first snapshot and it was applied."""
        return self._ready

    # --- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._watch(POLICIES), name="kdn-policy-watch"),
            asyncio.create_task(self._process(), name="kdn-policy-apply"),
        ]
        if not self._manifest_feed:
            self._tasks.append(asyncio.create_task(self._watch(MANIFESTS), name="kdn-policy-manifest-watch"))

    async def feed_manifests(self, ev) -> None:
        """One event (snapshot, put, delete) of the owner's ``manifests/`` view, in the order it came.
        Waits while the engine is behind by more than its queue (256 batches of changes)."""
        if not self._manifest_feed:
            raise RuntimeError("this PolicyEngine follows manifests/ itself (manifest_feed=False)")
        await self._queue.put((MANIFESTS, ev))

    async def close(self) -> None:
        """Stop watching and cancel warms in flight. The tiers keep the rules last applied."""
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        timer, self._timer = ([self._timer] if self._timer is not None else []), None
        await stop_tasks(self._tasks + self._warms.take_tasks() + timer, what="policy")
        self._tasks = []

    async def __aenter__(self) -> PolicyEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_applied(self, predicate: Callable[[PolicyEngine], bool], timeout: float = 10.0) -> None:
        """Return once ``predicate(self)`` holds, checked after every apply and every warm; TimeoutError if not in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            changed = self._changed
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):  # not wait_for: on 3.11 it can drop a cancel
                    await changed.wait()
            except TimeoutError:
                raise TimeoutError(
                    f"policy state did not satisfy the predicate within {timeout}s "
                    f"(active={sorted(self._active)}, invalid={sorted(self._invalid)}, stats={self.stats})"
                ) from None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- watching ----------------------------------------------------------

    async def _watch(self, prefix: str) -> None:
        def failed(_: str) -> None:
            self.stats.watch_errors += 1

        await follow(self._registry, prefix, lambda ev: self._queue.put((prefix, ev)), what="policy",
                     backoff=(self._retry_s, self._max_retry_s), on_error=failed)

    async def _process(self) -> None:
        # One consumer for both watches: every change is taken in arrival
        # order, then manifests are resolved and the rules applied once per
        # batch. Ordering against the manifest watch: a manifest event for a
        # ref no policy names yet is ignored; when a policy then names it,
        # get_manifest reads the registry *after* that event happened, so it
        # sees the manifest; any later change arrives as a later event.
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                for prefix, ev in batch:
                    if prefix == POLICIES:
                        self._take_policy(ev)
                    elif prefix == MANIFESTS:
                        self._take_manifest(ev)
                await self._resolve()
                self._apply()
            except Exception:  # noqa: BLE001 - a bug in one batch must not stop every later policy
                log.exception("applying policies failed; the next change tries again")

    def _take_policy(self, ev) -> None:
        if ev.kind == "snapshot":
            before, self._records, self._invalid = self._records, {}, {}
            for key, value in ev.items.items():
                self._put_policy(key, value, before.get(key[len(POLICIES):]))
            for name in before.keys() - {k[len(POLICIES):] for k in ev.items}:
                self._gone(name, before[name])
            self._snapshots.add(POLICIES)
        elif ev.kind == "put":
            self._put_policy(ev.key, ev.value, self._records.get(ev.key[len(POLICIES):]))
        elif ev.kind == "delete":
            name = ev.key[len(POLICIES) :]
            self._invalid.pop(ev.key, None)
            p = self._records.pop(name, None)
            if p is not None:
                self._gone(name, p)

    def _gone(self, name: str, p: Policy) -> None:
        """A policy's key is gone. Unsigned edges drop it; signed ones keep it: only a signed tombstone removes."""
        if self._verifier is None:
            return
        self._records[name] = p
        if name not in self._kept:
            self._kept.add(name)
            self.stats.invalid += 1
            log.warning("policy %s was deleted from the registry without a signed tombstone: still applied here "
                        "(remove a signed policy with `kdn policy rm --operator-key`)", name)

    def _put_policy(self, key: str, value: bytes | None, current: Policy | None = None) -> None:
        """Take the record at ``key``; ``current`` is the policy in force under its name until now."""
        name = key[len(POLICIES) :]
        self._records.pop(name, None)
        self._invalid.pop(key, None)
        try:
            p = Policy.unpack(value or b"")
            if not is_tombstone(p):  # a tombstone removes: only its name, signature and time count
                validate_policy(p)
            if p.name != name:
                raise InvalidInput(f"record names {p.name!r} but sits at {key!r}")
            if self._verifier is not None:
                try:
                    self._verifier.check(p)
                except (TypeError, ValueError) as e:  # a field the signed payload cannot hold
                    raise InvalidInput(f"policy {p.name} cannot be verified: {e}") from None
                at = set_at(p)
                newest, removed = self._newest.get(name, (float("-inf"), False))
                # Older than the newest seen is a replay; at the same instant a removal wins over a set.
                if at < newest or (at == newest and removed and not is_tombstone(p)):
                    raise InvalidInput(f"policy {p.name}: signed at {at:.0f}, older than the one seen here "
                                       f"({newest:.0f}): a replay")
                self._newest[name] = (at, is_tombstone(p))
        except KDNError as e:
            self.stats.invalid += 1
            self._invalid[key] = str(e)
            log.warning("skipping invalid policy %s: %s", key, _line(e))
            if current is not None and self._verifier is not None:
                self._records[name] = current  # an unsigned or replayed record over a signed one does not undo it
            return
        self._kept.discard(name)
        if is_tombstone(p):
            return  # removed (signed, where signatures count): nothing applies under the name
        self._records[name] = p

    def _take_manifest(self, ev) -> None:
        wanted = self._wanted()
        if ev.kind == "snapshot":
            for ref in wanted:
                self._keep_manifest(ref, self._unpack_manifest(ref, ev.items.get(MANIFESTS + ref)))
            self._snapshots.add(MANIFESTS)
            return
        ref = ev.key[len(MANIFESTS) :]
        if ref in wanted:
            self._keep_manifest(ref, self._unpack_manifest(ref, ev.value) if ev.kind == "put" else None)

    def _keep_manifest(self, ref: str, m: Manifest | None) -> None:
        if m is not None and m.body is not None:  # a pointer not followed yet: read it whole (_resolve, retried)
            self._manifests.pop(ref, None)
        else:
            self._manifests[ref] = m

    async def _whole(self, m: Manifest | None) -> Manifest | None:
        """``m``, or the whole manifest a pointer names (RegistryUnavailable while its body cannot be read)."""
        if m is None or m.body is None:
            return m
        full = None if self._bodies is None else await self._bodies.get_manifest_body(m.namespace, m.name, m.body)
        if full is None or not m.points_at(full):
            raise RegistryUnavailable(f"manifest {m.ref} v{m.version}: its body {m.body[:16]} could not be read "
                                      "from the origins")
        return full

    @staticmethod
    def _unpack_manifest(ref: str, value: bytes | None) -> Manifest | None:
        if value is None:
            return None
        try:
            return Manifest.unpack(value)
        except KDNError as e:
            log.warning("manifest %s named by a policy is unreadable: %s", ref, _line(e))
            return None

    def _wanted(self) -> set[str]:
        return {p.manifest for p in self._records.values() if p.manifest is not None and self._here(p)}

    def _here(self, p: Policy) -> bool:
        if p.kind == "push":
            regions = p.extra.get("regions") or []
            return not regions or self.region in regions
        return p.region is None or p.region == self.region or p.kind == "upper"

    async def _resolve(self) -> None:
        wanted = self._wanted()
        for ref in list(self._manifests):
            if ref not in wanted:
                del self._manifests[ref]  # re-read if a policy names it again: the watch ignored it meanwhile
        failed = False
        for ref in sorted(wanted - self._manifests.keys()):
            ns, name = ref.split("/")
            try:
                self._manifests[ref] = await self._whole(await self._registry.get_manifest(ns, name))
            except InvalidInput as e:
                log.warning("manifest %s named by a policy is unreadable: %s", ref, _line(e))
                self._manifests[ref] = None
            except KDNError as e:
                self.stats.resolve_failures += 1
                log.warning("cannot read manifest %s (%s); retrying in %.1fs", ref, _line(e), self._retry_s)
                failed = True
        if failed and not self._closed:
            # Unresolved refs stay out of _manifests, so the next batch reads them again.
            if self._retry is not None:
                self._retry.cancel()
            self._retry = asyncio.get_running_loop().call_later(self._retry_s, self._kick)
        # The bytes a scheduled warm or push moves set how far ahead of its window it starts.
        fills = {p.manifest for p in self._records.values()
                 if p.schedule is not None and p.kind in ("warm", "push") and p.manifest and self._here(p)}
        await self._warms.size({ref: self._manifests.get(ref) for ref in fills},
                               [s for s in (self._bodies, self._registry) if s is not None])

    def _kick(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):  # full: a batch is coming anyway
            self._queue.put_nowait(("retry", None))

    def _arm(self, at: float | None) -> None:
        """Apply again at ``at`` on ``clock`` (None: nothing scheduled here)."""
        if at == self._wake_at and (at is None or self._timer is not None):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._wake_at, self._timer = at, None
        if at is not None and not self._closed:
            self._timer = asyncio.create_task(self._wake(at), name="kdn-policy-schedule")

    async def _wake(self, at: float) -> None:
        while self.clock.now() < at:
            await self.clock.sleep_until(at)
        # No await from here to the kick: a cancel by _arm (a new time) cannot land after the clock was read.
        self._timer = self._wake_at = None
        self._kick()

    def _phase(self, name: str, p: Policy, now: float) -> Phase:
        """``p``'s phase now. A run that started for a window holds to the window's end, even if its lead has
        shrunk since (a faster link measured, say): releasing its pin and starting it again later would let
        what it filled go meanwhile."""
        ph = phase(p, now, self._warms.lead(p))
        before = self._phases.get(name)
        if not ph.held and before is not None and before.held and before.window == ph.window:
            return Phase(ph.window, True, ph.window.end, before.lead_s)
        return ph

    # --- applying ----------------------------------------------------------

    def _apply(self) -> None:
        here = {n: p for n, p in self._records.items() if self._here(p)}
        resolved = {ref: m for ref, m in self._manifests.items() if m is not None}
        # Scheduled policies hold part of the time: the rules and the runs get the ones that hold now.
        now = self.clock.now()
        phases = {n: self._phase(n, p, now) for n, p in sorted(here.items()) if p.schedule is not None}
        live = {n: p for n, p in here.items() if n not in phases or phases[n].held}
        rules, quotas = rules_for(live.values(), resolved)
        changed = False
        if quotas != self._quotas:
            for t in self._tiers:
                t.set_quotas(quotas)
            self._quotas, changed = quotas, True
        if rules != self._rules:
            for t in self._tiers:
                t.apply_policy(rules)
            self._rules, changed = rules, True
        if changed:
            self.stats.applies += 1
        self._warms.update(live, resolved, {n: ph.window.start for n, ph in phases.items()})
        self._warms.forget(self._records.keys())
        self._phases = phases
        self._arm(min((ph.until for ph in phases.values()), default=None))
        kinds: dict[str, int] = {}
        for p in here.values():
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        self.stats.active = kinds
        self._policies, self._active = dict(self._records), here
        self._pinned = rules.pinned
        self._upper = frozenset(p.region for p in self._records.values() if p.kind == "upper" and p.region)
        self._unresolved = frozenset(ref for ref in self._manifests if ref not in resolved)
        self._invalid_view = dict(self._invalid)
        self._ready = self._snapshots >= {POLICIES, MANIFESTS}
        self._notify()


def _line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0][:200]
