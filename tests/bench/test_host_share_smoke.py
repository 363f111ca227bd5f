"""bench/host_share.py, smallest run: a real origin, edge and host tier process, two engine processes loading one
context from the host's shared memory at once, and restarted engines timed from the host and from the edge. Checks
the shape of what it measures: one copy held however many engines read it, each engine's mapping of the segment
(read in place), and a restarted engine's load from the host beside the edge's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_engines_share_one_copy_and_a_restart_finds_it(tmp_path):
    res = tmp_path / "hs.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "host_share.py"), "--model", "tiny-llama",
                        "--tokens", "1024", "--engines", "1,2", "--repeat", "1", "--json", str(tmp_path / "raw.json"),
                        "--results", str(res)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    raw = json.loads((tmp_path / "raw.json").read_text())
    context = raw["bytes"]
    assert raw["held"]["used_bytes"] >= context > 0  # the host holds the context once (blocks are aligned up)
    for row in raw["sharing"]:
        assert len(row["per_engine"]) == row["engines"]
        for g in row["per_engine"]:
            assert g["bytes"] == context and g["mem"]["segment"]["Rss"] >= context // 2  # read in place
    assert raw["restart"]["host"] and raw["restart"]["edge"]
    tables = {t["id"]: t["markdown"] for t in json.loads(res.read_text())["tables"]}
    assert set(tables) == {"sharing", "restart"}
