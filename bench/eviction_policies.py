"""The eviction policies ``bench/eviction.py`` compares with the edge's (``kdn.edge.eviction``):
LRU (the baseline every cache paper uses), W-TinyLFU and a prefix-aware LRU.

They were in ``kdn.edge.eviction`` until the traces chose the edge's default (ARC): the edge
does not use these, so they live with the bench that measures them. Same protocol, same
byte-sized contract as the edge's policies; ``tests/bench/test_eviction_trace.py`` checks each
against known behaviour.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Protocol

from kdn.edge.eviction import EvictionPolicy

Key = Hashable


class ChainAwarePolicy(EvictionPolicy, Protocol):
    """An :class:`EvictionPolicy` that also takes a key's parent chunk on insert (:class:`PrefixLRU`).

    ``parent`` is the key of the chunk just before this one in its prefix chain
    (None for a chain's first chunk, or when the caller does not know): an
    object's header names its parent address (``kdn.format.objects``), so a tier could
    pass ``(header.parent, encoding)``. The tiers do not yet (``EntryMeta``
    carries no parent): a tier that calls the plain ``on_insert(key, size)``
    gets the policy's parent-blind behaviour.
    """

    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None: ...


class LRU:
    """Least recently used: the baseline every cache paper compares with.

    One ``OrderedDict`` from least to most recently used. A skipped victim is
    moved to the most-recent end (it is pinned or being read: in use, hence
    recent), so the walk stops when it meets a key it has already skipped.
    """

    def __init__(self, budget: int = 0) -> None:
        self._order: OrderedDict[Key, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def on_insert(self, key: Key, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Key]:
        skipped: set[Key] = set()
        while self._order:
            key = next(iter(self._order))
            if key in skipped:
                return  # every key still here was offered and refused
            yield key
            if key in self._order:  # the tier skipped it
                skipped.add(key)
                self._order.move_to_end(key)


_M64 = (1 << 64) - 1
_HALVE = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """TinyLFU's frequency estimate: a count-min sketch of 4-bit counters (0..15), 4 rows,
    halved every ``10 x capacity`` increments (the aging of Einziger, Friedman and Manes,
    "TinyLFU: A Highly Efficient Cache Admission Policy", ACM ToS 2017), as in Caffeine.

    ``width`` is the power of two at or above ``capacity`` (the number of
    entries the cache holds); ``ensure_capacity`` grows it, starting over.
    """

    _SEEDS = (0xC3A5C85C97CB3127, 0xB492B66FBE98F273, 0x9AE16A3B2F90404F, 0xCBF29CE484222325)

    def __init__(self, capacity: int, *, sample_factor: int = 10) -> None:
        self._sample_factor = sample_factor
        self.width = 0
        self.ensure_capacity(capacity)

    def ensure_capacity(self, capacity: int) -> None:
        width = 1 << max(4, (max(1, capacity) - 1).bit_length())
        if width <= self.width:
            return
        self.width = width
        self._shift = 64 - (width.bit_length() - 1)
        self._rows = [bytearray(width) for _ in self._SEEDS]
        self.sample_size = self._sample_factor * max(1, capacity)
        self.additions = 0

    def _indexes(self, key: Key) -> list[int]:
        h = hash(key) & _M64  # murmur3's fmix64, then one multiply-shift per row
        h = ((h ^ (h >> 33)) * 0xFF51AFD7ED558CCD) & _M64
        h = ((h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
        h ^= h >> 33
        return [((h * s) & _M64) >> self._shift for s in self._SEEDS]

    def frequency(self, key: Key) -> int:
        return min(row[i] for row, i in zip(self._rows, self._indexes(key)))

    def increment(self, key: Key) -> None:
        added = False
        for row, i in zip(self._rows, self._indexes(key)):
            if row[i] < 15:
                row[i] += 1
                added = True
        if added:
            self.additions += 1
            if self.additions >= self.sample_size:
                self.reset()

    def reset(self) -> None:
        """Halve every counter (the sketch forgets old popularity)."""
        self._rows = [row.translate(_HALVE) for row in self._rows]
        self.additions //= 2


class WTinyLFU:
    """W-TinyLFU: Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission
    Policy", ACM Transactions on Storage 2017 (https://doi.org/10.1145/3149371), as
    Caffeine implements it, with a fixed window. Byte-sized.

    - *window* (1% of the budget, LRU): every new key enters here.
    - *main* (the rest, segmented LRU): *probation* and *protected* (80% of
      main). A hit in probation moves a key to protected; protected's overflow
      goes back to probation's most recent end.
    - *admission*: when room is needed and the window is full, the window's
      LRU key (the candidate) duels probation's LRU key (the victim): the one
      that :class:`FrequencySketch` says is less frequent is evicted, the
      victim on a tie (TinyLFU admits only a strictly more frequent key).
      Like Caffeine, a candidate with frequency >= 6 that would lose is
      admitted anyway with probability 1/128 (seeded), against hash flooding.
    - every hit and every insert counts once in the sketch. No doorkeeper.

    A tier makes room before it inserts the new key, so the duel runs while
    the window is full, one insert ahead of Caffeine's order (insert, move the
    window's LRU key to probation, evict): with equal sizes the two evict the
    same keys. Without a ``capacity`` (entries) the sketch grows with the
    number of keys held, as Caffeine's does for weighted caches.
    """

    def __init__(
        self,
        budget: int,
        *,
        window_ratio: float = 0.01,
        protected_ratio: float = 0.80,
        capacity: int | None = None,
        seed: int = 0,
    ) -> None:
        self._window_target = max(1, int(budget * window_ratio))
        self._protected_target = int(max(1, budget - self._window_target) * protected_ratio)
        self._window: OrderedDict[Key, int] = OrderedDict()  # key -> size, head = least recent
        self._probation: OrderedDict[Key, int] = OrderedDict()
        self._protected: OrderedDict[Key, int] = OrderedDict()
        self._where: dict[Key, OrderedDict[Key, int]] = {}
        self._window_bytes = self._protected_bytes = 0
        self._grow = capacity is None
        self.sketch = FrequencySketch(capacity if capacity is not None else 16)
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Key) -> bool:
        return key in self._where

    def queue_of(self, key: Key) -> str | None:
        """``"window"``, ``"probation"``, ``"protected"`` or None (for tests and debugging)."""
        q = self._where.get(key)
        for name, queue in (("window", self._window), ("probation", self._probation), ("protected", self._protected)):
            if q is queue:
                return name
        return None

    def on_insert(self, key: Key, size: int) -> None:
        if key in self._where:
            return
        if self._grow and len(self._where) >= self.sketch.width:
            self.sketch.ensure_capacity(2 * self.sketch.width)
        self.sketch.increment(key)
        self._window[key] = size
        self._where[key] = self._window
        self._window_bytes += size
        while self._window_bytes > self._window_target and len(self._window) > 1:
            k, s = self._window.popitem(last=False)  # room was made: it joins main without a duel
            self._window_bytes -= s
            self._probation[k] = s
            self._where[k] = self._probation

    def on_access(self, key: Key) -> None:
        q = self._where.get(key)
        if q is None:
            return
        self.sketch.increment(key)
        if q is self._probation:
            size = self._probation.pop(key)
            self._protected[key] = size
            self._where[key] = self._protected
            self._protected_bytes += size
            while self._protected_bytes > self._protected_target and len(self._protected) > 1:
                k, s = self._protected.popitem(last=False)
                self._protected_bytes -= s
                self._probation[k] = s
                self._where[k] = self._probation
        else:
            q.move_to_end(key)

    def remove(self, key: Key) -> None:
        q = self._where.pop(key, None)
        if q is None:
            return
        size = q.pop(key)
        if q is self._window:
            self._window_bytes -= size
        elif q is self._protected:
            self._protected_bytes -= size

    def _admit(self, candidate: Key, victim: Key) -> bool:
        cf, vf = self.sketch.frequency(candidate), self.sketch.frequency(victim)
        if cf > vf:
            return True
        return cf >= 6 and self._rng.random() < 1 / 128

    @staticmethod
    def _first(q: OrderedDict[Key, int], skipped: set[Key]) -> Key | None:
        for k in q:  # skipped keys were moved to the end
            if k not in skipped:
                return k
        return None

    def victims(self) -> Iterator[Key]:
        skipped: set[Key] = set()
        while True:
            cand = self._first(self._window, skipped) if self._window_bytes >= self._window_target else None
            victim = self._first(self._probation, skipped)
            if victim is None:
                victim = self._first(self._protected, skipped)
            if victim is None and cand is None:
                victim = self._first(self._window, skipped)
                if victim is None:
                    return
            if cand is not None and victim is not None:
                loser = victim if self._admit(cand, victim) else cand
            else:
                loser = cand if victim is None else victim
            try:
                yield loser
            finally:
                q = self._where.get(loser)
                if q is not None:  # skipped: pinned or in use
                    skipped.add(loser)
                    q.move_to_end(loser)
                elif loser is victim and cand is not None and cand in self._window:
                    size = self._window.pop(cand)  # the candidate won its duel: into main
                    self._window_bytes -= size
                    self._probation[cand] = size
                    self._where[cand] = self._probation


class PrefixLRU:
    """Prefix-aware LRU for chunk chains: evict the deepest chunk of the least recently used chain first.

    An engine reuses a prompt's chunks only up to the first one missing, so a
    chunk is worth something only while every chunk before it is cached, and
    a parent is worth at least as much as any of its children (every prefix
    hit that reads the child reads the parent). The policy keeps the cached
    chunks as a forest (``on_insert(key, size, parent=...)``) and evicts in
    this order:

    1. *orphans*: chunks whose named parent is not cached (unreachable, so no
       reusable tokens), least recently used first;
    2. *leaves* (chunks no cached chunk names as parent), least recently used
       first. A request touches its chain head to tail, so the tail is never
       older than the head; evicting a leaf can make its parent a leaf, so a
       cold chain is eaten from its tail, and a head shared by many chains
       (a system prompt) stays while any of them does. LRU, with the same
       accesses, evicts a chain's head first and strands the rest;
    3. anything left (parents whose descendants the tier refused), least
       recently used first.

    The score it keeps is thus "reusable tokens a chunk enables": a parent
    enables at least its children's, so no chunk goes before its
    descendants. Without parents (a plain ``on_insert(key, size)``) every key
    is a root and a leaf and this is exactly LRU. Byte-sized like the others.

    In a tier, "parent absent" means absent *from this tier*: it fits a cache
    whose reads stop at its first miss. A memory tier in front of a disk tier
    that holds the parents should pass ``parent=None``. A skipped key (pinned,
    in use) counts as just used.
    """

    def __init__(self, budget: int = 0) -> None:
        self._size: dict[Key, int] = {}
        self._parent: dict[Key, Key | None] = {}
        self._stamp: dict[Key, int] = {}  # last use
        self._kids: dict[Key, set[Key]] = {}  # parent -> its cached children (parent cached or not)
        self._orphans: OrderedDict[Key, None] = OrderedDict()
        self._heap: list[tuple[int, int, Key]] = []  # (stamp, seq, key) of leaves; stale items skipped
        self._tick = 0
        self._seq = 0
        self._walking = False

    def __len__(self) -> int:
        return len(self._size)

    def __contains__(self, key: Key) -> bool:
        return key in self._size

    def _is_leaf(self, key: Key) -> bool:
        return key in self._size and key not in self._orphans and key not in self._kids

    def _push(self, key: Key) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self._stamp[key], self._seq, key))

    def _touch(self, key: Key) -> None:
        self._tick += 1
        self._stamp[key] = self._tick
        if key in self._orphans:
            self._orphans.move_to_end(key)
        elif key not in self._kids:
            self._push(key)
        if not self._walking and len(self._heap) > 2 * len(self._size) + 64:
            self._heap = [(self._stamp[k], i, k) for i, k in enumerate(self._size) if self._is_leaf(k)]
            heapq.heapify(self._heap)
            self._seq = len(self._heap)

    def on_insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._size:
            return
        self._size[key] = size
        self._parent[key] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(key)
            if parent not in self._size:
                self._orphans[key] = None
        for c in self._kids.get(key, ()):  # children cached before their parent: reachable again
            if self._orphans.pop(c, False) is None and self._is_leaf(c):
                self._push(c)
        self._touch(key)

    def on_access(self, key: Key) -> None:
        if key in self._size:
            self._touch(key)

    def remove(self, key: Key) -> None:
        if key not in self._size:
            return
        del self._size[key], self._stamp[key]
        parent = self._parent.pop(key)
        self._orphans.pop(key, None)
        if parent is not None:
            siblings = self._kids[parent]
            siblings.discard(key)
            if not siblings:
                del self._kids[parent]
                if self._is_leaf(parent):
                    self._push(parent)
        for c in self._kids.get(key, ()):
            self._orphans[c] = None

    def victims(self) -> Iterator[Key]:
        offered: set[Key] = set()
        refused: list[Key] = []
        self._walking = True
        try:
            while True:  # 1. orphans (an evicted orphan may orphan its children: look again)
                batch = [k for k in self._orphans if k not in offered]
                if not batch:
                    break
                for k in batch:
                    if k in self._orphans:
                        offered.add(k)
                        yield k
                        if k in self._size:
                            refused.append(k)
            while self._heap:  # 2. leaves, least recently used first
                stamp, _, k = heapq.heappop(self._heap)
                if k in offered or not self._is_leaf(k) or self._stamp[k] != stamp:
                    continue
                offered.add(k)
                yield k
                if k in self._size:
                    refused.append(k)
            for k in sorted((k for k in self._size if k not in offered), key=self._stamp.__getitem__):
                if k in self._size:  # 3. what the tier's refusals left
                    offered.add(k)
                    yield k
                    if k in self._size:
                        refused.append(k)
        finally:
            self._walking = False
            for k in refused:
                if k in self._size:
                    self._touch(k)
