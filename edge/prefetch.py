"""Prefetch: when chunk i of a published chain is read, bring chunks i+1..i+k into the owner's tier.

The edge learns chains from the registry's manifests (watched), so it knows
what follows an address without asking anyone. Each next address goes to its
owner: this edge fills it in the background if it is the owner, else it asks
the owner to (``POST /v1/prefetch``). Counting: an entry filled by a prefetch
is "used" when a real request first reads it and "wasted" when it is evicted
unread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a type only: `kdn edge serve --help` reads CHAIN_BUDGET and loads no registry code)
    from kdn.format.address import Address
    from kdn.registry import Manifest

log = logging.getLogger(__name__)


# The chain index's default bound, in addresses: ~170 B each (the address string, its position entry,
# the chain's list slot), so ~170 MB at the default. A registry of 10^7 manifests of 32 chunks would
# otherwise be 3.2x10^8 addresses, ~54 GB, in every edge (docs/scale.md).
CHAIN_BUDGET = 1_000_000


class ChainIndex:
    """address -> (chain, position) for published manifests; kept current by a registry watch.

    Bounded by ``budget`` addresses: past it, the chains read least recently (``following``) are dropped
    first (``evicted`` counts them); a chain longer than the whole budget is not kept. A dropped chain
    costs its prefetches only: reads are served as before, and its next publish (or an edge restart)
    indexes it again."""

    def __init__(self, budget: int = CHAIN_BUDGET) -> None:
        self.budget = budget
        self._chains: OrderedDict[str, list[Address]] = OrderedDict()  # "ns/name" -> addresses, least recent first
        self._pos: dict[Address, tuple[str, int]] = {}  # address -> ("ns/name", index)
        self.addresses = 0  # held now, over every chain
        self.evicted = 0  # chains dropped for room (or too long to keep)

    def full(self) -> bool:
        return self.addresses >= self.budget

    def put(self, m: Manifest) -> None:
        self.remove(m.ref)
        if len(m.addresses) > self.budget:
            self.evicted += 1
            return
        while self._chains and self.addresses + len(m.addresses) > self.budget:
            self._drop(next(iter(self._chains)))
            self.evicted += 1
        self._chains[m.ref] = list(m.addresses)
        self.addresses += len(m.addresses)
        for i, a in enumerate(m.addresses):
            self._pos[a] = (m.ref, i)

    def remove(self, ref: str) -> None:
        if ref in self._chains:
            self._drop(ref)

    def _drop(self, ref: str) -> None:
        chain = self._chains.pop(ref)
        self.addresses -= len(chain)
        for a in chain:
            if self._pos.get(a, (None,))[0] == ref:
                del self._pos[a]

    def position(self, address: Address) -> tuple[str, int] | None:
        """``("ns/name", index)`` of the indexed chain that names ``address`` (None: none does); reads no recency
        (the KV-cache events read a chunk's tokens from that manifest: edge/kv_events.py)."""
        return self._pos.get(address)

    def following(self, address: Address, k: int) -> list[Address]:
        at = self._pos.get(address)
        if at is None or k <= 0:
            return []
        self._chains.move_to_end(at[0])  # read now: the last to go
        chain = self._chains[at[0]]
        return chain[at[1] + 1 : at[1] + 1 + k]

    def __len__(self) -> int:
        return len(self._chains)


class Prefetcher:
    """Schedules background fills of what follows a read; bounded: at most ``max_pending`` at once.

    A fill is of the encoding the read was of (``None``: the edge's preference): a client that reads
    raw copies on a fast last hop would miss on prefetched zstd ones, and the other way round.
    """

    def __init__(self, index: ChainIndex, k: int, fetch: Callable[[Address, str | None], Awaitable[None]], *,
                 max_pending: int = 64):
        self.index = index
        self.k = k
        self._fetch = fetch
        self._pending: set[tuple[Address, str | None]] = set()
        self._tasks: set[asyncio.Task] = set()
        self.max_pending = max_pending
        self.dropped = 0

    def after_read(self, address: Address, encoding: str | None = None) -> None:
        for nxt in self.index.following(address, self.k):
            self.schedule(nxt, encoding)

    def schedule(self, address: Address, encoding: str | None = None) -> None:
        key = (address, encoding)
        if key in self._pending:
            return
        if len(self._pending) >= self.max_pending:
            self.dropped += 1  # a prefetch is a hint: shed it rather than queue without bound
            return
        self._pending.add(key)
        task = asyncio.create_task(self._run(key), name=f"prefetch-{address[:12]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: tuple[Address, str | None]) -> None:
        try:
            await self._fetch(*key)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed prefetch costs nothing but the attempt
            log.debug("prefetch of %s failed: %s", key[0], e)
        finally:
            self._pending.discard(key)

    async def idle(self) -> None:
        """Wait until no prefetch is running (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
