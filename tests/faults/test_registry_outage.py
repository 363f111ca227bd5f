"""etcd restarted under a client: the connection comes back within about a second, and a publish job in
flight waits the outage out instead of failing (its computed chunks are not thrown away)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kdn.errors import RegistryUnavailable
from kdn.registry import EtcdRegistry

import faultlib as F  # bench/, on sys.path through conftest.py

pytestmark = pytest.mark.timeout(180)


async def test_the_registry_reconnects_within_a_second_of_etcd_coming_back(tmp_path):
    """gRPC's default reconnect backoff grows to 120 s: after a 30 s etcd outage every write failed fast for
    many seconds more (a publish right after the restart failed, seen in bench/faults.py)."""
    etcd = F.Etcd(tmp_path)
    etcd.start()
    reg = EtcdRegistry("127.0.0.1", etcd.client_port, "/outage/", timeout=1.0)
    try:
        await reg._put(reg._key("k"), b"before")  # noqa: SLF001 - a raw write is all this needs
        etcd.stop()
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:  # clients keep trying while it is down: the backoff grows
            with pytest.raises(RegistryUnavailable):
                await reg._put(reg._key("k"), b"down")  # noqa: SLF001
            await asyncio.sleep(0.5)
        etcd.start()
        back = time.monotonic()
        while True:
            try:
                await reg._put(reg._key("k"), b"after")  # noqa: SLF001
                break
            except RegistryUnavailable:
                await asyncio.sleep(0.05)
        took = time.monotonic() - back
        assert took < 3.0, f"writes failed for {took:.1f} s after etcd was back"
    finally:
        await reg.close()
        etcd.stop()


async def test_a_publish_in_flight_waits_out_an_etcd_restart(tmp_path):
    w = F.World(tmp_path, regions={})
    await w.start()
    try:
        w.etcd.stop()
        publish = asyncio.create_task(w.publish("A log of ships sighted from the north light. " * 60, "during"))
        # The job computes, and its registry writes fail and are retried: the origin says so in its log.
        deadline = time.monotonic() + 60
        while "registry unavailable" not in w.origin.log.read_text():
            assert not publish.done(), "the publish ended while etcd was down"
            assert time.monotonic() < deadline, "the publish never reached the registry"
            await asyncio.sleep(0.05)
        assert not publish.done(), "the publish ended while etcd was down"
        w.etcd.start()
        manifest = await asyncio.wait_for(publish, 60)
        assert manifest["addresses"] and set(manifest["addresses"]) <= set(w.digests)
    finally:
        await w.close()
