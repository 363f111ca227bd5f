"""A planted record costs its reader nothing (#51 item 10): object records in a folder store had no size bound,
so a 14.5 MB record of 200,000 tails written into ``records.sqlite3`` cost the origin's event loop ~1.4 s per
anonymous ``POST /v1/records``. A stored record is now bounded before it is parsed, a tail is shorter than the
chunk it continues, and a record that breaks either reads as absent, logged.
"""

from __future__ import annotations

import logging
import time

import msgpack
import pytest
from origin_helpers import running_origin

from kdn.errors import InvalidInput
from kdn.registry import EmbeddedRegistry, Encoding, ObjectRecord
from kdn.registry.records import MAX_TAILS
from kdn.registry.split import MAX_RECORD_BYTES, RECORDS_FILE

MID = "c" * 64


def record(address: str, **kw) -> ObjectRecord:
    return ObjectRecord(**{"address": address, "model_id": MID, "namespace": "public", "kind": "kv", "start": 0,
                           "end": 256, "parent": None, "standalone": False,
                           "encodings": {"zstd": Encoding("zstd", 10, "1" * 64)}, "origin": "o", **kw})


def planted(address: str, n_tails: int, length: int | None = None) -> bytes:
    """The bytes of a public record with ``n_tails`` tails (of lengths 1..n, or one of ``length``), as an attacker
    who can write the store's file writes them: past every check a writer makes."""
    d = record(address).to_dict()
    d["tails"] = {str(length if length is not None else i + 1): f"{i:064x}" for i in range(n_tails)}
    return msgpack.packb(d)


async def plant(store, address: str, value: bytes) -> None:
    reg = EmbeddedRegistry(store / RECORDS_FILE)
    try:
        await reg._put(reg._object_key(address), value)
    finally:
        await reg.close()


async def test_a_planted_oversize_record_reads_as_absent_at_once(tmp_path, etcd_url, caplog):
    big, bad_tail, good = "b1" * 32, "b2" * 32, "b3" * 32
    value = planted(big, 200_000)
    assert len(value) > MAX_RECORD_BYTES  # ~14.5 MB
    async with running_origin(tmp_path, etcd_url) as (server, session):
        store = tmp_path / "store"
        await plant(store, big, value)
        await plant(store, bad_tail, planted(bad_tail, 1, length=256))  # a tail as long as its chunk
        await plant(store, good, record(good).pack())
        with caplog.at_level(logging.ERROR, logger="kdn.registry"):
            for _ in range(3):
                t0 = time.monotonic()
                async with session.post("/v1/records", json={"addresses": [big, bad_tail, good]}) as r:
                    assert r.status == 200
                    got = (await r.json())["records"]
                took = time.monotonic() - t0
                assert got[:2] == [None, None] and got[2]["address"] == good
                assert took < 1.0, f"POST /v1/records with a planted record took {took:.2f} s"
            async with session.get(f"/v1/registry/objects/{big}") as r:
                assert r.status == 404
        said = [rec.getMessage() for rec in caplog.records if rec.name == "kdn.registry"]
        assert sum(big in m and "over" in m for m in said) == 1  # logged, once
        assert sum(bad_tail in m and "tails" in m for m in said) == 1


def test_a_tail_as_long_as_its_chunk_is_refused_at_validation():
    a, t = "a" * 64, "b" * 64
    assert record(a, tails={255: t}).tails == {255: t}
    for length in (256, 257, 10_000):
        with pytest.raises(InvalidInput, match="tails"):
            record(a, tails={length: t})
        with pytest.raises(InvalidInput, match="tails"):
            ObjectRecord.from_dict({**record(a).to_dict(), "tails": {str(length): t}})
    # A span that would let every length through: the count is bounded too.
    with pytest.raises(InvalidInput, match="tails"):
        record(a, end=1 << 20, tails={i + 1: t for i in range(MAX_TAILS + 1)})


async def test_a_planted_oversize_record_in_a_bucket_reads_as_absent(s3_store_url, tmp_path, caplog):
    """The same bound over an s3:// store's records (``S3Records``, which will not download one that large):
    beside a registry, one too large reads as absent, logged, and the batch it was in is still answered."""
    import obstore as obs

    from kdn.origin.s3records import RECORDS, S3Records
    from kdn.origin.s3store import bucket, parse_s3_url
    from kdn.registry.split import RecordsBeside

    big, good = "c1" * 32, "c2" * 32
    async with RecordsBeside(EmbeddedRegistry(tmp_path / "control.sqlite3"), S3Records(s3_store_url)) as reg:
        stored = record(good)
        await reg.put_objects([stored])
        raw = bucket(parse_s3_url(s3_store_url), under=RECORDS)
        obs.put(raw, reg.records._object_key(big).strip("/"), b"x" * (MAX_RECORD_BYTES + 1))
        with caplog.at_level(logging.ERROR, logger="kdn.registry"):
            got = await reg.get_objects([big, good])
            assert got == [None, stored]
            assert await reg.get_object(big) is None
        assert sum(big in r.getMessage() and "over" in r.getMessage() for r in caplog.records) == 1


def test_security_md_states_the_bounds_the_code_has():
    from pathlib import Path

    from kdn.registry.split import PARSE_ON_LOOP_BYTES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert (MAX_RECORD_BYTES, MAX_TAILS, PARSE_ON_LOOP_BYTES) == (4 << 20, 4096, 64 << 10)
    assert "over 4 MiB (`MAX_RECORD_BYTES`" in doc and "at most 4,096" in doc
    assert "past 64 KiB are parsed on a worker thread" in doc
