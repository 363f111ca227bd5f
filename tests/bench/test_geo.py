"""bench/geo.py: the baselines' source sets and rankings, the per-seed report, and a tiny run over etcd.

The report tests build RunResults by hand (no servers); the last test runs the bench itself with a few
requests per seed (about 30 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kdn.client import KDNClient

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("kdn_bench_geo", ROOT / "bench" / "geo.py")
geo = sys.modules.setdefault("kdn_bench_geo", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(geo)
import results as R  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _world():
    edges = {f"{r}-{i}": SimpleNamespace(node_id=f"{r}-{i}", region=r, url=f"http://{r}-{i}")
             for r in geo.REGIONS for i in (1, 2)}
    return SimpleNamespace(edges=edges, origin_link=SimpleNamespace(url="http://origin"))


def test_source_sets():
    w = _world()
    st = geo.client_sources(w, "mid", "static-nearest")
    assert st == {"edges": [("mid-1", "http://mid-1")], "origin": "http://origin"}
    rnd = geo.client_sources(w, "mid", "random")
    assert rnd == {"edges": [("mid-1", "http://mid-1"), ("mid-2", "http://mid-2")], "origin": "http://origin"}
    for s in ("latency", "oracle", "oracle-hedged"):
        kw = geo.client_sources(w, "mid", s)
        assert len(kw["edges"]) + len(kw["remote_edges"]) + 1 == 7  # all seven sources


def test_static_ranking_is_the_configured_order():
    c = KDNClient(**geo.client_sources(_world(), "near", "static-nearest"))
    for _ in range(5):
        assert [s.label for s in geo.static_ranking(c, 1 << 20, None)] == ["edge:near-1", "origin"]


def test_random_shuffles_the_region_only_origin_last():
    c = geo.BenchClient(**geo.client_sources(_world(), "far", "random"))
    c.rng.seed(1)
    firsts = set()
    for _ in range(40):
        order = [s.label for s in geo.region_random_ranking(c, 1 << 20, "x")]
        assert sorted(order[:2]) == ["edge:far-1", "edge:far-2"] and order[2] == "origin"
        firsts.add(order[0])
    assert firsts == {"edge:far-1", "edge:far-2"}


def test_parse_seeds_and_strategies():
    assert geo.parse([]).seeds == [7]
    a = geo.parse(["--seeds", "1,2,3", "--strategies", "static-nearest,oracle-hedged"])
    assert a.seeds == [1, 2, 3] and a.strategies == ["static-nearest", "oracle-hedged"]
    assert "static-nearest" in geo.DEFAULT_STRATEGIES and "oracle-hedged" in geo.DEFAULT_STRATEGIES
    with pytest.raises(SystemExit):
        geo.parse(["--strategies", "nearest"])
    with pytest.raises(SystemExit):
        geo.parse(["--seeds", "1,x"])


def _run(strategy: str, seed: int, fetch: list[float], region: str = "near", origin_mb: float = 1.0):
    r = geo.RunResult(f"{strategy}/p2/s{seed}", strategy, 2, seed, origin_bytes=origin_mb * 1e6)
    r.samples = [geo.Sample(region, f, f + 5, 1.0, 1, [f], [region], ["memory"]) for f in fetch]
    return r


def _results():
    out = []
    for seed, k in ((1, 1.0), (2, 2.0), (3, 4.0)):
        out.append(_run("latency", seed, [k * x for x in range(1, 101)], origin_mb=2.0))
        out.append(_run("static-nearest", seed, [2 * k * x for x in range(1, 101)], origin_mb=1.0))
        out.append(_run("oracle", seed, [k * x for x in range(1, 101)], origin_mb=2.0))
        out.append(_run("origin-only", seed, [10 * x for x in range(1, 101)], origin_mb=16.0))
    return out


def test_spread_and_ratios():
    assert geo.spread([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    assert geo.spread([1.234], 2) == "1.23"
    assert geo.spread([]) == "n/a"
    res = _results()
    assert geo.ratios(res, "latency", "static-nearest", 50) == [0.5, 0.5, 0.5]
    assert geo.ratios(res, "latency", "oracle", 99) == [1.0, 1.0, 1.0]
    assert geo.ratios(res, "latency", "nobody", 50) == []


def test_tables_and_headline_tie_together():
    res = _results()
    summary = geo.summary_table(res)
    # latency per seed: p50 51, 102, 204 ms (nearest rank), p99 99, 198, 396 ms: median (min-max)
    row = next(line for line in summary.splitlines() if line.startswith("| latency |"))
    assert row.startswith("| latency | 2 | 3 | 102.0 (51.0-204.0) |") and "| 198.0 (99.0-396.0) |" in row
    ratios = geo.ratio_table(res)
    assert "| latency / static-nearest | 0.50 (0.50-0.50) | 0.50 / 0.50 / 0.50 |" in ratios
    every = geo.strategy_table(res)
    assert len([x for x in every.splitlines() if x.startswith("| latency | 2 |")]) == 3
    r = R.Results("geo")
    r.table("summary", summary, echo=False)
    r.table("ratios", ratios, echo=False)
    geo.headline(r, res)
    h = r.headline
    assert "static-nearest" in h["what"] and "static-nearest" in h["baseline"]
    assert "p50 **0.50x**" in h["result"] and "p99 **0.50x**" in h["result"]
    assert "p50 0.50-0.50x (slower in 0 of 3)" in h["result"]
    assert "8x below origin-only's (static-nearest's: 16x below)" in h["result"]
    tables = {t["id"]: t["markdown"] for t in r.tables}
    for f in h["figures"]:
        assert f["shown"] in h["result"]
        for cell in f["cells"]:
            assert R.cell_in(tables[f["table"]], cell), (f, cell)


def test_a_tiny_run_per_seed(tmp_path):
    """Two seeds, the two new baselines: every request answered right, every connection emulated."""
    out = tmp_path / "geo.json"
    raw = tmp_path / "raw.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "geo.py"), "--requests", "4", "--docs", "2",
                        "--seeds", "1,2", "--strategies", "static-nearest,random,latency", "--no-prefetch0",
                        "--plot", "", "--json", str(raw), "--results", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(raw.read_text())
    assert [s["seed"] for s in d["seeds"]] == [1, 2]
    runs = d["runs"]
    assert sorted((r["strategy"], r["seed"]) for r in runs) == sorted(
        (s, seed) for s in ("static-nearest", "random", "latency") for seed in (1, 2))
    for r in runs:
        assert r["unemulated"] == 0 and not r["truncated"] and len(r["samples"]) == 4
        labels = {x for s in r["samples"] for x in s["labels"]}
        if r["strategy"] == "static-nearest":
            assert r["hedges"] == 0
            assert labels <= {"edge:near-1", "edge:mid-1", "edge:far-1", "origin"}
        if r["strategy"] == "random":  # the region's own edges (or the origin), never another region's
            assert all(x in ("origin", f"edge:{s['region']}-1", f"edge:{s['region']}-2")
                       for s in r["samples"] for x in s["labels"])
    res = json.loads(out.read_text())
    assert {t["id"] for t in res["tables"]} >= {"summary", "ratios", "strategies", "tiers", "targets"}
    assert "wrong prefix hits: 0" in res["tables"][-1]["markdown"]
    assert res["headline"] and "static-nearest" in res["headline"]["baseline"]
