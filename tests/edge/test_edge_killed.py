"""An edge SIGKILLed mid-service leaves the ring within lease TTL + 1 s, and reads keep succeeding."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import EDGE_TOKEN, cluster, free_port, get, publish  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TTL = 2.0  # etcd's minimum lease TTL

TEXT = ("Fog signals sounded every thirty seconds when the light could not be seen. " * 40)[:2500]


async def start_edge_process(c, node_id: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    (c.tmp / "edge-token").write_text(EDGE_TOKEN + "\n")
    cmd = [sys.executable, "-P", "-m", "kdn.cli", "edge", "serve", "--region", "eu", "--registry", c.registry,
           "--origin", c.origin_url(), "--mem-budget", "64MiB", "--disk", str(c.tmp / f"disk-{node_id}"),
           "--disk-budget", "256MiB", "--port", str(port), "--node-id", node_id, "--token-file", str(c.tokens),
           "--upstream-token-file", str(c.tmp / "edge-token"), "--lease-ttl", f"{TTL}s"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(c.tmp / f"{node_id}.log", "ab"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while True:
            assert proc.poll() is None, (c.tmp / f"{node_id}.log").read_text()[-2000:]
            try:
                async with s.get(f"{url}/healthz") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "edge process did not start"
            await asyncio.sleep(0.1)


async def test_killed_edge_leaves_ring_and_reads_keep_succeeding(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2")) as c:
        m = await publish(c, TEXT)
        proc, url = await start_edge_process(c, "victim")
        try:
            await c.wait_ring(["e1", "e2", "victim"])
            e1 = c.edge("e1")
            owned = [a for a in m["addresses"] if e1.membership.owner(a).node_id == "victim"]
            assert owned, "the victim owns nothing; publish more chunks"
            for a in owned:  # the victim fills and holds its addresses
                status, _, headers = await get(c.edge_url("e1"), a)
                assert status == 200 and headers["X-KDN-Source"] == "peer:victim"

            proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            proc.wait(10)
            # Reads keep succeeding at once: the dead owner is an error that falls back.
            for a in owned:
                status, _, headers = await get(c.edge_url("e2"), a)
                assert status == 200, "a read failed while the dead edge was still in the ring"
            await c.wait_ring(["e1", "e2"], timeout=TTL + 5)
            left_after = time.monotonic() - killed_at
            assert left_after <= TTL + 1.0, f"the dead edge stayed in the ring {left_after:.2f} s"
            # The survivors own its addresses now, and serve them.
            for a in owned:
                assert e1.membership.owner(a).node_id in ("e1", "e2")
                status, _, headers = await get(c.edge_url("e1"), a)
                assert status == 200 and "victim" not in headers["X-KDN-Source"]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
