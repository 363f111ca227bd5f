"""`kdn up`, as a newcomer runs it: one command, registry + origin + two regions of edges, a question."""

import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def free_port_block(n: int) -> int:
    """A port p with p..p+n free (best effort: bind them all, then release)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for i in range(n + 1):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port block")


def test_kdn_up_runs_the_demo_and_reuses_the_document(tmp_path):
    port = free_port_block(4)
    r = subprocess.run(
        [sys.executable, "-P", "-m", "kdn.cli", "up", "--no-serve", "--model", "tiny-llama", "--dir", str(tmp_path),
         "--port", str(port)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "Traceback" not in r.stderr
    assert re.search(r"published \d+ tokens as \d+ chunks", out)
    assert "edges     eu:" in out and "edges     us:" in out
    warm = re.search(r"KDN, warm .*reused (\d+)/(\d+) tokens .*memory", out)
    assert warm, out
    assert int(warm.group(1)) >= 3000  # the whole published document came from the cache
    assert re.search(r"\d+\.\dx faster with KDN", out)
    assert "kdn registry show" in out and "kdn publish" in out
