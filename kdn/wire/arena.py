"""A host arena: receive buffers reused across requests, under a byte budget.

An engine loading a prefix receives tens to thousands of MB per request. A
fresh buffer pays for its pages on first touch (47 MiB: 21.5 ms fresh against
4.2 ms reused, measured on this project's 2-core VM), and on a GPU host a
pageable buffer crosses PCIe at a seventh of a page-locked one's speed (7-8
against 52-55 GB/s on an H200). So bodies land in buffers taken from here and
handed back when their bytes have been used: the second load of a size finds
its memory faulted in (and pinned), and the arena never holds more than its
budget.

Buffers come in size classes (the size rounded up to an eighth of the power of
two above it, so at most 25% is wasted and chunks of one model, which share a few
sizes, share buffers). ``take`` reuses a free buffer of the class, or frees
idle buffers (largest first) to make room for a new one, or refuses with
``ArenaFull`` naming the budget: a load that would not fit falls back to a
recompute, it never grows the process without bound.

The core allocates ``bytearray``s; an engine adapter on a GPU host passes an
``allocate`` that returns page-locked memory (``kdn.kernels.pinned``), so this
module imports no tensor library.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kdn.errors import KDNError

MIN_CLASS = 64 << 10


class ArenaFull(KDNError):
    """A buffer was asked for that the arena's budget cannot hold (in use + asked > budget)."""


def size_class(n: int) -> int:
    """``n`` rounded up to an eighth of the power of two above it (at most 25% more than ``n``; at least 64 KiB)."""
    if n <= MIN_CLASS:
        return MIN_CLASS
    top = 1 << (n - 1).bit_length()  # the power of two at or above n
    step = top // 8  # quarter steps of [top/2, top]
    return -(-n // step) * step


@dataclass
class ArenaStats:
    takes: int = 0
    reused: int = 0
    allocated: int = 0  # buffers made
    freed: int = 0  # idle buffers dropped to make room
    refused: int = 0


Allocate = Callable[[int], memoryview]


class Lease:
    """One buffer of the arena, ``view`` sized exactly as asked; ``release`` returns it (once).

    After ``release`` the memory is the next taker's: nothing may read ``view`` (or an array made from it)
    again. That is the caller's contract; the arena cannot revoke views numpy or torch made of it.
    """

    __slots__ = ("_arena", "_cls", "_mem", "view", "_released")

    def __init__(self, arena: Arena, cls: int, mem: memoryview, size: int) -> None:
        self._arena, self._cls, self._mem = arena, cls, mem
        self.view = mem[:size]
        self._released = False

    @property
    def memory(self) -> memoryview:
        """The whole buffer (its class size): what an allocator made, e.g. a page-locked tensor's bytes."""
        return self._mem

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._arena._give(self._cls, self._mem)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _bytearray(n: int) -> memoryview:
    return memoryview(bytearray(n))


class Arena:
    """Reused buffers, at most ``budget`` bytes of them held (in use or idle). Thread-safe."""

    def __init__(self, budget: int, *, allocate: Allocate = _bytearray, name: str = "host arena") -> None:
        if budget <= 0:
            raise ValueError(f"arena budget must be positive, got {budget}")
        self.budget = budget
        self.name = name
        self._allocate = allocate
        self._free: dict[int, list[memoryview]] = {}
        self._held = 0  # bytes of every buffer made and not dropped (in use + idle)
        self._in_use = 0
        self._lock = threading.Lock()
        self.stats = ArenaStats()

    @property
    def held(self) -> int:
        return self._held

    @property
    def in_use(self) -> int:
        return self._in_use

    def take(self, size: int) -> Lease:
        """A buffer of ``size`` bytes (its contents are whatever the last user left)."""
        if size < 0:
            raise ValueError(f"buffer size must be >= 0, got {size}")
        cls = size_class(size)
        for attempt in (0, 1):
            with self._lock:
                free = self._free.get(cls)
                fits = bool(free) or self._in_use + cls <= self.budget
            if fits or attempt:
                break
            # Leases whose owners are garbage in a reference cycle go back when the collector runs their
            # finalizers (a loaded cache's tensors: kdn.adapters.hf.cache): collect once before refusing.
            gc.collect()
        with self._lock:
            self.stats.takes += 1
            free = self._free.get(cls)
            if free:
                mem = free.pop()
                self.stats.reused += 1
            else:
                if self._in_use + cls > self.budget:
                    self.stats.refused += 1
                    raise ArenaFull(f"{self.name}: {size} bytes asked with {self._in_use} of {self.budget} "
                                    "in use (raise the budget, or load fewer chunks at once)")
                self._make_room(cls)
                mem = None
            self._in_use += cls
        if mem is None:
            try:
                mem = self._allocate(cls)
            except BaseException:
                with self._lock:
                    self._in_use -= cls
                raise
            with self._lock:
                self._held += cls
                self.stats.allocated += 1
        return Lease(self, cls, mem, size)

    def _make_room(self, cls: int) -> None:
        """Drop idle buffers (largest first) until a new one of ``cls`` fits the budget (lock held)."""
        for c in sorted(self._free, reverse=True):
            bufs = self._free[c]
            while bufs and self._held + cls > self.budget:
                bufs.pop()
                self._held -= c
                self.stats.freed += 1
            if not bufs:
                del self._free[c]
            if self._held + cls <= self.budget:
                return

    def _give(self, cls: int, mem: memoryview) -> None:
        with self._lock:
            self._in_use -= cls
            self._free.setdefault(cls, []).append(mem)

    def clear(self) -> None:
        """Drop every idle buffer (their memory goes back to the allocator)."""
        with self._lock:
            for c, bufs in self._free.items():
                self._held -= c * len(bufs)
            self._free.clear()
