"""Eviction policies for the edge tiers: S3-FIFO (the default) and LRU (the baseline).

A policy only orders keys; it holds no bytes and knows nothing of pins,
readers, quotas or TTLs. Its whole interface is :class:`EvictionPolicy`:
the tier reports inserts, hits and removals, and asks for ``victims()`` when it
needs room. The tier *filters* that stream: it evicts a victim by calling
``remove(key)`` before it asks for the next one, and skips a victim (pinned, in
use, another namespace's) by simply asking for the next one. A skipped key
stays cached; the policy moves it to the back of its queue (a CLOCK-style
second chance) so that the walk ends once every remaining key was skipped.

Both policies are byte-sized: a 6 MiB object takes six times the room of a
1 MiB one. Construct them with the tier's budget in bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    """Orders keys for eviction. Not thread-safe: the tier calls it from its event loop."""

    def on_insert(self, key: Key, size: int) -> None: ...
    def on_access(self, key: Key) -> None: ...
    def remove(self, key: Key) -> None: ...
    def victims(self) -> Iterator[Key]:
        """Keys in eviction order. Call ``remove(k)`` for a yielded ``k`` to evict it; resume to skip it.

        While the iterator is open, remove no key but the one just yielded, and insert none.
        """
        ...


PolicyFactory = Callable[[int], EvictionPolicy]
"""A policy class or factory: ``factory(budget_bytes) -> EvictionPolicy``."""


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


class S3FIFO:
    """S3-FIFO: Yang, Zhang, Qiu, Yue, Rashmi, "FIFO queues are all you need for
    cache eviction", SOSP 2023 (https://doi.org/10.1145/3600006.3613147).

    Three FIFO queues, byte-sized here:

    - *small* (S, ~10% of the budget): every new key enters here, unless it is
      in the ghost queue. Most objects are one-hit wonders and leave from S
      quickly without displacing anything in M.
    - *main* (M, the rest): keys that proved themselves. Each key has a 2-bit
      frequency (0..3) that hits increment; at M's head a key with freq > 0 is
      reinserted at the tail with freq - 1 (FIFO-reinsertion), else evicted.
    - *ghost* (G): keys recently evicted from S, no data; its byte total is
      capped at M's share (the paper keeps as many entries as M). A key
      inserted while in G goes straight to M.

    Evict from S while S holds at least its share (or M is empty): its head
    goes to M if it was hit at least once since insertion (frequency cleared,
    libCacheSim's ``move-to-main-threshold=1``), else it is evicted into G.
    Otherwise evict from M as above.
    """

    def __init__(self, budget: int, *, small_ratio: float = 0.10, max_freq: int = 3) -> None:
        self._small_target = max(1, int(budget * small_ratio))
        self._ghost_cap = max(1, budget - self._small_target)
        self._max_freq = max_freq
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> size, head = oldest
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_bytes = 0
        self._ghost_bytes = 0

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq

    def queue_of(self, key: Key) -> str | None:
        """``"small"``, ``"main"``, ``"ghost"`` or None (for tests and debugging)."""
        for name, q in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if key in q:
                return name
        return None

    def on_insert(self, key: Key, size: int) -> None:
        if key in self._freq:
            return
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and f < self._max_freq:
            self._freq[key] = f + 1

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        else:
            self._main.pop(key, None)

    def victims(self) -> Iterator[Key]:
        skipped_small: set[Key] = set()
        skipped_main: set[Key] = set()
        while len(skipped_small) < len(self._small) or len(skipped_main) < len(self._main):
            from_small = len(skipped_small) < len(self._small) and (
                self._small_bytes >= self._small_target or len(skipped_main) == len(self._main)
            )
            q, skipped = (self._small, skipped_small) if from_small else (self._main, skipped_main)
            key = next(iter(q))
            if key in skipped:
                q.move_to_end(key)  # walk past keys the tier already refused
                continue
            if self._freq[key] > 0:
                if from_small:  # hit while in S: promote to M, access bits cleared
                    size = self._small.pop(key)
                    self._small_bytes -= size
                    self._main[key] = size
                    self._freq[key] = 0
                else:  # FIFO-reinsertion with one frequency bit spent
                    self._freq[key] -= 1
                    q.move_to_end(key)
                continue
            size = q[key]
            try:
                yield key
            finally:  # also when the tier closes the walk right after its last victim
                if key in self._freq:  # skipped: pinned or in use; keep it, look further
                    skipped.add(key)
                    q.move_to_end(key)
                elif from_small:  # evicted from S: remember it in the ghost queue
                    self._remember(key, size)

    def _remember(self, key: Key, size: int) -> None:
        self._ghost[key] = size
        self._ghost_bytes += size
        while self._ghost_bytes > self._ghost_cap:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]
