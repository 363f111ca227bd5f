"""Object records in the origin's S3 bucket (``origin/s3records.py``), against a real SeaweedFS on loopback.

The object part of the registry contract (tests/registry/test_contract.py) over ``S3Records``: round trips,
more records than one transaction, added encodings and tails kept by a re-publish, and -- S3 has no
transactions -- two writers' read-modify-writes of one record losing nothing (conditional PUTs); plus what
a records store refuses (leases, watches) and bounds (an oversized object planted in the bucket).
"""

from __future__ import annotations

import asyncio

import obstore as obs
import pytest

from kdn.errors import InvalidInput
from kdn.origin.s3records import MAX_RECORD_BYTES, RECORDS, S3Records
from kdn.origin.s3store import bucket, parse_s3_url
from kdn.registry.split import RecordsBeside
from registry_helpers import addr, chain, enc, obj


@pytest.fixture
async def records(s3_store_url):
    handles: list[S3Records] = []

    def make() -> S3Records:
        handles.append(S3Records(s3_store_url))
        return handles[-1]

    yield make
    for h in handles:
        await h.close()


async def test_object_round_trip_and_batch_get(records):
    reg = records()
    a, b, c = chain("doc", 3)
    tailed = a.with_tail(17, addr("tail"))
    await reg.put_objects([tailed, c])
    assert await reg.get_object(a.address) == tailed
    assert await reg.get_object(b.address) is None
    assert await reg.get_objects([a.address, b.address, c.address]) == [tailed, None, c]
    assert await records().get_objects([a.address, c.address]) == [tailed, c]  # another handle: the same bucket


async def test_more_records_than_one_transaction(records):
    reg = records()
    objs = chain("long", 300)
    await reg.put_objects(objs)
    assert await reg.get_objects([o.address for o in objs] + [addr("missing")]) == objs + [None]
    keys = [k for k, _ in await reg.list_keys("objects/")]
    assert keys == sorted(f"objects/{o.address}" for o in objs)


async def test_republishing_keeps_added_encodings_and_tails(records):
    reg = records()
    a = obj("p")
    await reg.put_objects([a])
    await reg.add_tail(a.address, 9, addr("t9"))
    await reg.put_objects([obj("p", encs=("zstd-planes",))])
    got = await reg.get_object(a.address)
    assert set(got.encodings) == {"raw", "zstd-planes"} and got.tails == {9: addr("t9")}
    assert await reg.add_encoding(addr("ghost"), enc()) is None and await reg.get_object(addr("ghost")) is None


async def test_two_writers_read_modify_writes_lose_no_update(records):
    """Two origins on one bucket add encodings and tails to one record at once: every conditional PUT that lost
    its race read the record again and rebuilt, so all 24 of each land."""
    a, b = records(), records()
    rec = obj("hot")
    await a.put_objects([rec])
    n = 24

    async def one(i: int) -> None:
        reg = a if i % 2 else b
        await reg.add_encoding(rec.address, enc(f"codec{i}", bytes([i])))
        await reg.add_tail(rec.address, i + 1, addr(f"tail{i}"))

    await asyncio.gather(*(one(i) for i in range(n)))
    got = await b.get_object(rec.address)
    assert set(got.encodings) == {"raw"} | {f"codec{i}" for i in range(n)}
    assert got.tails == {i + 1: addr(f"tail{i}") for i in range(n)}


async def test_leases_and_watches_are_refused_and_an_oversized_record_is_not_read(records, s3_store_url, tmp_path):
    reg = records()
    with pytest.raises(InvalidInput, match="no leases"):
        await reg._grant(10)
    with pytest.raises(InvalidInput, match="not watched"):
        reg.watch("objects/")
    # Something too large planted where a record goes: refused before it is read, with the reason.
    a = addr("big")
    raw = bucket(parse_s3_url(s3_store_url), under=RECORDS)
    obs.put(raw, reg._object_key(a).strip("/"), b"x" * (MAX_RECORD_BYTES + 1))
    with pytest.raises(InvalidInput, match="over"):
        await reg.get_object(a)
    # Beside a registry, the records store gets object records and nothing else.
    from kdn.registry import EmbeddedRegistry

    async with RecordsBeside(EmbeddedRegistry(tmp_path / "control.sqlite3"), records()) as split:
        await split.put_objects([obj("routed")])
        assert await split.control.get_object(obj("routed").address) is None
        assert await split.records.get_object(obj("routed").address) == obj("routed")
