"""The host tier's index: reservations count against the budget, leases pin, eviction follows the policy and
skips what is pinned, and a refused object evicts nothing."""

from __future__ import annotations

import pytest
from host_helpers import object_record

from kdn.edge.eviction import POLICIES
from kdn.host.alloc import ALIGN
from kdn.host.store import HostStore, NoRoom
from kdn.wire.host import STAMP

BLOCK = 16 * ALIGN
OBJ = BLOCK - STAMP  # a blob whose block (its stamp, then its bytes) is BLOCK long
RECORD = object_record("0" * 64)  # the store keeps a record with each object, and reads none of it


def held(store: HostStore, name: str, size: int = OBJ):
    r = store.reserve(size)
    return store.commit(r, (name * 64, "raw"), RECORD)


@pytest.fixture(params=sorted(POLICIES))
def store(request):
    return HostStore(4 * BLOCK, 4 * BLOCK, POLICIES[request.param])


def test_eviction_makes_room_for_a_new_object(store):
    for name in "abcd":
        held(store, name)
    assert store.used == 4 * BLOCK
    held(store, "e")
    assert len(store) == 4 and store.used == 4 * BLOCK and store.stats.evictions == 1


def test_a_leased_object_is_never_evicted(store):
    objs = [held(store, name) for name in "abcd"]
    for h in objs:  # all four read once (so the policy ranks them alike, oldest first) ...
        store.acquire(h.key)
    for h in objs[1:]:  # ... and only a's lease is still held
        store.release(h)
    for name in "efghij":  # the policy names a first, and is asked for the next one each time
        held(store, name)
        assert store.get(objs[0].key) is objs[0]
    assert objs[0] not in list(store.evictable()) and store.stats.evictions == 6
    store.release(objs[0])
    assert objs[0] in list(store.evictable())


def test_leases_and_fills_that_pin_everything_refuse_without_evicting(store):
    h = [held(store, name) for name in "abc"]
    for x in h:
        store.acquire(x.key)
    filling = store.reserve(OBJ)  # the last block: a fill in flight
    with pytest.raises(NoRoom):
        store.reserve(1)
    assert store.stats.evictions == 0 and store.stats.refused == 1 and len(store) == 3
    store.cancel(filling)
    assert store.reserve(OBJ).offset == filling.offset


def test_a_hole_too_small_for_the_object_is_refused_before_anything_goes():
    store = HostStore(4 * BLOCK, 4 * BLOCK)
    a, b, c, d = (held(store, name) for name in "abcd")
    store.acquire(b.key)
    store.acquire(d.key)  # a and c could go, but they are not next to each other
    with pytest.raises(NoRoom):
        store.reserve(2 * BLOCK - STAMP)
    assert len(store) == 4 and store.stats.evictions == 0


def test_an_object_larger_than_the_budget_is_refused():
    store = HostStore(4 * BLOCK, 2 * BLOCK)
    with pytest.raises(NoRoom, match="larger than"):
        store.reserve(2 * BLOCK + 1)


def test_fragmented_room_evicts_until_a_block_is_contiguous():
    store = HostStore(4 * BLOCK, 4 * BLOCK)
    for name in "abcd":
        held(store, name)
    store.acquire(("b" * 64, "raw"))  # pins the second block: the room for 2 blocks lies in c + d
    r = store.reserve(2 * BLOCK - STAMP)
    assert r.offset == 2 * BLOCK + STAMP and store.used <= store.budget
    assert ("b" * 64, "raw") in store


def test_the_budget_is_below_the_segment():
    store = HostStore(8 * BLOCK, 2 * BLOCK)
    for name in "abcdef":
        held(store, name)
        assert store.used <= 2 * BLOCK
    assert len(store) == 2
