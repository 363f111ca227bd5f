"""The host arena: buffers reused across loads, never more than the budget held, a clear refusal past it."""

from __future__ import annotations

import threading

import pytest

from kdn.wire.arena import Arena, ArenaFull, size_class

MiB = 1 << 20


@pytest.mark.parametrize("n, want", [(0, 64 << 10), (1, 64 << 10), (64 << 10, 64 << 10), ((64 << 10) + 1, 80 << 10),
                                     (5 * MiB, 5 * MiB), (5 * MiB + 1, 6 * MiB), (183 * MiB, 192 * MiB)])
def test_size_classes_waste_at_most_a_quarter(n, want):
    assert size_class(n) == want
    assert size_class(n) >= n and (n <= 64 << 10 or size_class(n) <= 1.25 * n + 1)


def test_the_arena_does_not_grow_across_100_loads():
    """Each load takes 31 chunk buffers and hands them back: the arena makes them once."""
    arena = Arena(64 * MiB)
    sizes = [1_000_000] * 30 + [700_000]  # a prefix: whole chunks and a partial tail
    made = []
    for _ in range(100):
        leases = [arena.take(s) for s in sizes]
        for lease, s in zip(leases, sizes):
            assert len(lease.view) == s
            lease.view[:4] = b"kdn!"
        for lease in leases:
            lease.release()
        made.append(arena.stats.allocated)
    assert made[0] == made[-1] == len(sizes)  # made on the first load, reused on every other
    assert arena.in_use == 0 and arena.held == sum(size_class(s) for s in sizes)
    assert arena.stats.reused == 99 * len(sizes)


def test_past_its_budget_the_arena_refuses_with_a_clear_error():
    arena = Arena(10 * MiB, name="test arena")
    held = [arena.take(4 * MiB), arena.take(4 * MiB)]
    with pytest.raises(ArenaFull, match=r"test arena: 4194304 bytes asked with 8388608 of 10485760 in use"):
        arena.take(4 * MiB)
    assert arena.stats.refused == 1
    held[0].release()
    arena.take(4 * MiB)  # fits again once one is back


def test_idle_buffers_of_other_sizes_make_room_for_a_new_one():
    arena = Arena(10 * MiB)
    for size in (2 * MiB, 3 * MiB, 4 * MiB):
        arena.take(size).release()
    assert arena.held == 9 * MiB and arena.in_use == 0
    lease = arena.take(8 * MiB)  # only fits once idle ones are dropped
    assert arena.held <= 10 * MiB and arena.stats.freed >= 2
    lease.release()
    assert arena.in_use == 0


def test_a_lease_released_twice_is_returned_once():
    arena = Arena(8 * MiB)
    lease = arena.take(MiB)
    lease.release()
    lease.release()
    assert arena.in_use == 0 and sum(len(v) for v in arena._free.values()) == 1


def test_an_allocator_that_fails_leaves_the_budget_as_it_was():
    def broken(n):
        raise MemoryError("no pinned memory")

    arena = Arena(8 * MiB, allocate=broken)
    with pytest.raises(MemoryError):
        arena.take(MiB)
    assert arena.in_use == 0 and arena.held == 0


def test_threads_share_one_arena_within_its_budget():
    arena = Arena(16 * MiB)
    errors: list[Exception] = []
    go = threading.Barrier(4)

    def worker():
        go.wait()
        try:
            for _ in range(200):
                with arena.take(MiB) as lease:
                    assert arena.held <= arena.budget
                    lease.view[0] = 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and arena.in_use == 0 and arena.held <= 4 * MiB
