"""A prefix's objects read from the machine's host tier: the first source of a load, before the edge's HTTP.

The host tier (``kdn host serve``) holds verified objects in a shared-memory segment this engine maps read-only
(``kdn.client.host``). A load asks it once which of the prefix's objects it holds (``Held``; an engine's lookup
asked already), leases those a batch at a time, and hands each, checked against the lookup, to the engine's
``into`` from the mapping on the decode threads (``load_held``: the one copy, mapping -> cache), with no socket
body and no hash on the request path (the host verified it when it landed, against the same signed record: the
digests must agree, or the host's copy is not used). What the host does not hold, or fails to give, comes from
the edges as before; what the edges served is then asked of the host ahead of the next request (``Behind``),
so the next engine on the machine finds it there.
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
    from concurrent.futures import Executor

    from kdn.client.host import HostClient
    from kdn.format.address import Address
    from kdn.format.objects import DecodedObject, ObjectView
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


def host_picks(hit: Lookup, on_host: Held, encoding: str | None) -> dict[str, list[int]]:
    """The objects of ``hit`` to read from the host, by the encoding to lease (``Held.pick``: ``encoding``, or
    raw first of those the signed record names)."""
    picks: dict[str, list[int]] = {}
    for i, rec in enumerate(hit.records[:len(hit.addresses)]):
        enc = on_host.pick(i, [encoding] if encoding else list(rec.encodings))
        if enc is not None:
            picks.setdefault(enc, []).append(i)
    return picks


async def load_held(host: HostClient, hit: Lookup, picks: dict[str, list[int]], budget: float | None,
                    into: Callable[[int, ObjectView], None], decoders: tuple[Executor, int], speeds: DecodeSpeeds,
                    stats: HostStats, arrived: list[float]) -> dict[int, tuple[Fetched, DecodedObject]]:
    """The objects of ``hit`` in ``picks`` (``host_picks``), handed to ``into`` from the mapping: leased a round
    trip's batch at a time (``HostClient.lease_batches``), each batch checked and copied on the decode threads
    (``decoders``: the pool and its size; a job per thread, not a future per object) while the next is leased,
    its leases ended once its copies are done. Per index what it gave; an index missing (the host refused its
    lease, or its record names another digest than the signed one) is the caller's to read from the edges. A
    check that fails (the object is not the one the lookup asked for) raises, once every copy already started
    has ended and its leases with it: a lease never ends while a thread may read its bytes."""
    batches: list[asyncio.Task[list[tuple[int, Fetched, DecodedObject] | None]]] = []
    try:
        for enc, indices in picks.items():
            at = 0
            try:
                async with asyncio.timeout(LOOKUP_S + 0.01 * len(indices)):
                    async for part in host.lease_batches([hit.addresses[i] for i in indices], enc):
                        mine, at = indices[at:at + len(part)], at + len(part)
                        granted = _granted(hit, mine, part, stats)
                        if granted:
                            batch = asyncio.ensure_future(_copied(host, hit, granted, budget, into, decoders, speeds,
                                                                  stats, arrived))
                            batch.add_done_callback(_read)  # (a batch that outlives a cancelled load: still read)
                            batches.append(batch)
                        if any(b.done() and not b.cancelled() and b.exception() for b in batches):
                            break  # a check failed: the load fails, nothing more is leased for it
            except (HostError, TimeoutError) as e:  # the rest of this encoding from the edges
                stats.fallbacks += len(indices) - at
                stats.note(f"lease_many: {type(e).__name__}: {e}")
    finally:
        # Each batch ends its own leases once its copies have; a caller that stops waiting (cancelled) leases
        # no more batches, and those already leased run to their end without it.
        if batches:
            await asyncio.wait(batches)
    return _gathered(batches, stats)


def _read(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _gathered(batches: Sequence[asyncio.Task[list[tuple[int, Fetched, DecodedObject] | None]]], stats: HostStats
              ) -> dict[int, tuple[Fetched, DecodedObject]]:
    """What the batches gave, by index, counted as hits; the first failure raised once every batch is read."""
    out: dict[int, tuple[Fetched, DecodedObject]] = {}
    failed: BaseException | None = None
    for b in batches:
        e = b.exception()
        if e is not None:
            failed = failed or e
            continue
        for got in b.result():
            if got is not None:
                out[got[0]] = got[1:]
    stats.hits += len(out)
    if failed is not None:
        raise failed
    return out


def _granted(hit: Lookup, indices: Sequence[int], part: Sequence[Leased | HostError], stats: HostStats
             ) -> list[tuple[int, Leased]]:
    """A batch's leases by object index; each refused one counted and noted (the edges serve it)."""
    out = []
    for i, x in zip(indices, part):
        if isinstance(x, Leased):
            out.append((i, x))
        else:
            stats.fallbacks += 1
            stats.note(f"{hit.addresses[i][:16]}: {x}")
    return out


async def _copied(host: HostClient, hit: Lookup, granted: list[tuple[int, Leased]], budget: float | None,
                  into: Callable[[int, ObjectView], None], decoders: tuple[Executor, int], speeds: DecodeSpeeds,
                  stats: HostStats, arrived: list[float]) -> list[tuple[int, Fetched, DecodedObject] | None]:
    """One batch's objects checked and copied on the decode threads (its objects dealt out, a job per thread),
    then its leases ended."""
    loop, (pool, threads) = asyncio.get_running_loop(), decoders
    jobs: list[asyncio.Future[list[tuple[int, Fetched, DecodedObject] | str]]] = []
    try:
        jobs = [loop.run_in_executor(pool, _copy_job, granted[t::threads], hit, budget, into, speeds)
                for t in range(min(threads, len(granted)))]
        await asyncio.wait(jobs)
    finally:
        if any(not j.done() for j in jobs):  # cancelled (a loop shutting down): the threads still read the mapping
            await asyncio.wait(jobs)
        try:
            await host.release_many([x.lease for _, x in granted])
        except HostError as e:  # (a refusal of one: the others ended; a gone host ended them all)
            log.warning("host tier release_many: %s", e)
    now = time.perf_counter()
    out: list[tuple[int, Fetched, DecodedObject] | None] = []
    failed = [e for e in (j.exception() for j in jobs) if e is not None]  # (every job's read: none left unread)
    if failed:
        raise failed[0]
    for job in jobs:
        for got in job.result():
            if isinstance(got, str):  # the edges serve it (and write its place in the cache again)
                stats.fallbacks += 1
                stats.note(got)
                out.append(None)
            else:
                arrived.append(now)
                out.append(got)
    return out


def _copy_job(granted: Sequence[tuple[int, Leased]], hit: Lookup, budget: float | None,
              into: Callable[[int, ObjectView], None], speeds: DecodeSpeeds
              ) -> list[tuple[int, Fetched, DecodedObject] | str]:
    """(A decode thread.) Each leased object checked against the signed record and the lookup, then copied
    into the cache from the mapping; in its place the reason the edges must serve it instead: its host record
    (its frame's map) names another digest, or its block's stamp changed while it was copied (its lease had
    ended with a dropped connection: the copy may hold another object's bytes, and the edge's copy replaces it)."""
    out: list[tuple[int, Fetched, DecodedObject] | str] = []
    for i, leased in granted:
        signed = hit.records[i].encodings.get(leased.encoding)
        theirs = leased.record.get("encodings", {}).get(leased.encoding, {}).get("digest")
        if signed is None or theirs != signed.digest:
            out.append("the host's record names another digest than the signed one")
            continue
        f = Fetched(leased.address, leased.encoding, leased.view, "host", 0.0)
        try:
            decoded = decode_checked(f, hit, budget, None, i, into, speeds)
        except Exception:  # noqa: BLE001 -- a check of bytes that changed under it: not the object's fault
            if leased.intact():
                raise
        if not leased.intact():
            out.append(f"{leased.address[:16]}: its block in the host tier changed while it was copied")
            continue
        out.append((i, f, decoded))
    return out


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
