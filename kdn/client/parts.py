"""Parts of an object: the named tensors of one, by range requests verified piece by piece.

An engine that wants one layer of a chunk (``L3.k`` and ``L3.v``) need not move
the rest: the pieces holding the object's header come first (``kdn.format.pieces``: 1 MiB
each by default), then the pieces holding those tensors, each verified against
the piece digests of the object's (signed) record as it lands. Where the record
has no pieces, the whole object is fetched and verified, then cut.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from kdn.format.address import Address
from kdn.errors import InvalidInput, SourceError
from kdn.client.lookup import Fetched, Tensors
from kdn.format.pieces import Pieces

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.objects import Layout


class PartSource(Protocol):
    """What ``fetch_tensors`` asks of a client (``KDNClient`` is one): a record, a whole object, a range of
    pieces. Named here so this module never imports the facade that calls it."""

    async def record(self, address: Address) -> dict[str, Any] | None: ...

    async def fetch(self, address: Address, *, encoding: str | None = None) -> Fetched: ...

    async def fetch_part(self, address: Address, encoding: str, first: int, end: int) -> Fetched: ...


def tensor_span(layout: Layout, name: str) -> tuple[int, int]:
    try:
        return layout.span(name)
    except KeyError:
        raise InvalidInput(f"object {layout.header.address[:16]} has no tensor {name[:64]!r}") from None


async def fetch_tensors(client: PartSource, address: Address, names: Iterable[str], *, encoding: str = "raw") -> Tensors:
    """Only the named tensors of an object (one layer's ``L3.k`` and ``L3.v``, say), verified: the pieces
    holding its header, then the pieces that hold those tensors, by range requests. Where the record has
    no pieces, the whole object is fetched and verified, then cut."""
    from kdn.format.objects import head_length, read_layout

    rec = await client.record(address)
    if rec is None or encoding not in rec["encodings"]:
        raise SourceError(f"{address} has no {encoding!r} record here")
    e = rec["encodings"][encoding]
    size, pieces, want = int(e["size"]), Pieces.of(e), list(names)
    if pieces is None:
        f = await client.fetch(address, encoding=encoding)
        layout = read_layout(f.blob[:head_length(f.blob[:8])], size)
        return Tensors(layout, {n: memoryview(f.blob)[slice(*tensor_span(layout, n))] for n in want}, size)
    pb = pieces.piece_bytes
    head = await client.fetch_part(address, encoding, 0, 1)
    moved = len(head.blob)
    hl = head_length(head.blob[:8])
    if hl > len(head.blob):  # a header longer than a piece: the pieces it spans
        more = await client.fetch_part(address, encoding, 1, -(-hl // pb))
        head, moved = replace(head, blob=bytearray(head.blob) + more.blob), moved + len(more.blob)
    layout = read_layout(head.blob[:hl], size)
    spans = {n: tensor_span(layout, n) for n in want}
    if not spans:
        return Tensors(layout, {}, moved)
    first, end = min(b for b, _ in spans.values()) // pb, -(-max(e for _, e in spans.values()) // pb)
    held = -(-len(head.blob) // pb)  # pieces already here with the header
    data: bytes | bytearray | memoryview = head.blob
    base = 0
    if end > held:
        body = await client.fetch_part(address, encoding, max(first, held), end)
        moved += len(body.blob)
        data, base = ((bytearray(head.blob[first * pb:]) + body.blob, first * pb) if first < held
                      else (body.blob, first * pb))
    return Tensors(layout, {n: memoryview(data)[b - base:e - base] for n, (b, e) in spans.items()}, moved)

