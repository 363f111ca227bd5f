"""Per-object read counts at a running edge (issue #30, the console's per-manifest hits): a whole GET answered
from a tier counts on that tier's entry; an authorized HEAD reports each tier's count in ``X-KDN-Reads``; an
anonymous HEAD learns nothing; an entry dropped and filled again starts at 0."""

from __future__ import annotations

import os
import sys

import aiohttp

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import EDGE_TOKEN, cluster, get, publish  # noqa: E402

from kdn.client.holding import READS_HEADER, parse_reads  # noqa: E402

TEXT = ("The lock keeper opens the upper gate at dawn and the lower one at dusk. " * 12)[:700]


async def head(url: str, address: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.head(f"{url}/v1/objects/{address}", headers=headers) as r:
            return r.status, r.headers.copy()


async def test_reads_are_counted_per_object_reported_by_head_and_reset_by_eviction(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT)
        a, url, edge = m["addresses"][0], c.edge_url("e1"), c.edge("e1")
        key = (a, "zstd")
        status, _, h = await get(url, a)  # the first read fills: not a hit, not counted
        assert status == 200 and h["X-KDN-Source"] == "origin"
        assert edge.reads(key)["memory"] == 0
        for n in (1, 2):
            status, _, h = await get(url, a)
            assert status == 200 and h["X-KDN-Source"] == "memory"
            assert edge.reads(key)["memory"] == n
        # A range read and a HEAD count nothing.
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/objects/{a}", headers={"Range": "bytes=0-9"}) as r:
                assert r.status == 206
        status, h = await head(url, a, EDGE_TOKEN)
        assert status == 200 and h["X-KDN-Source"] in ("memory", "disk")
        reads = parse_reads(h[READS_HEADER])
        assert reads["memory"] == 2 and reads.get("disk", 0) == 0, h[READS_HEADER]
        status, h = await head(url, a)  # anonymous: neither the tier nor the reads
        assert status == 200 and h["X-KDN-Source"] == "edge" and READS_HEADER not in h
        # Dropped from every tier (as an eviction drops it: tests/edge/test_tier_contract.py): the next read
        # fills again, and the new entry's count starts at 0.
        for tier in edge.tiers:
            await tier.delete(key)
        assert edge.reads(key) == {}
        assert (await get(url, a))[0] == 200 and (await get(url, a))[0] == 200
        status, h = await head(url, a, EDGE_TOKEN)
        assert parse_reads(h[READS_HEADER])["memory"] == 1
