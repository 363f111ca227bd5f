"""An engine killed with SIGKILL while it holds a lease: the kernel closes its socket, the host ends its leases,
and the object it pinned is evictable again. (And a lease held by a live engine blocks eviction.)"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap

from edge_helpers import wait_until
from host_helpers import Shelf, host_config, running

from kdn.client.host import HostClient

ENGINE = textwrap.dedent("""
    import asyncio, sys
    from kdn.client.host import HostClient

    async def main():
        async with HostClient(sys.argv[1]) as host:
            async with host.lease(sys.argv[2], "raw") as obj:
                assert bytes(obj.view[:8]) == bytes.fromhex(sys.argv[3])  # reading the mapping
                print("leased", obj.offset, flush=True)
                await asyncio.sleep(3600)

    asyncio.run(main())
""")

SIZE = 256 << 10  # objects of ~256 KiB in a budget of four


async def test_a_lease_dies_with_its_killed_engine_and_the_object_becomes_evictable(short_dir):
    shelf = Shelf()
    config = host_config(short_dir, segment_bytes=4 * (SIZE + 4096))
    async with running(config, shelf) as tier:
        address, blob = shelf.add(0, SIZE)
        engine = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-c", ENGINE, config.socket, address, blob[:8].hex(),
            stdout=asyncio.subprocess.PIPE, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        try:
            line = await asyncio.wait_for(engine.stdout.readline(), 60)
            assert line.startswith(b"leased"), line
            key = (address, "raw")
            assert tier.store.get(key).leases == 1
            # Pressure while it reads: many other objects go through the segment; the leased one stays.
            async with HostClient(config.socket) as other:
                assert all(o == "filled" for o in await other.warm([shelf.add(i, SIZE)[0] for i in range(1, 9)], "raw"))
            assert key in tier.store and tier.stats()["evictions"] >= 4

            engine.send_signal(signal.SIGKILL)
            assert await engine.wait() == -signal.SIGKILL
            await wait_until(lambda: tier.stats()["leases"] == 0 and tier.stats()["connections"] == 0)
            assert tier.store.get(key) in list(tier.store.evictable())
            async with HostClient(config.socket) as other:
                await other.warm([shelf.add(i, SIZE)[0] for i in range(9, 20)], "raw")
            assert key not in tier.store  # nothing left pinning it: evicted like any other
        finally:
            if engine.returncode is None:
                engine.kill()
                await engine.wait()


async def test_a_clean_close_ends_the_leases_it_left_open(short_dir):
    shelf = Shelf()
    async with running(host_config(short_dir), shelf) as tier:
        address, blob = shelf.add(0)
        client = await HostClient(tier.config.socket).connect()
        lease = client.lease(address, "raw")
        obj = await lease.__aenter__()  # never exited: the engine just hangs up
        assert bytes(obj.view) == blob and tier.stats()["leases"] == 1
        await client.close()
        await wait_until(lambda: tier.stats()["leases"] == 0)


async def test_a_lease_request_given_up_mid_fill_pins_nothing(short_dir):
    """The engine stops waiting (its deadline) while the host fills: the fill completes and the host pins the
    object for a lease nobody will use; the client releases it as its answer arrives, connection still open."""
    shelf = Shelf()
    async with running(host_config(short_dir), shelf) as tier:
        shelf.gate = asyncio.Event()
        address, _ = shelf.add(0)
        async with HostClient(tier.config.socket) as engine:

            async def read() -> None:
                async with engine.lease(address, "raw"):
                    raise AssertionError("given up before the answer")

            waiting = asyncio.create_task(read())
            await asyncio.wait_for(shelf.taken.get(), 10)
            waiting.cancel()
            shelf.gate.set()
            await wait_until(lambda: tier.stats()["fills"] == 1 and tier.stats()["leases"] == 0)
            assert tier.stats()["connections"] == 1 and waiting.cancelled()
            async with engine.lease(address, "raw") as obj:  # the connection is fine
                assert not obj.filled
