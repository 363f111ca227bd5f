"""bench/finetune.py, smallest run: a two-step fine-tune of SmolLM2, its layer plan on one short sample, the base's
states published through a real origin and read from an edge, each plan beside the variant's own prefill. A run
that breaks fails here instead of in the next benchmark session."""

from __future__ import annotations

import re

import pytest

from quick_run import quick_tables  # tests/bench/quick_run.py


@pytest.mark.timeout(600)
def test_a_quick_finetune_run_compares_the_plans_with_the_variants_own_prefill(tmp_path):
    tables = quick_tables("finetune", tmp_path)
    main = tables["main"]
    rows = [r for r in (line.split(" | ") for line in main.splitlines() if line.startswith("| "))
            if len(r) > 1 and re.fullmatch(r"\d+ of \d+", r[1])]
    names = [r[0].lstrip("| ") for r in rows]
    assert names[0].startswith("variant's own full prefill") and names[1].startswith("every layer from the base")
    assert names[-1] == "every layer recomputed"
    L = int(rows[0][1].split(" of ")[1])
    assert rows[1][1] == f"0 of {L}" and rows[-1][1] == f"{L} of {L}"
    # every layer recomputed: the variant's own reading of the context (the NLL of a one-shot prefill)
    assert rows[-1][4] == rows[0][4] and rows[-1][5] == "+0.0%"
    groups = tables["groups"]
    assert any(line.startswith("| +5% | ") for line in groups.splitlines()), groups
    layers = tables["layers"]
    assert len([x for x in layers.splitlines() if x.startswith("| ") and x[2].isdigit()]) == L
