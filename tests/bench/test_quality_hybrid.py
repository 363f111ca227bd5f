"""bench/quality_hybrid.py: its --quick run trains, measures and writes honest JSON; its contexts are held out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import quality_hybrid

    return quality_hybrid


def test_contexts_come_from_the_test_tails_and_do_not_overlap():
    import torch

    qh = _bench()
    docs = [("a", torch.arange(12000)), ("b", torch.arange(20000, 30000))]
    cases = qh.contexts(docs, [512, 1024], 128, 100)
    assert [c[1].numel() for c in cases] == [512, 512, 1024, 1024, 512, 512]  # documents in turn, lengths cycled
    for name, ctx, cont in cases:
        ids = dict(docs)[name.split("@")[0]]
        tail_start = int(ids.numel() * qh.VALID_END)
        assert int(ctx[0]) - int(ids[0]) >= tail_start and cont.numel() == 128
        assert torch.equal(cont, ids[int(ctx[-1]) - int(ids[0]) + 1 :][:128])
    used = [set(torch.cat([c, n]).tolist()) for _, c, n in cases]
    assert sum(map(len, used)) == len(set().union(*used))


def test_quick_run(tmp_path):
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "run_all.py"), "--quick", "--only",
                        "quality_hybrid", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads((out / "quality_hybrid.json").read_text())
    assert d["bench"] == "quality_hybrid" and d["quick"] is True and d["cases"] == 2
    tables = {t["id"]: t["markdown"] for t in d["tables"]}
    assert set(tables) == {"training", "main"}
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip().strip("|").split("|")]
            for r in tables["main"].splitlines()[2:]}
    assert set(rows) == {"raw", "int8", *_bench().CONTROLS}
    assert rows["raw"][1] == "1.00" and rows["raw"][6] == "0.000 / 0.000" and rows["raw"][7] == "1.000 / 1.000"
    assert 0 < float(rows["int8"][3].rstrip("%")) < 100  # the lossless conv/SSM state's share of the bytes
    assert 1.0 < float(rows["int8"][1]) < float(rows["int8"][4])  # below the cap the lossless state sets
    t = d["training"]
    assert t["steps_done"] == 20 and t["nll"]["test32"] < t["valid_nll_init"]
