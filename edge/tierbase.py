"""The bookkeeping both edge tiers share: ``TierBase`` (index, accounting, pins, quotas, TTL, eviction),
its ``Entry`` and the handles' ``HandleBase``; ``MemoryTier`` and ``DiskTier`` only move the bytes.
The interface they meet is ``kdn.edge.tiers``.

When an insert does not fit, room is made in this order (``TierBase._make_room``):

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from kdn.format.address import validate_namespace
from kdn.errors import InvalidInput

from kdn.edge.eviction import ARC, EvictionPolicy, PolicyFactory
from kdn.edge.tiers import (EntryMeta, EvictCallback, Handle, Key, PolicyFn, Reason, TierStats, steady_wall,
                            validate_key)

HeldCallback = Callable[[Key, EntryMeta, bool], None]


@dataclass(eq=False)
class Entry:
    key: Key
    meta: EntryMeta
    payload: Any = None  # bytes (memory) or Path (disk)
    readers: int = 0
    writing: bool = False  # reserved, bytes not committed yet
    doomed: bool = False  # out of the index; freed at the last release
    gone: bool = False  # freed: no accounting left
    verified: bool = True
    verifying: asyncio.Future[bool] | None = None
    # Whole reads this tier answered from this entry (``HandleBase.count_read``): the operator console's
    # per-manifest hits. Bounded as the entry is; an eviction (or a restart) starts it again at 0.
    reads: int = 0

    @property
    def protected(self) -> bool:
        return self.meta.pinned or self.readers > 0 or self.writing


class TierBase:
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
        # ``fn(key, meta, present)``: an entry entered (True) or left (False) the index, for any reason; called
        # inside the tier's bookkeeping, so it only takes note (edge/kv_events.py). None: nobody listens.
        self.on_held: HeldCallback | None = None
        self._clock = clock
        self._policy: EvictionPolicy = policy(budget)
        self._index: dict[Key, Entry] = {}
        self._doomed: dict[Key, Entry] = {}
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
        e = Entry(key, meta, writing=True)
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

    def reads(self, key: Key) -> int | None:
        """The whole reads answered from ``key``'s entry since it arrived in this tier; None if not held."""
        return self._index[key].reads if self.contains(key) else None

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

    def _evict(self, eligible: Callable[[Entry], bool], needed: Callable[[], bool]) -> None:
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

    def _load(self, entries: list[Entry]) -> None:
        """Index entries found at start (oldest first), then evict down to the budget."""
        for e in entries:
            self._account(e, +1)
            self._commit(e)
        if self.used > self.budget:
            self._evict(lambda e: True, lambda: self.used > self.budget)
        self._notify()

    def _commit(self, e: Entry) -> None:
        self._index[e.key] = e
        self._policy.on_insert(e.key, e.meta.size)
        self._schedule_ttl(e)
        if self.on_held is not None:
            self.on_held(e.key, e.meta, True)

    def _schedule_ttl(self, e: Entry) -> None:
        if e.meta.expires_at is not None:
            self._seq += 1
            heapq.heappush(self._ttl, (e.meta.expires_at, self._seq, e.key))

    def _drop(self, e: Entry, reason: Reason | None = None) -> None:
        """Take ``e`` out of the index; free it now, or at its last release if a reader holds it."""
        del self._index[e.key]
        self._policy.remove(e.key)
        if self.on_held is not None:
            self.on_held(e.key, e.meta, False)
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

    def _release_bytes(self, e: Entry) -> None:
        self._account(e, -1)
        e.gone = True
        self._free(e)

    def _account(self, e: Entry, sign: int) -> None:
        ns, n = e.meta.namespace, e.meta.size
        self.used += sign * n
        self._ns_used[ns] = self._ns_used.get(ns, 0) + sign * n
        if e.protected:
            self._protected += sign * n
            self._ns_protected[ns] = self._ns_protected.get(ns, 0) + sign * n

    def _set(self, e: Entry, **changes: Any) -> None:
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

    def _pin(self, e: Entry) -> None:
        self._set(e, readers=e.readers + 1)

    def _unpin(self, e: Entry) -> None:
        self._set(e, readers=e.readers - 1)
        if e.readers == 0 and e.doomed and not e.gone:
            del self._doomed[e.key]
            self._release_bytes(e)

    async def _verify(self, e: Entry) -> bool:
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
            if self.on_held is not None:
                self.on_held(e.key, e.meta, False)
            self._release_bytes(e)
            self._events.append((e.key, e.meta, "corrupt"))
            self._notify()
        return ok and not e.gone

    # --- hooks -------------------------------------------------------------

    async def _write(self, e: Entry, blob: bytes | bytearray | memoryview) -> Any:
        raise NotImplementedError

    def _free(self, e: Entry) -> None:
        raise NotImplementedError

    async def _check(self, e: Entry) -> bool:
        return True

    def _handle(self, e: Entry) -> Handle:
        raise NotImplementedError


class HandleBase:
    """Release-once plumbing shared by the handles of both tiers."""

    data: memoryview | None = None  # set by a memory handle
    path: Path | None = None  # set by a disk handle

    def __init__(self, tier: TierBase, e: Entry) -> None:
        self.key, self.meta, self.size = e.key, e.meta, e.meta.size
        self._tier: TierBase | None = tier
        self._e = e

    def count_read(self) -> None:
        """One whole read answered from this entry (a GET; not a HEAD, a range or a fill's re-check)."""
        self._e.reads += 1

    def release(self) -> None:
        if self._tier is not None:
            tier, self._tier = self._tier, None
            tier._unpin(self._e)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
