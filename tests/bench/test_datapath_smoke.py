"""bench/datapath.py, smallest run: a real origin and edge, a published document (zstd and raw), the
verified fetch timed beside the raw recv_into bound, and the host tier's loads (a real `kdn host serve`) beside
a memcpy. A run that breaks (a publish that never ends, a
path that no longer fetches) fails here instead of in the next benchmark session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_tiny_datapath_run_times_the_fetch_beside_its_bound(tmp_path):
    out = tmp_path / "dp.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "datapath.py"), "--model", "tiny-llama",
                        "--lengths", "512", "--repeat", "2", "--paths", "recv_into,kdn-fetch,memcpy,host-hf",  # (vLLM: head_dim 16 refused)
                        "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["encoding"] for r in rows} == {"raw", "zstd"}
    for r in rows:
        assert r["objects"] == 2 and r["wire_bytes"] > 0
        assert set(r["times"]) == {"recv_into", "kdn-fetch", "memcpy", "host-hf"} and all(len(t) == 2 and min(t) > 0
                                                                     for t in r["times"].values())
