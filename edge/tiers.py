"""Cache tiers of the edge: the ``Tier`` interface and its entry types.

A tier (memory, disk) holds immutable blobs by ``(address, encoding)`` under a
byte budget. Reads go through a *handle* that holds the entry while the bytes
are in use (vLLM's kv_offload pins blocks during I/O the same way): a held
entry's bytes are never freed under its reader (an eviction, expiry or ``delete``
takes it out of the index and frees it at the last handle's release; eviction
and the expiry pass skip held entries; a read finding it past its TTL drops it).
Operator policy (``pinned``: never evicted; TTL) is
applied from outside with ``apply_policy``; per-namespace quotas with
``set_quotas``.

The index, accounting and eviction both tiers share, and the order in which an insert makes room,
are in ``kdn.edge.tierbase``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from kdn.format.address import Address, Digest, validate_address, validate_name, validate_namespace
from kdn.errors import InvalidInput
from kdn.format.store import validate_encoding


_WALL0, _MONO0 = time.time(), time.monotonic()


def steady_wall() -> float:
    """Wall-clock seconds that a step of the system clock does not move: the wall time when this process
    started plus the monotonic time since. TTLs are measured on it. They are persisted as wall time (the
    disk tier's ``inserted_at`` must mean something after a restart), but within a process an NTP step or
    ``date -s`` forward expired every entry at once, and one backward kept every entry alive for as long
    as the step (bench/faults.py ``clock_jump``)."""
    return _WALL0 + (time.monotonic() - _MONO0)


Key = tuple[Address, str]
"""``(address, encoding)``: one immutable blob."""

Reason = Literal["capacity", "ttl", "corrupt"]
EvictCallback = Callable[[Key, "EntryMeta", Reason], None]
PolicyFn = Callable[[Key, "EntryMeta"], "PolicyState"]
"""``fn(key, meta)``: the key too, because a pin by manifest is decided by address."""


def validate_key(key: object) -> Key:
    if not (isinstance(key, tuple) and len(key) == 2):
        raise InvalidInput("a tier key is an (address, encoding) tuple")
    return validate_address(key[0]), validate_encoding(key[1])


@dataclass(frozen=True)
class EntryMeta:
    """What a tier knows about one blob. ``pinned``/``expires_at`` are policy state, set from outside."""

    size: int
    digest: Digest  # BLAKE3 hex of the blob, as in the registry
    namespace: str
    manifest: str | None = None  # "namespace/name" of the manifest it was published in
    # When the object arrived at this edge, wall-clock seconds (``steady_wall``). A put keeps a value the
    # caller set (a copy between tiers: the disk persist, a promotion to memory) and stamps 0 with its
    # clock, so a TTL counts from the object's arrival, not from its latest copy.
    inserted_at: float = 0.0
    pinned: bool = False  # never evicted while pinned
    # After it the entry is not served (a miss; a pin overrides it) and is dropped by the next expiry pass
    # or read; before it, an entry with a TTL is dropped first under pressure.
    expires_at: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise InvalidInput(f"entry size must be a non-negative int, got {self.size!r}")
        validate_address(self.digest, what="digest")
        validate_namespace(self.namespace)
        if self.manifest is not None:
            ns, _, name = self.manifest.partition("/")
            validate_namespace(ns)
            validate_name(name)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


@dataclass(frozen=True)
class PolicyState:
    """The operator's verdict on one entry: see ``Tier.apply_policy``."""

    pinned: bool = False
    expires_at: float | None = None


@dataclass
class TierStats:
    """Plain counters; the server exports them as Prometheus metrics."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0  # bytes handed out through hits
    inserts: int = 0
    inserted_bytes: int = 0
    refused: int = 0  # puts that could not fit
    corrupt: int = 0  # entries whose bytes failed their digest (disk, first read after a restart)
    evictions: dict[str, int] = field(default_factory=lambda: {"capacity": 0, "ttl": 0})
    evicted_bytes: dict[str, int] = field(default_factory=lambda: {"capacity": 0, "ttl": 0})


class Handle(Protocol):
    """A pinned read of one entry. Release it (or leave its ``with`` block) when the bytes are sent.

    It says how it is best sent: ``data``, a view of bytes held in memory (written as they are), or
    ``path``, a file (sendfile); exactly one of them is set."""

    key: Key
    meta: EntryMeta
    size: int
    data: memoryview | None
    path: Path | None

    async def read(self) -> bytes | memoryview: ...
    def count_read(self) -> None:
        """Count one whole read answered from this entry (``CacheTier.reads``)."""
        ...

    def release(self) -> None: ...
    def __enter__(self) -> Handle: ...
    def __exit__(self, *exc: object) -> None: ...


class CacheTier(Protocol):
    """What the read path needs of a tier (``Edge.load``): pinned reads, inserts, membership.
    Methods that may touch a disk are async; bookkeeping ones are not."""

    name: str  # "memory" / "disk"
    budget: int  # bytes
    used: int  # bytes held, including deleted entries still held by readers and writes in flight
    stats: TierStats

    async def acquire(self, key: Key) -> Handle | None:
        """A pinned handle on the entry, or None on a miss. Counts a hit or a miss."""
        ...

    async def put(self, key: Key, blob: bytes | bytearray | memoryview, meta: EntryMeta) -> bool:
        """Insert; False if it cannot fit. A key already present (or being written) is not written twice."""
        ...

    async def delete(self, key: Key) -> bool:
        """Remove now, or at the last release if a reader holds it; False if absent."""
        ...

    def contains(self, key: Key) -> bool: ...
    def reads(self, key: Key) -> int | None:
        """Whole reads counted on the entry since it arrived here (its handles' ``count_read``); None: not held.
        Kept in the entry: an eviction drops it with the bytes, a restart starts at 0."""
        ...


class GovernedTier(Protocol):
    """What operator policies need of a tier (``PolicyEngine``): its entries, pins, TTLs and quotas."""

    name: str
    on_evict: EvictCallback | None  # called after an entry leaves for "capacity", "ttl" or "corrupt"

    def keys(self) -> list[Key]: ...
    def entries(self) -> list[tuple[Key, EntryMeta]]: ...
    def apply_policy(self, fn: PolicyFn | None) -> None:
        """Set pin and TTL of every entry from ``fn(key, meta)``, now and on every later put; None clears it."""
        ...

    def set_quotas(self, quotas: dict[str, int]) -> None: ...
    async def expire(self, now: float | None = None) -> int:
        """Drop every expired entry that is not pinned or in use; returns how many."""
        ...


class Tier(CacheTier, GovernedTier, Protocol):
    """A whole tier, as the memory and disk tiers are: both faces."""
