"""bench/lookup.py, smallest run: a real signing origin and an edge, a published document, and the three
lookups (the bare round trip, a record read per chunk, records with the answer) timed side by side. A run
that breaks fails here instead of in the next benchmark session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_tiny_lookup_run_times_each_way_beside_the_round_trip(tmp_path):
    out = tmp_path / "lookup.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "lookup.py"), "--model", "tiny-llama",
                        "--lengths", "768", "--repeat", "2", "--results", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (table,) = json.loads(out.read_text())["tables"]
    rows = [line for line in table["markdown"].splitlines() if line.startswith("| tiny-llama")]
    assert len(rows) == 1 and "| 768 | 3 |" in rows[0], table["markdown"]
