"""How an object comes to the host tier: read its signed record, set a block aside, fetch the blob from the
region's edges straight into that block, verified as it lands, then hold it.

The fetch is the one verified fetch of edges and clients (``kdn.wire.fetch``): the digest is the one the
record promised, and the record counts only if a trusted publisher key signed it (``KDNClient``'s trust). The
BLAKE3 of every byte is fed as it lands; a body that fails is never committed, its block given back. So an
object is verified once, here, and engines reading the mapping never hash it again.

Concurrent asks for one object share its fill (``kdn.edge.flight.SingleFlight``: a caller that hangs up
stops waiting, the fill goes on for the others). The block is reserved before the first byte is fetched,
so fills in flight count against the budget together (``HostStore.reserve``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kdn.edge.flight import SingleFlight
from kdn.errors import DigestMismatch, KDNError, SourceError
from kdn.format.address import Address
from kdn.host.store import HostStore, Key, NoRoom
from kdn.registry.records import ObjectRecord
from kdn.wire.fetch import Buffer, Want

if TYPE_CHECKING:  # pragma: no cover
    from kdn.client.client import KDNClient

MAX_OBJECT_BYTES = 1 << 30  # as the fetch client's own limit (kdn.client.client)


class Absent(KDNError):
    """No such object for this caller: not published, no such encoding, or in a namespace its token does not
    grant (all three answer alike)."""


class Upstream(Protocol):
    """Where fills come from: signed records, and verified bodies landed in a buffer the fill gives."""

    async def record(self, address: Address) -> ObjectRecord | None:
        """The record of ``address`` if it is published and trusted, else None."""
        ...

    async def fetch_into(self, want: Want, alloc: Callable[[int], Buffer]) -> None:
        """``want``'s bytes in ``alloc(size)``'s buffer, verified; raises if no source delivers them."""
        ...


class EdgeUpstream:
    """The region's edges (and origin) through one ``KDNClient``: records believed as its trusted keys allow,
    bodies fetched by its verified fetch in its source order, failing over, never hedged (one block, one
    writer at a time)."""

    def __init__(self, client: KDNClient) -> None:
        self.client = client

    async def record(self, address: Address) -> ObjectRecord | None:
        """The client's record, as the host tier keeps it with the object it holds (``kdn.host.store.Held``)."""
        return await self.client.record(address)

    async def fetch_into(self, want: Want, alloc: Callable[[int], Buffer]) -> None:
        c = self.client
        routes = c.routing.ranked(want.nbytes, want.address)
        async with c.net.limit:
            await c.fetcher.fetch(want, routes, hedge=False, alloc=alloc, observer=c.fetch_observer)


class Slot:
    """A fill's block as the buffer its fetch lands in. An attempt that fails releases it and the next source's
    attempt takes it again and rewrites it (the block is nobody's until committed); never two at once."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self._taken = False

    def take(self, n: int) -> Slot:
        if n != len(self.view) or self._taken:
            raise SourceError(f"a fill's block holds one body of {len(self.view)} bytes, asked for {n}"
                              + (" again" if self._taken else ""))
        self._taken = True
        return self

    def release(self) -> None:
        self._taken = False


class Filler:
    """Fills the store's segment from ``upstream``, one fill per key at a time."""

    def __init__(self, store: HostStore, segment: memoryview, upstream: Upstream, *,
                 max_object_bytes: int = MAX_OBJECT_BYTES) -> None:
        self.store, self.segment, self.upstream = store, segment, upstream
        self.max_object_bytes = max_object_bytes
        self.flight: SingleFlight[None] = SingleFlight()
        self.failed = 0  # fills that no source delivered intact

    async def record(self, address: Address) -> ObjectRecord | None:
        """The trusted record of ``address`` (None: not published, or not signed by a trusted key)."""
        return await self.upstream.record(address)

    async def fill(self, key: Key, record: ObjectRecord) -> None:
        """``key`` held in the segment when this returns (unless evicted since: the caller acquires it at
        once). Raises Absent (no such encoding), NoRoom, or SourceError / DigestMismatch (no source
        delivered it intact)."""
        if key in self.store:
            return
        await self.flight.do(key, lambda: self._fill(key, record))

    async def _fill(self, key: Key, record: ObjectRecord) -> None:
        address, encoding = key
        # 1. Held already: a fill of this key ended between the caller's check and this task's start.
        if key in self.store:
            return
        # 2. What the signed record promises: the digest every byte is checked against.
        enc = record.encodings.get(encoding)
        if enc is None:
            raise Absent(f"{address} has no {encoding!r} encoding")
        size = enc.size
        if size > self.max_object_bytes:
            raise NoRoom(f"{address}.{encoding} is {size} bytes, over the host tier's limit")
        want = Want(address, encoding, size, enc.digest, enc.piece_list)
        # 3. Its block, room made by eviction before a byte moves (so concurrent fills share the budget).
        r = self.store.reserve(size, address)
        slot = Slot(self.segment[r.offset:r.offset + size])
        # 4. The body, straight into the block, verified as it lands. Nobody knows the block's offset until
        #    the commit, so bytes of a failed or lying source are never read by an engine.
        try:
            await self.upstream.fetch_into(want, slot.take)
        except BaseException as e:
            self.store.cancel(r)
            if isinstance(e, (SourceError, DigestMismatch)):
                self.failed += 1
            raise
        # 5. Held: visible to lookups and leases from here on.
        self.store.commit(r, key, record)

    async def close(self) -> None:
        await self.flight.close()
