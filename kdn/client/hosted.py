"""A prefix's objects read from the machine's host tier: the first source of a load, before the edge's HTTP.

The host tier (``kdn host serve``) holds verified objects in a shared-memory segment this engine maps read-only
(``kdn.client.host``). A load asks it once which of the prefix's objects it holds (``Held``); each held one is
leased, checked against the lookup, and handed to the engine's ``into`` from the mapping (the one copy: mapping
-> cache), with no socket body and no hash on the request path (the host verified it when it landed, against
the same signed record: the digests must agree, or the host's copy is not used). What the host does not hold,
or fails to give, comes from the edges as before; what the edges served is then asked of the host ahead of
the next request (``warm_behind``), so the next engine on the machine finds it there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdn.client.checked import decode_checked
from kdn.client.leased import Leased
from kdn.client.lookup import Fetched, Lookup
from kdn.wire.host import HostError

if TYPE_CHECKING:  # pragma: no cover
    from kdn.client.host import HostClient
    from kdn.format.address import Address
    from kdn.format.objects import DecodedObject, ObjectView
    from kdn.registry.records import ObjectRecord
    from kdn.wire.estimate import DecodeSpeeds

log = logging.getLogger("kdn.client")

LOOKUP_S = 0.5  # the most a load waits for the host's answer to which objects it holds (a local socket: ~0.1 ms)
RECONNECT_S = 5.0  # a host that went away (or was not up) is tried again at most this often, by a load
PREFERRED = ("raw", "zstd")  # what to lease when the host holds several: raw is a memcpy into the cache


@dataclass
class HostStats:
    """What the host tier gave this client (``KDNClient.host_stats``)."""

    hits: int = 0  # objects loaded from the host's mapping
    misses: int = 0  # objects of a load the host did not hold
    fallbacks: int = 0  # held objects the host failed to give (then read from the edges)
    warms: int = 0  # objects asked of the host after the edges served them
    reconnects: int = 0  # new connections to a host that had gone away (a restart)
    tried: float = float("-inf")  # when a load last tried to reach a host that was gone (time.monotonic)
    errors: list[str] = field(default_factory=list)  # the last few reasons, newest last

    def note(self, why: str) -> None:
        self.errors = [*self.errors[-7:], why[:200]]


@dataclass(frozen=True)
class Held:
    """Which encodings the host holds of each object of a lookup (empty: none, or no host)."""

    encodings: list[frozenset[str]]
    # Asked with ``records`` (a lookup the host may answer alone): each held object's signed record as the host
    # sent it, unchecked (None where not held, or not asked).
    records: list[dict[str, Any] | None] | None = None

    def any(self) -> bool:
        return any(self.encodings)

    def pick(self, index: int, record_encodings: Sequence[str]) -> str | None:
        """The encoding to lease for object ``index``: one the host holds and the signed record names, raw first."""
        have = self.encodings[index] if index < len(self.encodings) else frozenset()
        return next((e for e in PREFERRED if e in have and e in record_encodings), None)


async def held(host: HostClient | None, addresses: Sequence[Address], stats: HostStats, *,
               records: bool = False) -> Held:
    """Ask the host once which of a load's objects it holds (with ``records``, their signed records too); a host
    that is down or slow holds nothing."""
    if host is None or not addresses:
        return Held([])
    if host.gone:  # a restarted host has a new segment: connect and map anew, at most every RECONNECT_S
        now = time.monotonic()
        if now - stats.tried < RECONNECT_S:
            return Held([])
        stats.tried = now
        try:
            async with asyncio.timeout(LOOKUP_S):
                await host.reconnect()
        except (HostError, TimeoutError) as e:
            stats.note(f"reconnect: {e}")
            return Held([])
        stats.reconnects += 1
    try:
        async with asyncio.timeout(LOOKUP_S):
            found = await host.lookup(addresses, records=records)
    except (HostError, TimeoutError) as e:
        stats.note(f"lookup: {e}")
        return Held([])
    return Held([frozenset(e) for e in found.encodings], found.records)


async def held_of(host: HostClient | None, hit: Lookup, stats: HostStats, count: int | None = None) -> Held:
    """What the host holds of ``hit``'s first ``count`` objects (all by default): as it said at the lookup
    (``Lookup.held``) where it was asked then and is still connected, else asked now (``held``)."""
    n = len(hit.addresses) if count is None else count
    if host is not None and hit.held is not None and not host.gone:
        return Held(list(hit.held[:n]))  # (an object past what it answered, a partial tail, reads as not held)
    return await held(host, hit.addresses[:n], stats)


async def lease_held(host: HostClient | None, hit: Lookup, on_host: Held, encoding: str | None,
                     stats: HostStats) -> dict[int, Leased | HostError]:
    """Every object of ``hit`` the host holds, leased in one round trip per ``MAX_LEASE_MANY`` (by the encoding
    ``Held.pick`` chooses: ``encoding``, or raw first): per index its ``Leased``, or the ``HostError`` its lease
    met. Nothing (each object then leased on its own, as before) where no host answers the batch at once: an
    older host without the op, or one gone. The caller ends them: ``release_leased``."""
    if host is None or host.gone:
        return {}
    picks: dict[str, list[int]] = {}
    for i, rec in enumerate(hit.records[:len(hit.addresses)]):
        enc = on_host.pick(i, [encoding] if encoding else list(rec.encodings))
        if enc is not None:
            picks.setdefault(enc, []).append(i)
    out: dict[int, Leased | HostError] = {}
    for enc, indices in picks.items():
        try:
            async with asyncio.timeout(LOOKUP_S + 0.01 * len(indices)):
                got = await host.lease_many([hit.addresses[i] for i in indices], enc)
        except (HostError, TimeoutError) as e:
            stats.note(f"lease_many: {e}")
            continue
        out.update(zip(indices, got))
    return out


async def release_leased(host: HostClient | None, granted: dict[int, Leased | HostError]) -> None:
    """End the leases ``lease_held`` took (the views of them are not read after)."""
    ids = [x.lease for x in granted.values() if isinstance(x, Leased)]
    if host is not None and ids:
        try:
            await host.release_many(ids)
        except HostError as e:  # (a refusal of one: the others ended; a gone host ended them all)
            log.warning("host tier release_many: %s", e)


async def from_host(host: HostClient, hit: Lookup, index: int, address: Address, encoding: str,
                    rec: ObjectRecord, budget: float | None, into: Callable[[int, ObjectView], None],
                    decoders: Any, speeds: DecodeSpeeds, stats: HostStats,
                    granted: Leased | HostError | None = None) -> tuple[Fetched, DecodedObject] | None:
    """Object ``index`` from the host, handed to ``into`` from the mapping, or None (read it from the edges):
    the host failed, or its copy is not the one the signed record names. ``granted``: its lease taken already
    (``lease_held``: the caller ends it), or the error that lease met; None: leased (and ended) here."""
    try:
        if isinstance(granted, HostError):
            raise granted
        if granted is not None:
            return _counted(await _copy(granted, hit, index, encoding, rec, budget, into, decoders, speeds, stats),
                            stats)
        async with host.lease(address, encoding) as leased:
            got = await _copy(leased, hit, index, encoding, rec, budget, into, decoders, speeds, stats)
    except HostError as e:
        stats.fallbacks += 1
        stats.note(f"{address[:16]}.{encoding}: {e}")
        return None
    return _counted(got, stats)


def _counted(got: tuple[Fetched, DecodedObject] | None, stats: HostStats) -> tuple[Fetched, DecodedObject] | None:
    if got is not None:
        stats.hits += 1
    return got


async def _copy(leased: Leased, hit: Lookup, index: int, encoding: str, rec: ObjectRecord, budget: float | None,
                into: Callable[[int, ObjectView], None], decoders: Any, speeds: DecodeSpeeds,
                stats: HostStats) -> tuple[Fetched, DecodedObject] | None:
    """A leased object checked against the signed record, then copied into the cache (decode threads: off the
    loop) while its lease holds the bytes in place; None where the host's record (as its frame sent it: a map)
    names another digest."""
    t0 = time.perf_counter()
    theirs = leased.record.get("encodings", {}).get(encoding, {}).get("digest")
    if theirs != rec.encodings[encoding].digest:
        stats.fallbacks += 1
        stats.note(f"{leased.address[:16]}.{encoding}: the host's record names another digest")
        return None
    f = Fetched(leased.address, encoding, leased.view, "host", time.perf_counter() - t0)
    out = await asyncio.get_running_loop().run_in_executor(decoders, decode_checked, f, hit, budget, None, index, into,
                                                           speeds)
    return f, out


class Behind:
    """Warms asked of the host after the edges served a load's missing objects: started beside the request,
    never awaited by it, bounded in number, each one's outcome counted."""

    MAX = 64  # warms in flight at once; past it nothing more is asked (the next load will ask again)

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, host: HostClient, addresses: Sequence[Address], encoding: str, stats: HostStats) -> None:
        if not addresses or len(self.tasks) >= self.MAX:
            return

        async def run() -> None:
            try:
                outcomes = await host.warm(list(addresses), encoding)
                stats.warms += sum(o in ("filled", "held") for o in outcomes)
            except HostError as e:
                stats.note(f"warm: {e}")

        task = asyncio.ensure_future(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
