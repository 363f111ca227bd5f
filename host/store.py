"""The host tier's index: which objects the segment holds, where, who leases them, and what to evict.

An object is held under its key, ``(address, encoding)``, as its exact blob bytes in one block of the
segment (``kdn.host.alloc``). Its life:

1. ``reserve(size)``: room is made (below) and a block set aside for a fill; nobody can see it yet.
2. ``commit``: the fill's bytes landed and were verified; the object is held, visible to lookups and leases.
   (``cancel`` gives the block of a failed fill back.)
3. ``acquire`` pins it for a lease (``release`` unpins). A pinned object is never evicted, so its block is
   never freed, so no fill is ever given it: the bytes an engine reads under a lease cannot change.
4. Eviction frees the block of an object nobody leases and no pin policy keeps.

Pins (``set_pins``, the addresses the region's pin policies name: ``kdn.host.policies``) keep every held
encoding of those addresses from eviction, now and as they arrive, like a lease that no connection holds. They
are bounded by the budget the way everything is: a pinned object got its block by ``reserve``, which counts
pinned, leased and filling blocks as kept before it evicts anything, so the pinned bytes never pass the budget;
a pinned address whose fill finds no room is refused there (logged, ``stats.pins_refused``), never given room by
evicting what a lease or another pin keeps. Dropping an address from the pins makes its objects evictable.

Each block starts with the object's stamp (``kdn.wire.host.STAMP`` bytes, the blob after it): its generation,
drawn at ``commit`` and answered with every lease, overwritten with 0 when the block is given up (eviction,
``cancel``) and so before any other fill can write there. An engine whose lease ended early (its connection
dropped while the host lived on) and that was still copying learns from the stamp that the bytes may have
changed under it (``kdn.client.leased.Leased.intact``). The stamps are written into ``stamps`` (the segment's
read-write view; None in tests of the index alone).

Room is made in the eviction policy's order (``kdn.edge.eviction``'s ARC by default, the edge's own; it
orders keys, knows nothing of bytes or pins) until both the byte budget and a contiguous block allow the
object. Leased and pinned objects and blocks reserved for fills are skipped. Whether that can succeed is
known before anything is evicted (``Allocator.fits`` over the blocks that must stay), so a refused object
evicts nothing. Single-threaded: the host calls it from its event loop, never across an ``await``.
"""

from __future__ import annotations

import logging
import secrets
import struct
from collections.abc import Iterator, Set
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack

from kdn.edge.eviction import ARC, PolicyFactory
from kdn.errors import InvalidInput, KDNError
from kdn.format.address import Address
from kdn.host.alloc import Allocator, aligned
from kdn.registry.records import ObjectRecord
from kdn.wire.host import STAMP

Key = tuple[Address, str]  # (address, encoding): one blob

log = logging.getLogger(__name__)


def footprint(length: int) -> int:
    """The bytes of the segment (and of the budget) a blob of ``length`` bytes takes: its block, stamp included."""
    return aligned(length) + STAMP


class NoRoom(KDNError):
    """The segment cannot hold an object now: larger than the budget, or the leased, pinned and filling
    blocks leave no room for it. (The engine reads it from the edge instead.)"""


@dataclass(eq=False)
class Held:
    """One object in the segment: its blob is ``segment[offset : offset + length]``."""

    key: Key
    offset: int
    length: int
    record: ObjectRecord  # the signed object record the fill verified it against
    generation: int = 0  # its stamp in the segment (random, nonzero; a lease answers it)
    leases: int = 0
    # ``record`` as the host's frames carry it (a map, ``kdn.wire.host``) and its size packed: made once, when
    # the object is held, so the lookups and leases on an engine's request path only read them.
    wire: dict[str, Any] = field(init=False, repr=False)
    wire_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.wire = self.record.to_dict()
        self.wire_bytes = len(msgpack.packb(self.wire))


@dataclass(frozen=True)
class Reservation:
    """A block set aside for one fill: ``offset`` (the blob's: ``STAMP`` bytes into the block), and the blob's
    ``length`` (the block may be longer)."""

    offset: int
    length: int


@dataclass
class Stats:
    hits: int = 0  # leases of an object already held
    misses: int = 0  # leases that had to fill first
    fills: int = 0  # objects committed
    fill_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    refused: int = 0  # reservations refused (NoRoom)
    pins_refused: int = 0  # ... of them, for an address a pin policy names (the pin does not fit)


@dataclass
class HostStore:
    """``HostStore(segment_bytes, budget)``: the index over a segment's blocks (the bytes are the caller's)."""

    segment_bytes: int
    budget: int
    policy: PolicyFactory = ARC
    stats: Stats = field(default_factory=Stats)
    stamps: memoryview | None = field(default=None, repr=False)  # the segment, where generations are stamped

    def __post_init__(self) -> None:
        if not 0 < self.budget <= self.segment_bytes:
            raise InvalidInput(f"the budget must be 1..{self.segment_bytes} bytes (the segment), got {self.budget}")
        self._alloc = Allocator(self.segment_bytes)
        self._order = self.policy(self.budget)
        self._held: dict[Key, Held] = {}
        self._by_address: dict[Address, dict[str, Held]] = {}  # the same objects, by address then encoding
        self._filling: set[int] = set()  # offsets of blocks reserved for fills
        self._pinned: set[int] = set()  # offsets of held objects at least one lease pins
        self.leases = 0  # leases held now, all objects together
        self.leased_bytes = 0  # bytes of the blocks in ``_pinned``
        self._pins: Set[Address] = frozenset()  # addresses pin policies keep (set_pins)
        self._kept: set[int] = set()  # offsets of held objects whose address is in ``_pins``
        self.pinned_bytes = 0  # bytes of the blocks in ``_kept``
        self._pin_told = False  # a refusal of the current pins was logged

    # --- what is held ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Key) -> bool:
        return key in self._held

    def get(self, key: Key) -> Held | None:
        """The held object, without touching its place in the eviction order (lookups, tests)."""
        return self._held.get(key)

    def encodings(self, address: Address) -> list[Held]:
        """Every encoding of ``address`` held (a lookup's answer)."""
        return list(self._by_address.get(address, {}).values())

    @property
    def used(self) -> int:
        """Bytes of the segment in blocks: held objects and reservations (what the budget bounds)."""
        return self._alloc.used

    @property
    def holes(self) -> int:
        return self._alloc.holes

    @property
    def pinned(self) -> int:
        """Objects held that a pin policy keeps."""
        return len(self._kept)

    # --- pins -------------------------------------------------------------------------------------------

    def set_pins(self, addresses: Set[Address]) -> None:
        """Keep every held encoding of ``addresses`` from eviction, and each that is committed later; the
        objects of addresses no longer named may go. (All that is held fits the budget, so every held object
        of ``addresses`` is kept at once; one that is not held yet gets its room at its fill or is refused.)"""
        if addresses != self._pins:  # (a rule change that leaves the pins as they were is not a new set)
            self._pins, self._pin_told = frozenset(addresses), False
        for h in self._held.values():
            self._keep(h, h.key[0] in self._pins)

    def _keep(self, h: Held, kept: bool) -> None:
        if kept and h.offset not in self._kept:
            self._kept.add(h.offset)
            self.pinned_bytes += self._alloc.length(h.offset - STAMP)
        elif not kept and h.offset in self._kept:
            self._kept.remove(h.offset)
            self.pinned_bytes -= self._alloc.length(h.offset - STAMP)

    # --- leases -----------------------------------------------------------------------------------------

    def acquire(self, key: Key, *, count: bool = True) -> Held | None:
        """The held object, pinned for one lease (None: not held). ``count``: a lease's first ask (a hit or
        a miss, and a use in the eviction order); its ask again after a fill is neither."""
        h = self._held.get(key)
        if h is None:
            self.stats.misses += int(count)
            return None
        if count:  # (the pin right after its own fill is the insert's use, not a second one)
            self.stats.hits += 1
            self._order.on_access(key)
        self._pin(h)
        return h

    def release(self, h: Held) -> None:
        assert h.leases > 0, "released more leases than were taken"
        h.leases -= 1
        self.leases -= 1
        if h.leases == 0:
            self._pinned.remove(h.offset)
            self.leased_bytes -= self._alloc.length(h.offset - STAMP)

    def _pin(self, h: Held) -> None:
        if h.leases == 0:
            self._pinned.add(h.offset)
            self.leased_bytes += self._alloc.length(h.offset - STAMP)
        h.leases += 1
        self.leases += 1

    # --- fills --------------------------------------------------------------------------------------------

    def reserve(self, length: int, address: Address | None = None) -> Reservation:
        """A block for a blob of ``length`` bytes (of ``address``, if the caller says), room made for it by
        eviction; NoRoom if none can be had."""
        size = footprint(length)
        if size > self.budget:
            raise self._refuse(address, f"an object of {length} bytes is larger than the host tier's budget "
                                        f"({self.budget})")
        kept = self._filling | self._pinned | self._kept
        kept_bytes = sum(self._alloc.length(o - STAMP) for o in kept)
        if kept_bytes + size > self.budget or not self._alloc.fits(size, (o - STAMP for o in kept)):
            # Planned before anything is evicted: leases, pins and fills in flight keep too much of the segment.
            raise self._refuse(address, f"no room for {length} bytes: {kept_bytes} of the {self.budget}-byte "
                                        "budget are leased, pinned or being filled")
        offset = self._make_room(size) + STAMP
        self._filling.add(offset)
        return Reservation(offset, length)

    def _make_room(self, size: int) -> int:
        """Evict in policy order until the budget and a block allow ``size`` bytes; the block's offset."""
        walk = self._order.victims()
        try:
            while True:
                if self._alloc.used + size <= self.budget:
                    offset = self._alloc.alloc(size)
                    if offset is not None:
                        return offset
                victim = next(walk, None)
                # The plan said enough can go: every unpinned object is yielded before the walk ends.
                assert victim is not None, "eviction ran out of victims the plan counted on"
                h = self._held[cast(Key, victim)]  # (the policy orders our keys)
                if h.leases == 0 and h.offset not in self._kept:
                    self._evict(h)
        finally:
            walk.close()

    def _refuse(self, address: Address | None, why: str) -> NoRoom:
        self.stats.refused += 1
        if address is not None and address in self._pins:
            self.stats.pins_refused += 1
            if not self._pin_told:  # one line per set of pins: a manifest twice the budget would log each object
                self._pin_told = True
                log.warning("a pinned object does not fit the host tier: %s (%d bytes pinned); it is served from "
                            "the edges, and further refusals of these pins are only counted (pins_refused)",
                            why, self.pinned_bytes)
        return NoRoom(why)

    def _evict(self, h: Held) -> None:
        self._order.remove(h.key)
        del self._held[h.key]
        address, encoding = h.key
        same = self._by_address[address]
        del same[encoding]
        if not same:
            del self._by_address[address]
        self.stats.evictions += 1
        self.stats.evicted_bytes += h.length
        self._stamp(h.offset, 0)  # before the block can be anyone's: an engine still copying it sees the change
        self._alloc.free(h.offset - STAMP)

    def cancel(self, r: Reservation) -> None:
        """A failed fill's block, given back."""
        self._filling.remove(r.offset)
        self._stamp(r.offset, 0)
        self._alloc.free(r.offset - STAMP)

    def commit(self, r: Reservation, key: Key, record: ObjectRecord) -> Held:
        """The fill's bytes are in the block and verified: the object is held from now on."""
        self._filling.remove(r.offset)
        if key in self._held:  # (fills are single-flight per key, so only a caller's misuse gets here)
            self._stamp(r.offset, 0)
            self._alloc.free(r.offset - STAMP)
            return self._held[key]
        h = Held(key, r.offset, r.length, record, secrets.randbits(64) | 1)
        self._stamp(r.offset, h.generation)  # before anyone can lease it
        self._held[key] = h
        self._by_address.setdefault(key[0], {})[key[1]] = h
        self._keep(h, key[0] in self._pins)
        self._order.on_insert(key, self._alloc.length(r.offset - STAMP))
        self.stats.fills += 1
        self.stats.fill_bytes += r.length
        return h

    def _stamp(self, offset: int, generation: int) -> None:
        """The generation word of the block whose blob starts at ``offset``."""
        if self.stamps is not None:
            struct.pack_into("<Q", self.stamps, offset - STAMP, generation)

    def evictable(self) -> Iterator[Held]:
        """Held objects no lease and no pin keeps (what eviction may take)."""
        return (h for h in self._held.values() if not h.leases and h.offset not in self._kept)
