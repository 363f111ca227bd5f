"""The byte budget holds while many fills are in flight at once: each fill's block is reserved before its
first byte moves, so fills together never take more than the budget; those that cannot fit are refused
(``no-room``, the engine reads from the edge), and one object asked by many at once is filled once."""

from __future__ import annotations

import asyncio

from host_helpers import Shelf, host_config, running

from kdn.client.host import HostClient
from kdn.wire.host import HostError

SIZE = 128 << 10


async def test_concurrent_fills_never_take_more_than_the_budget(short_dir):
    shelf = Shelf()
    budget = 4 * (SIZE + 4096)
    config = host_config(short_dir, segment_bytes=2 * budget, budget=budget)
    async with running(config, shelf) as tier:
        seen: list[int] = []
        shelf.on_take = lambda: seen.append(tier.store.used)
        shelf.gate = asyncio.Event()  # every fill holds its block, waiting
        addresses = [shelf.add(i, SIZE)[0] for i in range(10)]
        async with HostClient(config.socket) as engine:

            async def read(address: str) -> bytes | str:
                try:
                    async with engine.lease(address, "raw") as obj:
                        return bytes(obj.view)
                except HostError as e:
                    return e.code

            reads = [asyncio.create_task(read(a)) for a in addresses]
            for _ in range(4):  # four blocks fit: four fills take theirs and wait
                await asyncio.wait_for(shelf.taken.get(), 10)
            done, _ = await asyncio.wait(reads, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert done  # the rest were refused, not queued behind the budget
            refused = [r.result() for r in done]
            assert set(refused) == {"no-room"}, refused
            assert tier.store.used <= budget and tier.stats()["fills_in_flight"] == 4
            shelf.gate.set()
            got = await asyncio.gather(*reads)
        assert max(seen) <= budget and tier.store.used <= budget
        assert sorted(x for x in got if isinstance(x, str)) == ["no-room"] * 6
        assert [x for x in got if isinstance(x, bytes)] == [shelf.objects[a][0] for a, x in zip(addresses, got)
                                                             if isinstance(x, bytes)]


async def test_one_object_asked_by_many_engines_at_once_is_filled_once(short_dir):
    shelf = Shelf()
    async with running(host_config(short_dir), shelf) as tier:
        shelf.gate = asyncio.Event()
        address, blob = shelf.add(0, SIZE)
        engines = [await HostClient(tier.config.socket).connect() for _ in range(5)]
        try:

            async def read(c: HostClient) -> bytes:
                async with c.lease(address, "raw") as obj:
                    return bytes(obj.view)

            reads = [asyncio.create_task(read(c)) for c in engines]
            await asyncio.wait_for(shelf.taken.get(), 10)
            shelf.gate.set()
            assert await asyncio.gather(*reads) == [blob] * 5
        finally:
            for c in engines:
                await c.close()
        s = tier.stats()
        assert shelf.fetched == 1 and s["fills"] == 1 and s["misses"] == 5 and s["leases"] == 0
