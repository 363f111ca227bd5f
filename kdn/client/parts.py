"""Parts of an object: the named tensors of one, by range requests verified piece by piece.

An engine that wants one layer of a chunk (``L3.k`` and ``L3.v``), or a hybrid model's attention K/V of a
chunk whose conv/recurrent states a later chunk supersedes, need not move the rest: the pieces holding the
object's header come first (``kdn.format.pieces``: 1 MiB each by default), then the pieces holding those
tensors, as few range requests as the gaps between them allow (``piece_runs``), each piece verified against
the digests of the object's (signed) record as it lands. What lands is laid out at its own offsets in a
buffer of the object's size (an anonymous mapping: the pages never written are never touched), so the
object's own layout reads it. Where the record has no pieces, ``fetch_tensors`` fetches the whole object,
verifies it and cuts it; ``fetch_kept`` answers None and its caller fetches the object whole as ever.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kdn.format.address import Address, Digest
from kdn.errors import InvalidInput, SourceError, TensorMismatch
from kdn.client.lookup import Fetched, Tensors
from kdn.format.layout import head_length, read_layout
from kdn.format.pieces import Pieces

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.objects import Layout, ObjectView
    from kdn.registry.records import ObjectRecord
    from kdn.wire.bodyget import Tally

class PartSource(Protocol):
    """What ``fetch_tensors`` asks of a client (``KDNClient`` is one): a record, a whole object, a range of
    pieces. Named here so this module never imports the facade that calls it."""

    async def record(self, address: Address) -> ObjectRecord | None: ...

    async def fetch(self, address: Address, *, encoding: str | None = None) -> Fetched: ...

    async def fetch_part(self, address: Address, encoding: str, first: int, end: int) -> Fetched: ...


class RangeSource(Protocol):
    """What ``fetch_kept`` asks of a client (``KDNClient`` is one): pieces ``part`` of an object whose record the
    caller already holds (no second record read), verified, each body counted in ``tally``."""

    async def fetch(self, address: Address, *, encoding: str | None = None, digest: Digest | None = None,
                    size: int | None = None, cold: bool = False, pieces: Pieces | None = None,
                    tally: Tally | None = None, part: tuple[int, int] | None = None) -> Fetched: ...


Get = Callable[[int, int], Awaitable[Fetched]]  # pieces [first, end) of one object, verified


@dataclass(frozen=True)
class Kept:
    """Some tensors of one object, verified, at their own offsets in a buffer of the object's size
    (``fetched.blob``; the bytes of the other tensors are not there): ``held`` names them, ``moved`` counts
    the body bytes the range requests moved. Read it through ``part_view``, never as a whole object."""

    fetched: Fetched
    held: frozenset[str]
    moved: int


def piece_runs(spans: Iterable[tuple[int, int]], piece_bytes: int, held: int = 0) -> list[tuple[int, int]]:
    """The pieces ``[first, end)`` holding byte ``spans`` (``[begin, end)`` of the blob), past the first ``held``
    pieces (already here), as ascending runs, one range request each: runs that touch are one. (Runs a gap
    apart stay apart, however small the gap: the requests are in flight together, and a gap of states is what
    a hybrid's narrowed fetch exists to skip.)"""
    runs: list[tuple[int, int]] = []
    for b, e in sorted((b // piece_bytes, -(-e // piece_bytes)) for b, e in spans if e > b):
        b = max(b, held)
        if b >= e:
            continue
        if runs and b <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], e))
        else:
            runs.append((b, e))
    return runs


async def _gather(get: Get, size: int, pieces: Pieces, names: Callable[[Layout], Collection[str]]
                  ) -> tuple[Layout, memoryview, list[str], int, Fetched]:
    """The head's pieces, then the runs of pieces holding the tensors ``names(layout)`` picks, laid out in a
    buffer of ``size`` bytes: (layout, buffer, the names, bytes moved, the head's fetch)."""
    pb = pieces.piece_bytes
    head = await get(0, 1)
    hl = head_length(head.blob[:8])
    buf = memoryview(mmap.mmap(-1, size))  # anonymous: a page costs memory once written, and only what lands is
    buf[:len(head.blob)] = head.blob
    held, moved = -(-len(head.blob) // pb), len(head.blob)
    if hl > len(head.blob):  # a header longer than a piece: the pieces it spans
        more = await get(held, -(-hl // pb))
        buf[held * pb:held * pb + len(more.blob)] = more.blob
        held, moved = -(-hl // pb), moved + len(more.blob)
    layout = read_layout(buf[:hl], size)
    want = list(names(layout))
    runs = piece_runs((layout.span(n) for n in want), pb, held)
    tasks = [asyncio.ensure_future(get(b, e)) for b, e in runs]
    try:
        bodies = await asyncio.gather(*tasks)
    except BaseException:  # one run failed (every source): the others are not waited for
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for (b, _), f in zip(runs, bodies):
        buf[b * pb:b * pb + len(f.blob)] = f.blob
        moved += len(f.blob)
    return layout, buf, want, moved, head


def _spans_known(layout: Layout, want: Iterable[str]) -> list[str]:
    out = list(want)
    for n in out:
        if n not in layout.offsets:
            raise InvalidInput(f"object {layout.header.address[:16]} has no tensor {n[:64]!r}")
    return out


async def fetch_tensors(client: PartSource, address: Address, names: Iterable[str], *, encoding: str = "raw") -> Tensors:
    """Only the named tensors of an object (one layer's ``L3.k`` and ``L3.v``, say), verified: the pieces
    holding its header, then the pieces that hold those tensors, by range requests. Where the record has
    no pieces, the whole object is fetched and verified, then cut."""
    rec = await client.record(address)
    if rec is None or encoding not in rec.encodings:
        raise SourceError(f"{address} has no {encoding!r} record here")
    e = rec.encodings[encoding]
    size, pieces, want = e.size, e.piece_list, list(names)
    if pieces is None:
        f = await client.fetch(address, encoding=encoding)
        layout = read_layout(f.blob[:head_length(f.blob[:8])], size)
        return Tensors(layout, {n: memoryview(f.blob)[slice(*layout.span(n))] for n in _spans_known(layout, want)},
                       size)

    async def get(first: int, end: int) -> Fetched:
        return await client.fetch_part(address, encoding, first, end)

    layout, buf, want, moved, _ = await _gather(get, size, pieces, lambda lay: _spans_known(lay, want))
    return Tensors(layout, {n: buf[slice(*layout.span(n))] for n in want}, moved)


async def fetch_kept(client: RangeSource, address: Address, *, encoding: str, digest: Digest, size: int,
                     pieces: Pieces | None, keep: Collection[str], tally: Tally | None = None,
                     cold: bool = False) -> Kept | None:
    """The tensors ``keep`` of an object whose record the caller holds (``digest``, ``size``, ``pieces``), by
    verified range requests (``_gather``); a name the object lacks is left out (the caller's own header check
    names it). ``cold``: the entry edge must fill it first (its ranges are not hedged, as a whole fetch of it
    is not). None where the record has no pieces: fetch it whole."""
    if pieces is None:
        return None
    t0 = time.perf_counter()

    async def get(first: int, end: int) -> Fetched:
        return await client.fetch(address, encoding=encoding, digest=digest, size=size, cold=cold, pieces=pieces,
                                  tally=tally, part=(first, end))

    layout, buf, want, moved, head = await _gather(get, size, pieces,
                                                   lambda lay: [n for n in keep if n in lay.offsets])
    f = Fetched(address, encoding, buf, head.source, time.perf_counter() - t0)
    return Kept(f, frozenset(want), moved)


def part_view(blob: memoryview, held: Collection[str], *, max_decoded: int | None = None) -> ObjectView:
    """An ``ObjectView`` of a ``Kept`` buffer that decodes only the tensors ``held``: asked for any other, it
    raises ``TensorMismatch`` rather than read bytes that never arrived."""
    return _part_view_type()(blob, frozenset(held), max_decoded=max_decoded)


@functools.cache
def _part_view_type() -> Callable[..., ObjectView]:  # (a class made at first use: kdn.client imports no numpy)
    from kdn.format.objects import ObjectView, RawTensor

    class PartView(ObjectView):
        def __init__(self, blob: memoryview, held: frozenset[str], *, max_decoded: int | None = None) -> None:
            super().__init__(blob, max_decoded=max_decoded)
            self.held = held

        def _only(self, names: Iterable[str]) -> None:
            absent = sorted(set(names) - self.held)
            if absent:
                raise TensorMismatch(f"only part of object {self.header.address[:16]} was fetched: not "
                                     f"{absent[0][:64]!r}")

        def decode(self, names: Collection[str] | None = None, *,
                   out: bytearray | memoryview | None = None) -> dict[str, RawTensor]:
            self._only(self.header.tensors if names is None else names)
            return super().decode(names, out=out)

        def decode_into(self, name: str, dst: Any) -> None:
            self._only((name,))
            super().decode_into(name, dst)

    return PartView
