"""Verified streaming: an object's body checked piece by piece as it lands, not only once it is whole.

A whole-blob digest proves nothing until the last byte: a consumer that waits
for it cannot use layer 0 while layer 29 is on the wire, and a source that lies
in its first megabyte is found out only after it has sent all of them. So an
origin records, beside each encoding's BLAKE3, the BLAKE3 of every fixed-size
piece of the blob (``PIECE_BYTES``, 1 MiB: the block size vLLM's offloading
connector settled on; a SmolLM2 chunk's raw blob is 6 pieces), and signs them
with the rest of the record (``kdn.registry.signing.payload``). The fetch
(``kdn.wire.fetch``) then verifies each piece the moment its last byte lands:

- a piece that does not match aborts the transfer there (the connection is
  dropped, the source counted as a liar, the next one asked): at most one
  piece of a forged body is ever received past the first wrong byte's piece;
- the body's sink hears ``verified(n)`` each time its first ``n`` bytes are
  proven (a ``kdn.wire.bodyget.Sink`` may define it), so it may use them at once;
- the pieces together stand in for the whole digest: the origin computes both
  from the same bytes (``kdn.origin`` store: at write time, and at a restart
  only after the whole digest written beside the blob matched), so bytes whose
  every piece matches are the bytes the whole digest names -- one hash per
  byte, not two.

A blob of at most one piece records no pieces (its one piece digest would be
the whole digest), and a record from before pieces carries none: both are
verified whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from blake3 import blake3

from kdn.format.address import Digest, blob_digest, validate_digest
from kdn.errors import DigestMismatch, InvalidInput

PIECE_BYTES = 1 << 20
MIN_PIECE_BYTES = 64 << 10  # smaller pieces would make a record's digest list larger than it is worth
MAX_PIECE_BYTES = 1 << 30


def check_piece_bytes(piece_bytes: object) -> int:
    """A piece size an origin may record: an int in [64 KiB, 1 GiB]."""
    if not (isinstance(piece_bytes, int) and not isinstance(piece_bytes, bool)
            and MIN_PIECE_BYTES <= piece_bytes <= MAX_PIECE_BYTES):
        raise InvalidInput(f"piece size must be an int in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}] bytes, "
                           f"got {str(piece_bytes)[:20]}")
    return piece_bytes


def n_pieces(size: int, piece_bytes: int) -> int:
    return -(-size // piece_bytes)


def piece_digests(data: bytes | bytearray | memoryview, piece_bytes: int = PIECE_BYTES) -> tuple[Digest, ...]:
    """The BLAKE3 of each ``piece_bytes`` piece of ``data``; () when ``data`` is at most one piece."""
    view = memoryview(data).cast("B")
    if len(view) <= piece_bytes:
        return ()
    return tuple(blob_digest(view[i:i + piece_bytes]) for i in range(0, len(view), piece_bytes))


@dataclass(frozen=True)
class Pieces:
    """What a record says of a blob's pieces: their size (the last may be shorter) and digests, in order."""

    piece_bytes: int
    digests: tuple[Digest, ...]

    @classmethod
    def checked(cls, size: object, piece_bytes: object, digests: object) -> Pieces | None:
        """The pieces of a ``size``-byte blob as a record (or a peer's JSON) states them; None if it states
        none; InvalidInput if what it states cannot describe that blob."""
        if not digests and not piece_bytes:
            return None
        piece_bytes = check_piece_bytes(piece_bytes)
        if not isinstance(size, int) or isinstance(size, bool) or size <= piece_bytes:
            raise InvalidInput(f"a {str(size)[:20]}-byte blob of one piece records no pieces")
        if not isinstance(digests, Sequence) or isinstance(digests, str | bytes):
            raise InvalidInput("piece digests must be a list")
        if len(digests) != n_pieces(size, piece_bytes):
            raise InvalidInput(f"{len(digests)} piece digests for a {size}-byte blob in {piece_bytes}-byte pieces "
                               f"(expected {n_pieces(size, piece_bytes)})")
        return cls(piece_bytes, tuple(validate_digest(d) for d in digests))


def piece_span(size: int, pieces: Pieces, first: int, end: int) -> tuple[int, int, Pieces]:
    """Pieces ``[first, end)`` of a ``size``-byte blob: their bytes ``[lo, hi)`` and their digests (what a range
    request for them is verified against)."""
    n = len(pieces.digests)
    if not (0 <= first < end <= n):
        raise InvalidInput(f"pieces [{first}, {end}) of a blob of {n}")
    lo, hi = first * pieces.piece_bytes, min(end * pieces.piece_bytes, size)
    return lo, hi, Pieces(pieces.piece_bytes, pieces.digests[first:end])


class BodyVerifier:
    """What a fetch feeds the body to as it lands (``kdn.wire.bodyget.Hasher``), and asks at the end."""

    def update(self, data: memoryview, /) -> object:  # pragma: no cover - the two below
        raise NotImplementedError

    def verified(self) -> bool:  # pragma: no cover
        raise NotImplementedError


class WholeDigest(BodyVerifier):
    """One BLAKE3 over the whole body, compared once the last byte is in."""

    def __init__(self, digest: Digest) -> None:
        self.digest = digest
        self._h = blake3()

    def update(self, data: memoryview, /) -> object:
        return self._h.update(data)

    def verified(self) -> bool:
        return bool(self._h.hexdigest() == self.digest)


class PieceVerifier(BodyVerifier):
    """Each piece compared as its last byte lands: a wrong one raises ``DigestMismatch`` there (the fetch
    drops the connection); ``on_verified(n)`` hears each new proven prefix length."""

    def __init__(self, size: int, pieces: Pieces, what: str = "body",
                 on_verified: Callable[[int], object] | None = None) -> None:
        self.size = size
        self.pieces = pieces
        self.what = what
        self.on_verified = on_verified
        self._h = blake3()
        self._i = 0  # the piece being hashed
        self._fill = 0  # its bytes so far
        self.proven = 0  # bytes proven so far (a prefix of the body)

    def _want(self) -> int:
        return min(self.pieces.piece_bytes, self.size - self._i * self.pieces.piece_bytes)

    def update(self, data: memoryview, /) -> object:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        pos = 0
        while pos < len(view):
            if self._i >= len(self.pieces.digests):
                raise DigestMismatch(f"{self.what}: bytes past its {self.size} recorded bytes")
            take = min(len(view) - pos, self._want() - self._fill)
            self._h.update(view[pos:pos + take])
            self._fill += take
            pos += take
            if self._fill == self._want():
                if self._h.hexdigest() != self.pieces.digests[self._i]:
                    raise DigestMismatch(f"{self.what}: piece {self._i} (bytes {self.proven}.."
                                         f"{self.proven + self._fill}) does not match its digest")
                self.proven += self._fill
                self._i += 1
                self._fill = 0
                self._h = blake3()
                if self.on_verified is not None:
                    self.on_verified(self.proven)
        return None

    def verified(self) -> bool:
        return self.proven == self.size and self._i == len(self.pieces.digests)


def verifier(size: int, digest: Digest, pieces: Pieces | None, what: str = "body",
             on_verified: Callable[[int], object] | None = None) -> BodyVerifier:
    """Piece by piece where the record has pieces, else whole."""
    if pieces is None:
        return WholeDigest(digest)
    return PieceVerifier(size, pieces, what, on_verified)
