"""Eviction policies of the edge tiers: ARC (the default) and S3-FIFO (``kdn edge serve --eviction``).

The default is the one the traces pick: on the reusable-prefix tokens of both Mooncake
FAST'25 traces held in ``bench/traces/``, summed over 1/5/10/30% budgets, ARC leads
(docs/benchmarks.md, "Prefix reuse on the Mooncake traces"); S3-FIFO wins the 1% budget of
the conversation trace and the synthetic Zipf traces of ``bench/eviction.py``, so it stays
selectable. LRU, W-TinyLFU and the prefix-aware LRU the bench compares them with live in
``bench/eviction_policies.py``: the edge does not use them.

A policy only orders keys; it holds no bytes and knows nothing of pins,
readers, quotas or TTLs. Its whole interface is :class:`EvictionPolicy`:
the tier reports inserts, hits and removals, and asks for ``victims()`` when it
needs room. The tier *filters* that stream: it evicts a victim by calling
``remove(key)`` before it asks for the next one, and skips a victim (pinned, in
use, another namespace's) by simply asking for the next one. A skipped key
stays cached; the policy moves it to the back of its queue (a CLOCK-style
second chance) so that the walk ends once every remaining key was skipped.

Every policy here is byte-sized: a 6 MiB object takes six times the room of a
1 MiB one. Construct them with the tier's budget in bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable
from typing import Protocol

Key = Hashable

MAX_GHOST_KEYS = 1 << 20
"""Ghost entries (keys only, no data) a policy remembers at most, whatever their byte total: a ghost list
is bounded by bytes like the cache, so a tier of tiny objects would otherwise keep millions of keys."""


class EvictionPolicy(Protocol):
    """Orders keys for eviction. Not thread-safe: the tier calls it from its event loop."""

    def on_insert(self, key: Key, size: int) -> None: ...
    def on_access(self, key: Key) -> None: ...
    def remove(self, key: Key) -> None: ...
    def victims(self) -> Generator[Key, None, None]:
        """Keys in eviction order. Call ``remove(k)`` for a yielded ``k`` to evict it; resume to skip it.

        While the iterator is open, remove no key but the one just yielded, and insert none.
        """
        ...


PolicyFactory = Callable[[int], EvictionPolicy]
"""A policy class or factory: ``factory(budget_bytes) -> EvictionPolicy``."""


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

    def victims(self) -> Generator[Key, None, None]:
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
        while self._ghost_bytes > self._ghost_cap or len(self._ghost) > MAX_GHOST_KEYS:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]


class ARC:
    """ARC: Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
    FAST 2003 (https://www.usenix.org/conference/fast-03/arc-self-tuning-low-overhead-replacement-cache).

    Four LRU lists, byte-sized here: T1 (keys seen once lately), T2 (seen at
    least twice), and their ghosts B1 and B2 (keys only, no data). ``p`` is
    the target size of T1. A key inserted while in B1 grows ``p`` by its size
    (times ``|B2| / |B1|`` when B2 is the larger), one in B2 shrinks it the same
    way; both go to T2, as does a T1 key that is hit. REPLACE evicts T1's LRU
    key into B1 while T1 holds more than ``p`` (or T2 is empty), else T2's LRU
    key into B2. Ghosts are trimmed so that T1 + B1 <= c and
    T1 + T2 + B1 + B2 <= 2c.

    One difference from the paper's pseudo-code, forced by the protocol: a
    tier makes room (``victims()``) before it says which key arrives
    (``on_insert``), so a ghost hit moves ``p`` from the next replacement on,
    and the tie rule "x in B2 and |T1| = p: replace from T1" is left out.
    ``tests/bench/test_eviction_trace.py`` compares it with a textbook ARC.
    """

    def __init__(self, budget: int) -> None:
        self._c = max(1, budget)
        self._p = 0.0
        self._t1: OrderedDict[Key, int] = OrderedDict()  # key -> size, head = least recent
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._b1: OrderedDict[Key, int] = OrderedDict()
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._t1_bytes = self._t2_bytes = self._b1_bytes = self._b2_bytes = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: Key) -> bool:
        return key in self._t1 or key in self._t2

    @property
    def p(self) -> float:
        """T1's target size in bytes (for tests and debugging)."""
        return self._p

    def list_of(self, key: Key) -> str | None:
        """``"T1"``, ``"T2"``, ``"B1"``, ``"B2"`` or None (for tests and debugging)."""
        for name, q in (("T1", self._t1), ("T2", self._t2), ("B1", self._b1), ("B2", self._b2)):
            if key in q:
                return name
        return None

    def on_insert(self, key: Key, size: int) -> None:
        if key in self._t1 or key in self._t2:
            return
        if key in self._b1:  # evicted from T1 too early: give T1 more room
            self._p = min(float(self._c), self._p + size * max(1.0, self._b2_bytes / self._b1_bytes))
            self._b1_bytes -= self._b1.pop(key)
            self._t2[key] = size
            self._t2_bytes += size
        elif key in self._b2:  # evicted from T2 too early: give T2 more room
            self._p = max(0.0, self._p - size * max(1.0, self._b1_bytes / self._b2_bytes))
            self._b2_bytes -= self._b2.pop(key)
            self._t2[key] = size
            self._t2_bytes += size
        else:
            self._t1[key] = size
            self._t1_bytes += size
        while self._t1_bytes + self._b1_bytes > self._c and self._b1:
            self._b1_bytes -= self._b1.popitem(last=False)[1]
        while self._t1_bytes + self._t2_bytes + self._b1_bytes + self._b2_bytes > 2 * self._c and self._b2:
            self._b2_bytes -= self._b2.popitem(last=False)[1]
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """At most MAX_GHOST_KEYS ghosts: the oldest of the longer list go first."""
        while len(self._b1) + len(self._b2) > MAX_GHOST_KEYS:
            if len(self._b1) >= len(self._b2):
                self._b1_bytes -= self._b1.popitem(last=False)[1]
            else:
                self._b2_bytes -= self._b2.popitem(last=False)[1]

    def on_access(self, key: Key) -> None:
        if key in self._t1:
            size = self._t1.pop(key)
            self._t1_bytes -= size
            self._t2[key] = size
            self._t2_bytes += size
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self._t1:
            self._t1_bytes -= self._t1.pop(key)
        elif key in self._t2:
            self._t2_bytes -= self._t2.pop(key)

    def victims(self) -> Generator[Key, None, None]:
        skipped1: set[Key] = set()
        skipped2: set[Key] = set()
        while len(skipped1) < len(self._t1) or len(skipped2) < len(self._t2):
            from_t1 = len(skipped1) < len(self._t1) and (self._t1_bytes > self._p or len(skipped2) == len(self._t2))
            q, skipped = (self._t1, skipped1) if from_t1 else (self._t2, skipped2)
            key = next(iter(q))
            if key in skipped:
                q.move_to_end(key)  # walk past keys the tier already refused
                continue
            size = q[key]
            try:
                yield key
            finally:
                if key in q:  # skipped: pinned or in use
                    skipped.add(key)
                    q.move_to_end(key)
                elif from_t1:  # evicted: remember it in its ghost list
                    self._b1[key] = size
                    self._b1_bytes += size
                    self._trim_ghosts()
                else:
                    self._b2[key] = size
                    self._b2_bytes += size
                    self._trim_ghosts()


POLICIES: dict[str, PolicyFactory] = {"arc": ARC, "s3-fifo": S3FIFO}
"""The policies ``kdn edge serve --eviction`` offers, by name."""
DEFAULT_POLICY = "arc"


def policy_named(name: str) -> PolicyFactory:
    """The factory for an ``--eviction`` name; a clear error for anything else."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: use one of {', '.join(POLICIES)}") from None
