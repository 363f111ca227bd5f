"""The TTFT hit path, this tree against an older commit, side by side on one machine.

    python -P bench/ttft_ab.py                      # against 194b41e (before the read-path redesign), 2 rounds
    python -P bench/ttft_ab.py --old REV --rounds 3 [--length 8192]

The older commit is checked out as a git worktree under ``bench/work/ttft-ab/`` with a virtualenv of its
own (system site-packages, the tree installed editable without dependencies), so each side runs its own
client, edge and adapters. Each round runs ``bench/ttft.py`` (SmolLM2-135M, 2,048 tokens unless ``--length``
says otherwise, 3 repeats) of the old tree, then of this one, alternating which goes first, and reads the
memory-tier hit path from each run's raw JSON: lookup + fetch & verify + codec decode + cache build (the data
path, what the redesign changed), the suffix's prefill on the loaded cache, and TTFT. The ratios are this
tree's over the old one's, per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # python -P leaves it out
import results as R  # noqa: E402

WORK = HERE / "work" / "ttft-ab"
PARTS = ("lookup_ms", "fetch_ms", "codec_ms", "build_ms")


def log(msg: str) -> None:
    print(f"[ttft-ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def old_tree(rev: str) -> tuple[Path, Path]:
    """(worktree, python) of ``rev``, made once."""
    tree, venv = WORK / f"tree-{rev}", WORK / f"venv-{rev}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                       capture_output=True)
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "wheel", "setuptools"], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(tree)],
                       check=True, capture_output=True)
    return tree, py


def run_side(tree: Path, py: Path, out: Path, repeat: int, extra: list[str], length: int) -> dict:
    """One bench/ttft.py run in ``tree``; the memory path's row of its raw JSON."""
    argv = [str(py), "-P", "bench/ttft.py", "--models", "smollm2-135m", "--lengths", str(length), "--repeat", str(repeat),
            "--plot", "", "--json", str(out), *extra]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": ""}
    p = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{tree.name}: bench/ttft.py exited {p.returncode}: {p.stderr.strip()[-800:]}")
    row = json.loads(out.read_text())["rows"][0]
    return row["paths"]["memory"]


def _ms(d: dict, key: str) -> float:
    v = d[key]
    return float(v["median"] if isinstance(v, dict) else v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="194b41e", help="the commit to compare with (default: before the redesign)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="bench/ttft.py --repeat, per side and round")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a multiple of 256)")
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("ttft_ab", args)
    WORK.mkdir(parents=True, exist_ok=True)
    old_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.old], capture_output=True,
                             text=True, check=True).stdout.strip()
    otree, opy = old_tree(old_rev)
    sides = {"old": (otree, opy, []), "new": (ROOT, Path(sys.executable), ["--paths", "prefill,prefill-lean,memory",
                                                                          "--no-headline"])}
    got: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for side in order:
            tree, py, extra = sides[side]
            log(f"round {r + 1}/{args.rounds}: {side} ({tree.name})")
            d = run_side(tree, py, WORK / f"{side}-{r}.json", args.repeat, extra, args.length)
            got[side].append(d)
            log(f"  {side}: data path {sum(d[k] for k in PARTS):.1f} ms, TTFT {d['ttft']['median']:.1f} ms")

    lines = ["| round | side | lookup | fetch + verify | codec decode | build cache | data path | suffix prefill | "
             "TTFT (median) |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratios = []
    for r in range(args.rounds):
        for side in ("old", "new"):
            d = got[side][r]
            label = f"{old_rev} (old)" if side == "old" else "this tree"
            lines.append(f"| {r + 1} | {label} | " + " | ".join(f"{d[k]:.1f}" for k in PARTS)
                         + f" | **{sum(d[k] for k in PARTS):.1f}** | {d.get('prefill_ms', float('nan')):.1f} | "
                         f"{d['ttft']['median']:.1f} |")
        ratios.append(sum(got["new"][r][k] for k in PARTS) / sum(got["old"][r][k] for k in PARTS))
    res.table("rounds", "\n".join(lines), f"Memory-tier hit at {args.length:,} tokens (SmolLM2-135M), ms (medians per run)")
    med = statistics.median(ratios)
    summary = ["| comparison | median over rounds | worst round | best round |", "| --- | ---: | ---: | ---: |",
               f"| data path, this tree / {old_rev} | **{med:.2f}** | {max(ratios):.2f} | {min(ratios):.2f} |"]
    for key, what in (("prefill_ms", "suffix prefill"), ("ttft", "TTFT")):
        rs = [_ms(got["new"][r], key) / _ms(got["old"][r], key) for r in range(args.rounds)]
        summary.append(f"| {what}, this tree / {old_rev} | **{statistics.median(rs):.2f}** | {max(rs):.2f} | "
                       f"{min(rs):.2f} |")
    res.table("summary", "\n".join(summary), "Data path (lookup + fetch + verify + decode + cache build), new / old")
    res.extra.update({"old": old_rev, "ratios": [round(x, 3) for x in ratios]})
    res.write()


if __name__ == "__main__":
    main()
