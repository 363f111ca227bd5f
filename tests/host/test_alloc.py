"""The segment's allocator: first fit, aligned blocks, freed neighbours merged, and what eviction could reach."""

from __future__ import annotations

import random

import pytest

from kdn.errors import InvalidInput
from kdn.host.alloc import ALIGN, Allocator, aligned


def test_blocks_are_aligned_and_first_fit():
    a = Allocator(10 * ALIGN)
    assert a.alloc(1) == 0 and a.length(0) == ALIGN
    assert a.alloc(ALIGN + 1) == ALIGN and a.length(ALIGN) == 2 * ALIGN
    assert a.alloc(0) == 3 * ALIGN  # an empty object still takes a block of its own
    a.free(0)
    assert a.alloc(ALIGN) == 0  # the lowest hole that fits
    assert a.alloc(7 * ALIGN) is None and a.alloc(6 * ALIGN) == 4 * ALIGN
    assert a.used == 10 * ALIGN and a.holes == 0


def test_freed_neighbours_merge_into_one_hole():
    a = Allocator(8 * ALIGN)
    offs = [a.alloc(2 * ALIGN) for _ in range(4)]
    assert offs == [0, 2 * ALIGN, 4 * ALIGN, 6 * ALIGN]
    a.free(offs[1])
    a.free(offs[3])
    assert a.holes == 2 and a.alloc(4 * ALIGN) is None
    a.free(offs[2])  # between the two holes: all three merge
    assert a.holes == 1 and a.largest_hole == 6 * ALIGN
    assert a.alloc(6 * ALIGN) == 2 * ALIGN


def test_fits_knows_what_eviction_could_free():
    a = Allocator(8 * ALIGN)
    offs = [a.alloc(2 * ALIGN) for _ in range(4)]
    assert a.fits(4 * ALIGN, kept=[offs[0], offs[3]])  # blocks 1 and 2 could go: a 4-block hole
    assert not a.fits(4 * ALIGN, kept=[offs[1], offs[3]])  # kept blocks split the rest into 2 + 2
    assert a.fits(8 * ALIGN, kept=[]) and not a.fits(9 * ALIGN, kept=[])


def test_random_alloc_free_never_overlaps_and_frees_back_to_one_hole():
    rng = random.Random(7)
    a = Allocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            n = rng.randint(1, 40 << 10)
            off = a.alloc(n)
            if off is not None:
                assert off % ALIGN == 0
                live[off] = aligned(n)
        spans = sorted(live.items())
        assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(spans, spans[1:])), "blocks overlap"
        assert a.used == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.holes == 1 and a.largest_hole == a.size and a.used == 0


def test_a_segment_smaller_than_a_block_is_refused():
    with pytest.raises(InvalidInput):
        Allocator(ALIGN - 1)
