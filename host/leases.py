"""One engine connection's leases: what it pins in the segment, ended by ``release`` or by the connection.

Lease ids are the connection's own (1, 2, 3, ...), so an engine can release only what it took. When the
connection ends for any reason (a clean close, a crash, ``kill -9``: the kernel closes the socket either way)
``close`` hands every lease back, so a dead engine pins nothing. Bounded: ``MAX_LEASES`` a connection.
"""

from __future__ import annotations

from kdn.wire.host import HostError
from kdn.host.store import Held, HostStore

MAX_LEASES = 4096  # a 1M-token prompt's chunks at 256 tokens each, four times over


class Leases:
    def __init__(self, store: HostStore, limit: int = MAX_LEASES) -> None:
        self.store, self.limit = store, limit
        self._held: dict[int, Held] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._held)

    def add(self, h: Held) -> int:
        """Take over one pin of ``h`` (``HostStore.acquire``'s) as a lease; its id. At the limit the pin is
        given back and the request refused."""
        if len(self._held) >= self.limit:
            self.store.release(h)
            raise HostError("too-many", f"this connection holds {self.limit} leases: release some first")
        lease, self._next = self._next, self._next + 1
        self._held[lease] = h
        return lease

    def release(self, lease: object) -> None:
        h = self._held.pop(lease, None) if isinstance(lease, int) and not isinstance(lease, bool) else None
        if h is None:
            raise HostError("bad-request", f"no lease {str(lease)[:24]} on this connection")
        self.store.release(h)

    def close(self) -> None:
        """Every lease handed back (the connection ended)."""
        held, self._held = self._held, {}
        for h in held.values():
            self.store.release(h)
