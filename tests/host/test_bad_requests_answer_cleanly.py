"""Refused requests answer with a code and one line, and the connection survives (but after an oversize frame,
which ends it cleanly); another tenant's object answers word for word as an unpublished one."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
from edge_helpers import wait_until
from host_helpers import Shelf, host_config, running

from kdn.client.host import HostClient
from kdn.wire.host import MAX_MESSAGE, HostError, pack

ACME = "tenant-acme-" + "a" * 20
BETA = "tenant-beta-" + "b" * 20


class Raw:
    """A client that writes whatever bytes a test gives it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: str) -> Raw:
        return cls(*await asyncio.open_unix_connection(path))

    async def ask(self, message: dict | bytes) -> dict:
        self.writer.write(pack(message) if isinstance(message, dict) else message)
        return await self.answer()

    async def answer(self) -> dict:
        (n,) = struct.unpack(">I", await asyncio.wait_for(self.reader.readexactly(4), 10))
        return msgpack.unpackb(await self.reader.readexactly(n))

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def host(short_dir):
    (short_dir / "grants").write_text(f"{ACME} read acme\n{BETA} read beta\n")
    shelf = Shelf()
    async with running(host_config(short_dir, token_file=str(short_dir / "grants")), shelf) as tier:
        yield tier, shelf


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def test_malformed_requests_are_refused_and_the_connection_goes_on(host):
    tier, shelf = host
    address, _ = shelf.add(1)
    raw = await Raw.open(tier.config.socket)
    try:
        cases = [
            (frame(b"\xc1"), "bad-request"),  # not msgpack
            (frame(msgpack.packb([1, 2])), "bad-request"),  # not a map
            ({"id": 1, "op": "teleport"}, "bad-request"),
            ({"id": 2, "op": "lease", "address": "not-an-address", "encoding": "raw"}, "bad-request"),
            ({"id": 3, "op": "lease", "address": address, "encoding": "RAW/../x"}, "bad-request"),
            ({"id": 4, "op": "lookup", "addresses": "abc"}, "bad-request"),
            ({"id": 5, "op": "release", "lease": 99}, "bad-request"),
            ({"id": "six", "op": "stats"}, "bad-request"),
            ({"id": 7, "op": "stats", "token": "x" * 600}, "bad-request"),
            ({"id": 8, "op": "stats", "token": "no-such-token-" + "z" * 20}, "unauthorized"),
            ({"id": 9, "op": "lease", "address": "f" * 64, "encoding": "raw"}, "absent"),
        ]
        for message, code in cases:
            a = await raw.ask(message)
            assert (a["ok"], a["error"]) == (False, code), (message, a)
            assert a["message"] and "\n" not in a["message"]
        a = await raw.ask({"id": 10, "op": "lease", "address": address, "encoding": "raw"})
        assert a["ok"] and a["id"] == 10 and a["length"] == len(shelf.objects[address][0])
        assert a["record"] == shelf.objects[address][1].to_dict()  # the typed record's map, as the frame carries it
    finally:
        raw.close()


async def test_an_oversize_frame_is_refused_and_the_connection_closes_cleanly(host):
    tier, shelf = host
    address, _ = shelf.add(1)
    raw = await Raw.open(tier.config.socket)
    raw.writer.write(struct.pack(">I", MAX_MESSAGE + 1) + b"\0" * 64)
    a = await raw.answer()
    assert (a["ok"], a["error"]) == (False, "oversize") and a["id"] is None
    assert await asyncio.wait_for(raw.reader.read(), 10) == b""  # closed after the refusal, nothing more
    raw.close()
    async with HostClient(tier.config.socket) as c:  # the host is fine
        async with c.lease(address, "raw") as obj:
            assert len(obj.view) == len(shelf.objects[address][0])
    assert tier.stats()["leases"] == 0


async def test_another_tenants_object_answers_as_an_absent_one(host):
    tier, shelf = host
    theirs, _ = shelf.add(1, namespace="acme")
    async with HostClient(tier.config.socket, token=ACME) as acme, HostClient(tier.config.socket, token=BETA) as beta:
        with pytest.raises(HostError) as refused_first:
            async with beta.lease(theirs, "raw"):
                pass
        assert tier.stats()["fills"] == 0  # never filled for a token that may not read it
        async with acme.lease(theirs, "raw"):
            assert (await acme.lookup([theirs])).held == [True]
            assert (await beta.lookup([theirs])).held == [False]
            with pytest.raises(HostError) as refused_held:
                async with beta.lease(theirs, "raw"):
                    pass
        with pytest.raises(HostError) as absent:
            async with beta.lease("e" * 64, "raw"):
                pass
        assert (await beta.warm([theirs], "raw")) == ["absent"]
    for e in (refused_first.value, refused_held.value):
        assert (e.code, e.message) == (absent.value.code, absent.value.message.replace("e" * 64, theirs))


async def test_anonymous_callers_read_public_only(host):
    tier, shelf = host
    public, _ = shelf.add(1)
    acme, _ = shelf.add(2, namespace="acme")
    async with HostClient(tier.config.socket) as anon:
        assert (await anon.warm([public, acme], "raw")) == ["filled", "absent"]
        assert (await anon.lookup([public, acme])).prefix == 1


async def test_a_connection_past_its_lease_limit_is_refused_until_it_releases(host, monkeypatch):
    import functools

    import kdn.host.session as session

    monkeypatch.setattr(session, "Leases", functools.partial(session.Leases, limit=2))
    tier, shelf = host
    a, b, c = (shelf.add(i)[0] for i in range(3))
    async with HostClient(tier.config.socket) as host_client:
        async with host_client.lease(a, "raw"), host_client.lease(b, "raw"):
            with pytest.raises(HostError, match="too-many"):
                async with host_client.lease(c, "raw"):
                    pass
            assert tier.stats()["leases"] == 2
        async with host_client.lease(c, "raw"):
            assert tier.stats()["leases"] == 1


async def test_requests_past_the_in_flight_limit_are_refused_not_queued(host):
    from kdn.host.session import MAX_IN_FLIGHT

    tier, shelf = host
    shelf.gate = asyncio.Event()  # every fill waits: every lease request stays in flight
    addresses = [shelf.add(i, 4096)[0] for i in range(MAX_IN_FLIGHT + 1)]
    raw = await Raw.open(tier.config.socket)
    try:
        for i, a in enumerate(addresses):
            raw.writer.write(pack({"id": i, "op": "lease", "address": a, "encoding": "raw"}))
        first = await raw.answer()
        assert (first["id"], first["error"]) == (MAX_IN_FLIGHT, "too-many")
        shelf.gate.set()
        answers = [await raw.answer() for _ in range(MAX_IN_FLIGHT)]
        assert all(a["ok"] for a in answers) and sorted(a["id"] for a in answers) == list(range(MAX_IN_FLIGHT))
    finally:
        raw.close()
    await wait_until(lambda: tier.stats()["leases"] == 0)  # the connection's end released all 64


async def test_an_unknown_token_fails_the_connect_and_leaves_no_connection(host):
    tier, _ = host
    with pytest.raises(HostError) as e:
        await HostClient(tier.config.socket, token="not-a-granted-token-" + "q" * 12).connect()
    assert e.value.code == "unauthorized"
    await wait_until(lambda: tier.stats()["connections"] == 0)


async def test_lease_many_answers_each_address_and_release_many_ends_them(host):
    """A load's objects leased in one round trip: each held one its lease, each other its own refusal (another
    tenant's answers as an unpublished one), the rest still leased; release_many ends them, an unknown id is a
    bad request that still ends the others; over MAX_LEASE_MANY addresses is refused whole."""
    from kdn.client.leased import Leased
    from kdn.wire.host import MAX_LEASE_MANY

    tier, shelf = host
    mine = [shelf.add(i, namespace="acme")[0] for i in range(3)]
    theirs, _ = shelf.add(9, namespace="beta")
    unpublished = "f" * 64
    async with HostClient(tier.config.socket, token=ACME) as h:
        got = await h.lease_many([mine[0], theirs, mine[1], unpublished, mine[2]], "raw")
        assert [type(x).__name__ for x in got] == ["Leased", "HostError", "Leased", "HostError", "Leased"]
        assert got[1].code == got[3].code == "absent" and got[1].message.split(" ")[:2] == got[3].message.split(" ")[:2]
        leased = [x for x in got if isinstance(x, Leased)]
        assert all(x.object().header.address == a for x, a in zip(leased, mine))
        assert (await h.stats())["leases"] == 3
        with pytest.raises(HostError, match="bad-request: no lease 99999"):
            await h.release_many([leased[0].lease, 99999])
        assert (await h.stats())["leases"] == 2
        await h.release_many([x.lease for x in leased[1:]])
        assert (await h.stats())["leases"] == 0
        raw = await Raw.open(tier.config.socket)
        try:
            a = await raw.ask({"id": 1, "op": "lease_many", "token": ACME, "addresses": [mine[0]] * (MAX_LEASE_MANY + 1),
                               "encoding": "raw"})
            assert (a["ok"], a["error"]) == (False, "bad-request")
        finally:
            raw.close()
