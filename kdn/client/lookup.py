"""What the fetch client hands back: a lookup's prefix (its objects as ``kdn.chunk.Chunk``: ``Lookup.chunk``), a
fetched object, a prefix's states, a probe.

Plain data, no I/O: ``kdn.client.KDNClient`` makes these (and re-exports them);
engine adapters and benches read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kdn.chunk import Chunk
from kdn.format import address as A

if TYPE_CHECKING:  # pragma: no cover
    from kdn.wire.fetch import Buffer
    from kdn.format.objects import DecodedObject, Layout
    from kdn.registry.records import ObjectRecord


@dataclass
class Lookup:
    """The longest reusable prefix of a prompt: ``addresses`` cover ``tokens`` leading tokens."""

    model_id: A.ModelId
    namespace: str
    addresses: list[A.Address]
    tokens: int
    chunk_tokens: int
    records: list[ObjectRecord] = field(default_factory=list)  # registry records of ``addresses``, in order
    cold: set[A.Address] = field(default_factory=set)  # addresses the entry edge reported it would have to fill
    sources: list[str] = field(default_factory=list)  # per whole chunk: where the entry edge would serve it from
    # What the machine's host tier said it holds of ``addresses`` (encodings each), when it was asked at lookup
    # (``KDNClient(host=)``): a load plans and leases by it without asking again. None: not asked.
    held: list[frozenset[str]] | None = None

    @property
    def chunks(self) -> int:
        return len(self.addresses)

    def token_counts(self) -> list[int]:
        """Tokens per object, in chain order: whole chunks, then the partial tail if there is one."""
        whole = min(len(self.addresses), self.tokens // self.chunk_tokens)
        counts = [self.chunk_tokens] * whole
        if len(self.addresses) > whole:
            counts.append(self.tokens - whole * self.chunk_tokens)
        return counts

    def span(self, index: int) -> tuple[int, int]:
        """The tokens ``[start, end)`` object ``index`` covers (as ``token_counts`` says, without the list)."""
        if not 0 <= index < len(self.addresses):
            raise IndexError(f"object {index} of a lookup of {len(self.addresses)}")
        start = index * self.chunk_tokens
        return start, min(start + self.chunk_tokens, self.tokens)

    def chunk(self, index: int, record: ObjectRecord, encoding: str, *, warm: bool | None = None) -> Chunk:
        """Object ``index`` of this prefix as a load fetches it: its span, ``encoding`` (one ``record`` names) with
        that encoding's digest, size and piece digests, and the tier the entry edge named for it. Only the last object may be a partial tail."""
        e = record.encodings[encoding]
        start = index * self.chunk_tokens
        return Chunk(self.addresses[index], start, min(start + self.chunk_tokens, self.tokens), encoding,
                     e.digest, e.size, self.sources[index] if index < len(self.sources) else "", e.piece_list,
                     warm=warm)

    def head(self, k: int) -> Lookup:
        """The first ``k`` objects of this prefix (a hybrid engine that must recompute the last token drops one)."""
        keep = self.addresses[:k]
        return replace(self, addresses=keep, tokens=sum(self.token_counts()[:k]), records=self.records[:k],
                       cold=self.cold & set(keep), sources=self.sources[:k])


@dataclass(frozen=True)
class Probe:
    """What a probe of the link measured (``KDNClient.probe``): ``Speeds.observe_load``'s arguments."""

    nbytes: int
    seconds: float
    abandoned: bool


@dataclass(frozen=True)
class Fetched:
    address: A.Address
    encoding: str
    blob: bytearray | memoryview  # the receive buffer, verified (a view of an arena lease when one lent it)
    source: str
    seconds: float
    buffer: Buffer | None = None  # what to release once the bytes are used (an arena lease; else a no-op)

    def release(self) -> None:
        """Hand the receive buffer back (a no-op unless it came from an arena): ``blob`` is not read after."""
        if self.buffer is not None:
            self.buffer.release()


@dataclass
class Tensors:
    """Some tensors of one object (``KDNClient.fetch_tensors``): their bytes as stored in the blob (``layout``
    names each one's dtype, shape and codec), and the bytes moved to get them."""

    layout: Layout
    tensors: dict[str, memoryview]
    bytes_fetched: int


@dataclass
class PrefixStates:
    lookup: Lookup
    objects: list[DecodedObject]  # in chain order
    fetched: list[Fetched]
    fetch_s: float
    decode_s: float

    @property
    def sources(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.fetched:
            out[f.source] = out.get(f.source, 0) + 1
        return out
