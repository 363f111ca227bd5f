"""The README's "Try it by hand" commands run as written (a new user's first minute).

The block is read out of README.md and run by bash in a temp folder (where
``kdn/data/docs`` is the repository's), with two substitutions for isolation
only: its state folder ``/tmp/kdn`` becomes a temp folder, and its port 8000
a free one.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ports import free_port  # bench/lib/ports.py

ROOT = Path(__file__).resolve().parents[2]


def try_it_by_hand() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Try it by hand", 1)[1]
    lines = []
    for line in section.splitlines()[1:]:
        if line.startswith("    "):
            lines.append(line[4:])
        elif lines:
            break  # the first indented block only
    assert lines, "README has no command block under 'Try it by hand'"
    return "\n".join(lines)


def test_try_it_by_hand_runs_as_written(tmp_path):
    block = try_it_by_hand()
    port = free_port()
    script = block.replace("/tmp/kdn", str(tmp_path / "state")).replace("8000", str(port))
    (tmp_path / "kdn").mkdir()
    (tmp_path / "kdn" / "data").symlink_to(ROOT / "kdn" / "data")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"README block failed ({r.returncode}):\n{script}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert "published public/sourdough-guide:" in r.stdout
    assert "manifests/public/sourdough-guide" in r.stdout
    assert '"type": "manifest"' in r.stdout
    # the address command prints the README's own prefix-chain test vector
    vector = re.search(r"prefix_addresses\(M, \"public\", range\(10\), chunk_tokens=4\)` \| `(\w+)…(\w+)`",
                       (ROOT / "README.md").read_text())
    assert vector, "the README's test vector row moved"
    assert re.search(rf"0-4\s+{vector.group(1)}\w*{vector.group(2)}", r.stdout), r.stdout
