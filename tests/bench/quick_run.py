"""Run a bench script's ``--quick`` mode as CI would (``python -P``, its own results file) and read back its tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_tables(bench: str, tmp_path: Path, timeout: float = 580) -> dict[str, str]:
    """The markdown of each table of ``bench/<bench>.py --quick``, by id; fails with its output if it fails."""
    out = tmp_path / f"{bench}.json"
    p = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / f"{bench}.py"), "--quick", "--results", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    return {str(t["id"]): str(t["markdown"]) for t in d["tables"]}
