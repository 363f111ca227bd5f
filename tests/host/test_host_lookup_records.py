"""A lookup with ``records`` (an engine asking the host tier first, ``kdn.client.find``): each held object's signed
record comes back as its fill verified it; one another tenant holds, or one not held, is null; and however much
the records weigh, the answer stays inside the frame limit (past ``RECORDS_BYTES`` the rest are null: the engine
then asks its edge, as without a host)."""

from __future__ import annotations

import pytest
from host_helpers import Shelf, host_config, running

from kdn.client.host import HostClient
from kdn.registry.records import ObjectRecord
from kdn.wire import host as wire

ACME = "tenant-acme-" + "a" * 20


@pytest.fixture
async def tier(short_dir):
    (short_dir / "grants").write_text(f"{ACME} read acme\n")
    shelf = Shelf()
    async with running(host_config(short_dir, token_file=str(short_dir / "grants")), shelf) as t:
        yield t, shelf


async def test_records_come_with_the_lookup_for_what_the_caller_may_read(tier):
    t, shelf = tier
    public = [shelf.add(i)[0] for i in range(3)]
    theirs = shelf.add(10, namespace="acme")[0]
    async with HostClient(t.config.socket, token=ACME) as acme:
        assert await acme.warm([theirs], "raw") == ["filled"]
    async with HostClient(t.config.socket) as anyone:
        assert await anyone.warm(public, "raw") == ["filled"] * 3
        plain = await anyone.lookup([*public, theirs, "0" * 64])
        assert plain.records is None  # not asked: not sent
        got = await anyone.lookup([*public, theirs, "0" * 64], records=True)
    assert got.held == [True, True, True, False, False]
    # Each one the map of the record its fill verified (made once, when it was held), as a lease's frame has it.
    assert got.records == [shelf.objects[a][1].to_dict() for a in public] + [None, None]  # acme's: not held


async def test_a_leases_record_is_the_typed_records_map_and_reads_back_as_it(tier):
    t, shelf = tier
    address = shelf.add(0)[0]
    record = shelf.objects[address][1]
    async with HostClient(t.config.socket) as h:
        async with h.lease(address, "raw") as filled:
            async with h.lease(address, "raw") as held:
                assert filled.filled and not held.filled
                assert filled.record == held.record == record.to_dict()
                assert ObjectRecord.from_dict(held.record) == record


async def test_records_past_the_byte_budget_are_null_and_the_answer_fits_a_frame(tier, monkeypatch):
    t, shelf = tier
    addresses = [shelf.add(i)[0] for i in range(6)]
    async with HostClient(t.config.socket) as h:
        assert await h.warm(addresses, "raw") == ["filled"] * 6
        one = len(wire.msgpack.packb(shelf.objects[addresses[0]][1].to_dict()))
        monkeypatch.setattr("kdn.host.ops.RECORDS_BYTES", 3 * one + one // 2)  # room for three and a half
        got = await h.lookup(addresses, records=True)
    assert got.held == [True] * 6 and got.records is not None
    assert [r is not None for r in got.records] == [True, True, True, False, False, False]
