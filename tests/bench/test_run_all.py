"""bench/run_all.py: a quick run writes honest JSON; the docs are exactly what the committed results render.

The second half is the guard of issue #15: a figure hand-edited in docs/benchmarks.md or the README's
headline rows, or a headline figure that is not in its run's table, fails here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("kdn_bench_run_all", ROOT / "bench" / "run_all.py")
run_all = sys.modules.setdefault("kdn_bench_run_all", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(run_all)
import results as R  # noqa: E402

RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


@pytest.mark.timeout(120)
def test_quick_run_writes_results(tmp_path):
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "run_all.py"), "--quick", "--only",
                        "ring,eviction-zipf", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=110)
    assert p.returncode == 0, p.stdout + p.stderr
    for name, bench, table in (("ring", "ring", "main"), ("eviction-zipf", "eviction", "zipf")):
        d = json.loads((out / f"{name}.json").read_text())
        assert d["bench"] == bench and d["run"] == name and d["quick"] is True
        assert d["command"].startswith(f"python -P bench/{bench}.py ") and "--results" not in d["command"]
        assert len(d["commit"]["sha"]) == 40 and isinstance(d["commit"]["dirty"], bool)
        m = d["machine"]
        assert m["cores"] >= 1 and m["memory_gib"] and len(m["load_before"]) == 3 and len(m["load_after"]) == 3
        assert d["started"] and d["seconds"] >= 0
        t = next(t for t in d["tables"] if t["id"] == table)
        assert t["markdown"].startswith("| ") and "---:" in t["markdown"]
        h = d["headline"]
        assert h["baseline"] and h["figures"]
        for f in h["figures"]:
            assert f["shown"] in h["result"] and R.cell_in(t["markdown"], f["cell"])
    # quick results never reach the docs
    (tmp_path / "doc.md").write_text("<!-- bench:ring:main:begin -->\nx\n<!-- bench:ring:main:end -->\n")
    with pytest.raises(run_all.RenderError, match="quick"):
        run_all.render_text((tmp_path / "doc.md").read_text(), tmp_path / "doc.md", run_all.load_results(out))


def test_docs_are_what_the_results_render():
    """Rendering the committed results changes nothing, and rendering twice is rendering once."""
    results = run_all.load_results(run_all.RESULTS)
    for doc in run_all.DOCS:
        text = doc.read_text()
        once = run_all.render_text(text, doc, results)
        assert once == text, f"{doc.relative_to(ROOT)} differs from bench/results: python -P bench/run_all.py --render"
        assert run_all.render_text(once, doc, results) == once


def test_a_hand_edited_figure_is_caught(tmp_path):
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    edited = text.replace("| 0.8 | 10% | 68.3 GiB | 0.5016 |", "| 0.8 | 10% | 68.3 GiB | 0.6016 |")
    assert edited != text
    assert run_all.render_text(edited, doc, run_all.load_results(run_all.RESULTS)) == text
    readme = (ROOT / "README.md").read_text()
    assert run_all.HEAD_BEGIN in readme and run_all.HEAD_END in readme
    edited = readme.replace("**1.45x** smaller", "**1.55x** smaller")
    assert edited != readme
    assert run_all.render_text(edited, ROOT / "README.md", run_all.load_results(run_all.RESULTS)) == readme


def test_every_region_has_a_result(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:no-such-run:main:begin -->\n| 1 |\n<!-- bench:no-such-run:main:end -->\n")
    with pytest.raises(run_all.RenderError, match="no bench/results/no-such-run.json"):
        run_all.render_text(doc.read_text(), doc, run_all.load_results(run_all.RESULTS))
    doc.write_text("<!-- bench:ring:nope:begin -->\n| 1 |\n<!-- bench:ring:nope:end -->\n")
    with pytest.raises(run_all.RenderError, match="no table 'nope'"):
        run_all.render_text(doc.read_text(), doc, run_all.load_results(run_all.RESULTS))


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_results_are_honest(path):
    """Each result names its command and machine; imported ones say so; each headline names its baseline
    and every figure it quotes is in a cell of a table of its run (or of the run it names)."""
    d = json.loads(path.read_text())
    assert d["command"] and d["machine"] and d["tables"]
    assert d.get("imported") or (d.get("commit") or {}).get("sha"), "a run has its commit, an import its origin"
    assert not d.get("quick"), "a --quick run is not a result for the docs"
    assert path.stem in run_all.BY_NAME, f"{path.stem} is not a run of bench/run_all.py"
    h = d.get("headline")
    if not h:
        return
    assert path.stem in run_all.HEADLINES
    assert h["baseline"].strip() and h["what"].strip()
    for f in h["figures"]:
        assert f["shown"] in h["result"], f
        run, _, tid = f["table"].rpartition(":")
        src = json.loads((path.parent / f"{run}.json").read_text()) if run else d
        md = next(t["markdown"] for t in src["tables"] if t["id"] == tid)
        for cell in f.get("cells") or [f["cell"]]:
            assert R.cell_in(md, cell), (f, cell)


def test_headline_block_lists_every_headline():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(run_all.HEAD_BEGIN):readme.index(run_all.HEAD_END)]
    results = run_all.load_results(run_all.RESULTS)
    for name in run_all.HEADLINES:
        h = (results.get(name) or {}).get("headline")
        assert h, f"README headline {name} has no result"
        assert h["result"] in block and h["baseline"] in block


@pytest.mark.timeout(240)
def test_quick_vllm_run_writes_results_and_headline(tmp_path):
    """bench/vllm_ttft.py writes its table and a headline from its own rows (a real vLLM engine on CPU)."""
    pytest.importorskip("vllm")
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "run_all.py"), "--quick", "--only", "vllm_ttft",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads((out / "vllm_ttft.json").read_text())
    md = d["tables"][0]["markdown"]
    assert d["bench"] == "vllm_ttft" and md.count("\n") == 2 and "| smollm2-135m | 256 |" in md
    row = d["rows"][0]
    assert row["paths"]["kdn-hit"]["reused"] == [256] and row["paths"]["prefill"]["reused"] == [0]
    assert row["paths"]["host-hit"]["reused"] == [256] and row["tiers_so_far"].get("host", 0) >= 256, row
    # (the host-hit path's tokens came from the host tier's shared memory, the kdn-hit path's from the edge)
    h = d["headline"]
    for f in h["figures"]:
        assert f["shown"] in h["result"] and R.cell_in(md, f["cell"])
    assert f"{row['kdn_vs_local']:.2f}x" in h["result"] and f"{row['host_vs_local']:.2f}x" in h["result"]


def _result(tmp_path: Path, name: str, **fields) -> Path:
    (tmp_path / f"{name}.json").write_text(json.dumps(fields))
    return tmp_path


def test_a_result_is_current_only_while_the_code_it_measures_is_unchanged(tmp_path):
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    root = subprocess.run([*git, "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.split()[0]
    ring = run_all.BY_NAME["ring"]
    assert "bench/ring.py" in run_all._bench_sources("ring") and "bench/results.py" in run_all._bench_sources("ring")
    # cross_engine imports vllm_ttft, which imports bench/lib/ports.py: a change to either stales it
    assert {"bench/vllm_ttft.py", "bench/lib/ports.py"} <= set(run_all._bench_sources("cross_engine"))
    # the package modules a bench imports count, through every import form, and only those: the ring bench
    # (kdn.ring) does not measure the blend, the blend bench does; the vLLM connector is named in a string
    assert {"kdn/ring.py", "kdn/__init__.py"} <= set(run_all._bench_sources("ring"))
    assert "adapters/hf/rag.py" not in run_all._bench_sources("ring")
    assert "kernels/blend.py" in run_all._bench_sources("blend")
    assert "adapters/vllm/connector.py" in run_all._bench_sources("vllm_ttft")
    assert "edge/cli.py" in run_all._bench_sources("serve")  # ``-m kdn.cli`` -> the CLI's parts, in quotes
    assert "bench/serve_clients.py" in run_all._bench_sources("serve")  # a script it runs as a process
    assert "origin/cli.py" in run_all._bench_sources("vllm_ttft")  # ["kdn", "origin", "serve", ...]
    assert run_all.stale(ring, _result(tmp_path, "ring", commit={"sha": head, "dirty": False})) == ""
    assert "modified tree" in run_all.stale(ring, _result(tmp_path, "ring", commit={"sha": head, "dirty": True}))
    assert run_all.stale(ring, _result(tmp_path, "ring", commit={"sha": root, "dirty": False})).startswith(
        f"changed since {root[:7]}: ")
    assert "imported" in run_all.stale(ring, _result(tmp_path, "ring", commit={"sha": "dfca218"}, imported=True))
    assert "not in this repository" in run_all.stale(ring, _result(tmp_path, "ring", commit={"sha": "f" * 40}))
    assert run_all.stale(ring, tmp_path / "empty") == "no result"
