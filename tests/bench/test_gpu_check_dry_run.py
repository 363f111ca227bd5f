"""bench/gpu_check.py on the CPU (``--device cpu --quick``): the script a lent GPU runs, every path of it
exercised here -- the device loader (staged copies), the edge over loopback, the planner column -- so the
one GPU run a session gets is not spent finding a typo. The CUDA-only parts (pinned copies, streams) run
only there; tests/adapters/test_gpu_loader.py checks the same loads on a GPU where one exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_gpu_script_runs_on_the_cpu(tmp_path):
    out, raw = tmp_path / "gpu.json", tmp_path / "raw.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                        "--json", str(raw), "--results", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(raw.read_text())
    assert d["exactness"] and all(r.get("bit_identical") for r in d["exactness"]), d["exactness"]
    paths = {r["path"] for r in d["ttft"]}
    assert paths == {"prefill-lean", "host-raw", "host-zstd", "edge-raw", "planner"}
    raw_row = next(r for r in d["ttft"] if r["path"] == "host-raw")
    assert raw_row["copies_per_chunk"] == 2  # one copy onto the device, one placing every layer: never per tensor
    planner = next(r for r in d["ttft"] if r["path"] == "planner")
    assert planner["choice"] in ("load", "compute") or planner["choice"].startswith("load ")
    res = json.loads(out.read_text())
    assert {t["id"] for t in res["tables"]} == {"ttft", "exactness"}
    assert res["headline"] and "bit-identical" in res["headline"]["result"]
