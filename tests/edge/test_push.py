"""Pushes (#29 item 4): a manifest's objects sent to the regions a policy names before their first reader asks.

Real processes' parts in one test: etcd, an origin, an edge in eu and one in us (aiohttp servers on loopback),
the policy set through the `kdn policy set` CLI.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import cluster, get, metric, publish  # noqa: E402

from kdn import cli  # noqa: E402

TEXT = ("The pier master logs each vessel's draught before it berths, and the tide before it sails. " * 30)[:2000]


async def test_a_push_fills_the_named_regions_ahead_of_readers_at_its_rate(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        await c.start_edge("e1", "eu")
        await c.start_edge("u1", "us")
        m = await publish(c, TEXT, name="harbor")
        addrs = m["addresses"]
        us, eu = c.edge("u1"), c.edge("e1")
        sizes = [(await us.records.get(a)).encodings["zstd"].size for a in addrs]
        rate = max(1, sum(sizes) // 2)  # the push's bytes take about two seconds at this rate
        t0 = time.monotonic()
        argv = ["policy", "set", "harbor-us", "--push", "public/harbor", "--to", "us", "--rate", str(rate),
                "--registry", c.registry]
        assert await asyncio.to_thread(cli.main, argv) == 0
        server = c.edges["u1"]
        for _ in range(200):  # (bounded: 20 s)
            if metric(server, "kdn_edge_pushed_objects_total", policy="harbor-us") == len(addrs):
                break
            await asyncio.sleep(0.1)
        took = time.monotonic() - t0
        assert metric(server, "kdn_edge_pushed_objects_total", policy="harbor-us", outcome="filled") == len(addrs)
        assert metric(server, "kdn_edge_pushed_bytes_total", policy="harbor-us") == sum(sizes)
        assert metric(server, "kdn_edge_push_pending", policy="harbor-us") == 0
        # paced: a fill starts once the bytes started before it fit the rate (the last one's own bytes aside)
        assert took >= (sum(sizes) - max(sizes)) / rate * 0.9, (took, sum(sizes), rate)
        assert all(us.holds((a, "zstd")) for a in addrs)
        assert not any(eu.holds((a, "zstd")) for a in addrs)  # not a region it names
        # A reader in us now gets every object from the edge's memory, none from the origin.
        for a in addrs:
            status, _, h = await get(c.edge_url("u1"), a)
            assert status == 200 and h["X-KDN-Source"] == "memory", (a, h.get("X-KDN-Source"))
        # Set again (a new record): what the edge holds is skipped, counted as held, not filled twice.
        argv[argv.index("--rate") + 1] = "1GiB"
        assert await asyncio.to_thread(cli.main, argv) == 0
        for _ in range(100):
            if metric(server, "kdn_edge_pushed_objects_total", policy="harbor-us", outcome="held") == len(addrs):
                break
            await asyncio.sleep(0.1)
        assert metric(server, "kdn_edge_pushed_objects_total", policy="harbor-us", outcome="held") == len(addrs)
        assert metric(server, "kdn_edge_pushed_bytes_total", policy="harbor-us") == sum(sizes)


async def test_a_publish_that_asks_for_a_push_fills_those_regions_and_deleting_it_ends_the_push(tmp_path, etcd_url):
    """``push`` in the publish body: once the manifest is written the origin sets the push policy
    (push.<namespace>.<name>); the region it names fills every object before a reader asks, the other none;
    deleting the manifest removes the policy."""
    import aiohttp

    from edge_helpers import PUBLISH

    from kdn.registry import open_registry

    async with cluster(tmp_path, etcd_url, edges=()) as c:
        await c.start_edge("e1", "eu")
        await c.start_edge("u1", "us")
        m = await publish(c, TEXT, name="tide", push=["us"], push_rate=1 << 30)
        addrs, policy = m["addresses"], "push.public.tide"
        server = c.edges["u1"]
        for _ in range(200):  # (bounded: 20 s)
            if metric(server, "kdn_edge_pushed_objects_total", policy=policy) == len(addrs):
                break
            await asyncio.sleep(0.1)
        assert metric(server, "kdn_edge_pushed_objects_total", policy=policy, outcome="filled") == len(addrs)
        us, eu = c.edge("u1"), c.edge("e1")
        assert all(us.holds((a, "zstd")) for a in addrs)
        assert not any(eu.holds((a, "zstd")) for a in addrs)  # not a region it names
        async with open_registry(c.registry) as reg:
            (p,) = [p for p in await reg.list_policies() if p.name == policy]
            assert (p.kind, p.manifest, p.extra) == ("push", "public/tide", {"regions": ["us"], "rate_bytes": 1 << 30})
            async with aiohttp.ClientSession(c.origin_url(), headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
                async with s.delete("/v1/manifests/public/tide") as r:
                    assert r.status == 200, await r.text()
            assert policy not in [p.name for p in await reg.list_policies()]


def test_push_flags_are_checked(tmp_path, capsys):
    reg = ["--registry", f"file:{tmp_path / 'r.sqlite3'}"]
    for argv, why in ((["--push", "public/x", "--region", "eu"], "--to"), (["--warm", "public/x", "--to", "eu"], "--push"),
                      (["--push", "public/x", "--rate", "0"], "--rate"), (["--push", "public/x", "--to", ","], "--to")):
        assert cli.main(["policy", "set", "p", *argv, *reg]) != 0
        assert why in capsys.readouterr().err
    assert cli.main(["policy", "set", "p", "--push", "public/x", "--to", "us,eu", "--rate", "5MiB/s", *reg]) == 0
    assert "push public/x to regions eu, us at most 5 MiB/s per edge" in capsys.readouterr().out
    assert cli.main(["policy", "ls", *reg]) == 0
    assert "eu,us" in capsys.readouterr().out
