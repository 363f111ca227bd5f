"""Embedded-only cases: several processes sharing one file, and the bounded change log."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import time

from kdn.registry import EmbeddedRegistry, Policy
from registry_helpers import next_event, policy

WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from kdn.registry import EmbeddedRegistry, Policy

    async def main(path):
        async with EmbeddedRegistry(path) as reg:
            await reg.put_policy(Policy("from-child", "warm", region="eu"))
            await reg.delete_policy("from-parent")

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_watch_sees_writes_from_another_process(tmp_path):
    path = tmp_path / "shared.sqlite3"
    async with EmbeddedRegistry(path) as reg:
        await reg.put_policy(policy("from-parent"))
        async with contextlib.aclosing(reg.watch("policies/")) as watch:
            assert list((await next_event(watch)).items) == ["policies/from-parent"]
            child = await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, str(path))
            assert await asyncio.wait_for(child.wait(), 30) == 0
            put = await next_event(watch)
            gone = await next_event(watch)
    assert (put.kind, put.key) == ("put", "policies/from-child")
    assert Policy.unpack(put.value) == Policy("from-child", "warm", region="eu")
    assert (gone.kind, gone.key) == ("delete", "policies/from-parent")


async def test_a_lagging_watcher_relists_when_the_log_is_pruned(tmp_path):
    path = tmp_path / "r.sqlite3"
    async with EmbeddedRegistry(path, log_revisions=10) as reg:
        async with contextlib.aclosing(reg.watch("policies/")) as watch:
            assert (await next_event(watch)).items == {}
            for i in range(130):  # the log is pruned every 64 revisions down to the last 10
                await reg.put_policy(policy(f"p{i:03d}"))
            ev = await next_event(watch)
            assert ev.kind == "snapshot" and len(ev.items) == 130


async def test_data_outlives_the_instance(tmp_path):
    path = tmp_path / "r.sqlite3"
    async with EmbeddedRegistry(path) as reg:
        await reg.put_policy(policy())
    async with EmbeddedRegistry(path) as reg:
        assert await reg.list_policies() == [policy()]


async def test_expired_lease_is_collected_by_any_instance(tmp_path):
    from registry_helpers import eventually, node

    path = tmp_path / "r.sqlite3"
    async with EmbeddedRegistry(path) as a, EmbeddedRegistry(path) as b:
        lease = await a.register_node(node(), ttl=0.3)
        lease._stop_keepalive()
        assert await b.list_nodes() == [node()]

        async def gone() -> bool:
            return await b.list_nodes() == []

        await eventually(gone, timeout=2)
        assert await a._refresh(lease.lease_id) is False  # an expired lease is not revived


async def test_one_poller_serves_every_watch_of_a_handle(tmp_path):
    """Five watches on one handle: the change log is read by one poller, and each watch sees its own prefix."""
    import asyncio

    from kdn.registry import EmbeddedRegistry, Policy

    reg = EmbeddedRegistry(tmp_path / "r.sqlite3", poll_s=0.02)
    writer = EmbeddedRegistry(tmp_path / "r.sqlite3")  # another handle: another process, as far as the file goes
    seen: dict[str, list] = {p: [] for p in ("policies/", "nodes/", "manifests/", "models/", "objects/")}
    try:
        async def follow(prefix):
            async for ev in reg.watch(prefix):
                seen[prefix].append(ev)

        tasks = [asyncio.create_task(follow(p)) for p in seen]
        while not all(seen.values()):  # every watch has its snapshot
            await asyncio.sleep(0.01)
        await writer.put_policy(Policy(name="p1", kind="pin", manifest="public/doc"))
        for _ in range(200):
            if len(seen["policies/"]) >= 2:
                break
            await asyncio.sleep(0.01)
        polls, t0 = reg._hub.polls, time.monotonic()
        await asyncio.sleep(0.5)
        # one poll per interval for the handle, not one per watch (5 watches would make ~5x as many); over the
        # time that really passed, so a slow moment of the machine cannot fail it
        assert reg._hub.polls - polls <= (time.monotonic() - t0) / 0.02 + 3
        assert [e.kind for e in seen["policies/"]] == ["snapshot", "put"]
        assert all(len(v) == 1 for k, v in seen.items() if k != "policies/"), "a watch saw another prefix's event"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await reg.close()
        await writer.close()
