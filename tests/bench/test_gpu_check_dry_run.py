"""bench/gpu_check.py on the CPU (``--device cpu --quick``, and ``--smoke``): the script a lent GPU runs, every
path of it exercised here -- the device loader (staged copies, held chunks crossing layer after layer with a
wait per decoder layer, the same copies on the compute stream), the edge over loopback, the host tier (a
``kdn host serve`` process beside the edge, read through ``KDNClient`` and through held leases), the planner
column, every row written to ``--json`` as it is measured -- so the one GPU run a session gets is not spent
finding a typo. The CUDA-only parts (pinned copies, the copy stream, the mapping page-locked) run only there;
tests/adapters/test_gpu_loader.py checks the same loads on a GPU where one exists, and
tests/adapters/test_copy_stream.py the order of copies, events and waits against a stand-in device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *flags: str) -> tuple[dict, dict]:
    out, raw = tmp_path / "gpu.json", tmp_path / "raw.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", *flags,
                        "--json", str(raw), "--results", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(raw.read_text())
    # every row was printed as it was measured, and the --json file holds them all
    printed = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert all(r in printed for section in ("exactness", "ttft") for r in d[section])
    return d, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_the_gpu_script_runs_on_the_cpu(tmp_path):
    d, res = run(tmp_path, "--quick")
    assert d["exactness"] and all(r.get("bit_identical") for r in d["exactness"]), d["exactness"]
    paths = {r["path"] for r in d["ttft"]}
    assert paths == {"prefill-lean", "host-raw", "host-zstd", "host-held", "host-serial", "edge-raw", "tier-raw",
                     "tier-held", "planner"}
    by = {r["path"]: r for r in d["ttft"]}
    assert by["host-raw"]["copies_per_chunk"] == 2  # one copy onto the device, one placing every layer: never per tensor
    assert not d.get("errors"), d["errors"]  # (a new path that fails on a device is reported there, not fatal)
    # every loaded path makes host-raw's cache: the same first logits, bit for bit
    assert all(r["same_logits"] for r in d["ttft"] if r["path"] not in ("prefill-lean", "planner"))
    for name in ("host-held", "host-serial"):  # the copy stream against the compute stream, HF's and vLLM's path
        assert by[name]["h2d_gbps"] > 0 and by[name]["vllm_h2d_gbps"] > 0
    assert by["tier-held"]["mapping_pinned"] is False  # (no CUDA here: the mapping stays pageable)
    assert by["planner"]["choice"] in ("load", "compute") or by["planner"]["choice"].startswith("load ")
    assert {t["id"] for t in res["tables"]} == {"ttft", "overlap", "tier", "exactness"}
    assert res["headline"] and "bit-identical" in res["headline"]["result"]


@pytest.mark.timeout(300)
def test_the_smoke_mode_runs_on_the_cpu_without_server_processes(tmp_path):
    d, res = run(tmp_path, "--smoke")
    assert d["info"]["smoke"] and all(r.get("bit_identical") for r in d["exactness"])
    assert {r["model"] for r in d["exactness"]} == {"tiny-llama", "tiny-qwen2"}
    # one shape at one length (--quick's on the CPU), the copy-stream rows, and no edge or host tier to start
    assert {(r["shape"], r["length"]) for r in d["ttft"]} == {("tiny-shape", 512)}
    assert {r["path"] for r in d["ttft"]} == {"prefill-lean", "host-raw", "host-zstd", "host-held", "host-serial",
                                              "planner"}
    assert {t["id"] for t in res["tables"]} == {"ttft", "overlap", "exactness"} and not d.get("errors")
