"""`kdn registry show ADDRESS` says which regions hold an object now (#29): each region's owner edge, on that
region's ring, asked with a HEAD (which never fills), and only with a token it may be sent to."""

from __future__ import annotations

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, get, publish  # noqa: E402

from kdn import cli  # noqa: E402
from kdn.ring import Ring  # noqa: E402

TEXT = ("The ferry timetable changes with the tide; the winter schedule starts in November. " * 12)[:900]


async def show(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert await asyncio.to_thread(cli.main, ["registry", "show", *args]) == 0
    return json.loads(capsys.readouterr().out)


async def test_each_regions_owner_says_whether_it_holds_the_object(tmp_path, etcd_url, capsys):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        for nid in ("e1", "e2"):
            await c.start_edge(nid, region="eu")
        await c.start_edge("u1", region="us")
        await c.wait_ring(["e1", "e2"], "eu")
        await c.wait_ring(["u1"], "us")
        m = await publish(c, TEXT)
        addr = m["addresses"][0]
        token = str(c.tokens.with_name("edge-token"))

        out = await show(capsys, addr, "--registry", etcd_url, "--token-file", token)
        eu_owner = Ring(["e1", "e2"]).owner(addr)
        assert out["type"] == "object" and set(out["regions"]) == {"eu", "us"}
        assert out["regions"]["eu"]["owner"] == eu_owner and out["regions"]["us"]["owner"] == "u1"
        assert out["regions"]["eu"]["holds"] == "no" and out["regions"]["us"]["holds"] == "no"  # nobody read it

        status, _, _ = await get(c.edge_url("e1"), addr)  # a reader in eu: the owner fills it
        assert status == 200
        out = await show(capsys, addr, "--registry", etcd_url, "--token-file", token)
        assert out["regions"]["eu"]["holds"] in ("memory", "disk") and out["regions"]["us"]["holds"] == "no"
        # Asking filled nothing: the us edge still holds nothing after two shows.
        out = await show(capsys, addr, "--registry", etcd_url, "--token-file", token)
        assert out["regions"]["us"]["holds"] == "no"

        # Without a token an edge does not tell what is cached (others' reads): unknown, not a guess.
        env = os.environ.pop("KDN_TOKEN", None)
        try:
            out = await show(capsys, addr, "--registry", etcd_url)
        finally:
            if env is not None:
                os.environ["KDN_TOKEN"] = env
        assert all(r["holds"].startswith("unknown") for r in out["regions"].values()), out["regions"]
        # A token is sent only where --token-hosts allows: naming no loopback host withholds it.
        out = await show(capsys, addr, "--registry", etcd_url, "--token-file", token, "--token-hosts", "edge-*.example")
        assert all(r["holds"].startswith("unknown") for r in out["regions"].values()), out["regions"]
