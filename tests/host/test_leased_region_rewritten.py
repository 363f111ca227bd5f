"""A leased region is never rewritten: while an engine holds a lease, fills and evictions churn through the rest
of the segment (every other block reused many times over), and the leased bytes stay the blob's."""

from __future__ import annotations

from blake3 import blake3
from host_helpers import Shelf, host_config, running

from kdn.client.host import HostClient

SIZE = 96 << 10


async def test_fill_and_evict_pressure_never_touches_a_leased_region(short_dir):
    shelf = Shelf()
    config = host_config(short_dir, segment_bytes=6 * (SIZE + 4096))
    async with running(config, shelf) as tier:
        leased = [shelf.add(i, SIZE) for i in range(2)]
        others = [shelf.add(i, SIZE + 977 * i)[0] for i in range(2, 40)]  # mixed sizes: holes of every shape
        async with HostClient(config.socket) as engine, HostClient(config.socket) as pusher:
            async with engine.lease(leased[0][0], "raw") as a, engine.lease(leased[1][0], "raw") as b:
                before = [blake3(a.view).digest(), blake3(b.view).digest()]
                assert before == [blake3(blob).digest() for _, blob in leased]
                spans = [(a.offset, a.offset + len(a.view)), (b.offset, b.offset + len(b.view))]
                for round_ in range(3):
                    outcomes = await pusher.warm(others, "raw")
                    assert set(outcomes) <= {"filled", "held"}, outcomes
                    for h in tier.store.evictable():  # no held block overlaps a leased one
                        assert all(h.offset + h.length <= lo or h.offset >= hi for lo, hi in spans)
                assert tier.stats()["evictions"] >= 2 * len(others)  # every other block reused again and again
                assert [blake3(a.view).digest(), blake3(b.view).digest()] == before
                assert tier.stats()["leases"] == 2
