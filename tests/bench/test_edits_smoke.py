"""bench/edits.py, smallest run: a real origin and an edge, the old version of a document published, one edit,
the full prefill, exact reuse and the approximate path side by side. A run that breaks fails here instead of
in the next benchmark session."""

from __future__ import annotations

import pytest

from quick_run import quick_tables  # tests/bench/quick_run.py


@pytest.mark.timeout(600)
def test_a_quick_edits_run_compares_the_three_paths(tmp_path):
    tables = quick_tables("edits", tmp_path)
    main = tables["main"]
    rows = [line for line in main.splitlines() if line.startswith("| harbor-policy | sentence | middle |")]
    assert [r.split(" | ")[3] for r in rows] == ["full prefill", "exact reuse", "approximate 15%"], main
    exact, approx = rows[1].split(" | ")[4], rows[2].split(" | ")[4]
    # exact reuse stops at the chunk that holds the edit; the approximate path reuses nearly all of the rest
    n_exact = [int(x) for x in exact.split(" / ")]
    n_approx = [int(x) for x in approx.split(" / ")]
    assert n_exact[0] % 256 == 0 and n_exact[1] == 0 and n_exact[2] > 0
    assert n_approx[0] >= n_exact[0] and n_approx[1] > 0 and n_approx[2] < n_exact[2]
    assert sum(n_exact) == sum(n_approx)
    assert "summary" in tables
