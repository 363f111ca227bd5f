"""vLLM on the CPU: a host-tier hit with its layers written inside the forward's wait, against the same hit
written by threads ahead of the forward (the connector's ``write_threads``, ``adapters/vllm/ahead.py``).

    python -P bench/vllm_write_ahead.py [--models smollm2-135m,qwen2-0.5b-shape] [--length 8192] [--repeat 8]
                                        [--threads 2]

The world of ``bench/vllm_ttft.py`` (an origin, an edge, a ``kdn host serve`` filled before the timed runs, one
vLLM engine in this process with the connector), one model per process. Per repeat, in rotating order: vLLM's
own local prefix-cache hit (the bound: it moves no bytes) and a host-tier hit; the host hits alternate between
the two ways of writing, switched on the engine's worker between requests, so both meet the same machine state.
Per way: the time to the first token (median, min-max), and from the connector's own phases the time the
forward waited for the load (inline: the wait for its pieces plus every layer's writes; ahead: the waits for
the writers' marks) and the writers' own time (writer 0's, beside the forward).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import results as R  # noqa: E402
import vllm_ttft as V  # noqa: E402

WAYS = ("inline", "ahead")


def bench_model(name: str, length: int, repeat: int, threads: int) -> dict:
    """One model's rows: the local hits and each way's host hits and phases."""
    from kdn.adapters.vllm import worker as W
    from kdn.adapters.vllm.ahead import WriteAhead

    ways: list[str] = []  # the way of each load the worker started, in order
    loads: list[tuple[str, float, float]] = []  # (way, forward's wait ms, writer ms) per accounted load
    start, account = W.WorkerSide.start, W.WorkerSide._account
    ahead: dict[int, WriteAhead] = {}

    def started(self, meta):  # type: ignore[no-untyped-def]
        if meta.loads:
            way = WAYS[len(ways) % 2]
            self._ahead = ahead.setdefault(id(self), WriteAhead(threads)) if way == "ahead" else None
            ways.append(way)
        return start(self, meta)

    def accounted(self, run):  # type: ignore[no-untyped-def]
        inline = self._ahead is None
        loads.append((ways[-1], (run.stall + (run.write if inline else 0.0)) * 1e3, run.write * 1e3))
        return account(self, run)

    W.WorkerSide.start, W.WorkerSide._account = started, accounted  # type: ignore[method-assign]
    V.PATHS = ("local-hit", "host-hit")
    times: dict[str, list[float]] = {"local-hit": [], "inline": [], "ahead": []}
    hits: list[tuple[str, float, float]] = []  # the loads of the timed host hits (not the fills before them)
    ran = [length]

    def log(msg: str) -> None:
        print(msg, flush=True)
        at = re.search(r"L=(\d+)\]", msg)
        if at:  # the context vllm_ttft ran (a model's context may hold fewer tokens than asked)
            ran[0] = int(at.group(1))
        m = re.search(r"rep \d+ (\S+)\s+([\d.]+) ms", msg)
        if m:
            times["local-hit" if m.group(1) == "local-hit" else ways[-1]].append(float(m.group(2)))
            if m.group(1) == "host-hit" and loads:
                hits.append(loads[-1])

    try:
        V.bench_model(name, [length], repeat, 16, log, ["zstd", "raw"])
    except KeyError:  # (vllm_ttft's summary wants its other paths: the samples are in hand)
        pass
    row: dict = {"model": name, "length": ran[0], "threads": threads,
                 "paths": {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
                           for k, v in times.items() if v}}
    for way in WAYS:
        mine = [x for x in hits if x[0] == way]
        row[way] = {"waited_ms": statistics.median(x[1] for x in mine) if mine else None,
                    "writer_ms": statistics.median(x[2] for x in mine) if mine else None}
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | context | local prefix-cache hit ms | host hit, writes in the forward's wait: ms | "
           "the forward waited ms | host hit, writer threads ahead: ms | the forward waited ms | writers' own ms "
           "| ahead / inline |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        P = r["paths"]

        def ms(k: str) -> str:
            return f"{P[k]['median']:,.0f} ({P[k]['min']:,.0f}-{P[k]['max']:,.0f})"

        def of(way: str, k: str) -> str:
            v = r[way][k]
            return "-" if v is None else f"{v:.0f}"

        out.append(f"| {r['model']} | {r['length']:,} | {ms('local-hit')} | {ms('inline')} | {of('inline', 'waited_ms')} "
                   f"| {ms('ahead')} | {of('ahead', 'waited_ms')} | {of('ahead', 'writer_ms')} | "
                   f"{P['ahead']['median'] / P['inline']['median']:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2-0.5b-shape")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="writer threads of the ahead way")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one model, its row to this file
    R.add_arg(ap)
    args = ap.parse_args(argv)
    if args.one:
        V.vllm_env()
        Path(args.one).write_text(json.dumps(bench_model(args.models, args.length, args.repeat, args.threads)))
        return 0
    res = R.Results("vllm_write_ahead", args)
    rows, t0 = [], time.perf_counter()
    for m in [m.strip() for m in args.models.split(",") if m.strip()]:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:  # one process per engine
            subprocess.run([sys.executable, "-P", __file__, "--one", f.name, "--models", m, "--length",
                            str(args.length), "--repeat", str(args.repeat), "--threads", str(args.threads)],
                           check=True)
            rows.append(json.loads(Path(f.name).read_text()))
    print(f"\nMachine: {V.machine()}; {time.perf_counter() - t0:.0f} s\n")
    res.table("main", table(rows))
    res.extra["rows"] = rows
    res.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
