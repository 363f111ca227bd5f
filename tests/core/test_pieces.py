"""Verified streaming (kdn/format/pieces.py): piece digests in the signed record, checked as each piece lands.

The sources are real aiohttp servers on loopback; one streams its body slowly and counts what it got to
send before the reader hung up, which is what "a lie is found within a piece" means on the wire.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

from kdn.format.address import Digest
from kdn.wire.bodyget import BodyGetter
from kdn.errors import DigestMismatch, InvalidInput, SourceError
from kdn.wire.estimate import Estimates
from kdn.wire.fetch import Fetcher, Fresh, Route, Want
from kdn.format.pieces import MIN_PIECE_BYTES, PIECE_BYTES, Pieces, PieceVerifier, piece_digests
from kdn.registry import Encoding, ObjectRecord
from kdn.registry.signing import SignatureError, Signer, Verifier, payload

MiB = 1 << 20
BLOB = bytes(range(251)) * (8 * MiB // 251 + 1)  # 8 MiB and a bit: 9 pieces, the last one short
ADDR = "cd" * 32


def want(blob: bytes = BLOB, *, pieces: bool = True) -> Want:
    p = Pieces(PIECE_BYTES, piece_digests(blob)) if pieces else None
    return Want(ADDR, "raw", len(blob), Digest(blake3(blob).hexdigest()), p)


def test_piece_digests_cover_the_blob_and_a_one_piece_blob_records_none():
    d = piece_digests(BLOB)
    assert len(d) == 9 and d[0] == blake3(BLOB[:MiB]).hexdigest() and d[-1] == blake3(BLOB[8 * MiB:]).hexdigest()
    assert piece_digests(BLOB[:MiB]) == ()  # one piece: its digest would be the whole digest


@pytest.mark.parametrize("size, piece_bytes, digests, why", [
    (len(BLOB), PIECE_BYTES, piece_digests(BLOB)[:-1], "8 piece digests"),
    (len(BLOB), 4096, ["ab" * 32] * 4, "piece size"),
    (MiB, PIECE_BYTES, ["ab" * 32], "one piece"),
    (len(BLOB), PIECE_BYTES, "ab" * 32, "must be a list"),
    (len(BLOB), PIECE_BYTES, ["xyz"] * 9, "digest"),
])
def test_pieces_that_cannot_describe_the_blob_are_refused(size, piece_bytes, digests, why):
    with pytest.raises(InvalidInput, match=why):
        Pieces.checked(size, piece_bytes, digests)
    with pytest.raises(InvalidInput):
        Encoding("raw", size, "ab" * 32, piece_bytes, digests)


def _record(enc: Encoding) -> ObjectRecord:
    return ObjectRecord(address=ADDR, model_id="ef" * 32, namespace="public", kind="kv", start=0, end=256,
                        parent=None, standalone=False, encodings={"raw": enc}, origin="o1")


def test_records_carry_pieces_and_sign_them_and_old_records_are_unchanged(tmp_path):
    enc = Encoding("raw", len(BLOB), blake3(BLOB).hexdigest(), PIECE_BYTES, list(piece_digests(BLOB)))
    rec = _record(enc)
    again = ObjectRecord.unpack(rec.pack())
    assert again == rec and again.encodings["raw"].piece_list == Pieces(PIECE_BYTES, piece_digests(BLOB))
    plain = _record(Encoding("raw", len(BLOB), enc.digest))
    assert "pieces" not in plain.to_dict()["encodings"]["raw"]  # a record without pieces is as small as before
    assert b"pieces" not in payload(plain)  # ...and what it signs is what was signed before pieces existed
    signer = Signer.generate(tmp_path / "o.key")
    verifier = Verifier([signer.public])
    signed = signer.sign(rec)
    verifier.check(signed)
    forged = list(enc.pieces)
    forged[3] = blake3(b"forged").hexdigest()
    import dataclasses

    tampered = dataclasses.replace(signed, encodings={"raw": dataclasses.replace(enc, pieces=tuple(forged))})
    with pytest.raises(SignatureError, match="signature"):
        verifier.check(tampered)


def test_a_piece_verifier_proves_prefixes_and_stops_at_the_first_wrong_piece():
    seen: list[int] = []
    v = PieceVerifier(len(BLOB), Pieces(PIECE_BYTES, piece_digests(BLOB)), on_verified=seen.append)
    for i in range(0, len(BLOB), 300_001):  # segments that straddle piece boundaries
        v.update(memoryview(BLOB)[i:i + 300_001])
    assert v.verified() and seen == [MiB * k for k in range(1, 9)] + [len(BLOB)]
    bad = bytearray(BLOB)
    bad[3 * MiB + 5] ^= 1
    v = PieceVerifier(len(bad), Pieces(PIECE_BYTES, piece_digests(BLOB)))
    v.update(memoryview(bad)[:3 * MiB])
    assert v.proven == 3 * MiB and not v.verified()
    with pytest.raises(DigestMismatch, match="piece 3"):
        v.update(memoryview(bad)[3 * MiB:])


def serve(behaviour: str, sent: list[int]):
    """A source that streams its body 64 KiB at a time (so a reader that hangs up early is seen)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = bytearray(BLOB)
        if behaviour == "lie-early":
            body[1000] ^= 1
        elif behaviour == "lie-late":
            body[-10] ^= 1
        resp = web.StreamResponse(headers={"X-KDN-Encoding": "raw", "X-KDN-Source": "memory",
                                           "Content-Length": str(len(body))})
        await resp.prepare(request)
        sent.append(0)
        try:
            for i in range(0, len(body), 64 << 10):
                await resp.write(bytes(body[i:i + (64 << 10)]))
                sent[-1] = i + (64 << 10)
                await asyncio.sleep(0.002)
        except (ConnectionError, RuntimeError):
            pass  # the reader hung up: what it took is in ``sent``
        return resp

    app = web.Application()
    app.router.add_get("/v1/objects/{address}", handler)
    return TestServer(app, host="127.0.0.1")


@pytest.fixture
async def source():
    started: list[TestServer] = []

    async def make(behaviour: str, sent: list[int]) -> str:
        s = serve(behaviour, sent)
        await s.start_server()
        started.append(s)
        return str(s.make_url("")).rstrip("/")

    yield make
    for s in started:
        await s.close()


class Watched(Fresh):
    """A body buffer that hears what is proven of it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.proven: list[int] = []

    def verified(self, n: int) -> None:
        self.proven.append(n)


async def test_a_lie_in_the_first_piece_stops_the_transfer_there_and_the_next_source_serves(source):
    getter = BodyGetter(ssl=None)
    fetcher = Fetcher(getter, Estimates(), timeout=10.0)
    liar_sent: list[int] = []
    liar, good = await source("lie-early", liar_sent), await source("ok", [])
    bufs: list[Watched] = []

    def alloc(n: int) -> Watched:
        bufs.append(Watched(n))
        return bufs[-1]

    body = await fetcher.fetch(want(), [Route("edge:liar", liar, "edge"), Route("origin", good, "origin")],
                               alloc=alloc)
    assert bytes(body.blob) == BLOB and fetcher.failovers == 1
    await asyncio.sleep(0.05)  # let the liar's handler see the hang-up
    # The reader hung up after the first piece (1 MiB) plus what the socket buffers held: far from 8 MiB.
    assert liar_sent[0] < 4 * MiB, liar_sent
    assert bufs[0].proven == []  # nothing of the forged body was ever proven
    assert bufs[1].proven == [MiB * k for k in range(1, 9)] + [len(BLOB)]  # the good one, piece by piece
    getter.close()


@pytest.mark.parametrize("pieces", [True, False])
async def test_a_lie_in_the_last_piece_is_caught_by_pieces_and_by_the_whole_digest(source, pieces):
    getter = BodyGetter(ssl=None)
    fetcher = Fetcher(getter, Estimates(), timeout=10.0)
    liar = await source("lie-late", [])
    bufs: list[Watched] = []

    def alloc(n: int) -> Watched:
        bufs.append(Watched(n))
        return bufs[-1]

    with pytest.raises(DigestMismatch):
        await fetcher.fetch(want(pieces=pieces), [Route("edge:liar", liar, "edge")], alloc=alloc)
    # Piece by piece, the first eight pieces were proven before the ninth failed; whole, nothing was.
    assert bufs[0].proven == ([MiB * k for k in range(1, 9)] if pieces else [])
    getter.close()


async def test_pieces_that_do_not_match_the_digest_fail_the_fetch_not_the_reader(source):
    """A record whose pieces name other bytes (only possible unsigned) is a lie like any other."""
    getter = BodyGetter(ssl=None)
    fetcher = Fetcher(getter, Estimates(), timeout=10.0)
    good = await source("ok", [])
    other = bytes(len(BLOB))
    w = Want(ADDR, "raw", len(BLOB), Digest(blake3(BLOB).hexdigest()), Pieces(PIECE_BYTES, piece_digests(other)))
    with pytest.raises(DigestMismatch):
        await fetcher.fetch(w, [Route("origin", good, "origin")])
    with pytest.raises(SourceError):  # a fetch of the right bytes still works on the same getter
        await fetcher.fetch(want(BLOB[:-1]), [Route("origin", good, "origin")])
    assert bytes((await fetcher.fetch(want(), [Route("origin", good, "origin")])).blob) == BLOB
    getter.close()


def test_the_minimum_piece_size_bounds_a_record_s_digest_list():
    with pytest.raises(InvalidInput):
        Pieces.checked(100 * MIN_PIECE_BYTES, MIN_PIECE_BYTES // 2, ["ab" * 32] * 200)
