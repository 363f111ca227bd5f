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

What "apply" means: after every change the engine builds one rule function
and hands it to each tier (``GovernedTier.apply_policy``), which re-rules *every
entry already cached* at once (pins and unpins take effect immediately; a TTL
is measured from each entry's ``inserted_at``, so an entry older than a new
TTL is expired at once, dropped first under pressure or at the next
``GovernedTier.expire()``) and rules every later insert with it. Quotas replace the
tiers' quotas as a whole (``set_quotas``): the engine owns them. Rules that
did not change are not re-applied, so a policy event that changes nothing
costs no walk over the tiers.

Manifests that do not exist yet: the engine also watches ``manifests/`` (a
watch, not a timer). A put of a manifest some policy names resolves it, and
a delete unresolves it (its pins go, since the addresses are no longer known).

Warm dedup: a warm runs once per (policy record, manifest addresses). A
manifest re-published with other addresses, or a policy record that changed
(another manifest, or ``kdn policy set`` run again, which stamps
``extra.set_at``) warms again; a watch that re-lists after a reconnect or a
compaction does not. A new warm of a policy cancels its previous one still in
flight, and removing the policy cancels it too, so the callback must tolerate
cancellation. A failed warm is logged and counted (``stats.warm_failures``),
never retried on its own and never fatal.

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
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kdn.address import Address, validate_name
from kdn.edge.tiers import EntryMeta, GovernedTier, Key, PolicyState
from kdn.errors import InvalidInput, KDNError, RegistryUnavailable
from kdn.registry.follow import follow, stop_tasks
from kdn.registry.records import Manifest, Policy
from kdn.units import format_duration, format_size

__all__ = ["PolicyEngine", "PolicyStats", "Removal", "Warm", "is_tombstone", "policy_from_options", "policy_row",
           "policy_scope", "remove_policy", "set_at", "tombstone", "validate_policy"]

log = logging.getLogger(__name__)

POLICIES = "policies/"
MANIFESTS = "manifests/"

Warm = Callable[..., Awaitable[None]]
"""``warm(addresses, namespace)``: fetch these objects into this edge's tiers now; for a push also
``rate=`` (bytes a second, or None) and ``policy=`` (its name, for progress)."""


MAX_PUSH_REGIONS = 1000


def set_at(p: Policy) -> float:
    """When ``kdn policy set`` (or ``rm``) made ``p``: its ``extra.set_at``, signed with the rest; 0 if none."""
    at = p.extra.get("set_at")
    return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at) else 0.0


def is_tombstone(p: Policy) -> bool:
    """A signed removal (``kdn policy rm --operator-key``): the policy's fields, ``extra.deleted`` set."""
    return p.extra.get("deleted") is True


def tombstone(name: str, at: float) -> Policy:
    """What removing the policy ``name`` writes where policies are signed (sign it): the name, ``deleted``
    and ``set_at``, nothing taken from the record it removes. Built from what the registry holds, it signed
    whatever a registry writer had put there (another policy's name, a record no edge would take)."""
    return Policy(name=name, kind="ttl", extra={"deleted": True, "set_at": at})


def validate_policy(p: Policy) -> Policy:
    """The fields each kind needs, beyond what the record itself checks. Used by the CLI too."""
    if p.kind in ("pin", "warm", "push"):
        if p.manifest is None:
            raise InvalidInput(f"policy {p.name!r}: a {p.kind} policy needs a manifest (namespace/name)")
        if p.kind == "push":
            regions, rate = p.extra.get("regions", []), p.extra.get("rate_bytes")
            if p.region is not None:
                raise InvalidInput(f"policy {p.name!r}: a push names its regions in extra.regions, not region")
            if not isinstance(regions, list) or len(regions) > MAX_PUSH_REGIONS:
                raise InvalidInput(f"policy {p.name!r}: extra.regions must be a list of at most "
                                   f"{MAX_PUSH_REGIONS} region names")
            for r in regions:
                validate_name(r)
            if rate is not None and not (isinstance(rate, int) and not isinstance(rate, bool) and rate > 0):
                raise InvalidInput(f"policy {p.name!r}: extra.rate_bytes must be a positive int (bytes a second)")
    elif p.kind == "ttl":
        if p.ttl_s is None:
            raise InvalidInput(f"policy {p.name!r}: a ttl policy needs ttl_s")
    elif p.kind == "quota":
        if p.namespace is None or p.quota_bytes is None:
            raise InvalidInput(f"policy {p.name!r}: a quota policy needs a namespace and quota_bytes")
    elif p.kind == "upper":
        if p.region is None:
            raise InvalidInput(f"policy {p.name!r}: an upper policy names the upper tier's region")
        if p.manifest is not None or p.namespace is not None or p.ttl_s is not None or p.quota_bytes is not None:
            raise InvalidInput(f"policy {p.name!r}: an upper policy takes a region only (it holds for every object)")
    return p


KINDS_SET = ("pin", "warm", "push", "ttl", "quota", "upper")  # what `kdn policy set` and the console set


def policy_from_options(name: str, *, pin: str | None = None, warm: str | None = None, push: str | None = None,
                        ttl: str | None = None, quota: str | None = None, upper: bool = False, to: str | None = None,
                        rate: str | None = None, namespace: str | None = None, manifest: str | None = None,
                        region: str | None = None, at: float | None = None) -> Policy:
    """The policy ``kdn policy set`` writes for these options (exactly one of pin, warm, push, ttl, quota,
    upper), checked: the one place options become a record, so the CLI and the operator console
    (origin/console/forms.py) refuse the same input with the same words. ``at`` stamps ``extra.set_at`` (now by
    default): every set is a new record, so setting a warm again warms again."""
    from kdn.units import parse_duration, parse_size

    chosen = [k for k, v in (("pin", pin), ("warm", warm), ("push", push), ("ttl", ttl), ("quota", quota))
              if v is not None] + (["upper"] if upper else [])
    if len(chosen) != 1:
        raise InvalidInput(f"exactly one of --pin, --warm, --push, --ttl, --quota, --upper (got {len(chosen)})")
    fields: dict[str, Any] = {"name": name, "region": region}
    extra: dict[str, Any] = {}
    if (to is not None or rate is not None) and push is None:
        raise InvalidInput("--to and --rate go with --push")
    if push is not None:
        if region is not None or namespace is not None or manifest is not None:
            raise InvalidInput("--push names its manifest and its regions (--to), not --region, --namespace or --manifest")
        fields.update(kind="push", manifest=push)
        if to is not None:
            extra["regions"] = sorted({validate_name(r.strip()) for r in to.split(",") if r.strip()})
            if not extra["regions"]:
                raise InvalidInput("--to names no region")
        if rate is not None:
            bytes_a_second = parse_size(rate.removesuffix("/s"))
            if bytes_a_second <= 0:
                raise InvalidInput("--rate must be more than zero")
            extra["rate_bytes"] = bytes_a_second
    elif pin is not None or warm is not None:
        if namespace is not None or manifest is not None:
            raise InvalidInput("--namespace and --manifest go with --ttl or --quota; --pin and --warm name their manifest")
        fields.update(kind="pin" if pin is not None else "warm", manifest=pin if pin is not None else warm)
    elif upper:
        if region is None:
            raise InvalidInput("--upper needs --region REGION: the region the others fill through")
        if namespace is not None or manifest is not None:
            raise InvalidInput("--upper holds for every object; it takes no --namespace or --manifest")
        fields.update(kind="upper")
    elif ttl is not None:
        fields.update(kind="ttl", ttl_s=parse_duration(ttl), namespace=namespace, manifest=manifest)
    else:
        assert quota is not None
        if namespace is None:
            raise InvalidInput("--quota needs --namespace NS")
        if manifest is not None:
            raise InvalidInput("--quota caps a namespace; it takes no --manifest")
        fields.update(kind="quota", quota_bytes=parse_size(quota), namespace=namespace)
    return validate_policy(Policy(**fields, extra={**extra, "set_at": time.time() if at is None else at}))


@dataclass(frozen=True)
class Removal:
    """What ``remove_policy`` did: ``done`` (False: nothing was removed), the outcome line, and a note to show
    before it (``kdn policy rm`` prints the note and a failure on stderr)."""

    done: bool
    message: str
    note: str | None = None


async def remove_policy(reg: Any, name: str, signer: Any = None) -> Removal:
    """Remove the policy ``name`` as ``kdn policy rm`` does: with a ``signer`` (a ``kdn.signing.Signer``), a
    signed tombstone (edges with --operator-keys ignore a bare delete of a signed policy); without one, delete
    the record. Shared by the CLI and the operator console."""
    name = validate_name(name)
    if signer is None:
        if not await reg.delete_policy(name):
            return Removal(False, f"kdn: no policy named {name}")
        return Removal(True, f"policy {name} removed")
    from kdn.signing import Verifier

    # The tombstone is built from the name alone (a registry writer controls what is stored there). The stored
    # record only orders it: one this key signed, set on a machine whose clock ran ahead, must not outlive its
    # removal.
    at, note = time.time(), None
    raw = dict(await reg.list_keys(f"{POLICIES}{name}")).get(f"{POLICIES}{name}")
    old = None
    if raw is not None:
        try:
            old = Policy.unpack(raw)
        except KDNError:
            old = None
    if old is not None and old.name == name and Verifier([signer.public]).ok(old):
        if is_tombstone(old):
            return Removal(False, f"kdn: policy {name} is removed already")
        at = max(at, set_at(old) + 0.001)
    elif raw is None:
        note = (f"kdn: note: no policy named {name} in the registry; a signed tombstone is written anyway "
                "(edges that still apply one under that name drop it)")
    await reg.put_policy(signer.sign(tombstone(name, at)))
    return Removal(True, f"policy {name} removed (a signed tombstone: edges with --operator-keys drop it)", note)


def policy_row(p: Policy) -> tuple[str, str, str, str, str]:
    """The columns ``kdn policy ls`` prints for a policy an edge would apply (``validate_policy``) or a signed
    tombstone: name, kind, region (``*``: every one; a push's: the regions it goes to), scope and setting.
    The operator console shows the same (origin/console/policies.py)."""
    if is_tombstone(p):
        return p.name, "-", "-", "-", "removed (a signed tombstone)"
    if p.kind == "push":
        rate = p.extra.get("rate_bytes")
        return (p.name, p.kind, ",".join(p.extra.get("regions") or []) or "*", str(p.manifest),
                f"at most {format_size(rate)}/s per edge" if rate else "-")
    if p.kind in ("pin", "warm"):
        scope, setting = str(p.manifest), "-"
    elif p.kind == "ttl":
        assert p.ttl_s is not None  # (validate_policy: a ttl policy has its time)
        scope, setting = policy_scope(p), format_duration(p.ttl_s)
    elif p.kind == "upper":
        scope, setting = "every object", "the upper tier: other regions fill through it"
    else:
        assert p.quota_bytes is not None  # (validate_policy: a quota policy has its bytes)
        scope, setting = f"namespace {p.namespace}", format_size(p.quota_bytes)
    return p.name, p.kind, p.region or "*", scope, setting


def policy_scope(p: Policy) -> str:
    """What a ttl policy is about, in words: its namespace and/or manifest, or everything."""
    parts = [f"namespace {p.namespace}"] if p.namespace else []
    if p.manifest:
        parts.append(f"manifest {p.manifest}")
    return " and ".join(parts) or "everything"


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


@dataclass(frozen=True)
class _Ttl:
    seconds: float
    namespace: str | None
    manifest: str | None
    addresses: frozenset[Address]  # the manifest's, when it is resolved

    def matches(self, key: Key, meta: EntryMeta) -> bool:
        if self.namespace is not None and meta.namespace != self.namespace:
            return False
        if self.manifest is not None and not (key[0] in self.addresses or meta.manifest == self.manifest):
            return False
        return True


@dataclass(frozen=True)
class _Rules:
    """The rule function handed to the tiers; equal rules are not re-applied."""

    pinned: frozenset[Address] = frozenset()
    ttls: tuple[_Ttl, ...] = ()

    def __call__(self, key: Key, meta: EntryMeta) -> PolicyState:
        ttl = min((t.seconds for t in self.ttls if t.matches(key, meta)), default=None)
        return PolicyState(
            pinned=key[0] in self.pinned,
            expires_at=None if ttl is None else meta.inserted_at + ttl,
        )


def _addresses(m: Manifest) -> tuple[Address, ...]:
    return tuple(dict.fromkeys([*m.addresses, *m.standalone]))  # order kept, duplicates dropped


class PolicyEngine:
    """Follows ``policies/`` (and ``manifests/``) in the registry and applies them to this edge's tiers.

    ``await start()`` launches the watches and returns at once; the first
    snapshot is applied as soon as the registry answers (``ready``). With
    ``manifest_feed=True`` the engine does not watch ``manifests/`` itself:
    its owner, which follows that prefix anyway (the edge's one manifest view),
    hands it each event through ``feed_manifests``.
    """

    def __init__(
        self,
        registry,
        region: str,
        tiers: Sequence[GovernedTier],
        *,
        warm: Warm | None = None,
        retry_s: float = 0.5,
        max_retry_s: float = 30.0,
        manifest_feed: bool = False,
        verifier=None,
        bodies=None,
    ) -> None:
        self._registry = registry
        # Where the whole manifest a registry pointer names is read (``Manifest.body``: an origin with
        # ``--records store``): ``get_manifest_body(namespace, name, digest)``; None: pointers name nothing.
        self._bodies = bodies
        # kdn.signing.Verifier of the operator keys (--operator-keys): a policy none of them signed is skipped,
        # so a registry writer without an operator key can neither pin nor expire what it likes.
        self._verifier = verifier
        self._manifest_feed = manifest_feed
        self.region = validate_name(region)
        self._tiers = list(tiers)
        self._warm = warm
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
        self._rules: _Rules | None = None
        self._quotas: dict[str, int] | None = None
        self._warmed: dict[str, tuple[Policy, tuple[Address, ...]]] = {}
        self._warm_tasks: dict[str, asyncio.Task[None]] = {}
        # Public views, replaced whole at each apply so a reader never sees half a change.
        self._policies: dict[str, Policy] = {}
        self._active: dict[str, Policy] = {}
        self._pinned: frozenset[Address] = frozenset()
        self._upper: frozenset[str] = frozenset()
        self._unresolved: frozenset[str] = frozenset()
        self._invalid_view: dict[str, str] = {}
        self._ready = False
        self.stats = PolicyStats()
        self._queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue(maxsize=256)
        self._tasks: list[asyncio.Task[None]] = []
        self._retry: asyncio.TimerHandle | None = None
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
        await stop_tasks(self._tasks + list(self._warm_tasks.values()), what="policy")
        self._tasks, self._warm_tasks = [], {}

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

    def _kick(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):  # full: a batch is coming anyway
            self._queue.put_nowait(("retry", None))

    # --- applying ----------------------------------------------------------

    def _apply(self) -> None:
        here = {n: p for n, p in self._records.items() if self._here(p)}
        resolved = {ref: m for ref, m in self._manifests.items() if m is not None}
        pinned: set[Address] = set()
        ttls: list[_Ttl] = []
        quotas: dict[str, int] = {}
        for p in here.values():
            m = resolved.get(p.manifest) if p.manifest is not None else None
            if p.kind == "pin" and m is not None:
                pinned.update(_addresses(m))
            elif p.kind == "ttl" and p.ttl_s is not None:  # (a parsed ttl policy always has one)
                addrs = frozenset(_addresses(m)) if m is not None else frozenset()
                ttls.append(_Ttl(float(p.ttl_s), p.namespace, p.manifest, addrs))
            elif p.kind == "quota" and p.namespace is not None and p.quota_bytes is not None:
                quotas[p.namespace] = min(quotas.get(p.namespace, p.quota_bytes), p.quota_bytes)
        rules = _Rules(frozenset(pinned), tuple(sorted(ttls, key=lambda t: (t.seconds, t.namespace or "", t.manifest or ""))))
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
        self._start_warms(here, resolved)
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

    def _start_warms(self, here: dict[str, Policy], resolved: dict[str, Manifest]) -> None:
        warms = {n: p for n, p in here.items() if p.kind in ("warm", "push")}
        for name in list(self._warmed):
            if name not in warms:  # removed, or no longer for this region
                del self._warmed[name]
                self._cancel_warm(name)
        if self._warm is None:
            return
        for name, p in sorted(warms.items()):
            m = resolved.get(p.manifest) if p.manifest is not None else None
            if m is None:
                continue  # not published yet: warms when it is
            addrs = _addresses(m)
            if self._warmed.get(name) == (p, addrs):
                continue  # this record, this content: warmed already
            self._warmed[name] = (p, addrs)
            self._cancel_warm(name)
            self.stats.warm_runs += 1
            self._warm_tasks[name] = asyncio.create_task(self._run_warm(name, list(addrs), m.namespace, p),
                                                         name=f"kdn-warm-{name}")

    def _cancel_warm(self, name: str) -> None:
        task = self._warm_tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def _run_warm(self, name: str, addresses: list[Address], namespace: str, p: Policy) -> None:
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
            self.stats.warm_failures += 1
            log.warning("warm %s (%d objects of %s) failed: %s", name, len(addresses), namespace, _line(e))
        else:
            self.stats.warm_done += 1
            log.info("warm %s: %d objects of %s in %.2fs", name, len(addresses), namespace, time.monotonic() - t0)
        finally:
            if self._warm_tasks.get(name) is asyncio.current_task():
                del self._warm_tasks[name]
            self._notify()


def _line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0][:200]
