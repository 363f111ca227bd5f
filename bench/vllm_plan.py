"""vLLM with the load planner over an edge link that turns slow, then recovers: never (for long) slower than computing.

    python -P bench/vllm_plan.py [--model smollm2-135m] [--length 2048] [--mbit auto] [--slow 6]

On 127.0.0.1, in their own processes: an origin (transformers, bf16, ``zstd``
and ``raw``) and one edge with a memory tier; in front of the edge a user-space
link emulator (``bench/lib/linkemu.py``, in a process of its own; no ``tc netem`` here); then one vLLM
engine (CPU, bf16, in this process) with ``KDNConnector`` as consumer, the
load planner on (its default). The context of ``--length`` tokens is
published once and read once through the engine (filling the edge's memory).
Then, each request the context plus a 16-token suffix, a fresh cache salt,
one output token, its time to first token (TTFT) and the planner's choice:

1. ``fast``: the link unlimited (loopback): the planner loads;
2. ``slow``: the link cut to ``--mbit`` (2 ms each way; ``auto``: the rate at
   which the context's wire bytes take ``SLOW_X`` = 3 times vLLM's prefill of
   the prompt, measured just before, so that the contrast is the same on a
   fast CPU and a slow one: 40 Mbit on the AVX2 EPYC this bench first ran on,
   whose prefill took 3 s): ``--slow`` requests
   with the planner; then the baselines on the same slow link: the connector
   without a planner (``"plan": false``: it loads whatever is published), and
   vLLM's own prefill (``"load": false``);
3. ``recovered``: the link unlimited again; once the planner's last load
   measurement is ``PROBE_AFTER_S`` old, requests until it loads everything
   again (first a probe: the request computes while one chunk is fetched
   beside it, off the request path).

The bound of every row is vLLM's prefill of the same prompt, measured in the
same run. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import statistics
import sys
import select
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))
import results as R  # noqa: E402
import vllm_ttft as V  # noqa: E402  (its processes, publish and model inputs)
from linkemu import LinkEmulator  # noqa: E402
from ports import free_port  # noqa: E402

SLOW_X = 3.0  # --mbit auto: the slow link moves the context's bytes in this many prefills


class Link:
    """A LinkEmulator in its own process, steered over its stdin. In this process its pacing shared the GIL
    with the engine under test (vLLM's engine core runs here): while a given-up load's bytes or a probe drained
    through it, vLLM's own prefill ran 10-30% slower, a cost of the bench, not of the system."""

    def __init__(self, target_port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", __file__, "--link-child", str(target_port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._answer()
        if not line.startswith("url "):
            self.close()
            raise RuntimeError(f"the link emulator did not start: {line!r}")
        self.url = line.split(" ", 1)[1]

    def _answer(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else ""

    def set(self, delay_ms: float, mbit: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"set {delay_ms} {mbit}\n")
        self.proc.stdin.flush()
        if self._answer() != "ok":
            raise RuntimeError("the link emulator did not take its new profile")

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)


def link_child(target_port: int) -> int:
    """The emulator's process (``Link``): one shared bottleneck to 127.0.0.1:``target_port``; ``set D M`` and
    ``quit`` on stdin, one answer line each."""

    async def serve() -> None:
        emu = LinkEmulator(0, "127.0.0.1", target_port, delay_ms=0, mbit=0, shared=True)
        await emu.start()
        print(f"url {emu.url}", flush=True)
        loop = asyncio.get_running_loop()
        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                words = line.split()
                if not words or words[0] == "quit":
                    return
                if words[0] == "set" and len(words) == 3:
                    emu.set_profile(float(words[1]), float(words[2]))
                    print("ok", flush=True)
        finally:
            await emu.stop()

    asyncio.run(serve())
    return 0


def run(args, log) -> dict:
    folder, doc, q = V.model_inputs(args.model, [args.length], 16)
    L = args.length
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-plan-"))
    procs: list[V.Proc] = []
    link = None
    try:
        (tmp / "tokens").write_text(V.PUBLISH_TOKEN + " admin *\n")
        registry = f"file:{tmp / 'registry.sqlite3'}"
        op, ep = free_port(), free_port()
        origin = V.Proc("origin", ["kdn", "origin", "serve", "--model", folder, "--dtype", "bfloat16", "--registry",
                                   registry, "--store", str(tmp / "store"), "--port", str(op), "--token-file",
                                   str(tmp / "tokens")], tmp / "origin.log")
        procs.append(origin)
        origin.wait(f"http://127.0.0.1:{op}/healthz")
        edge = V.Proc("edge", ["kdn", "edge", "serve", "--region", "bench", "--registry", registry, "--origin",
                               f"http://127.0.0.1:{op}", "--port", str(ep), "--mem-budget", "2GiB"], tmp / "edge.log")
        procs.append(edge)
        edge.wait(f"http://127.0.0.1:{ep}/healthz")
        V.publish(f"http://127.0.0.1:{op}", "ctx", doc[:L], ["zstd", "raw"])
        link = Link(ep)
        log(f"published {L} tokens; link emulator on {link.url}")

        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=folder, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=True, max_model_len=L + 16 + 64, gpu_memory_utilization=0.3,
                  kv_transfer_config={"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                                      "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"edges": [link.url]}})
        planner = llm.llm_engine.engine_core.engine_core.scheduler.connector.sched.planner
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker  # what the loads really did (vLLM counts a failed load as reused)
        from kdn.planner import PROBE_AFTER_S

        ids = doc[:L] + q
        rows: list[dict] = []

        def request(phase: str, kdn: dict) -> dict:
            before = dict(planner.reasons.counts)
            loaded0 = planner.reasons.tokens_loaded
            got0 = sum(worker.totals.data["tokens"].values())
            late0 = worker.totals.data["failures"].get("timeout", 0)
            sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params": {"kdn": kdn}})
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=secrets.token_hex(4))], sp,
                               use_tqdm=False)[0]
            ms = (time.perf_counter() - t0) * 1e3
            chose = [k for k, v in planner.reasons.counts.items() if v > before.get(k, 0)]
            row = {"phase": phase, "kdn": kdn, "ttft_ms": ms, "reused": out.num_cached_tokens,
                   "choice": chose[0] if chose else ("off" if kdn.get("load") is False else "no planner"),
                   "planned_tokens": planner.reasons.tokens_loaded - loaded0, "first_token": out.outputs[0].token_ids[0],
                   "loaded": sum(worker.totals.data["tokens"].values()) - got0,
                   "given_up": worker.totals.data["failures"].get("timeout", 0) - late0,
                   "load_bps": planner.speeds.load_bps}
            rows.append(row)
            log(f"{phase:9s} {json.dumps(kdn):28s} {ms:9.1f} ms  loaded {row['loaded']:5d}  given up "
                f"{row['given_up']}  {row['choice']}  (load speed now {(row['load_bps'] or 0) / 1e6:.0f} MB/s)")
            return row

        request("warm", {"load": False})  # one-off engine costs; a prefill times the engine's steps
        prefill_ms = request("warm", {"load": False})["ttft_ms"]
        wire0 = sum(worker.totals.data["bytes"].values())
        request("warm", {"plan": False})  # fills the edge's memory tier from the origin
        wire = sum(worker.totals.data["bytes"].values()) - wire0  # the context's bytes, as the client fetches them
        for _ in range(3):
            request("fast", {})
        mbit = (wire * 8 / (SLOW_X * prefill_ms / 1e3) / 1e6 if args.mbit == "auto" else float(args.mbit))
        log(f"slow link: {mbit:.1f} Mbit for {wire / 1e6:.1f} MB: {wire * 8 / (mbit * 1e6):.1f} s against a "
            f"{prefill_ms / 1e3:.1f} s prefill")
        link.set(2, mbit)
        for _ in range(args.slow):
            request("slow", {})
        for _ in range(2):
            request("slow-noplan", {"plan": False})
        for _ in range(3):
            request("prefill", {"load": False})
        link.set(0, 0)
        last = planner.speeds.last_load or time.monotonic()
        wait = max(0.0, last + PROBE_AFTER_S + 0.5 - time.monotonic())
        log(f"link restored; {wait:.0f} s until the planner's last measurement is stale")
        time.sleep(wait)
        for _ in range(4):
            r = request("recovered", {})
            if r["choice"] == "load" and r["loaded"] >= L - 128:
                break
        return {"rows": rows, "length": L, "mbit": mbit, "wire_bytes": wire, "model": args.model,
                "probe_after_s": PROBE_AFTER_S, "planner": {"counts": planner.reasons.counts}}
    finally:
        if link is not None:
            link.close()
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def tables(res: R.Results, out: dict) -> None:
    rows = out["rows"]
    prefill = statistics.median(r["ttft_ms"] for r in rows if r["phase"] == "prefill")
    lines = ["| phase | request | planner's choice | tokens loaded | load given up | TTFT ms | TTFT / vLLM prefill |",
             "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
    n: dict[str, int] = {}
    for r in rows:
        if r["phase"] == "warm":
            continue
        n[r["phase"]] = n.get(r["phase"], 0) + 1
        what = {"slow-noplan": "slow, no planner (`plan: false`)", "prefill": "slow, vLLM prefill (`load: false`)"}
        lines.append(f"| {what.get(r['phase'], r['phase'])} | {n[r['phase']]} | {r['choice']} | {r['loaded']:,} "
                     f"| {'yes' if r['given_up'] else ''} | {r['ttft_ms']:,.0f} | {r['ttft_ms'] / prefill:.2f}x |")
    res.table("main", "\n".join(lines))

    def stat(phase: str) -> tuple[float, float]:
        v = [r["ttft_ms"] for r in rows if r["phase"] == phase]
        return statistics.median(v), max(v)

    slow, noplan = stat("slow"), stat("slow-noplan")
    # A probe computes too (its chunk is fetched beside the request): it counts among the computed ones.
    settled = [r["ttft_ms"] for r in rows if r["phase"] == "slow" and r["choice"] in ("compute", "probe")]
    spoiled = sum(1 for r in rows if r["phase"] == "slow" and r["choice"] not in ("compute", "probe"))
    summary = ["| over the slow link | median TTFT ms | worst TTFT ms | median / prefill |",
               "| --- | ---: | ---: | ---: |",
               f"| vLLM prefill (the bound) | {prefill:,.0f} | {stat('prefill')[1]:,.0f} | 1.00x |",
               f"| KDN, planner on: all {len(settled) + spoiled} requests | {slow[0]:,.0f} | {slow[1]:,.0f} "
               f"| {slow[0] / prefill:.2f}x |",
               f"| KDN, planner on: once it computes (probes included, {len(settled)} requests) | "
               + (f"{statistics.median(settled):,.0f} | {max(settled):,.0f} | {statistics.median(settled) / prefill:.2f}x |"
                  if settled else "- | - | - |"),
               f"| KDN without a planner (`plan: false`) | {noplan[0]:,.0f} | {noplan[1]:,.0f} "
               f"| {noplan[0] / prefill:.2f}x |"]
    res.table("summary", "\n".join(summary))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--mbit", default="auto",
                    help="the slow link's bandwidth, each way (auto: the context's bytes take 3x the prefill)")
    ap.add_argument("--slow", type=int, default=6, help="requests with the planner over the slow link")
    ap.add_argument("--json", default=str(V.WORK / "vllm_plan.json"))
    R.add_arg(ap)
    args = ap.parse_args(argv)
    V.vllm_env()
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_all:7.1f}s {msg}", flush=True)

    res = R.Results("vllm_plan", args)
    out = run(args, log)
    print(f"\nMachine: {V.machine()}\n")
    tables(res, out)
    res.extra.update(out)
    res.write()
    if args.json:
        V.WORK.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--link-child"]:
        sys.exit(link_child(int(sys.argv[2])))
    sys.exit(main())
