"""A lookup's objects fetched, verified and decoded, or placed straight into an engine's cache
(``KDNClient.fetch_prefix``).

A pipeline per object: each is decoded (off the event loop, on the client's decode threads) as soon as it has
arrived and been verified, while the others are still on the wire. Each object's encoding is the one its
record names that the client's quality budget allows at the least expected time (``choose_encoding``); a
kvtc object's basis is fetched first (``kdn.client.bases``), and every object is checked against the lookup before
anything is handed on (``kdn.client.checked``). Where the engine reads only some tensors of an object (``needs``:
a hybrid model's K/V of every chunk but the last, whose conv/recurrent states the last chunk's supersede),
only those are fetched, by verified range requests (``kdn.client.parts.fetch_kept``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kdn.format.address import Address
from kdn.client.checked import check_identity, decode_checked
from kdn.format.encodings import parse_budget
from kdn.errors import SourceError
from kdn.client.hosted import Behind, Held, HostStats, held_of, host_picks, load_held
from kdn.client.lookup import Fetched, Lookup, PrefixStates
from kdn.client.parts import Kept, fetch_kept, part_view
from kdn.format.pieces import Pieces

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Executor

    from kdn.chunk import Chunk
    from kdn.client.host import HostClient
    from kdn.format.address import Digest
    from kdn.format.objects import DecodedObject, Layout, ObjectView
    from kdn.registry.records import Encoding, ObjectRecord
    from kdn.wire.arena import Arena
    from kdn.wire.bodyget import Tally
    from kdn.wire.estimate import DecodeSpeeds
    from kdn.wire.scatter import Placer


class PrefixSource(Protocol):
    """What loading a prefix asks of a client (``KDNClient`` is one): its records, its choice of encoding, its
    fetches (whole, or received in place), its kvtc bases and its decode threads. Named here so this module
    never imports the facade that calls it."""

    @property
    def quality(self) -> str | float: ...

    @property
    def arena(self) -> Arena | None: ...

    @property
    def decoders(self) -> Executor: ...

    @property
    def decode_threads(self) -> int: ...

    @property
    def decode_speeds(self) -> DecodeSpeeds: ...

    @property
    def host(self) -> HostClient | None: ...  # the machine's host tier, the first source (kdn.client.hosted)

    @property
    def host_stats(self) -> HostStats: ...

    @property
    def behind(self) -> Behind: ...

    async def record(self, address: Address) -> ObjectRecord | None: ...

    def choose_encoding(self, encodings: Mapping[str, Encoding], quality: str | float | None = None) -> str | None: ...

    async def fetch(self, address: Address, *, encoding: str | None = None, digest: Digest | None = None,
                    size: int | None = None, quality: str | float | None = None, cold: bool = False,
                    pooled: bool = False, arena: Arena | None = None, pieces: Pieces | None = None,
                    tally: Tally | None = None, part: tuple[int, int] | None = None) -> Fetched: ...

    async def fetch_placed(self, address: Address, *, digest: Digest, size: int, pieces: Pieces | None,
                           place: Callable[[Layout], Mapping[str, Sequence[memoryview]]],
                           tally: Tally | None = None) -> tuple[Fetched, Layout]: ...

    async def prepare(self, f: Fetched, tokens: int | None = None) -> int | None: ...


async def fetch_prefix(client: PrefixSource, hit: Lookup, *, encoding: str | None = None,
                       quality: str | float | None = None, into: Callable[[int, ObjectView], None] | None = None,
                       arena: Arena | None = None, scatter: Placer | None = None,
                       tally: Tally | None = None,
                       needs: Callable[[int], Collection[str] | None] | None = None) -> PrefixStates:
    """Every object of ``hit``, in chain order (``KDNClient.fetch_prefix``, which says what each argument
    does): ``fetch_s`` is the time to the last byte, ``decode_s`` what decoding added after it."""
    t0 = time.perf_counter()
    arrived: list[float] = []
    # The host tier first, for a load into an engine's cache: one question for the whole prefix, and what it
    # holds leased and copied from its mapping (``load_held``), while the edges serve the rest.
    on_host = await held_of(client.host, hit, client.host_stats) if into is not None else Held([])
    picks = host_picks(hit, on_host, encoding) if client.host is not None and on_host.any() else {}
    from_host = None
    if picks and client.host is not None and into is not None:
        from_host = asyncio.ensure_future(load_held(
            client.host, hit, picks, parse_budget(client.quality if quality is None else quality), into,
            (client.decoders, client.decode_threads), client.decode_speeds, client.host_stats, arrived))
    picked = {i for indices in picks.values() for i in indices}
    one = _ChunkFetch(client, hit, encoding, quality, into, arena, scatter, tally, arrived,
                      needs if into is not None else None)
    got: dict[int, tuple[Fetched, DecodedObject]] = {}
    try:
        rest = [i for i in range(len(hit.addresses)) if i not in picked]
        got.update(zip(rest, await asyncio.gather(*(one(i, hit.addresses[i]) for i in rest))))
        if from_host is not None:
            await asyncio.wait([from_host])
    except BaseException:
        if from_host is not None:  # an edge failed, or the load was given up: no more batches are leased, and
            from_host.cancel()  # those leased end their leases once their copies have (``load_held``)
            await asyncio.wait([from_host])
            if not from_host.cancelled():
                from_host.exception()  # (read: the edge's failure, or the cancellation, is what is raised)
        raise
    if from_host is not None:
        got.update(from_host.result())
        missed = [i for i in sorted(picked) if i not in got]  # held, but not given: from the edges after all
        got.update(zip(missed, await asyncio.gather(*(one(i, hit.addresses[i]) for i in missed))))
    done = [got[i] for i in range(len(hit.addresses))]
    if client.host is not None and into is not None:  # what the edges served, asked of the host for next time
        served = [f for f, _ in done if f.source != "host"]
        client.host_stats.misses += len(served)
        if served:
            client.behind.start(client.host, [f.address for f in served], served[0].encoding, client.host_stats)
    t_last = max(arrived, default=t0)
    return PrefixStates(hit, [o for _, o in done], [f for f, _ in done], t_last - t0, time.perf_counter() - t_last)


class _ChunkFetch:
    """The fetch of each object of a prefix from the edges (what the host tier did not give): its record's
    encoding chosen, fetched as a ``kdn.chunk.Chunk``, and decoded (or placed)."""

    def __init__(self, client: PrefixSource, hit: Lookup, encoding: str | None, quality: str | float | None,
                 into: Callable[[int, ObjectView], None] | None, arena: Arena | None, scatter: Placer | None,
                 tally: Tally | None, arrived: list[float],
                 needs: Callable[[int], Collection[str] | None] | None = None) -> None:
        self.client, self.hit, self.encoding, self.quality, self.needs = client, hit, encoding, quality, needs
        self.into, self.scatter, self.tally, self.arrived = into, scatter, tally, arrived
        self.budget = parse_budget(client.quality if quality is None else quality)
        self.pool = arena if arena is not None else client.arena
        self.known = dict(zip(hit.addresses, hit.records))  # verified by the lookup: no second record read

    async def __call__(self, index: int, address: Address) -> tuple[Fetched, DecodedObject]:
        from kdn.format.objects import DecodedObject

        c, hit = self.client, self.hit
        rec = self.known.get(address) or await c.record(address)
        if rec is None:
            raise SourceError(f"{address} is not in the registry")
        enc = self.encoding or c.choose_encoding(rec.encodings, self.quality)
        if enc is None or enc not in rec.encodings:
            raise SourceError(f"{address} has no encoding {enc!r} within quality {self.quality or c.quality!r}"
                              f" (it has {sorted(rec.encodings)})")
        chunk = hit.chunk(index, rec, enc, warm=address not in hit.cold)
        keep = self.needs(index) if self.needs is not None else None
        if keep is not None and chunk.pieces is not None:
            return await self._kept(index, chunk, keep)
        if self.scatter is not None and enc == "raw" and self.scatter.placeable(index):
            f, layout = await _fetch_placed(c, chunk, index, hit, self.scatter, self.tally)
            self.arrived.append(time.perf_counter())
            self.scatter.placed(index, layout)
            return f, DecodedObject(layout.header, {})
        f = await c.fetch(address, encoding=enc, digest=chunk.digest, size=chunk.size, cold=chunk.cold,
                          pooled=self.into is not None, arena=self.pool, pieces=chunk.pieces, tally=self.tally)
        self.arrived.append(time.perf_counter())
        try:
            # A kvtc object: its basis first (fetched once); its decode bounded by the span the lookup
            # asked for, never by what the object's own header claims.
            cap = await c.prepare(f, chunk.tokens)
            return f, await asyncio.get_running_loop().run_in_executor(
                c.decoders, decode_checked, f, hit, self.budget, cap, index, self.into, c.decode_speeds)
        finally:
            if self.into is not None:  # decoded into the engine's cache: the receive buffer is free again
                f.release()

    async def _kept(self, index: int, chunk: Chunk, keep: Collection[str]) -> tuple[Fetched, DecodedObject]:
        """Only the tensors ``keep`` of object ``index``, by verified ranges, checked against the lookup as a
        whole object is (``decode_checked``), then handed to ``into`` as a view that decodes nothing else."""
        c, into = self.client, self.into
        assert into is not None  # (``needs`` is only asked of a load into an engine's cache)
        got = await fetch_kept(c, chunk.address, encoding=chunk.encoding, digest=chunk.digest, size=chunk.size,
                               pieces=chunk.pieces, keep=keep, tally=self.tally, cold=chunk.cold)
        assert got is not None  # (the record has pieces)
        self.arrived.append(time.perf_counter())
        cap = await c.prepare(got.fetched, chunk.tokens)
        # Not timed into the decode speeds: only part of the object is decoded, the speed is per whole object.
        obj = await asyncio.get_running_loop().run_in_executor(
            c.decoders, decode_checked, got.fetched, self.hit, self.budget, cap, index,
            functools.partial(_into_part, into, got, cap), None)
        return Fetched(chunk.address, chunk.encoding, memoryview(b""), got.fetched.source, got.fetched.seconds), obj


def _into_part(into: Callable[[int, ObjectView], None], got: Kept, cap: int | None, index: int,
               view: ObjectView) -> None:
    """``into`` handed the part of a checked object that arrived (``view`` reads it as if whole)."""
    into(index, part_view(view.buffer, got.held, max_decoded=cap))


async def _fetch_placed(client: PrefixSource, chunk: Chunk, index: int, hit: Lookup, scatter: Placer,
                        tally: Tally | None = None) -> tuple[Fetched, Layout]:
    """``chunk`` (object ``index`` of ``hit``) received straight into the engine's memory (``fetch_placed``), its
    header checked against the lookup before a byte is placed."""

    def place(layout: Layout) -> Mapping[str, Sequence[memoryview]]:
        check_identity(layout.header, hit, chunk.address)
        return scatter.place(index, layout)

    return await client.fetch_placed(chunk.address, digest=chunk.digest, size=chunk.size, pieces=chunk.pieces,
                                     place=place, tally=tally)
