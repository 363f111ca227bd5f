"""Cache tiers of the edge: the ``Tier`` interface, its entry types, and the bookkeeping both tiers share.

A tier (memory, disk) holds immutable blobs by ``(address, encoding)`` under a
byte budget. Reads go through a *handle* that holds the entry while the bytes
are in use (vLLM's kv_offload pins blocks during I/O the same way): a held
entry's bytes are never freed under its reader (an eviction, expiry or ``delete``
takes it out of the index and frees it at the last handle's release; eviction
and the expiry pass skip held entries; a read finding it past its TTL drops it).
Operator policy (``pinned``: never evicted; TTL) is
applied from outside with ``apply_policy``; per-namespace quotas with
``set_quotas``.

When an insert does not fit, room is made in this order (``_BaseTier._make_room``):

1. every TTL-expired entry that is not pinned or in use is dropped (reason ``ttl``);
2. if the namespace has a quota and the insert would take it over, only that
   namespace's own entries are evicted, in policy order, until it fits its
   quota; if its pinned and in-use bytes alone leave no room, the insert is
   refused. A quota is a hard cap: a namespace never holds more than its quota,
   so its inserts never push another namespace's data out to grow past it;
3. if the tier is still over budget, any namespace's entries are evicted in
   policy order (reason ``capacity``).

Entries that are pinned or held by a reader are skipped by every step. The
plan is checked before anything is evicted, so a refused insert evicts nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from kdn.address import Address, Digest, validate_address, validate_name, validate_namespace
from kdn.errors import InvalidInput
from kdn.store import validate_encoding

from kdn.edge.eviction import ARC, EvictionPolicy, PolicyFactory

_WALL0, _MONO0 = time.time(), time.monotonic()


def steady_wall() -> float:
    """Wall-clock seconds that a step of the system clock does not move: the wall time when this process
    started plus the monotonic time since. TTLs are measured on it. They are persisted as wall time (the
    disk tier's ``inserted_at`` must mean something after a restart), but within a process an NTP step or
    ``date -s`` forward expired every entry at once, and one backward kept every entry alive for as long
    as the step (bench/faults.py ``clock_jump``)."""
    return _WALL0 + (time.monotonic() - _MONO0)


Key = tuple[Address, str]
"""``(address, encoding)``: one immutable blob."""

Reason = Literal["capacity", "ttl", "corrupt"]
EvictCallback = Callable[[Key, "EntryMeta", Reason], None]
PolicyFn = Callable[[Key, "EntryMeta"], "PolicyState"]
"""``fn(key, meta)``: the key too, because a pin by manifest is decided by address."""


def validate_key(key: object) -> Key:
    if not (isinstance(key, tuple) and len(key) == 2):
        raise InvalidInput("a tier key is an (address, encoding) tuple")
    return validate_address(key[0]), validate_encoding(key[1])


@dataclass(frozen=True)
class EntryMeta:
    """What a tier knows about one blob. ``pinned``/``expires_at`` are policy state, set from outside."""

    size: int
    digest: Digest  # BLAKE3 hex of the blob, as in the registry
    namespace: str
    manifest: str | None = None  # "namespace/name" of the manifest it was published in
    # When the object arrived at this edge, wall-clock seconds (``steady_wall``). A put keeps a value the
    # caller set (a copy between tiers: the disk persist, a promotion to memory) and stamps 0 with its
    # clock, so a TTL counts from the object's arrival, not from its latest copy.
    inserted_at: float = 0.0
    pinned: bool = False  # never evicted while pinned
    # After it the entry is not served (a miss; a pin overrides it) and is dropped by the next expiry pass
    # or read; before it, an entry with a TTL is dropped first under pressure.
    expires_at: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise InvalidInput(f"entry size must be a non-negative int, got {self.size!r}")
        validate_address(self.digest, what="digest")
        validate_namespace(self.namespace)
        if self.manifest is not None:
            ns, _, name = self.manifest.partition("/")
            validate_namespace(ns)
            validate_name(name)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


@dataclass(frozen=True)
class PolicyState:
    """The operator's verdict on one entry: see ``Tier.apply_policy``."""

    pinned: bool = False
    expires_at: float | None = None


@dataclass
class TierStats:
    """Plain counters; the server exports them as Prometheus metrics."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0  # bytes handed out through hits
    inserts: int = 0
    inserted_bytes: int = 0
    refused: int = 0  # puts that could not fit
    corrupt: int = 0  # entries whose bytes failed their digest (disk, first read after a restart)
    evictions: dict[str, int] = field(default_factory=lambda: {"capacity": 0, "ttl": 0})
    evicted_bytes: dict[str, int] = field(default_factory=lambda: {"capacity": 0, "ttl": 0})


class Handle(Protocol):
    """A pinned read of one entry. Release it (or leave its ``with`` block) when the bytes are sent.

    It says how it is best sent: ``data``, a view of bytes held in memory (written as they are), or
    ``path``, a file (sendfile); exactly one of them is set."""

    key: Key
    meta: EntryMeta
    size: int
    data: memoryview | None
    path: Path | None

    async def read(self) -> bytes | memoryview: ...
    def release(self) -> None: ...
    def __enter__(self) -> Handle: ...
    def __exit__(self, *exc: object) -> None: ...


class CacheTier(Protocol):
    """What the read path needs of a tier (``Edge.load``): pinned reads, inserts, membership.
    Methods that may touch a disk are async; bookkeeping ones are not."""

    name: str  # "memory" / "disk"
    budget: int  # bytes
    used: int  # bytes held, including deleted entries still held by readers and writes in flight
    stats: TierStats

    async def acquire(self, key: Key) -> Handle | None:
        """A pinned handle on the entry, or None on a miss. Counts a hit or a miss."""
        ...

    async def put(self, key: Key, blob: bytes | bytearray | memoryview, meta: EntryMeta) -> bool:
        """Insert; False if it cannot fit. A key already present (or being written) is not written twice."""
        ...

    async def delete(self, key: Key) -> bool:
        """Remove now, or at the last release if a reader holds it; False if absent."""
        ...

    def contains(self, key: Key) -> bool: ...


class GovernedTier(Protocol):
    """What operator policies need of a tier (``PolicyEngine``): its entries, pins, TTLs and quotas."""

    name: str
    on_evict: EvictCallback | None  # called after an entry leaves for "capacity", "ttl" or "corrupt"

    def keys(self) -> list[Key]: ...
    def entries(self) -> list[tuple[Key, EntryMeta]]: ...
    def apply_policy(self, fn: PolicyFn | None) -> None:
        """Set pin and TTL of every entry from ``fn(key, meta)``, now and on every later put; None clears it."""
        ...

    def set_quotas(self, quotas: dict[str, int]) -> None: ...
    async def expire(self, now: float | None = None) -> int:
        """Drop every expired entry that is not pinned or in use; returns how many."""
        ...


class Tier(CacheTier, GovernedTier, Protocol):
    """A whole tier, as the memory and disk tiers are: both faces."""


@dataclass(eq=False)
class _Entry:
    key: Key
    meta: EntryMeta
    payload: Any = None  # bytes (memory) or Path (disk)
    readers: int = 0
    writing: bool = False  # reserved, bytes not committed yet
    doomed: bool = False  # out of the index; freed at the last release
    gone: bool = False  # freed: no accounting left
    verified: bool = True
    verifying: asyncio.Future[bool] | None = None

    @property
    def protected(self) -> bool:
        return self.meta.pinned or self.readers > 0 or self.writing


class _BaseTier:
    """Index, accounting, pins, quotas, TTL and eviction for a tier; subclasses move the bytes.

    Hooks: ``_write(entry, blob)`` stores bytes and returns the payload;
    ``_free(entry)`` drops them (synchronous: at most an unlink);
    ``_check(entry)`` verifies an unverified entry; ``_handle(entry)`` makes a handle.
    """

    name = "tier"

    def __init__(
        self,
        budget: int,
        policy: PolicyFactory = ARC,
        *,
        on_evict: EvictCallback | None = None,
        clock: Callable[[], float] = steady_wall,
    ) -> None:
        if budget <= 0:
            raise InvalidInput("a tier budget must be positive")
        self.budget = budget
        self.used = 0
        self.stats = TierStats()
        self.on_evict = on_evict
        self._clock = clock
        self._policy: EvictionPolicy = policy(budget)
        self._index: dict[Key, _Entry] = {}
        self._doomed: dict[Key, _Entry] = {}
        self._pending: dict[Key, asyncio.Future[bool]] = {}
        self._ns_used: dict[str, int] = {}
        self._protected = 0  # bytes that no eviction may touch (pinned, read, being written)
        self._ns_protected: dict[str, int] = {}
        self._quotas: dict[str, int] = {}
        self._rule: PolicyFn | None = None
        self._ttl: list[tuple[float, int, Key]] = []  # heap; stale items are skipped
        self._seq = 0
        self._events: list[tuple[Key, EntryMeta, Reason]] = []

    # --- the Tier interface ------------------------------------------------

    async def acquire(self, key: Key) -> Handle | None:
        key = validate_key(key)
        e = self._index.get(key)
        if e is not None and e.meta.expires_at is not None and not e.meta.pinned and e.meta.expired(self._clock()):
            # Past its TTL but not yet swept (the expiry pass runs each second; a restarted edge applies
            # its policies to a warm disk at once): a miss, never one more hit. (A pin beats a TTL.) Dropped
            # even while another reader holds it (its bytes go at that reader's release), so the refill
            # that follows is cached with a fresh arrival time instead of finding the key taken.
            self._drop(e, "ttl")
            self._notify()
            e = None
        if e is None:
            self.stats.misses += 1
            return None
        self._pin(e)
        try:
            ok = e.verified or await self._verify(e)
        except BaseException:  # cancelled while another reader hashes: give the pin back
            self._unpin(e)
            raise
        if not ok:
            self._unpin(e)
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.hit_bytes += e.meta.size
        self._policy.on_access(key)
        return self._handle(e)

    async def put(self, key: Key, blob: bytes | bytearray | memoryview, meta: EntryMeta) -> bool:
        key = validate_key(key)
        n = memoryview(blob).nbytes
        if n != meta.size:
            raise InvalidInput(f"blob is {n} bytes but its metadata says {meta.size}")
        if key in self._index:
            return True  # content-addressed: same key, same bytes
        if key in self._pending:
            return await asyncio.shield(self._pending[key])
        if meta.inserted_at <= 0:
            meta = replace(meta, inserted_at=self._clock())
        meta = self._ruled(key, meta)
        if key in self._doomed:  # deleted while read, bytes still here: take it back
            e = self._doomed.pop(key)
            self._account(e, -1)
            e.doomed, e.meta = False, replace(meta, size=e.meta.size)
            self._account(e, +1)
            self._commit(e)
            return True
        fits = self._make_room(meta.namespace, meta.size)
        self._notify()
        if not fits:
            self.stats.refused += 1
            return False
        e = _Entry(key, meta, writing=True)
        self._account(e, +1)
        done = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            e.payload = await self._write(e, blob)
        except BaseException:
            self._account(e, -1)
            done.set_result(False)
            raise
        finally:
            del self._pending[key]
        # Rule again: a policy applied while the bytes were written saw no
        # index entry for this key (it is only reserved), so without this a
        # pin that arrives mid-write would be lost.
        self._set(e, writing=False, meta=self._ruled(key, e.meta))
        self._commit(e)
        self.stats.inserts += 1
        self.stats.inserted_bytes += meta.size
        done.set_result(True)
        return True

    async def delete(self, key: Key) -> bool:
        e = self._index.get(validate_key(key))
        if e is None:
            return False
        self._drop(e)
        return True

    def contains(self, key: Key) -> bool:
        e = self._index.get(validate_key(key))
        # what acquire would serve (the clock is read only for an entry with a TTL)
        return e is not None and (e.meta.expires_at is None or e.meta.pinned or not e.meta.expired(self._clock()))

    def keys(self) -> list[Key]:
        return list(self._index)

    def entries(self) -> list[tuple[Key, EntryMeta]]:
        return [(k, e.meta) for k, e in self._index.items()]

    def apply_policy(self, fn: PolicyFn | None) -> None:
        self._rule = fn
        if fn is None:
            return
        for e in list(self._index.values()):
            self._set(e, meta=self._ruled(e.key, e.meta))
            self._schedule_ttl(e)

    def set_quotas(self, quotas: dict[str, int]) -> None:
        """Per-namespace byte caps, replacing the previous ones; applied from the next insert on."""
        self._quotas = {validate_namespace(ns): int(b) for ns, b in quotas.items()}

    async def expire(self, now: float | None = None) -> int:
        n = self._expire(self._clock() if now is None else now)
        self._notify()
        return n

    # --- room --------------------------------------------------------------

    def _make_room(self, ns: str, size: int) -> bool:
        """Evict so that ``size`` more bytes of ``ns`` fit; False (and nothing evicted) if they cannot."""
        quota = self._quotas.get(ns)
        if self._protected + size > self.budget:
            return False
        if quota is not None and self._ns_protected.get(ns, 0) + size > quota:
            return False
        ns_over = lambda: quota is not None and self._ns_used.get(ns, 0) + size > quota  # noqa: E731
        over = lambda: self.used + size > self.budget  # noqa: E731
        if not (over() or ns_over()):
            return True
        self._expire(self._clock())
        if ns_over():
            self._evict(lambda e: e.meta.namespace == ns, ns_over)
        if over():
            self._evict(lambda e: True, over)
        return True

    def _evict(self, eligible: Callable[[_Entry], bool], needed: Callable[[], bool]) -> None:
        # The victims() walk is lazy: remove() each victim before resuming it;
        # resuming without remove() tells the policy the key was skipped.
        walk = self._policy.victims()
        try:
            for key in walk:
                e = self._index[cast(Key, key)]  # the policy hands back the keys the tier gave it
                if e.protected or not eligible(e):
                    continue
                self._drop(e, "capacity")
                if not needed():
                    break
        finally:
            walk.close()

    def _expire(self, now: float) -> int:
        n, keep = 0, []
        while self._ttl and self._ttl[0][0] <= now:
            item = heapq.heappop(self._ttl)
            e = self._index.get(item[2])
            if e is None or e.meta.expires_at != item[0]:
                continue  # stale: entry gone or its TTL changed
            if e.protected:
                keep.append(item)  # pinned or read: try again at the next expiry
                continue
            self._drop(e, "ttl")
            n += 1
        for item in keep:
            heapq.heappush(self._ttl, item)
        return n

    # --- bookkeeping -------------------------------------------------------

    def _ruled(self, key: Key, meta: EntryMeta) -> EntryMeta:
        if self._rule is None:
            return meta
        s = self._rule(key, meta)
        return replace(meta, pinned=s.pinned, expires_at=s.expires_at)

    def _load(self, entries: list[_Entry]) -> None:
        """Index entries found at start (oldest first), then evict down to the budget."""
        for e in entries:
            self._account(e, +1)
            self._commit(e)
        if self.used > self.budget:
            self._evict(lambda e: True, lambda: self.used > self.budget)
        self._notify()

    def _commit(self, e: _Entry) -> None:
        self._index[e.key] = e
        self._policy.on_insert(e.key, e.meta.size)
        self._schedule_ttl(e)

    def _schedule_ttl(self, e: _Entry) -> None:
        if e.meta.expires_at is not None:
            self._seq += 1
            heapq.heappush(self._ttl, (e.meta.expires_at, self._seq, e.key))

    def _drop(self, e: _Entry, reason: Reason | None = None) -> None:
        """Take ``e`` out of the index; free it now, or at its last release if a reader holds it."""
        del self._index[e.key]
        self._policy.remove(e.key)
        if reason is not None:
            self.stats.evictions[reason] = self.stats.evictions.get(reason, 0) + 1
            self.stats.evicted_bytes[reason] = self.stats.evicted_bytes.get(reason, 0) + e.meta.size
        if e.readers:
            e.doomed = True
            self._doomed[e.key] = e
        else:
            self._release_bytes(e)
        if reason is not None:
            self._events.append((e.key, e.meta, reason))

    def _notify(self) -> None:
        # Callbacks run after the eviction walk is over, so one that calls
        # back into the tier cannot disturb the policy's iterator.
        events, self._events = self._events, []
        if self.on_evict is not None:
            for key, meta, reason in events:
                self.on_evict(key, meta, reason)

    def _release_bytes(self, e: _Entry) -> None:
        self._account(e, -1)
        e.gone = True
        self._free(e)

    def _account(self, e: _Entry, sign: int) -> None:
        ns, n = e.meta.namespace, e.meta.size
        self.used += sign * n
        self._ns_used[ns] = self._ns_used.get(ns, 0) + sign * n
        if e.protected:
            self._protected += sign * n
            self._ns_protected[ns] = self._ns_protected.get(ns, 0) + sign * n

    def _set(self, e: _Entry, **changes: Any) -> None:
        """Change fields that decide ``protected``, keeping the protected byte counts right."""
        counted = not e.gone
        if counted and e.protected:
            self._protected -= e.meta.size
            self._ns_protected[e.meta.namespace] -= e.meta.size
        for k, v in changes.items():
            setattr(e, k, v)
        if counted and e.protected:
            self._protected += e.meta.size
            self._ns_protected[e.meta.namespace] = self._ns_protected.get(e.meta.namespace, 0) + e.meta.size

    def _pin(self, e: _Entry) -> None:
        self._set(e, readers=e.readers + 1)

    def _unpin(self, e: _Entry) -> None:
        self._set(e, readers=e.readers - 1)
        if e.readers == 0 and e.doomed and not e.gone:
            del self._doomed[e.key]
            self._release_bytes(e)

    async def _verify(self, e: _Entry) -> bool:
        # Readers that arrive while the first one hashes wait on the same
        # future; whoever resumes first on a mismatch drops the entry, so it
        # is counted once and nobody ever gets a handle on it.
        if e.verifying is None:
            e.verifying = asyncio.ensure_future(self._check(e))
        ok = await asyncio.shield(e.verifying)
        if ok:
            e.verified = True
        elif not e.gone and not e.doomed:
            # Nobody holds a handle on an unverified entry (the waiters only
            # hold pins), so the bytes go now rather than at the last release.
            self.stats.corrupt += 1
            del self._index[e.key]
            self._policy.remove(e.key)
            self._release_bytes(e)
            self._events.append((e.key, e.meta, "corrupt"))
            self._notify()
        return ok and not e.gone

    # --- hooks -------------------------------------------------------------

    async def _write(self, e: _Entry, blob: bytes | bytearray | memoryview) -> Any:
        raise NotImplementedError

    def _free(self, e: _Entry) -> None:
        raise NotImplementedError

    async def _check(self, e: _Entry) -> bool:
        return True

    def _handle(self, e: _Entry) -> Handle:
        raise NotImplementedError


class _HandleBase:
    """Release-once plumbing shared by the handles of both tiers."""

    data: memoryview | None = None  # set by a memory handle
    path: Path | None = None  # set by a disk handle

    def __init__(self, tier: _BaseTier, e: _Entry) -> None:
        self.key, self.meta, self.size = e.key, e.meta, e.meta.size
        self._tier: _BaseTier | None = tier
        self._e = e

    def release(self) -> None:
        if self._tier is not None:
            tier, self._tier = self._tier, None
            tier._unpin(self._e)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
