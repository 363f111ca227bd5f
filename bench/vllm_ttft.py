"""vLLM's time to first token: a KDN hit vs its own prefill vs its own prefix-cache hit.

    python -P bench/vllm_ttft.py [--models smollm2-135m,qwen2-0.5b-shape] [--lengths 2048,8192]
                                 [--repeat 3] [--suffix 16] [--plot docs/img/vllm_ttft.png]
                                 [--host-write staged|in_place]

Per model, on 127.0.0.1 in their own processes: an origin (transformers,
bf16, embedded ``file:`` registry) and one edge with a 2 GiB memory tier;
then one vLLM engine (CPU, bf16, in this process) with ``KDNConnector`` as
consumer pointed at the edge. Each context of L tokens is published once (not
timed) and read once through the engine, which fills the edge's memory tier.
Then, in rotating order per repeat, the time to the first token of
``context + suffix`` (``LLM.generate`` with one output token, no tokenizer):

- ``prefill``: the engine computes everything. Each request gets a fresh
  cache salt, so its prefix cache holds nothing for it: what prefix caching
  off computes (it is on only because the other two paths need it);
- ``local-hit``: vLLM's own prefix cache holds the context (the same salt
  as a warming request just before): the best any cache can do;
- ``kdn-hit``: a fresh salt and the connector: lookup on the edge, fetch and
  verify from its memory tier over HTTP, decode and write into the paged cache
  layer by layer, then the suffix (the request says ``"host": false``);
- ``host-hit``: the same, the pieces copied from the machine's host tier
  (``kdn host serve``, a process of its own, filled from the edge before the
  timed runs): lookup on the edge, one question to the host over its Unix
  socket, each piece leased and copied from the shared-memory mapping into the
  staging, then the layer writes. No socket body, no hash on the request path.

Both hits reuse the context's whole 128-token blocks and compute the rest.
The origin publishes ``--encodings`` (default ``zstd,raw``, both lossless):
the client picks per object by its measured link, which on loopback is raw
(no decode); ``--encodings zstd`` measures the default publish.
Models: SmolLM2-135M-Instruct (converted folder; the shipped docs as text) and
a Qwen2-0.5B-shaped random-init bf16 model (``bench/ttft.py`` builds it;
random ids). Prints a markdown table (medians and min-max), writes
``bench/work/vllm_ttft.json`` and a PNG. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))
import results as R  # noqa: E402
from ports import free_port  # noqa: E402  (bench/lib/ports.py: ports the kernel will not hand out)

PUBLISH_TOKEN = "bench-publisher-" + "p" * 24
PATHS = ("prefill", "local-hit", "kdn-hit", "host-hit")


def vllm_env() -> None:
    """vLLM's CPU build, in this process: set before vllm is imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # What vLLM's own multiprocess executor sets for its CPU workers (vllm/utils/ompmultiprocessing.py): Intel
    # OpenMP's threads spin 5 ms after a parallel region, not its default 200 ms, in which they would hold a
    # core that the engine's next step (and a KDN load) needs. The in-process engine here does not set it.
    os.environ.setdefault("KMP_BLOCKTIME", "5")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
        # Intel's OpenMP must be preloaded; restart once with it (LD_PRELOAD is read at exec).
        os.environ["LD_PRELOAD"] = f"{iomp}:{os.environ['LD_PRELOAD']}" if os.environ.get("LD_PRELOAD") else str(iomp)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


class Proc:
    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as f:
            self.p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "LD_PRELOAD": ""})

    def wait(self, url: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} not up after {timeout:.0f} s")

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)


def publish(origin: str, name: str, tokens: list[int] | None, encodings: list[str] | None = None, *,
            body: dict | None = None) -> dict:
    """Publish ``tokens`` (or what ``body`` names: text, standalone) and wait for the job's manifest."""
    def call(method: str, url: str, data: dict | None = None) -> dict:
        req = urllib.request.Request(url, method=method, data=json.dumps(data).encode() if data else None,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {PUBLISH_TOKEN}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    job = call("POST", f"{origin}/v1/publish", {"name": name, **({"tokens": tokens} if tokens is not None else {}),
                                                **({"encodings": encodings} if encodings else {}), **(body or {})})
    while True:
        job = call("GET", f"{origin}/v1/jobs/{job.get('job') or job['id']}")
        if job["state"] == "done":
            return job["manifest"]
        if job["state"] == "failed":
            raise RuntimeError(f"publish {name} failed: {job['error']}")
        time.sleep(0.2)


def model_inputs(name: str, lengths: list[int], suffix: int) -> tuple[str, list[int], list[int]]:
    """(weights folder, document ids, question ids) of a bench model."""
    import ttft  # bench/ttft.py: the same models and text as the transformers TTFT bench

    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.models import model_folder

    folder = str(ttft.qwen_folder()) if name == ttft.QWEN else str(model_folder(name, "bfloat16"))
    lm = load_model(folder if name == ttft.QWEN else name, dtype="bfloat16")
    doc, q = ttft.token_stream(name, lm, max(lengths), suffix)
    return folder, doc, q


def bench_model(name: str, lengths: list[int], repeat: int, suffix: int, log, encodings: list[str],
                host_write: str | None = None) -> list[dict]:
    folder, doc, q = model_inputs(name, lengths, suffix)
    max_pos = json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]
    # SmolLM2's context is 8192: its "8k" context is the largest whole-chunk one that leaves room for the suffix.
    lengths = [min(L, (max_pos - suffix) // 256 * 256) for L in lengths]
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-ttft-"))
    procs: list[Proc] = []
    rows = []
    try:
        (tmp / "tokens").write_text(PUBLISH_TOKEN + " admin *\n")
        registry = f"file:{tmp / 'registry.sqlite3'}"
        op, ep = free_port(), free_port()
        from kdn.registry.signing import Signer

        signer = Signer.generate(tmp / "origin.key")  # the host tier holds only what a trusted key signed
        (tmp / "trusted").write_text(signer.public + "\n")
        origin = Proc("origin", ["kdn", "origin", "serve", "--model", folder, "--dtype", "bfloat16", "--registry",
                                 registry, "--store", str(tmp / "store"), "--port", str(op), "--token-file",
                                 str(tmp / "tokens"), "--signing-key", str(tmp / "origin.key")], tmp / "origin.log")
        procs.append(origin)
        origin.wait(f"http://127.0.0.1:{op}/healthz")
        edge = Proc("edge", ["kdn", "edge", "serve", "--region", "bench", "--registry", registry, "--origin",
                             f"http://127.0.0.1:{op}", "--port", str(ep), "--mem-budget", "2GiB"], tmp / "edge.log")
        procs.append(edge)
        edge.wait(f"http://127.0.0.1:{ep}/healthz")
        sock, seg = str(tmp / "host.sock"), f"/dev/shm/kdn-vllm-ttft-{os.getpid()}.seg"
        host = Proc("host", ["kdn", "host", "serve", "--edge", f"http://127.0.0.1:{ep}", "--trusted-keys",
                             str(tmp / "trusted"), "--socket", sock, "--segment", seg, "--segment-bytes", "2GiB"],
                    tmp / "host.log")
        procs.append(host)
        host_up(host, sock)
        manifests = {}
        for L in lengths:
            t0 = time.perf_counter()
            manifests[L] = publish(f"http://127.0.0.1:{op}", f"ctx-{L}", doc[:L], encodings)
            log(f"[{name}] published {L} tokens in {time.perf_counter() - t0:.1f} s")

        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"host_write": host_write} if host_write else {}  # the connector's default where not named

        llm = LLM(model=folder, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=True, max_model_len=min(max_pos, max(lengths) + suffix + 64),
                  gpu_memory_utilization=0.3,
                  kv_transfer_config={"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                                      "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"edges": [f"http://127.0.0.1:{ep}"],
                                                                    "host": sock, **extra}})
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
        sched = scheduler_side(llm)

        def first_token(ids: list[int], load: bool, salt: str, host: bool = False) -> tuple[float, int, int]:
            sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params": {"kdn": {"load": load, "host": host}}})
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], sp, use_tqdm=False)[0]
            return (time.perf_counter() - t0) * 1e3, out.num_cached_tokens, out.outputs[0].token_ids[0]

        first_token(doc[:300], False, "warm")  # one-off engine costs out of the way
        for L in lengths:
            ids = doc[:L] + q
            first_token(ids, True, secrets.token_hex(4))  # fills the edge's memory tier from the origin
            warm_host(sock, manifests[L]["addresses"])  # the host tier, filled from the edge before the timed runs
            samples: dict[str, list[tuple[float, int, int]]] = {p: [] for p in PATHS}
            seen = {k: len(v) for k, v in phases_of(worker, sched).items()}  # the fill's load is not a hit's
            by_path: dict[str, dict[str, list[float]]] = {"kdn-hit": {}, "host-hit": {}}  # each load's phases
            for r in range(repeat):
                for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:
                    salt = secrets.token_hex(4)
                    if path == "local-hit":
                        first_token(doc[:L] + [q[0] ^ 1] + q[1:], False, salt)  # the same context, warm
                    was = {k: len(v) for k, v in phases_of(worker, sched).items()}
                    smp = first_token(ids, path in ("kdn-hit", "host-hit"), salt, host=path == "host-hit")
                    samples[path].append(smp)
                    if path in by_path:  # this request's load's phases (one entry each), apart from the other path's
                        for k, v in phases_of(worker, sched).items():
                            by_path[path].setdefault(k, []).extend(s * 1e3 for s in v[was.get(k, 0):])
                    log(f"[{name} L={L}] rep {r + 1} {path:9s} {smp[0]:9.1f} ms, {smp[1]} tokens reused")
            before = dict(worker.totals.data["bytes"])
            rows.append(summarize(name, L, suffix, samples, dict(worker.totals.data["tokens"])))
            rows[-1]["phases_ms"] = {k: [s * 1e3 for s in v[seen.get(k, 0):]] for k, v in phases_of(worker, sched).items()}
            rows[-1]["bytes_by_encoding_so_far"] = before
            rows[-1]["phases_by_path_ms"] = by_path
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def host_up(proc: Proc, sock: str, timeout: float = 60.0) -> None:
    """Wait until the host tier answers on its socket."""
    import asyncio

    from kdn.client.host import HostClient
    from kdn.wire.host import HostError

    async def once() -> bool:
        try:
            await (await HostClient(sock).connect()).close()
            return True
        except HostError:
            return False

    deadline = time.monotonic() + timeout
    while not asyncio.run(once()):
        if proc.p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the host tier did not come up:\n{proc.log.read_text()[-3000:]}")
        time.sleep(0.2)


def warm_host(sock: str, addresses: list[str]) -> None:
    """Fill the host tier with these objects (raw) from its edge, and check it holds them all."""
    import asyncio

    from kdn.client.host import HostClient

    async def go() -> None:
        async with HostClient(sock, timeout=300) as h:
            outcomes = await h.warm(addresses, "raw")
            assert set(outcomes) <= {"filled", "held"}, outcomes

    asyncio.run(go())


def scheduler_side(llm: Any) -> Any:
    """The connector's scheduler side in this in-process engine (None where vLLM keeps it elsewhere)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    conn = getattr(getattr(core, "scheduler", None), "connector", None)
    return getattr(conn, "sched", None)


def phases_of(worker: Any, sched: Any) -> dict[str, list[float]]:
    """Every load's seconds per phase so far (adapters/vllm/stats.py ``PHASES``): lookup from the scheduler's
    side, the rest from the worker's."""
    out = {k: list(v) for k, v in worker.totals.data.get("phases", {}).items()}
    if sched is not None:
        out["lookup"] = list(sched.totals.data.get("phases", {}).get("lookup", []))
    return out


def phase_table(rows: list[dict]) -> str:
    """Where a KDN hit's time goes (medians over the hits), beside the local hit that moves nothing."""
    def med(r: dict, k: str) -> float:
        v = r.get("phases_ms", {}).get(k, [])
        return statistics.median(v) if v else float("nan")

    out = ["| model | context | source | KDN hit ms | local hit ms | lookup ms | fetch ms (first request to last piece "
           "staged) | of which the forward waited ms | layer writes ms | rest ms (KDN hit - local hit - lookup - wait - "
           "writes) |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        P = r["paths"]
        local = P["local-hit"]["median"]
        for path, source in (("kdn-hit", "edge (HTTP)"), ("host-hit", "host tier")):
            if path not in P:
                continue
            got = r.get("phases_by_path_ms", {}).get(path)
            if got:
                lk, fe, st, wr = (statistics.median(got[k]) if got.get(k) else float("nan")
                                  for k in ("lookup", "fetch", "stall", "write"))
            else:
                lk, fe, st, wr = (med(r, k) for k in ("lookup", "fetch", "stall", "write"))
            hit = P[path]["median"]
            out.append(f"| {r['model']} | {r['length']:,} | {source} | {hit:,.0f} | {local:,.0f} | {lk:.1f} | {fe:.0f} "
                       f"| {st:.0f} | {wr:.0f} | {hit - local - lk - st - wr:.0f} |")
    return "\n".join(out)


def summarize(name: str, L: int, suffix: int, samples: dict, tiers: dict) -> dict:
    row = {"model": name, "length": L, "suffix": suffix, "tiers_so_far": tiers, "paths": {}}
    for p, v in samples.items():
        ms = [s[0] for s in v]
        row["paths"][p] = {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "all": ms,
                           "reused": sorted({s[1] for s in v}), "first_tokens": sorted({s[2] for s in v})}
    P = row["paths"]
    row["kdn_vs_local"] = P["kdn-hit"]["median"] / P["local-hit"]["median"]
    row["kdn_vs_local_worst"] = P["kdn-hit"]["max"] / P["local-hit"]["median"]
    row["prefill_vs_kdn"] = P["prefill"]["median"] / P["kdn-hit"]["median"]
    row["prefill_vs_kdn_worst"] = P["prefill"]["min"] / P["kdn-hit"]["max"]
    if "host-hit" in P:
        row["host_vs_local"] = P["host-hit"]["median"] / P["local-hit"]["median"]
        row["host_vs_local_worst"] = P["host-hit"]["max"] / P["local-hit"]["median"]
        row["prefill_vs_host"] = P["prefill"]["median"] / P["host-hit"]["median"]
    return row


def table(rows: list[dict]) -> str:
    def ms(st: dict) -> str:
        return f"{st['median']:,.0f} ({st['min']:,.0f}-{st['max']:,.0f})"

    out = ["| model | context | vLLM prefill ms | local prefix-cache hit ms | KDN hit ms (edge memory) | "
           "KDN / local (worst) | KDN hit ms (host tier) | host / local (worst) | prefill / KDN (worst) | "
           "prefill / host | tokens reused |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        P = r["paths"]
        if "host-hit" in P:
            host = f"{ms(P['host-hit'])} | {r['host_vs_local']:.2f}x ({r['host_vs_local_worst']:.2f}x)"
            pre_host = f"{r['prefill_vs_host']:.1f}x"
        else:
            host, pre_host = "- | -", "-"
        out.append(f"| {r['model']} | {r['length']:,} | {ms(P['prefill'])} | {ms(P['local-hit'])} | {ms(P['kdn-hit'])} "
                   f"| {r['kdn_vs_local']:.2f}x ({r['kdn_vs_local_worst']:.2f}x) | {host} "
                   f"| {r['prefill_vs_kdn']:.1f}x ({r['prefill_vs_kdn_worst']:.1f}x) | {pre_host} "
                   f"| {'/'.join(str(x) for x in P['kdn-hit']['reused'])} |")
    return "\n".join(out)


def headline(res: R.Results, rows: list[dict]) -> None:
    """The README row: at each model's longest context, a KDN hit against vLLM's own prefix-cache hit and prefill."""
    longest: dict[str, dict] = {}
    for r in rows:
        if r["model"] not in longest or r["length"] > longest[r["model"]]["length"]:
            longest[r["model"]] = r
    if not longest:
        return
    last = list(longest.values())
    names = " / ".join(r["model"] for r in last)
    lengths = sorted({r["length"] for r in last})
    at = "/".join(f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in lengths)
    local = [f"{r['kdn_vs_local']:.2f}x" for r in last]
    pre = [f"{r['prefill_vs_kdn']:.1f}x" for r in last]
    worst = [f"{r['prefill_vs_kdn_worst']:.1f}x" for r in last]
    met = "met" if all(r["kdn_vs_local"] <= 1.5 for r in last) else "**not met**"
    figures = local + pre + worst
    host = ""
    if all("host_vs_local" in r for r in last):
        hl = [f"{r['host_vs_local']:.2f}x" for r in last]
        hw = [f"{r['host_vs_local_worst']:.2f}x" for r in last]
        hmet = "met" if all(r["host_vs_local"] <= 1.2 for r in last) else "**not met**"
        host = (f"; from the machine's host tier (shared memory) **{' / '.join(hl)}** (worst {' / '.join(hw)}; "
                f"the <= 1.2x target is {hmet})")
        figures += hl + hw
    res.set_headline(
        f"vLLM (CPU) time to first token at {at} tokens, KDN hit from an edge's memory (HTTP) and from the host tier",
        f"**{' / '.join(local)}** ({names}) the time of vLLM's own prefix-cache hit, which moves no bytes "
        f"(the within-1.5x target is {met}){host}; from the edge {' / '.join(pre)} faster than vLLM's prefill "
        f"(worst {' / '.join(worst)})",
        "vLLM's own local prefix-cache hit (no bytes moved); and vLLM's prefill, same run",
        [{"shown": x, "table": "main", "cell": x} for x in dict.fromkeys(figures)])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']}\n{r['length']:,} tokens" for r in rows]
    width = 0.27
    for i, p in enumerate(PATHS):
        ys = [r["paths"][p]["median"] for r in rows]
        lo = [r["paths"][p]["median"] - r["paths"][p]["min"] for r in rows]
        hi = [r["paths"][p]["max"] - r["paths"][p]["median"] for r in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], ys, width, yerr=[lo, hi], label=p, capsize=2)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, ms (log)")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_title("vLLM (CPU): KDN hit vs own prefill vs own prefix-cache hit")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def machine() -> str:
    import torch
    import vllm

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, vLLM {vllm.__version__} (CPU)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2-0.5b-shape")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "vllm_ttft.png"))
    ap.add_argument("--json", default=str(WORK / "vllm_ttft.json"))
    ap.add_argument("--encodings", default="zstd,raw",
                    help="encodings the origin publishes; the client picks by measured link (raw on loopback)")
    ap.add_argument("--host-write", choices=("staged", "in_place"), default=None,
                    help="the connector's host_write setting (default: the connector's own default)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one model, rows to this file
    ap.add_argument("--no-headline", action="store_true", help="no README headline (a variant run)")
    R.add_arg(ap)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_all:7.1f}s {msg}", flush=True)

    if args.one:
        vllm_env()
        rows = bench_model(args.models, lengths, args.repeat, args.suffix, log, args.encodings.split(","),
                           args.host_write)
        Path(args.one).write_text(json.dumps(rows))
        return 0
    res = R.Results("vllm_ttft", args)
    rows = []
    for m in [m.strip() for m in args.models.split(",") if m.strip()]:
        # One process per model: a vLLM engine is a process-wide thing (its connector, its threads).
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, "-P", __file__, "--one", f.name, "--models", m, "--lengths", args.lengths,
                            "--repeat", str(args.repeat), "--suffix", str(args.suffix), "--encodings", args.encodings,
                            *(["--host-write", args.host_write] if args.host_write else [])],
                           check=True)
            rows += json.loads(Path(f.name).read_text())
    print()
    print(f"Machine: {machine()}")
    print(f"Command: python -P bench/vllm_ttft.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print()
    res.table("main", table(rows))
    if all("phases_ms" in r for r in rows):
        res.table("phases", phase_table(rows))
    if not args.no_headline:
        headline(res, rows)
    res.extra["rows"] = rows
    res.write()
    if args.json:
        WORK.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
