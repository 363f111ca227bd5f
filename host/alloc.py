"""Where each object lies in the host tier's segment: address-ordered first fit over one fixed range, with
coalescing.

The segment is fixed in size and shared, so objects cannot move once an engine may hold their offset, and
nothing can grow it. Objects range from a few KB (a prefix's partial tail) to tens of MB (one chunk of a
large model), but one model's chunks share a handful of sizes (a whole chunk, raw or compressed) and differ
only in their tails. Address-ordered first fit suits that: a freed chunk's block is the next same-sized
chunk's, freed neighbours merge back into one hole at once, and on real allocation traces it fragments
about as little as best fit (Johnstone and Wilson, "The memory fragmentation problem: solved?", ISMM 1998).
Size classes (``kdn.wire.arena``'s, up to 25% rounding) would waste a quarter of a budget that is the
machine's shared memory, and a block of one class could not hold a neighbour class's object however
much room is free around it.

Blocks start at multiples of ``ALIGN`` (64 bytes: a cache line, and every dtype's alignment), so an
object's data section, 8-byte aligned inside its blob, is aligned for every tensor in the mapping.
Not thread-safe: the host tier calls it from its event loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from kdn.errors import InvalidInput

ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN`` (at least ``ALIGN``: an empty object still has an offset)."""
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class Allocator:
    """Blocks of ``[0, size)``: ``alloc(n)`` the lowest free block that fits, ``free(offset)`` merges it back."""

    def __init__(self, size: int) -> None:
        if size < ALIGN:
            raise InvalidInput(f"a segment of {size} bytes holds nothing: at least {ALIGN}")
        self.size = size - size % ALIGN
        self._starts: list[int] = [0]  # free blocks' offsets, ascending
        self._free: dict[int, int] = {0: self.size}  # free block offset -> length
        self._ends: dict[int, int] = {self.size: 0}  # free block end -> offset (to merge with a left neighbour)
        self._taken: dict[int, int] = {}  # allocated block offset -> length
        self.used = 0

    def __len__(self) -> int:
        """Blocks allocated now."""
        return len(self._taken)

    @property
    def holes(self) -> int:
        """Free blocks (1 when nothing is fragmented)."""
        return len(self._starts)

    @property
    def largest_hole(self) -> int:
        return max(self._free.values(), default=0)

    def length(self, offset: int) -> int:
        """The length of the allocated block at ``offset``."""
        return self._taken[offset]

    def alloc(self, n: int) -> int | None:
        """The offset of a new block of ``aligned(n)`` bytes: the lowest that fits. None: no hole is large enough."""
        want = aligned(n)
        for start in self._starts:
            have = self._free[start]
            if have < want:
                continue
            self._unlink(start)
            if have > want:
                self._link(start + want, have - want)
            self._taken[start] = want
            self.used += want
            return start
        return None

    def free(self, offset: int) -> None:
        """Give the block at ``offset`` back, merged with the free blocks on either side."""
        length = self._taken.pop(offset)
        self.used -= length
        start, end = offset, offset + length
        left = self._ends.get(start)
        if left is not None:
            self._unlink(left)
            start = left
        if end in self._free:
            right = self._free[end]
            self._unlink(end)
            end += right
        self._link(start, end - start)

    def fits(self, n: int, kept: Iterable[int]) -> bool:
        """Whether a block of ``aligned(n)`` bytes could be had if every allocated block but those at offsets
        ``kept`` were freed: what eviction can achieve at best, known before anything is evicted."""
        want, pos = aligned(n), 0
        for off in sorted(kept):
            if off - pos >= want:
                return True
            pos = off + self._taken[off]
        return self.size - pos >= want

    def _link(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._free[start] = length
        self._ends[start + length] = start

    def _unlink(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._ends[start + self._free.pop(start)]
