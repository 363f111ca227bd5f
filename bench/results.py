"""A bench's results as JSON: what ran (command, commit, machine), its markdown tables and headline.

Every script in ``bench/`` takes ``--results PATH`` (added by :func:`add_arg`; ``--json`` was already taken
by several of them for their raw data). A bench builds its tables through a :class:`Results`: each table is
printed as it is built and kept as the same string, so what the terminal shows and what the JSON holds
cannot differ. ``bench/run_all.py`` runs the benches with ``--results bench/results/NAME.json`` and renders
``docs/benchmarks.md`` (and the README's headline rows) from those files.

The JSON::

    {"bench": "ring", "command": "python -P bench/ring.py --vnodes 160", "argv": [...], "env": {...},
     "commit": {"sha": "...", "dirty": false}, "machine": {"cores": 2, "memory_gib": 23.5, "cpu": "...",
     "gpu": null, "python": "3.11.7", "load_before": [...], "load_after": [...]},
     "started": "2026-12-01T19:40:00+00:00", "seconds": 8.1, "params": {...},
     "tables": [{"id": "main", "title": "...", "markdown": "| ... |"}],
     "headline": {"what": "...", "result": "...", "baseline": "...",
                  "figures": [{"shown": "1.80x", "cell": "1.795", "table": "main"}]}}

A headline's ``figures`` tie each number the README quotes (``shown``, as it appears in ``result``) to the
table cell it comes from (``cell``, a substring of one cell of table ``table``); the tests check both.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Environment variables that change what a bench measures: recorded with the command.
ENV_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def add_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", metavar="PATH", default=None,
                    help="write the run's JSON results here (command, commit, machine, tables, headline)")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# What benches write while they run (plots, results, rendered pages): a change there is not a change to what
# was measured, so a bench run after another one rewrote its plot still counts as a run on a clean tree.
OUTPUTS = ("docs", "bench/results", "README.md")


def commit() -> dict[str, Any]:
    """HEAD and whether tracked files other than OUTPUTS differ from it (untracked files never count)."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){p}" for p in OUTPUTS))
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "memory_gib": _memory_gib(), "cpu": _cpu_model(),
            "gpu": _gpus() or None, "python": platform.python_version(), "platform": platform.platform()}


def command(argv: list[str] | None = None, env: dict[str, str] | None = None) -> str:
    """The command line as it would be typed from the repository root, ``--results`` left out."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    rest, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--results":
            skip = True
            continue
        if a.startswith("--results="):
            continue
        rest.append(a)
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return prefix + shlex.join(["python", "-P", str(script), *rest])


class Table:
    """A markdown table built line by line: each line is printed as it comes (long benches show progress)."""

    def __init__(self, id: str, title: str = "") -> None:
        self.id, self.title, self.lines = id, title, []  # type: ignore[var-annotated]

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    @property
    def markdown(self) -> str:
        return "\n".join(self.lines)


class Results:
    """Collects one run's tables and headline; :meth:`write` saves them if ``--results`` was given."""

    def __init__(self, bench: str, args: argparse.Namespace | None = None, params: dict[str, Any] | None = None):
        self.bench = bench
        self.path = getattr(args, "results", None) if args is not None else None
        if params is None and args is not None:
            params = {k: v for k, v in vars(args).items() if k != "results"}
        self.params = {k: (str(v) if isinstance(v, Path) else v) for k, v in (params or {}).items()}
        self.env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
        self.argv = list(sys.argv)
        self.started = _dt.datetime.now(_dt.timezone.utc)
        self.t0 = time.perf_counter()
        self.load_before = _load()
        self.commit = commit()  # at the start: what ran (a bench may write tracked files, e.g. its PNG, before the end)
        self.tables: list[dict[str, str]] = []
        self.headline: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}

    def table(self, id: str, markdown: str, title: str = "", echo: bool = True) -> str:
        """Keep a finished table (printed unless ``echo`` is false); returns it."""
        if any(t["id"] == id for t in self.tables):
            raise ValueError(f"table id {id!r} used twice")
        if echo:
            print(markdown, flush=True)
        self.tables.append({"id": id, "title": title, "markdown": markdown.strip("\n")})
        return markdown

    def start_table(self, id: str, title: str = "") -> Table:
        """A table printed line by line; :meth:`end_table` keeps it."""
        return Table(id, title)

    def end_table(self, t: Table) -> str:
        return self.table(t.id, t.markdown, t.title, echo=False)

    def set_headline(self, what: str, result: str, baseline: str, figures: list[dict[str, str]]) -> None:
        """The README row: ``what`` was measured, ``result`` (markdown), against ``baseline`` (named).

        ``figures``: ``{"shown": text in result, "cell": text of a cell, "table": table id}`` for each number.
        """
        for f in figures:
            if f["shown"] not in result:
                raise ValueError(f"headline figure {f['shown']!r} is not in its text")
        self.headline = {"what": what, "result": result, "baseline": baseline, "figures": figures}

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "command": command(self.argv, self.env),
            "argv": self.argv,
            "env": self.env,
            "commit": self.commit,
            "machine": {**machine(), "load_before": self.load_before, "load_after": _load()},
            "started": self.started.isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - self.t0, 1),
            "params": self.params,
            "tables": self.tables,
            "headline": self.headline,
            **self.extra,
        }

    def write(self, path: str | Path | None = None) -> Path | None:
        path = path or self.path
        if not path:
            return None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False, default=str) + "\n")
        tmp.replace(path)
        print(f"results: {path}", file=sys.stderr)
        return path


def cell_in(markdown: str, cell: str) -> bool:
    """Whether ``cell`` is (part of) one cell of a markdown table."""
    for line in markdown.splitlines():
        if line.lstrip().startswith("|"):
            if any(cell in c.replace("**", "") or cell in c for c in line.strip().strip("|").split("|")):
                return True
    return False


def run_logged(name: str, args: argparse.Namespace, run: Any) -> Results:
    """A bench's ``main`` tail: ``run(args, res, log)`` (a coroutine function) on a fresh event loop, where ``log``
    prints each line after the seconds since the start; then the results written. Returns them."""
    import asyncio

    res = Results(name, args)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t0:7.1f}s {msg}", flush=True)

    asyncio.run(run(args, res, log))
    res.write()
    return res
