"""A lease that ends before its engine is done copying: the engine's connection drops while the host lives on,
the host ends the connection's leases and gives the blocks to other objects. The engine must learn that the
bytes it copied may be another object's: each block's stamp (its generation, ``kdn.wire.host.STAMP``) is
overwritten before the block is reused, and a copy counts only if the stamp is unchanged after it
(``Leased.intact``). A load whose copies were cut off this way reads those objects from the edges instead, and
its cache ends up holding exactly the edge's bytes."""

from __future__ import annotations

import asyncio
import secrets
import struct
from types import SimpleNamespace

import pytest
import pytest_asyncio
from edge_helpers import EDGE_TOKEN, cluster, publish, wait_until
from host_helpers import Shelf, host_config, object_record, running

from kdn.client import KDNClient
from kdn.client.host import HostClient
from kdn.host.store import HostStore, footprint
from kdn.registry.signing import Signer
from kdn.wire.host import STAMP

SIZE = 96 << 10


def test_the_store_stamps_a_block_when_held_and_clears_it_before_reuse():
    segment = memoryview(bytearray(2 * footprint(SIZE)))
    store = HostStore(len(segment), len(segment), stamps=segment)
    stamp = lambda offset: struct.unpack_from("<Q", segment, offset - STAMP)[0]  # noqa: E731
    r = store.reserve(SIZE)
    a = store.commit(r, ("a" * 64, "raw"), object_record("a" * 64))
    assert a.generation and stamp(a.offset) == a.generation
    b = store.commit(store.reserve(SIZE), ("b" * 64, "raw"), object_record("b" * 64))
    assert b.generation not in (0, a.generation) and stamp(b.offset) == b.generation
    c = store.reserve(SIZE)  # evicts a: its stamp is cleared as its block is given up, before c's fill
    assert c.offset == a.offset and stamp(a.offset) == 0
    store.cancel(c)
    assert stamp(c.offset) == 0
    again = store.commit(store.reserve(SIZE), ("a" * 64, "raw"), object_record("a" * 64))
    assert again.offset == a.offset and stamp(again.offset) == again.generation != a.generation


async def test_a_copy_after_the_connection_dropped_and_the_block_was_reused_is_not_intact(short_dir):
    shelf = Shelf()
    config = host_config(short_dir, segment_bytes=2 * footprint(SIZE))  # two objects at a time
    async with running(config, shelf) as tier:
        (a, blob_a), (b, _), (c, _) = (shelf.add(i, SIZE) for i in range(3))
        async with HostClient(config.socket) as pusher:
            engine = await HostClient(config.socket).connect()
            async with engine.lease(a, "raw") as obj:
                assert bytes(obj.view) == blob_a and obj.intact()
                kept = await pusher.lease_many([a], "raw")  # another engine's lease of the same object ...
                assert obj.intact()
                await pusher.release_many([x.lease for x in kept])  # ... ended: it never touched the block
                await engine.close()  # the connection drops; the host lives on and ends its lease
                await wait_until(lambda: tier.stats()["leases"] == 0)  # (the host saw the connection end)
                assert await pusher.warm([b, c], "raw") == ["filled", "filled"]  # a's block goes to another object
                assert a not in {h.key[0] for h in tier.store.evictable()}
                assert bytes(obj.view) != blob_a  # what a copy would read now is not a's ...
                assert not obj.intact()  # ... and the engine can tell
            async with pusher.lease(b, "raw") as held:  # a living lease of a held object stays intact
                assert held.intact()


# --- a load through KDNClient, against a real CDN ------------------------------------------------------------------

DOC = ("The keeper's log for the night of the storm records wind from the north-east, "
       "two ships sighted, and the lamp relit twice after the glass cracked. ") * 12
OTHER = ("Harbour dues for the winter quarter are payable at the office on the quay, in coin or by note, "
         "before the first tide of the month. ") * 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cdn(etcd_server, tmp_path_factory):
    """Two documents of about one size: the one a load reads, and the one whose fill takes its blocks."""
    tmp = tmp_path_factory.mktemp("host-cut")
    key = Signer.generate(tmp / "origin.key")
    (tmp / "trusted").write_text(key.public + "\n")
    etcd = f"{etcd_server.replace('http://', 'etcd://')}/c{secrets.token_hex(4)}/"
    async with cluster(tmp, etcd, edges=("e1",), origin_kw={"signing_key": str(tmp / "origin.key")}) as c:
        m = await publish(c, DOC[:1100], encodings=["raw"])
        other = await publish(c, OTHER[:1400], name="dues", encodings=["raw"])
        yield SimpleNamespace(c=c, m=m, other=other, trusted=str(tmp / "trusted"))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_load_whose_leases_were_cut_off_mid_copy_reads_those_objects_from_the_edges(cdn, short_dir):
    async with KDNClient(edges=[cdn.c.edge_url("e1")]) as plain:  # what the edges serve, for reference
        hit = await plain.lookup(cdn.m["prefix_tokens"], cdn.m["model_id"])
        want: dict[int, bytes] = {}
        await plain.fetch_prefix(hit, encoding="raw", into=lambda i, view: want.__setitem__(i, bytes(view.buffer)))
    (short_dir / "edge-token").write_text(EDGE_TOKEN + "\n")
    config = host_config(short_dir, edges=(cdn.c.edge_url("e1"),), trusted_keys=cdn.trusted,
                         token_file=str(cdn.c.tokens), upstream_token_file=str(short_dir / "edge-token"),
                         segment_bytes=sum(footprint(len(b)) for b in want.values()))  # this document, no more
    async with running(config) as tier, HostClient(config.socket) as pusher:
        assert set(await pusher.warm(cdn.m["addresses"], "raw")) == {"filled"}
        loop = asyncio.get_running_loop()
        host = await HostClient(config.socket).connect()
        got: dict[int, bytes] = {}
        cut: list[int] = []

        async def drop_and_refill() -> None:
            await host.close()  # the engine's connection ends while the host lives on: every lease with it
            await wait_until(lambda: tier.stats()["leases"] == 0)  # (the host saw the connection end)
            await pusher.warm(cdn.other["addresses"], "raw")  # (no room but this document's blocks)
            assert any((a, "raw") not in tier.store for a in cdn.m["addresses"])

        def into(index: int, view) -> None:  # a decode thread; the first copy is cut off halfway
            if not cut:
                cut.append(index)
                asyncio.run_coroutine_threadsafe(drop_and_refill(), loop).result(timeout=60)
            got[index] = bytes(view.buffer)

        async with KDNClient(edges=[cdn.c.edge_url("e1")], host=host) as client:
            hit = await client.lookup(cdn.m["prefix_tokens"], cdn.m["model_id"])
            await client.fetch_prefix(hit, encoding="raw", into=into)
            assert got == want  # every object the edge's bytes, whatever the copies from the host read
            assert client.host_stats.fallbacks >= 1 and client.host_stats.hits < len(hit.addresses)
            assert any("changed while it was copied" in e for e in client.host_stats.errors), client.host_stats.errors
