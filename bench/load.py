"""Load and soak on a real trace: the Mooncake conversation trace replayed, time-compressed, against two
regions of edges whose tier budgets are below the working set.

    python -P bench/load.py                                  # 60 s, up to 200 clients, 5 trace minutes at 5x
    python -P bench/load.py --duration 600 --plot docs/img/soak.png   # the 10-minute soak
    python -P bench/load.py --speedup 0 --clients 200        # closed loop: every client as fast as it can

Every process is real and on 127.0.0.1 (bench/faultlib.World: etcd, an origin, 2 regions x 2 edges).
Objects: each 512-token block id of the trace is two chunk objects of ``--object-kib`` KiB (bytes
derived from the address, digests known to the readers); they are written into the origin's store and
recorded in the registry before the run, as an engine saving through its connector would. A request
fetches its whole prefix chain through one edge of its region (regions alternate), up to 4 objects at
a time, and checks every body's BLAKE3. Requests start at their trace time divided by ``--speedup`` and
wait for a free client (at most ``--clients`` in flight); the trace loops if the run outlasts it.

Measured: per edge, RSS against its memory budget and open file descriptors (sampled each second);
errors (goal 0); wrong bytes (goal 0); p50/p99 object and request latency; hits by source (the
``X-KDN-Source`` header); origin egress; registry operations per second (etcd's gRPC counter). A PNG
of RSS and p99 over time with ``--plot``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp
from blake3 import blake3

_here = Path(__file__).resolve().parent
if str(_here) not in sys.path:
    sys.path.insert(0, str(_here))

import faultlib as F  # noqa: E402
import results as R  # noqa: E402

TRACE = _here / "traces" / "mooncake_conversation_trace.jsonl"
CHUNK = 256


def load_trace(minutes: float) -> list[dict]:
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["timestamp"] < minutes * 60_000 and r["hash_ids"]]


def chunk_address(block: int, half: int) -> str:
    return blake3(f"kdn-load/{block}/{half}".encode()).hexdigest()


def blob_of(address: str, size: int, parent: str | None = None, start: int = 0) -> bytes:
    """A KV object as an origin writes it (its header names its namespace, which the origin serves it by),
    holding one tensor of ``size`` bytes derived from the address: a bare run of bytes is served by no
    origin."""
    from kdn.format.objects import RawTensor, encode_object

    data = blake3(bytes.fromhex(address)).digest(length=size)
    return encode_object(kind="kv", address=address, model_id="0" * 64, namespace="public", start=start,
                         end=start + CHUNK, position=start, parent=parent,
                         tensors={"L0.k": RawTensor("L0.k", "U8", (size,), data)}, encoding="zstd",
                         codec_for=lambda t: "raw")


def chains(trace: list[dict]) -> tuple[dict[str, tuple[str | None, int]], list[list[str]]]:
    """Every chunk (its parent and start), and each request's chain of chunk addresses."""
    objects: dict[str, tuple[str | None, int]] = {}
    per_request = []
    for r in trace:
        chain, parent = [], None
        for i, b in enumerate(r["hash_ids"]):
            for half in (0, 1):
                a = chunk_address(b, half)
                objects.setdefault(a, (parent, (2 * i + half) * CHUNK))
                chain.append(a)
                parent = a
        per_request.append(chain)
    return objects, per_request


async def populate(world, objects: dict[str, tuple[str | None, int]], size: int) -> dict[str, tuple[str, int]]:
    """Blobs into the origin's store (before it starts), records into the registry (after). Each blob's
    digest and length out."""
    from kdn.format.store import BlobDir

    store = BlobDir(world.root / "origin-store", fsync=False)
    digests = {}
    for a, (parent, start) in objects.items():
        blob = blob_of(a, size, parent, start)
        digests[a] = (blake3(blob).hexdigest(), len(blob))
        store.put(a, "zstd", blob, digest=digests[a][0])
    return digests


async def record(world, objects, digests, size: int) -> None:
    from kdn.registry import Encoding, ObjectRecord, open_registry

    async with open_registry(world.etcd.registry) as reg:
        models = await reg.list_models()
        model_id = models[0].model_id
        recs = [ObjectRecord(address=a, model_id=model_id, namespace="public", kind="kv", start=start,
                             end=start + CHUNK, parent=parent, standalone=False,
                             encodings={"zstd": Encoding("zstd", digests[a][1], digests[a][0])}, origin="origin-1")
                for a, (parent, start) in objects.items()]
        for i in range(0, len(recs), 2000):
            await reg.put_objects(recs[i:i + 2000])


def proc_rss_fds(pid: int) -> tuple[int, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0, 0


async def etcd_rpcs(world) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{world.etcd.metrics_port}/metrics") as r:
            text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{"))


async def run(args) -> dict:
    trace = load_trace(args.minutes)
    objects, requests = chains(trace)
    size = args.object_kib * 1024
    print(f"trace: {len(trace)} requests in its first {args.minutes:g} min, {len(objects)} chunk objects "
          f"of {args.object_kib} KiB = {len(objects) * size / 2**20:.0f} MiB working set", flush=True)
    with tempfile.TemporaryDirectory(prefix="kdn-load-") as tmp:
        world = F.World(Path(tmp), regions={"eu": 2, "us": 2}, mem_budget=args.mem_budget,
                        disk_budget=args.disk_budget, lease_ttl="5s")
        t0 = time.monotonic()
        digests = await populate(world, objects, size)
        await world.start()
        await record(world, objects, digests, size)
        print(f"setup: {time.monotonic() - t0:.0f} s", flush=True)
        try:
            return await replay(world, trace, requests, digests, size, args)
        finally:
            await world.close()


async def replay(world, trace, requests, digests, size, args) -> dict:
    regions = list(world.regions)
    rng = random.Random(args.seed)
    obj_lat: list[float] = []
    req_lat: list[float] = []
    sources: Counter = Counter()
    errors: Counter = Counter()
    wrong = 0
    done_requests = 0
    per_second: dict[int, list[float]] = defaultdict(list)
    samples = []
    slots = asyncio.Semaphore(args.clients)
    start = time.monotonic()
    end = start + args.duration
    span = (trace[-1]["timestamp"] + 1) / 1000

    async def fetch(s: aiohttp.ClientSession, edge, a: str) -> None:
        nonlocal wrong
        t = time.monotonic()
        try:
            async with s.get(f"{edge.url}/v1/objects/{a}", params={"encoding": "zstd"}) as r:
                body = await r.read()
                if r.status != 200:
                    errors[f"http {r.status}"] += 1
                    return
                sources[r.headers.get("X-KDN-Source", "?").split(":", 1)[0]] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            errors[type(e).__name__] += 1
            return
        if (blake3(body).hexdigest(), len(body)) != digests[a]:
            wrong += 1
        dt = time.monotonic() - t
        obj_lat.append(dt)
        per_second[int(t - start)].append(dt)

    async def one(s, i: int, chain: list[str]) -> None:
        nonlocal done_requests
        try:
            region = regions[i % len(regions)]
            edge = rng.choice(world.live_edges(region))
            t = time.monotonic()
            sem = asyncio.Semaphore(4)

            async def bounded(a):
                async with sem:
                    await fetch(s, edge, a)

            await asyncio.gather(*(bounded(a) for a in chain))
            req_lat.append(time.monotonic() - t)
            done_requests += 1
        finally:
            slots.release()

    async def sampler() -> None:
        rpc0 = await etcd_rpcs(world)
        while time.monotonic() < end:
            await asyncio.sleep(1.0)
            row = {"t": round(time.monotonic() - start, 1), "etcd_rpcs": await etcd_rpcs(world) - rpc0}
            for name, e in world.edges.items():
                row[f"{name}_rss"], row[f"{name}_fds"] = proc_rss_fds(e.pid)
            lat = sorted(per_second.get(int(row["t"]) - 1, []))
            row["p99_ms"] = lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else None
            samples.append(row)

    timeout = aiohttp.ClientTimeout(total=30, sock_connect=5)
    conn = aiohttp.TCPConnector(limit=0)
    tasks = set()
    sampling = asyncio.create_task(sampler())
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
        i, loop_n = 0, 0
        while time.monotonic() < end:
            r = trace[i]
            if args.speedup > 0:
                due = start + (loop_n * span + r["timestamp"] / 1000) / args.speedup
                if due > time.monotonic():
                    await asyncio.sleep(min(due - time.monotonic(), max(0.0, end - time.monotonic())))
                    if time.monotonic() >= end:
                        break
            await slots.acquire()
            t = asyncio.create_task(one(s, i + loop_n * len(trace), requests[i]))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            i += 1
            if i == len(trace):
                i, loop_n = 0, loop_n + 1
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - start
    await sampling
    egress = await world.origin.metric("kdn_origin_bytes_served")
    rpcs = samples[-1]["etcd_rpcs"] if samples else 0.0
    obj_lat.sort()
    req_lat.sort()

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

    budget = size_of(args.mem_budget)
    edges = {}
    for name in world.edges:
        rss = [row[f"{name}_rss"] for row in samples if row.get(f"{name}_rss")]
        fds = [row[f"{name}_fds"] for row in samples if row.get(f"{name}_fds")]
        edges[name] = {"rss_max_mib": max(rss) / 2**20 if rss else 0, "rss_over_budget_mib":
                       (max(rss) - budget) / 2**20 if rss else 0, "fds_max": max(fds) if fds else 0,
                       "fds_first": fds[0] if fds else 0}
    total = sum(sources.values())
    return {
        "requests": done_requests, "objects": len(obj_lat), "seconds": round(elapsed, 1),
        "objects_per_s": round(len(obj_lat) / elapsed, 1), "errors": dict(errors), "wrong": wrong,
        "object_p50_ms": round(pct(obj_lat, 0.5), 2), "object_p99_ms": round(pct(obj_lat, 0.99), 2),
        "request_p50_ms": round(pct(req_lat, 0.5), 1), "request_p99_ms": round(pct(req_lat, 0.99), 1),
        "hits": {k: round(v / total, 3) for k, v in sorted(sources.items())} if total else {},
        "origin_egress_mib": round(egress / 2**20, 1), "etcd_rpcs_per_s": round(rpcs / elapsed, 1),
        "edges": edges, "samples": samples, "mem_budget": args.mem_budget, "disk_budget": args.disk_budget,
        "clients": args.clients, "speedup": args.speedup, "trace_minutes": args.minutes,
        "object_kib": args.object_kib, "seed": args.seed,
    }


def size_of(text: str) -> int:
    from kdn.units import parse_size

    return parse_size(text)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in result["edges"]:
        a.plot(t, [s[f"{name}_rss"] / 2**20 for s in samples], label=name)
    a.axhline(size_of(result["mem_budget"]) / 2**20, color="grey", ls="--", label="memory budget")
    a.set_ylabel("edge RSS (MiB)")
    a.legend(fontsize=8, ncol=5)
    b.plot(t, [s["p99_ms"] if s["p99_ms"] is not None else float("nan") for s in samples], color="C3")
    b.set_ylabel("object fetch p99 (ms), per second")
    b.set_xlabel("seconds")
    fig.suptitle(f"bench/load.py: Mooncake trace, {result['clients']} clients, speedup {result['speedup']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(res: dict) -> str:
    lines = [
        "| requests | objects | objects/s | errors | wrong bytes | object p50 / p99 (ms) | request p50 / p99 (ms) "
        "| hits by source | origin egress (MiB) | etcd RPC/s |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |",
        f"| {res['requests']} | {res['objects']} | {res['objects_per_s']} | {res['errors'] or 0} | {res['wrong']} | "
        f"{res['object_p50_ms']} / {res['object_p99_ms']} | {res['request_p50_ms']} / {res['request_p99_ms']} | "
        f"{', '.join(f'{k} {v:.1%}' for k, v in res['hits'].items())} | {res['origin_egress_mib']} | "
        f"{res['etcd_rpcs_per_s']} |",
        "",
        f"| edge | max RSS (MiB) | over its {res['mem_budget']} memory budget (MiB) | open fds (first / max) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, e in res["edges"].items():
        lines.append(f"| {name} | {e['rss_max_mib']:.0f} | {e['rss_over_budget_mib']:.0f} | "
                     f"{e['fds_first']} / {e['fds_max']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (the harness stops by itself)")
    ap.add_argument("--clients", type=int, default=200, help="requests in flight at most")
    ap.add_argument("--speedup", type=float, default=5.0, help="trace time / run time; 0 = closed loop")
    ap.add_argument("--minutes", type=float, default=5.0, help="replay the trace's first N minutes (looped)")
    ap.add_argument("--object-kib", type=int, default=8, help="bytes per chunk object, KiB")
    ap.add_argument("--mem-budget", default="16MiB", help="each edge's memory tier")
    ap.add_argument("--disk-budget", default="64MiB", help="each edge's disk tier")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result (with per-second samples) here")
    ap.add_argument("--plot", help="write a PNG of RSS and p99 over time here")
    R.add_arg(ap)
    args = ap.parse_args()
    out = R.Results("load", args)
    res = asyncio.run(run(args))
    print()
    main_md, edges_md = report(res).split("\n\n")
    out.table("main", main_md, "Load: requests, objects, latency, hits, egress")
    print()
    out.table("edges", edges_md, "Per edge: memory and file descriptors")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=_here).stdout.strip()
    res["commit"], res["command"] = commit, " ".join(sys.argv)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.plot:
        plot(res, args.plot)
    out.write()
    return 0 if not res["errors"] and res["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
