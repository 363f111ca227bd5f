"""Run the benches, keep their results as JSON, and render the docs' tables and the README's headlines from them.

    python -P bench/run_all.py                      # every bench this machine can run, full settings (hours)
    python -P bench/run_all.py --only ring,eviction-zipf
    python -P bench/run_all.py --quick --only ring  # a smoke run: tiny settings, into bench/work/quick-results
    python -P bench/run_all.py --render             # only re-render the docs from bench/results/*.json
    python -P bench/run_all.py --check              # exit 1 if the docs differ from what the results render
    python -P bench/run_all.py --list               # the runs; which results no longer match the code
    python -P bench/run_all.py --stale              # re-run only those

Each run below is one bench command (the one docs/benchmarks.md documents), run as a subprocess with
``--results bench/results/NAME.json`` and a timeout; a failing run is reported and the others go on, its
previous JSON kept. A run whose hardware or software is not here (a GPU, vLLM, etcd) is skipped with the
reason, its previous JSON kept; ``archived`` runs are records of a past run (before a fix, say) and are never
re-run. After a full run the docs are rendered.

Rendering: in README.md and docs/*.md, the text between ``<!-- bench:NAME:TABLE:begin -->`` and
``<!-- bench:NAME:TABLE:end -->`` is table ``TABLE`` of ``bench/results/NAME.json``; ``TABLE`` = ``meta`` is
a line naming the results file, its command, commit, machine and date; the README rows between
``<!-- headlines:begin -->`` and ``<!-- headlines:end -->`` are the ``headline`` of each run in
``HEADLINES``. Everything else is hand-written and left alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
QUICK_OUT = ROOT / "bench" / "work" / "quick-results"
LOGS = ROOT / "bench" / "work" / "run_all"
DOCS = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "reliability.md",
        ROOT / "docs" / "security.md", ROOT / "docs" / "scale.md"]


@dataclass
class Run:
    name: str  # bench/results/NAME.json
    script: str  # bench/SCRIPT.py
    args: list[str] = field(default_factory=list)  # the documented command's arguments
    quick: list[str] | None = None  # tiny settings for --quick (None: no smoke run)
    needs: tuple[str, ...] = ()  # see NEEDS
    timeout: float = 3600.0  # seconds, full settings
    env: dict[str, str] = field(default_factory=dict)
    archived: str = ""  # why this is a record that is not re-run ("" = re-run)


# The question's own map (steer-question*): K and alpha as the oracle run ("steer") chose them on the needles'
# tuning split; the needles in full prefill and prefix reuse (the map made on KV loaded from chunks), SQuAD in
# full prefill only (prefix reuse has matched it in every steer run: loading is exact).
QUESTION_MAP = ["--map", "question", "--no-headline", "--fixed", "--k", "24", "--alphas", "0.03", "--contexts"]

RUNS: list[Run] = [
    Run("address_codec", "address_codec", ["--tokens", "1024", "--repeat", "7"],
        ["--tokens", "256", "--repeat", "1"], ("smollm2",), 900),
    Run("eviction-zipf", "eviction", ["--objects", "20000", "--requests", "1000000", "--seed", "7"],
        ["--objects", "500", "--requests", "5000", "--alphas", "1.0"], (), 900),
    Run("eviction-mooncake", "eviction", ["--trace", "mooncake", "--plot", "docs/img/eviction.png"],
        ["--trace", "mooncake", "--cache", "0.05", "--synthetic-seeds", "1", "--docs", "50",
         "--synthetic-requests", "200", "--theine-runs", "1"], (), 3600),
    Run("ring-v160", "ring", ["--addresses", "100000", "--vnodes", "160", "--seed", "7"],
        ["--addresses", "2000", "--vnodes", "160"], (), 600),
    Run("ring", "ring", ["--addresses", "100000", "--vnodes", "320", "--seed", "7"],
        ["--addresses", "2000"], (), 600),
    Run("quality", "quality", ["--contexts", "512", "1024", "--continuation", "256", "--png", "docs/img/quality.png"],
        ["--contexts", "256", "--continuation", "32", "--encodings", "raw", "int8"], ("smollm2",), 3600),
    Run("quality_transform", "quality_transform",
        ["--basis", "bench/work/kvtc-smollm2.basis", "--budgets", "1.5", "1.65", "1.75", "2.0", "2.5",
         "--encodings", "int8", "int4-g64", "cachegen-4", "ans-4", "--png", "docs/img/quality_transform.png",
         "--auto", "ladder=1.5,2.5 kl=0.0067 target=1.6 probe=64", "--heldout", "--long", "1024"],
        ["--basis", "bench/work/kvtc-smollm2.basis", "--contexts", "512", "--continuation", "32", "--budgets", "2.0",
         "--encodings", "int8", "--docs", "harbor-policy"], ("smollm2",), 3 * 3600),
    # The measure: the same 36 contexts (and the held-out set), each judged on its next 1,024 tokens (the
    # shipped documents' last contexts on the 384 or more they have), where int8's spread, the noise floor, is small.
    Run("quality_transform-long", "quality_transform",
        ["--basis", "bench/work/kvtc-smollm2.basis", "--budgets", "1.65", "2.0", "2.5", "--encodings", "int8",
         "--auto", "ladder=1.5,2.5 kl=0.0067 target=1.6 probe=64", "--heldout", "--continuation", "1024",
         "--min-continuation", "384"],
        ["--basis", "bench/work/kvtc-smollm2.basis", "--contexts", "512", "--continuation", "64", "--budgets", "2.0",
         "--encodings", "int8", "--docs", "harbor-policy"], ("smollm2",), 3 * 3600),
    Run("quality_hybrid", "quality_hybrid", ["--threads", "2"],
        ["--steps", "20", "--eval-every", "10", "--max-contexts", "2", "--continuation", "32", "--encodings", "raw",
         "int8"], ("smollm2",), 1800),
    Run("ttft_ab", "ttft_ab", ["--rounds", "4", "--repeat", "5"], ["--rounds", "1", "--repeat", "1"], ("smollm2",), 3600,
        {"OMP_WAIT_POLICY": "PASSIVE"}),
    # The transformers hit at 8k with room after the prefix (adapters/hf/room.py) against the commit before it.
    Run("ttft_ab-room", "ttft_ab", ["--old", "7e53390", "--length", "8192", "--rounds", "2", "--repeat", "3"],
        ["--old", "7e53390", "--rounds", "1", "--repeat", "1"], ("smollm2",), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("geo", "geo", ["--requests", "200", "--seeds", "1,2,3"],
        ["--requests", "6", "--docs", "2", "--strategies", "latency,static-nearest", "--no-prefetch0", "--plot", "",
         "--json", ""], ("etcd",), 2700),
    Run("ttft", "ttft", ["--repeat", "3"],
        ["--models", "smollm2-135m", "--lengths", "256", "--repeat", "1", "--plot", "", "--json", ""],
        ("smollm2",), 3 * 3600),
    Run("ttft-rows", "ttft", ["--models", "smollm2-135m", "--lengths", "2048", "--repeat", "3", "--plot", "",
                              "--json", "", "--no-headline"],
        ["--models", "smollm2-135m", "--lengths", "256", "--repeat", "1", "--plot", "", "--json", "",
         "--no-headline"], ("smollm2",), 1800),
    Run("vllm_ttft", "vllm_ttft", [], ["--models", "smollm2-135m", "--lengths", "256", "--repeat", "1", "--plot", "",
                                       "--json", ""], ("vllm",), 3 * 3600),
    # The CPU's write-ahead threads (write_threads) against writes inside the forward's wait, one engine, alternating.
    Run("vllm_write_ahead", "vllm_write_ahead", [], ["--models", "smollm2-135m", "--length", "256", "--repeat", "2"],
        ("vllm",), 3600),
    Run("blend", "blend", ["--png", "docs/img/blend.png"],
        ["--quick", "--png", ""], ("smollm2",), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    # The ratios that meet the blend target, on contexts the main run did not pick them on: other seeds
    # draw other generated documents, distractor passages and answer places. deviation-query was chosen
    # over variants looking at seeds 7 and 11; 13 is the draw no choice looked at.
    Run("blend-heldout", "blend", ["--seeds", "11,13", "--configs",
                                   "deviation-kv:15:1,deviation-query:12:1,deviation-query:15:1", "--png", ""],
        None, ("smollm2",), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    # Reuse across edits (issue #30 1b): an edited document read from its old version's published states.
    Run("edits", "edits", [], ["--quick"], ("smollm2",), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    # Reuse across fine-tunes (issue #30 part 2): a variant fine-tuned here reads the base's states, per layer plan.
    Run("finetune", "finetune", [], ["--quick"], ("smollm2",), 1800, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("steer", "steer", [], ["--quick"], ("smollm2",), 3 * 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    # The realistic map: what the origin's model marks under a generic probe question that names no fact.
    Run("steer-probe", "steer", ["--map", "probe", "--no-headline"], None, ("smollm2",), 3 * 3600,
        {"OMP_WAIT_POLICY": "PASSIVE"}),
    # The map from the question itself (issue #55 item 2): no oracle; retrieval heads calibrated on the tuning
    # split. On the needles and on a SQuAD reading set (bench/data/squad-steer.json), each beside the oracle.
    Run("steer-question", "steer", QUESTION_MAP + ["full,reuse", "--nll-cases", "8"], None, ("smollm2",), 3 * 3600,
        {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("steer-question-squad", "steer", QUESTION_MAP + ["full", "--nll-cases", "8", "--set", "squad"], None,
        ("smollm2",), 3 * 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("vllm_steer", "vllm_steer", [], ["--quick"], ("vllm", "smollm2"), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    # The question's own map inside vLLM (adapters/vllm/question.py), made in the question's pass, beside the
    # transformers adapter's: no oracle, the content-free scores as an origin publishes them.
    Run("vllm_steer-question", "vllm_steer", ["--map", "question"], ["--map", "question", "--quick"],
        ("vllm", "smollm2"), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("vllm_rag", "vllm_rag", [], ["--quick"], ("vllm", "smollm2"), 3600, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("serve", "serve", ["--sizes", "4MiB,kv256", "--conc", "1,4,16", "--servers",
                           "edge-mem,edge-disk,dict,dict-copy,nginx-1w,lmcache,redis", "--clients", "raw,kdn",
                           "--duration", "2", "--warmup", "0.5", "--rounds", "2", "--profile", "--no-install"],
        ["--sizes", "4MiB", "--conc", "1", "--servers", "edge-mem,dict", "--clients", "raw", "--duration", "0.5",
         "--warmup", "0.2", "--no-install", "--plot", ""], ("redis", "lmcache"), 1800),
    Run("gpu_check", "gpu_check", ["--device", "cuda"], None, ("gpu",), 3600),
    Run("scale", "scale", [], ["--records", "500"], ("etcd",), 900),
    Run("datapath", "datapath", ["--repeat", "5"], None, ("smollm2", "vllm"), 1800, {"OMP_WAIT_POLICY": "PASSIVE"}),
    # The host tier shared by several engines on one machine, and an engine's restart (issue #53).
    Run("host_share", "host_share", [], ["--model", "tiny-llama", "--tokens", "1024", "--engines", "1,2",
                                         "--repeat", "1", "--json", ""], ("smollm2",), 1200),
    # Engines on the KDN (issue #54): LMCache's L2 through KDN against its own fs L2; an edge's router events.
    Run("engines", "engines", [], ["--quick"], ("smollm2", "lmcache-mp"), 1800, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("lookup", "lookup", [], ["--model", "tiny-llama", "--lengths", "512", "--repeat", "1"], ("smollm2",), 1200),
    Run("hybrid_bytes", "hybrid_bytes", [], ["--lengths", "512", "--repeat", "1"], ("smollm2",), 1200,
        {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("load", "load", ["--json", "bench/work/load.json", "--plot", "docs/img/load.png"],
        ["--duration", "5", "--clients", "8", "--minutes", "0.5"], ("etcd",), 1200),
    Run("load-soak", "load", ["--duration", "600", "--speedup", "2", "--json", "bench/work/soak.json",
                              "--plot", "docs/img/soak.png"], None, ("etcd",), 1800),
    Run("faults", "faults", [], ["--quick", "--only", "origin_down"], ("etcd",), 3600),
    Run("upper_tier", "upper_tier", ["--json", "bench/work/upper_tier.json"],
        ["--regions", "2", "--requests", "3"], ("etcd",), 2400),
    Run("upper_tier-split", "upper_tier", ["--workload", "split", "--requests", "200", "--json",
                                           "bench/work/upper_tier_split.json"], None, ("etcd",), 2400),
    Run("vllm_ttft-zstd", "vllm_ttft", ["--models", "smollm2-135m", "--encodings", "zstd", "--json",
                                        "bench/work/vllm_ttft_zstd.json", "--plot", "", "--no-headline"],
        None, ("vllm",), 3600),
    Run("vllm_plan", "vllm_plan", [], None, ("vllm", "smollm2"), 1200, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Run("cross_engine", "cross_engine", [], ["--models", "tiny-llama64", "--docs", "1", "--new", "4", "--json", ""],
        ("vllm",), 3600),
    # Records of past runs the docs still discuss; their code has changed since, so re-running the same command
    # would not reproduce what the text around them says.
    Run("geo-seed7", "geo",
        archived="one seed (7), after the three client fixes, before the static-nearest baseline and --seeds"),
    Run("geo-regions-first", "geo", archived="three seeds, before the edges stopped asking other regions that were "
        "not worth a miss's round trip"),
    Run("geo-lockin", "geo", archived="three seeds, before the client stopped ranking transfers by lookup times "
        "and fanning hedges out"),
    Run("geo-before-fixes", "geo", archived="before three fetch-client fixes"),
    Run("geo-earlier", "geo", archived="an earlier run, before the client fixes"),
    Run("blend-loaded", "blend", archived="the run at 9a4531a under load 7.7-3.7, where the lean prefill slowed "
        "more than the blend (3.71x); the quiet re-run gives 2.99x"),
    Run("blend-first", "blend", archived="the first run, under heavy load"),
    Run("steer-budget1", "steer", archived="tuned within a 1% NLL budget on the tuning split (K 16/32, alpha "
        "0.01/0.03/0.1): +1.13% on the test split"),
    Run("steer-first", "steer", archived="the first run: heads and alpha tuned for accuracy alone (no NLL budget)"),
    Run("vllm_steer-gather", "vllm_steer", archived="before the steered requests' context K/V were kept between "
        "steps: every step gathered every key from the paged cache"),
    Run("vllm_steer-f2d3a96", "vllm_steer", archived="the same algorithm as the current run, one run earlier (before "
        "the key cache's pruning and bounds fixes): the run-to-run spread of the time column"),
    Run("vllm_steer-ctx", "vllm_steer", archived="with the context's keys kept between steps, before the steered "
        "rows' attention was written out instead of scaled_dot_product_attention with a float mask"),
    Run("serve-full", "serve", ["--lean", "--profile", "--duration", "2", "--warmup", "0.5"],
        archived="before the edge's memory-path fix (its edge-*-lean rows patch in what is now shipped)"),
]
BY_NAME = {r.name: r for r in RUNS}
# README headline rows, in this order (runs without a headline are left out).
HEADLINES = ["ttft", "vllm_ttft", "gpu_check", "datapath", "address_codec", "quality_transform", "eviction-zipf", "eviction-mooncake",
             "faults", "ring", "geo", "blend", "steer", "serve"]


def _have_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _have_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


# need -> (check, what is missing when the check fails)
NEEDS = {
    "gpu": (_have_gpu, "no NVIDIA GPU (nvidia-smi)"),
    "vllm": (lambda: _have_module("vllm"), "vLLM is not installed (scripts/install-vllm)"),
    "etcd": (lambda: bool(shutil.which("etcd") or Path("/usr/bin/etcd").exists()), "no etcd binary"),
    "smollm2": (lambda: _have_module("torch") and _have_module("transformers"), "torch/transformers not installed"),
    "redis": (lambda: bool(shutil.which("redis-server")), "redis-server not installed (apt; the bench runs "
              "with --no-install)"),
    "lmcache": (lambda: (ROOT / "bench" / "work" / "lmcache-venv").exists(), "no LMCache venv in bench/work"),
    "lmcache-mp": (lambda: _have_module("lmcache") and _have_module("zmq") and _have_module("msgpack"),
                   "lmcache (scripts/setup), pyzmq or msgpack not installed"),
    "nginx": (lambda: bool(shutil.which("nginx") or Path("/usr/sbin/nginx").exists()), "nginx not installed (apt; "
              "the bench runs with --no-install)"),
}


def missing(run: Run, quick: bool) -> str:
    needs = run.needs if not quick else tuple(n for n in run.needs if n not in ("redis", "lmcache", "nginx"))
    return "; ".join(why for n in needs for check, why in [NEEDS[n]] if not check())


def why_skip(run: Run, quick: bool) -> str:
    """Why this run does not run here ("" = it runs)."""
    if run.archived:
        return f"archived: {run.archived}"
    if quick and run.quick is None:
        return "no quick settings"
    if "add_arg(" not in (ROOT / "bench" / f"{run.script}.py").read_text():
        return f"bench/{run.script}.py does not write --results yet"
    return missing(run, quick)


# What every result depends on besides the code its bench imports: the dependency pins and the shipped docs.
ALWAYS = ("pyproject.toml", "kdn/data")
# The installed package's folders (pyproject.toml's package-dir): kdn.X lives in kdn/X unless mapped here.
PACKAGE_DIRS = {"kdn.origin": "origin", "kdn.edge": "edge", "kdn.kernels": "kernels", "kdn.adapters": "adapters",
                "kdn.service": "service", "kdn.up": "up"}
# kdn modules a file runs: ``import kdn...`` (lazy ones inside functions too) and module names in quotes
# (``-m kdn.cli``, vLLM's ``kv_connector_module_path``, the CLI's list of parts). A name in prose
# (a docstring's ``kdn.adapters.hf``) is not an import.
_KDN_NAME = re.compile(r"^\s*import\s+(kdn[\w.]*)|[\"'](kdn(?:\.\w+)+)[\"':]", re.M)
_KDN_COMMAND = re.compile(r"[\"']kdn[\"']\s*,")
_SCRIPT = re.compile(r"[\"'/](\w+)\.py[\"']")
_FROM_IMPORT = re.compile(r"^\s*from\s+(\.*[\w.]*)\s+import\s+(\([^)]*\)|[^\n#]*)", re.M)


def _module_path(module: str) -> Path:
    """Where ``module``'s file or package folder is (no suffix): ``kdn.adapters.hf.rag`` -> adapters/hf/rag."""
    for pkg, folder in PACKAGE_DIRS.items():
        if module == pkg or module.startswith(pkg + "."):
            return ROOT / folder / Path(*module[len(pkg) + 1:].split(".")) if module != pkg else ROOT / folder
    return ROOT / Path(*module.split("."))


def _module_files(module: str) -> list[Path]:
    """The files importing ``module`` runs: its own and each enclosing package's ``__init__.py`` (those that exist)."""
    parts = module.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        base = _module_path(".".join(parts[:i]))
        out += [f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()]
    return out


def _module_of(path: Path) -> str | None:
    """The dotted name of a repository file under the package (None: not part of it)."""
    rel = path.relative_to(ROOT).with_suffix("")
    folder = {v: k for k, v in PACKAGE_DIRS.items()}.get(rel.parts[0], "kdn" if rel.parts[0] == "kdn" else None)
    if folder is None:
        return None
    name = ".".join([folder, *rel.parts[1:]])
    return name.removesuffix(".__init__")


def _imports(path: Path, text: str) -> list[Path]:
    """The repository files ``path`` may import: bench/ and bench/lib/ modules by name (nothing in bench/
    imports tests/: tests/core/test_docs_agree.py), kdn modules by dotted name."""
    out: list[Path] = []
    for m in re.finditer(r"^\s*(?:from|import)\s+(\w+)", text, re.M):
        out += [d / f"{m.group(1)}.py" for d in (ROOT / "bench", ROOT / "bench" / "lib")
                if (d / f"{m.group(1)}.py").exists()]
    for m in _KDN_NAME.finditer(text):
        out += _module_files(m.group(1) or m.group(2))
    if _KDN_COMMAND.search(text):  # ["kdn", "origin", "serve", ...]: the console command is kdn.cli
        out += _module_files("kdn.cli")
    for m in _SCRIPT.finditer(text):  # a bench script run as its own process (serve_clients.py)
        out += [ROOT / "bench" / f"{m.group(1)}.py"] if (ROOT / "bench" / f"{m.group(1)}.py").exists() else []
    here = _module_of(path)
    for m in _FROM_IMPORT.finditer(text):
        mod, names = m.group(1), [n.split()[0] for n in m.group(2).strip("()").replace("\n", " ").split(",") if n.strip()]
        if mod.startswith("."):  # relative, inside the package
            if here is None:
                continue
            pkg = here if path.name == "__init__.py" else here.rpartition(".")[0]
            mod = importlib.util.resolve_name(mod, pkg)
        if mod != "kdn" and not mod.startswith("kdn."):
            continue
        out += _module_files(mod)
        for n in names:  # ``from kdn.format import address``: a submodule, if it is one
            out += _module_files(f"{mod}.{n}") if n != "*" else []
    return out


def _bench_sources(script: str) -> list[str]:
    """Every repository file the result of bench/SCRIPT.py measures: the script, the bench/ modules it
    imports, and the package modules any of them import, transitively."""
    seen: list[str] = []
    todo = [ROOT / "bench" / f"{script}.py"]
    while todo:
        path = todo.pop()
        rel = str(path.relative_to(ROOT))
        if rel in seen or not path.exists():
            continue
        seen.append(rel)
        todo += _imports(path, path.read_text())
    return seen


def stale(run: Run, results_dir: Path = RESULTS) -> str:
    """Why this run's result may not describe the code at HEAD ("" = current: no change since its commit)."""
    path = results_dir / f"{run.name}.json"
    if not path.exists():
        return "no result"
    data = json.loads(path.read_text())
    sha = (data.get("commit") or {}).get("sha")
    if data.get("imported") or not sha or len(sha) != 40:
        return "imported from the docs, no commit of its own"
    if data["commit"].get("dirty"):
        return f"run on a modified tree at {sha[:7]}"
    paths = [*ALWAYS, *_bench_sources(run.script)]
    out = subprocess.run(["git", "-C", str(ROOT), "diff", "--name-only", sha, "HEAD", "--", *paths],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return f"its commit {sha[:7]} is not in this repository"
    changed = out.stdout.split()
    if not changed:
        return ""
    more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
    return f"changed since {sha[:7]}: {', '.join(changed[:3])}{more}"


def execute(run: Run, out_dir: Path, quick: bool, timeout: float | None) -> tuple[str, float, str]:
    """(status, seconds, detail): status is ok, failed, timeout, skipped."""
    why = why_skip(run, quick)
    if why:
        return "skipped", 0.0, why
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"{run.name}.json"
    tmp = dest.with_name(dest.name + ".new")
    tmp.unlink(missing_ok=True)
    cmd = [sys.executable, "-P", f"bench/{run.script}.py", *(run.quick if quick else run.args), "--results", str(tmp)]
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{run.name}{'-quick' if quick else ''}.log"
    limit = timeout or (min(run.timeout, 900) if quick else run.timeout)
    print(f"== {run.name}: {' '.join(cmd[1:])}  (timeout {limit:.0f} s, log {log.relative_to(ROOT)})", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **run.env}, stdout=f, stderr=subprocess.STDOUT,
                                timeout=limit, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - t0, f"over {limit:.0f} s; see {log}"
    dt = time.perf_counter() - t0
    if rc != 0 or not tmp.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        tmp.unlink(missing_ok=True)
        return "failed", dt, f"exit {rc}{'' if tmp.exists() else ', no results'}; log {log}:\n{tail}"
    data = json.loads(tmp.read_text())
    data["run"] = run.name
    data["quick"] = quick
    if data.get("headline") and run.name not in HEADLINES:
        # a variant of a bench whose main run has the README row (ring-v160 beside ring): kept, not quoted
        data["headline_unquoted"], data["headline"] = data["headline"], None
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(dest)
    return "ok", dt, str(dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest)


# --- rendering ------------------------------------------------------------------------------------------------

MARK = re.compile(r"^<!-- bench:([A-Za-z0-9_.-]+):([A-Za-z0-9_.-]+):begin -->$")
HEAD_BEGIN, HEAD_END = "<!-- headlines:begin -->", "<!-- headlines:end -->"


class RenderError(Exception):
    pass


def load_results(results: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def _short(sha: str | None) -> str:
    return sha[:7] if sha else "unknown"


def machine_text(m: dict) -> str:
    if "description" in m:
        return m["description"]
    parts = [f"{m.get('cores')} cores ({m.get('cpu') or 'unknown CPU'})", f"{m.get('memory_gib')} GiB"]
    parts.append(", ".join(m["gpu"]) if m.get("gpu") else "no GPU")
    parts.append(f"Python {m.get('python')}")
    lb, la = m.get("load_before"), m.get("load_after")
    if lb and la:
        parts.append(f"load {lb[0]:.1f} before, {la[0]:.1f} after")
    return ", ".join(parts)


def meta_line(name: str, data: dict, doc: Path) -> str:
    rel = os.path.relpath(RESULTS / f"{name}.json", doc.parent)
    src = f"[`bench/results/{name}.json`]({rel})"
    imp = data.get("imported")
    kept = f"; kept as a record ({data['archived']}), not re-run" if data.get("archived") else ""
    if imp:
        c = data.get("commit") or {}
        at = f" (its commit: `{_short(c.get('sha'))}`)" if c.get("sha") else ""
        return (f"_Results: {src}, imported from this page at commit `{_short(imp['at_commit'])}`: the run{at} "
                f"predates `bench/run_all.py`; command and machine as stated here{kept}._")
    c = data.get("commit") or {}
    dirty = " + uncommitted changes" if c.get("dirty") else ""
    date = (data.get("started") or "")[:16].replace("T", " ")
    return (f"_Results: {src}: `{data['command']}` at commit `{_short(c.get('sha'))}`{dirty}, "
            f"{machine_text(data.get('machine') or {})}, {date} UTC, {data.get('seconds', 0):.0f} s._")


def _table(name: str, tid: str, results: dict[str, dict], doc: Path) -> str:
    if name not in results:
        raise RenderError(f"{doc.name}: no bench/results/{name}.json for its region {name}:{tid}")
    data = results[name]
    if data.get("quick"):
        raise RenderError(f"bench/results/{name}.json is a --quick run: not for the docs")
    if tid == "meta":
        return meta_line(name, data, doc)
    for t in data.get("tables", []):
        if t["id"] == tid:
            return t["markdown"]
    raise RenderError(f"{doc.name}: bench/results/{name}.json has no table {tid!r} "
                      f"(it has {', '.join(t['id'] for t in data.get('tables', []))})")


def headline_rows(results: dict[str, dict]) -> str:
    lines = ["| what | result | against |", "| --- | --- | --- |"]
    for name in HEADLINES:
        h = (results.get(name) or {}).get("headline")
        if not h:
            continue
        run = BY_NAME.get(name)
        script = f"bench/{run.script if run else results[name].get('bench', name)}.py"
        lines.append(f"| {h['what']} (`{script}`) | {h['result']} | {h['baseline']} |")
    return "\n".join(lines)


def render_text(text: str, doc: Path, results: dict[str, dict], used: set[tuple[str, str]] | None = None) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARK.match(line)
        if m or line == HEAD_BEGIN:
            end = f"<!-- bench:{m.group(1)}:{m.group(2)}:end -->" if m else HEAD_END
            try:
                j = lines.index(end, i + 1)
            except ValueError:
                raise RenderError(f"{doc.name}:{i + 1}: {line} has no {end}") from None
            inner = lines[i + 1:j]
            if any(MARK.match(x) or x == HEAD_BEGIN for x in inner):
                raise RenderError(f"{doc.name}:{i + 1}: nested regions")
            body = _table(m.group(1), m.group(2), results, doc) if m else headline_rows(results)
            if m and used is not None:
                used.add((m.group(1), m.group(2)))
            out += [line, body, end]
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def render(results_dir: Path = RESULTS, docs: list[Path] | None = None, write: bool = True) -> list[Path]:
    """Render every doc; returns the docs whose text changed (written unless ``write`` is false)."""
    results = load_results(results_dir)
    changed = []
    for doc in docs or DOCS:
        if not doc.exists():
            continue
        old = doc.read_text()
        new = render_text(old, doc, results)
        if new != old:
            changed.append(doc)
            if write:
                doc.write_text(new)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="runs: " + ", ".join(r.name for r in RUNS))
    ap.add_argument("--only", default="", help="comma list of runs")
    ap.add_argument("--skip", default="", help="comma list of runs")
    ap.add_argument("--quick", action="store_true", help="tiny settings (a smoke run); results go to --out, "
                    "never into the docs")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"where results go (default {RESULTS.relative_to(ROOT)}; --quick: "
                         f"{QUICK_OUT.relative_to(ROOT)})")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per bench (default: each run's own)")
    ap.add_argument("--render", action="store_true", help="only render the docs from bench/results")
    ap.add_argument("--check", action="store_true", help="only check the docs are what bench/results render")
    ap.add_argument("--no-render", action="store_true", help="do not render the docs after running")
    ap.add_argument("--list", action="store_true", help="list the runs, whether they can run here and whether "
                    "their result is current (no change to the code it measures since its commit)")
    ap.add_argument("--stale", action="store_true", help="run only the runs whose result is not current")
    args = ap.parse_args()

    if args.render or args.check:
        try:
            changed = render(write=not args.check)
        except RenderError as e:
            print(f"render: {e}", file=sys.stderr)
            return 2
        for d in changed:
            print(f"{'differs from its results' if args.check else 'rendered'}: {d.relative_to(ROOT)}")
        if args.check and changed:
            print("re-render with: python -P bench/run_all.py --render", file=sys.stderr)
        return 1 if args.check and changed else 0

    names = [n for n in args.only.split(",") if n] or [r.name for r in RUNS]
    skip = {n for n in args.skip.split(",") if n}
    unknown = [n for n in [*names, *skip] if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; runs: {', '.join(BY_NAME)}")
    runs = [BY_NAME[n] for n in names if n not in skip]
    if args.list:
        for r in runs:
            why = why_skip(r, args.quick)
            old = "" if r.archived else stale(r)
            print(f"{r.name:20} bench/{r.script}.py {' '.join(r.args)}" + (f"  [skipped here: {why}]" if why else "")
                  + (f"  [not current: {old}]" if old else ("" if r.archived else "  [current]")))
        return 0
    if args.stale:
        runs = [r for r in runs if not r.archived and stale(r)]
    out = args.out or (QUICK_OUT if args.quick else RESULTS)
    report = []
    for r in runs:
        status, dt, detail = execute(r, out, args.quick, args.timeout)
        print(f"   {r.name}: {status} ({dt:.0f} s) {detail}", flush=True)
        report.append((r.name, status, dt, detail.split("\n")[0]))
    print("\n| run | status | seconds | detail |\n| --- | --- | ---: | --- |")
    for name, status, dt, detail in report:
        print(f"| {name} | {status} | {dt:.0f} | {detail} |")
    rc = 1 if any(s in ("failed", "timeout") for _, s, _, _ in report) else 0
    if not args.quick and not args.no_render and out == RESULTS:
        try:
            for d in render():
                print(f"rendered: {d.relative_to(ROOT)}")
        except RenderError as e:
            print(f"render: {e}", file=sys.stderr)
            return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
