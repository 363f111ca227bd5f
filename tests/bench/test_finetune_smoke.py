"""bench/finetune.py, smallest run: a two-step fine-tune of SmolLM2, its layer plan on one short sample, the base's
states published through a real origin and read from an edge, each plan beside the variant's own prefill. A run
that breaks fails here instead of in the next benchmark session."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_a_quick_finetune_run_compares_the_plans_with_the_variants_own_prefill(tmp_path):
    out = tmp_path / "finetune.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "finetune.py"), "--quick", "--results", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    main = next(t for t in d["tables"] if t["id"] == "main")["markdown"]
    rows = [r for r in (line.split(" | ") for line in main.splitlines() if line.startswith("| "))
            if len(r) > 1 and re.fullmatch(r"\d+ of \d+", r[1])]
    names = [r[0].lstrip("| ") for r in rows]
    assert names[0].startswith("variant's own full prefill") and names[1].startswith("every layer from the base")
    assert names[-1] == "every layer recomputed"
    L = int(rows[0][1].split(" of ")[1])
    assert rows[1][1] == f"0 of {L}" and rows[-1][1] == f"{L} of {L}"
    # every layer recomputed: the variant's own reading of the context (the NLL of a one-shot prefill)
    assert rows[-1][4] == rows[0][4] and rows[-1][5] == "+0.0%"
    groups = next(t for t in d["tables"] if t["id"] == "groups")["markdown"]
    assert any(line.startswith("| +5% | ") for line in groups.splitlines()), groups
    layers = next(t for t in d["tables"] if t["id"] == "layers")["markdown"]
    assert len([x for x in layers.splitlines() if x.startswith("| ") and x[2].isdigit()]) == L
