"""Several engines on one machine, one host tier: bytes held once, and an engine restart that finds its knowledge.

    python -P bench/host_share.py [--model smollm2-135m] [--tokens 8192] [--engines 1,2,4] [--repeat 3]

An origin (signing) and one edge (memory tier) as processes on 127.0.0.1, a context of ``--tokens`` published
``raw``, and the machine's host tier (``kdn host serve``, a process of its own) filled from the edge. Then:

- **bytes held once**: N engine processes (a small script each: ``HostClient``, a lease per object, each object
  copied from the read-only mapping into the engine's own buffer, the cache's stand-in) load the whole context
  at once. Per engine, from ``/proc/PID/smaps_rollup`` while it holds its leases: the segment's pages it has
  mapped (shared: the same physical pages for every engine) and its own private memory; beside them the host's
  held bytes. The bound: N engines each holding their own copy would hold N x the context.
- **an engine restart**: an engine process exits and a new one starts; the time from its start to the context
  copied into its buffer, reading from the host tier (still filled: nothing to fetch again) and, for the
  baseline, from the edge over HTTP (``KDNClient.fetch``, verified: what an engine without a host tier does).
  Both include the interpreter's start and imports (what a restarted engine pays), and the bound is a memcpy of
  the same bytes in the same run.

Writes ``bench/work/host_share.json``; ``--results`` for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import datapath as D  # noqa: E402  (start_host, connect_host)
import results as R  # noqa: E402
import ttft as T  # noqa: E402  (server processes, publish, model helpers)

# One engine, as a process of its own: load every object from the host (or the edge), copy it into a buffer of
# its own, print its timings and memory while it still holds what it loaded, then wait for a line on stdin.
ENGINE = r'''
import asyncio, json, sys, time
t_start = float(sys.argv[1])
mode, where, addresses = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
import numpy as np

def smaps():
    """The process's memory (smaps_rollup), and what its mappings of files in /dev/shm (the segment) hold."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if v.strip().endswith("kB"):
                out[k.strip()] = int(v.split()[0]) * 1024
    seg, inside = {"Rss": 0, "Shared_Clean": 0, "Private_Clean": 0}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[5].startswith("/dev/shm/")
            elif inside and head and head[0].rstrip(":") in seg:
                seg[head[0].rstrip(":")] += int(head[1]) * 1024
    out["segment"] = seg
    return out

async def main():
    loaded = 0
    t0 = time.time()
    if mode == "host":
        from kdn.client.host import HostClient
        async with HostClient(where) as host:
            found = await host.lookup(addresses)
            assert found.prefix == len(addresses), found
            sizes = []
            bufs = []
            for a in addresses:
                async with host.lease(a, "raw") as obj:
                    buf = np.empty(len(obj.view), dtype=np.uint8)  # the engine's own memory (the cache's stand-in)
                    np.copyto(buf, np.frombuffer(obj.view, dtype=np.uint8))
                    bufs.append(buf)
                    loaded += len(obj.view)
            t1 = time.time()
            mem = smaps()  # (the mapping is still open: its pages count as this process's shared memory)
    else:
        from kdn.client import KDNClient
        async with KDNClient(edges=[where], max_hedges=0) as client:
            bufs = []
            for a in addresses:
                f = await client.fetch(a, encoding="raw")
                buf = np.empty(len(f.blob), dtype=np.uint8)
                np.copyto(buf, np.frombuffer(f.blob, dtype=np.uint8))
                bufs.append(buf)
                loaded += len(f.blob)
            t1 = time.time()
            mem = smaps()
    print(json.dumps({"start_to_loaded_s": t1 - t_start, "load_s": t1 - t0, "bytes": loaded, "mem": mem}), flush=True)
    sys.stdin.readline()  # hold what it loaded until told to go

asyncio.run(main())
'''


def spawn_engine(mode: str, where: str, addresses: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-c", ENGINE, repr(time.time()), mode, where, json.dumps(addresses)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def read_engine(p: subprocess.Popen, timeout: float = 300) -> dict:
    line = p.stdout.readline() if p.stdout else ""
    if not line:
        p.wait(timeout)
        raise RuntimeError(f"an engine process exited with {p.returncode}")
    return json.loads(line)


def finish(p: subprocess.Popen) -> None:
    if p.stdin:
        p.stdin.write("\n")
        p.stdin.flush()
    p.wait(60)


async def run(args) -> dict:
    import aiohttp
    import numpy as np

    from kdn.adapters.hf import load_model

    spec = T.model_spec(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-host-share-"))
    procs = []
    out: dict = {"model": args.model, "tokens": args.tokens}
    try:
        origin, edge = D.start_world(tmp, spec, procs)
        host_proc = D.start_host(tmp, edge.url)
        procs.append(host_proc)
        lm = load_model(spec)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-1" in (b.get("ring") or []))
            doc, _ = T.token_stream(args.model, lm, args.tokens, 16)
            man = await T.publish(s, origin.url, "host-share", doc[:args.tokens], encodings=["raw"])
        addresses = man["addresses"]
        host = await D.connect_host(host_proc, str(tmp / "host.sock"))
        try:
            assert set(await host.warm(addresses, "raw")) <= {"filled", "held"}
            held = (await host.stats())
        finally:
            await host.close()
        sock = str(tmp / "host.sock")
        for _ in range(2):  # the edge's memory tier holds every object (the baseline reads it warm)
            for p in [spawn_engine("edge", edge.url, addresses)]:
                read_engine(p)
                finish(p)
        out["held"] = held
        out["sharing"] = []
        for n in args.engines:
            engines = [spawn_engine("host", sock, addresses) for _ in range(n)]
            got = [read_engine(p) for p in engines]  # every engine holds its load now
            for p in engines:
                finish(p)
            out["sharing"].append({"engines": n, "per_engine": got})
            print(f"[{n} engines] " + ", ".join(
                f"segment mapped {g['mem']['segment']['Rss'] / 1e6:.0f} MB, private {g['mem'].get('Private_Dirty', 0) / 1e6:.0f} MB"
                for g in got), flush=True)
        joined = np.random.default_rng(0).integers(0, 256, sum(g["bytes"] for g in got[:1]), dtype=np.uint8)
        dst = np.empty_like(joined)
        restart: dict[str, list[float]] = {"host": [], "edge": [], "memcpy": []}
        for r in range(args.repeat):
            for mode in (("host", "edge") if r % 2 == 0 else ("edge", "host")):
                p = spawn_engine(mode, sock if mode == "host" else edge.url, addresses)
                g = read_engine(p)
                finish(p)
                restart[mode].append(g["start_to_loaded_s"])
                restart.setdefault(f"{mode}-load", []).append(g["load_s"])
            t0 = time.perf_counter()
            np.copyto(dst, joined)
            restart["memcpy"].append(time.perf_counter() - t0)
            print(f"[restart {r + 1}] host {restart['host'][-1] * 1e3:.0f} ms, edge {restart['edge'][-1] * 1e3:.0f} ms",
                  flush=True)
        out["restart"] = restart
        out["bytes"] = got[0]["bytes"]
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tables(out: dict) -> tuple[str, str]:
    nbytes, held = out["bytes"], out["held"]["used_bytes"]
    share = ["| engines | context MB | the host tier holds MB (one copy) | per engine: the segment's pages it maps (read "
             "in place, shared with the host and every engine) MB | per engine: private MB (its own cache copy and the process) | without a host tier: "
             "copies of the context outside the engines' caches |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in out["sharing"]:
        n = row["engines"]
        shared = statistics.median(g["mem"]["segment"]["Rss"] for g in row["per_engine"])
        private = statistics.median(g["mem"].get("Private_Clean", 0) + g["mem"].get("Private_Dirty", 0)
                                    for g in row["per_engine"])
        share.append(f"| {n} | {nbytes / 1e6:.0f} | {held / 1e6:.0f} | {shared / 1e6:.0f} | {private / 1e6:.0f} "
                     f"| {n} (each engine's receive buffer, gone at its exit) |")
    rs = out["restart"]

    def ms(v: list[float]) -> str:
        return f"{statistics.median(v) * 1e3:.0f} ({min(v) * 1e3:.0f}-{max(v) * 1e3:.0f})"

    restart = ["| model | context MB | restarted engine to context loaded, from the host tier: ms (min-max) | "
               "of which the load ms | the same from the edge (HTTP): ms | of which the load ms | edge / host | "
               "bound: memcpy of the bytes ms |",
               "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratio = statistics.median(rs["edge"]) / statistics.median(rs["host"])
    restart.append(f"| {out['model']} | {nbytes / 1e6:.0f} | {ms(rs['host'])} | {ms(rs['host-load'])} | {ms(rs['edge'])} "
                   f"| {ms(rs['edge-load'])} | {ratio:.2f}x | {ms(rs['memcpy'])} |")
    return "\n".join(share), "\n".join(restart)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench" / "work" / "host_share.json"))
    R.add_arg(ap)
    args = ap.parse_args()
    args.engines = [int(x) for x in args.engines.split(",")]
    res = R.Results("host_share", args)
    out = asyncio.run(run(args))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    share, restart = tables(out)
    res.table("sharing", share)
    res.table("restart", restart)
    res.extra["raw"] = out
    res.write()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
