"""The upper tier (origin shield) against today's pull from the origin: origin egress and fetch latency
over 3 and 10 regions, on the Mooncake conversation trace.

    python -P bench/upper_tier.py                         # 3 and 10 regions, with and without the upper tier
    python -P bench/upper_tier.py --regions 3 --requests 120 --json bench/work/upper_tier.json

Every process is real and on 127.0.0.1 (bench/faultlib.World: etcd, an origin, ``N`` regions of one
edge each, ``kdn edge serve``); the links between them are emulated (bench/lib/linkemu.py: one-way delay,
bandwidth per flow), chosen so an edge's upstream hops pay them:

    r0 -> origin            2.5 ms one way, 1 Gbit/s     (the region next to the origin: the upper tier)
    r1..rN-1 -> origin      40 ms one way, 200 Mbit/s    (a WAN to the origin)
    any region -> another   30 ms one way, 400 Mbit/s    (every edge advertises its URL through its link)
    client -> its edge      loopback, no delay

Objects: each 512-token block id of the trace is two chunk objects of ``--object-kib`` KiB (bytes from
the address, digests known to the readers), written into the origin's store and recorded in the
registry before the run (bench/load.py's ``populate``/``record``). Requests: the trace's first
``--requests`` rows. ``--workload shared`` (the default, what KDN is for: the same knowledge read in
every region): every region reads all of them, each region in its own seeded order, interleaved;
``--workload split``: each row from one region drawn at random (little is read twice: the trace's
first rows share few blocks). Seeded, the same sequence for both setups; ``--clients`` requests in
flight in all, each fetching its whole chain through its region's edge, 4 objects at a time, every body
checked against its BLAKE3 digest.

Setups, on fresh worlds: ``pull`` (today's default: an edge misses past the other regions, asked
cached-only where their recent hit rate pays for the round trip, to the origin), and ``upper`` (``kdn
policy set shield --upper --region r0``: other regions' misses fill through r0's edge, which fills from
the origin), ``auto`` (no policy: the edges measure their round trips to the origin, advertise them in
their node records and choose r0 themselves, edge/upper.py; the seconds until every edge took r0 are
reported beside it), and ``push`` (the upper tier, then ``kdn policy set ... --push`` of a manifest naming every
object, before the first request: each region's owner fills through r0 ahead of its readers; the push's
own time is reported beside it, its bytes counted in the egress). Measured: origin egress (its own ``kdn_origin_bytes_served``) beside its bound (the
distinct bytes the requests name: a pull CDN sends each object out of the origin at least once), and the
clients' object and request latency, p50 and p99, beside a floor measured in the same run (the objects
the client's own edge already held: memory or disk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from blake3 import blake3

_here = Path(__file__).resolve().parent
for _p in (_here, _here / "lib"):  # bench/ and bench/lib/ (linkemu)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import faultlib as F  # noqa: E402
import load as L  # noqa: E402
import results as R  # noqa: E402
from linkemu import LinkEmulator  # noqa: E402

ORIGIN_NEAR = (2.5, 1000)  # one-way ms, Mbit/s: r0 to the origin
ORIGIN_FAR = (40.0, 200)  # every other region to the origin
INTER_REGION = (30.0, 400)  # into any region's edge from another region
UPPER = "r0"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


async def one_run(n: int, setup: str, rows, objects, chains, size: int, args) -> dict:
    regions = [f"r{i}" for i in range(n)]
    near_port, far_port = F.free_port(), F.free_port()
    url_ports = {r: F.free_port() for r in regions}
    with tempfile.TemporaryDirectory(prefix="kdn-upper-") as tmp:
        # Every setup but ``auto`` keeps the edges from choosing an upper tier by latency (``--upper-tier
        # policy``): ``pull`` is then today's pull, and a policy names the tier in ``upper`` and ``push``.
        choose = [] if setup == "auto" else ["--upper-tier", "policy"]
        per_edge = {f"{r}-1": ["--origin", f"http://127.0.0.1:{near_port if r == UPPER else far_port}",
                               "--url", f"http://127.0.0.1:{url_ports[r]}", *choose] for r in regions}
        world = F.World(Path(tmp), regions={r: 1 for r in regions}, mem_budget=args.mem_budget,
                        disk_budget=args.disk_budget, lease_ttl="5s", per_edge_args=per_edge)
        links = [LinkEmulator(near_port, "127.0.0.1", world.origin.port, delay_ms=ORIGIN_NEAR[0], mbit=ORIGIN_NEAR[1]),
                 LinkEmulator(far_port, "127.0.0.1", world.origin.port, delay_ms=ORIGIN_FAR[0], mbit=ORIGIN_FAR[1])]
        links += [LinkEmulator(url_ports[r], "127.0.0.1", world.edges[f"{r}-1"].port, delay_ms=INTER_REGION[0],
                               mbit=INTER_REGION[1]) for r in regions]
        digests = await L.populate(world, objects, size)
        for link in links:
            await link.start()
        try:
            await world.start()
            await L.record(world, objects, digests, size)
            push: dict = {}
            if setup in ("upper", "push"):
                from kdn.registry import Policy, open_registry

                async with open_registry(world.etcd.registry) as reg:
                    await reg.put_policy(Policy(name="shield", kind="upper", region=UPPER))
                await _wait_upper(world)
            if setup == "auto":  # no policy: the edges' measured round trips to the origin choose r0
                push["chose_s"] = await _wait_upper(world, chosen_by="latency", timeout=60.0)
            if setup == "push":
                push = await _push(world, list(objects))
            r = await replay(world, regions, rows, chains, digests, size, args)
            r["push_seconds"] = push.get("seconds")
            r["chose_seconds"] = push.get("chose_s")
            r["origin_egress_mib"] = round(r["origin_egress_mib"] + push.get("egress_mib", 0.0), 1)
            r["egress_over_bound"] = round(r["origin_egress_mib"] / r["distinct_mib"], 2) if r["distinct_mib"] else 0.0
            return r
        finally:
            await world.close()
            for link in links:
                await link.stop()


async def _push(world, addresses: list[str], timeout: float = 600.0) -> dict:
    """A manifest naming every object, pushed to every region (through the upper tier): until each edge
    counts all of them done. Its seconds and the origin bytes it cost."""
    from kdn.registry import Manifest, Policy, open_registry

    egress0 = await world.origin.metric("kdn_origin_bytes_served")
    t0 = time.monotonic()
    async with open_registry(world.etcd.registry) as reg:
        model_id = (await reg.list_models())[0].model_id
        await reg.put_manifest(Manifest(namespace="public", name="trace", model_id=model_id, addresses=addresses,
                                        tokens=0, chunk_tokens=L.CHUNK, prefix_tokens=[]))
        await reg.put_policy(Policy(name="trace-push", kind="push", manifest="public/trace"))
    for e in world.edges.values():  # one edge a region: each owns, and pushes, every object
        while await e.metric("kdn_edge_pushed_objects", policy="trace-push") < len(addresses):
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{e.name}: the push did not finish in {timeout} s")
            await asyncio.sleep(0.2)
    failed = sum([await e.metric("kdn_edge_pushed_objects", policy="trace-push", outcome="failed")
                  for e in world.edges.values()])
    if failed:
        raise RuntimeError(f"{failed:.0f} pushed objects failed")
    egress = await world.origin.metric("kdn_origin_bytes_served") - egress0
    return {"seconds": round(time.monotonic() - t0, 1), "egress_mib": egress / 2**20}


async def _wait_upper(world, chosen_by: str = "policy", timeout: float = 20.0) -> float:
    """Until every edge says r0 is its upper tier, for ``chosen_by``'s reason (/healthz); the seconds it took."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        for e in world.edges.values():
            while True:
                async with s.get(f"{e.url}/healthz") as r:
                    h = await r.json()
                    if h.get("upper_tiers") == [UPPER] and h.get("upper_chosen_by") == chosen_by:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{e.name} did not take {UPPER} as its upper tier ({chosen_by}) in {timeout} s: "
                                       f"{h.get('upper_tiers')}, {h.get('upper_chosen_by')}, {h.get('origin_rtt_ms')} ms")
                await asyncio.sleep(0.1)
    return round(time.monotonic() - t0, 1)


async def replay(world, regions, rows, chains, digests, size, args) -> dict:
    rng = random.Random(args.seed)  # the same draws for both setups (one seed, one count)
    if args.workload == "shared":  # every region reads the same requests, each region in its own order
        order = [(r, i) for r in regions for i in range(len(rows))]
        rng.shuffle(order)
    else:  # each request from one region
        order = [(rng.choice(regions), i) for i in range(len(rows))]
    obj_lat: list[float] = []
    floor_lat: list[float] = []  # objects the client's own edge already held
    req_lat: list[float] = []
    sources: Counter = Counter()
    errors: Counter = Counter()
    error_texts: list[str] = []  # the first few, for the report
    wrong = 0
    slots = asyncio.Semaphore(args.clients)
    egress0 = await world.origin.metric("kdn_origin_bytes_served")

    async def fetch(s: aiohttp.ClientSession, edge, a: str) -> None:
        nonlocal wrong
        t = time.monotonic()
        try:
            async with s.get(f"{edge.url}/v1/objects/{a}", params={"encoding": "zstd"}) as r:
                body = await r.read()
                if r.status != 200:
                    errors[f"http {r.status}"] += 1
                    if len(error_texts) < 3:
                        error_texts.append(f"{edge.name}: {r.status} {body[:300]!r}")
                    return
                source = r.headers.get("X-KDN-Source", "?").split(":", 1)[0]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            errors[type(e).__name__] += 1
            return
        dt = time.monotonic() - t
        if (blake3(body).hexdigest(), len(body)) != digests[a]:
            wrong += 1
            return
        sources[source] += 1
        obj_lat.append(dt)
        if source in ("memory", "disk"):
            floor_lat.append(dt)

    async def one(s, region: str, i: int) -> None:
        try:
            edge = world.edges[f"{region}-1"]
            t = time.monotonic()
            sem = asyncio.Semaphore(4)

            async def bounded(a):
                async with sem:
                    await fetch(s, edge, a)

            await asyncio.gather(*(bounded(a) for a in chains[i]))
            req_lat.append(time.monotonic() - t)
        finally:
            slots.release()

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60, sock_connect=5),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = []
        for region, i in order:
            await slots.acquire()
            tasks.append(asyncio.create_task(one(s, region, i)))
        await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    egress = await world.origin.metric("kdn_origin_bytes_served") - egress0
    distinct = sum(digests[a][1] for a in {a for chain in chains for a in chain})
    total = sum(sources.values())
    return {
        "objects": len(obj_lat), "errors": dict(errors), "first_errors": error_texts, "wrong": wrong, "seconds": round(elapsed, 1),
        "origin_egress_mib": round(egress / 2**20, 1), "distinct_mib": round(distinct / 2**20, 1),
        "egress_over_bound": round(egress / distinct, 2) if distinct else float("nan"),
        "object_p50_ms": round(pct(obj_lat, 0.5), 1), "object_p99_ms": round(pct(obj_lat, 0.99), 1),
        "request_p50_ms": round(pct(req_lat, 0.5), 1), "request_p99_ms": round(pct(req_lat, 0.99), 1),
        "floor_p50_ms": round(pct(floor_lat, 0.5), 1), "floor_p99_ms": round(pct(floor_lat, 0.99), 1),
        "sources": {k: round(v / total, 3) for k, v in sorted(sources.items())} if total else {},
    }


def report(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| regions | setup | origin egress MiB | bound (distinct) MiB | egress / bound | object p50 / p99 ms "
             "| request p50 / p99 ms | own-edge hits p50 / p99 ms (floor) | served by (client's edge said) "
             "| errors | wrong bytes |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for n, by_setup in results.items():
        for setup, r in by_setup.items():
            src = ", ".join(f"{k} {v:.0%}" for k, v in r["sources"].items())
            if r.get("push_seconds") is not None:
                setup = f"push ({r['push_seconds']} s before)"
            elif r.get("chose_seconds") is not None:
                setup = f"auto (r0 chosen by latency in {r['chose_seconds']} s)"
            lines.append(f"| {n} | {setup} | {r['origin_egress_mib']} | {r['distinct_mib']} | "
                         f"{r['egress_over_bound']}x | {r['object_p50_ms']} / {r['object_p99_ms']} | "
                         f"{r['request_p50_ms']} / {r['request_p99_ms']} | {r['floor_p50_ms']} / {r['floor_p99_ms']} "
                         f"| {src} | {sum(r['errors'].values())} | {r['wrong']} |")
    return "\n".join(lines)


async def run(args) -> dict[str, dict[str, dict]]:
    rows = [json.loads(line) for line in L.TRACE.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["hash_ids"]][:args.requests]
    objects, chains = L.chains(rows)
    size = args.object_kib * 1024
    print(f"trace: {len(rows)} requests, {len(objects)} chunk objects of {args.object_kib} KiB "
          f"({len(objects) * size / 2**20:.0f} MiB distinct), {sum(map(len, chains))} fetches", flush=True)
    out: dict[str, dict[str, dict]] = {}
    for n in args.regions:
        out[str(n)] = {}
        for setup in args.setups:
            t0 = time.monotonic()
            r = out[str(n)][setup] = await one_run(n, setup, rows, objects, chains, size, args)
            print(f"{n} regions, {setup}: {r['seconds']} s of requests ({time.monotonic() - t0:.0f} s in all); "
                  f"egress {r['origin_egress_mib']} MiB ({r['egress_over_bound']}x the bound), object p50/p99 "
                  f"{r['object_p50_ms']}/{r['object_p99_ms']} ms, errors {r['errors'] or 0}, wrong {r['wrong']}",
                  flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regions", type=lambda v: [int(x) for x in v.split(",")], default=[3, 10],
                    help="region counts to run, e.g. 3,10 (at least 2: r0 is the upper tier)")
    ap.add_argument("--requests", type=int, default=60, help="the trace's first N requests")
    ap.add_argument("--workload", choices=("shared", "split"), default="shared",
                    help="shared: every region reads the same requests (shared knowledge, each region in its own "
                         "order); split: each request from one region drawn at random")
    ap.add_argument("--clients", type=int, default=4,
                    help="requests in flight at most (4 x 4 objects keeps 2 cores short of saturation)")
    ap.add_argument("--object-kib", type=int, default=64, help="bytes per chunk object, KiB")
    ap.add_argument("--mem-budget", default="256MiB", help="each edge's memory tier (above the working set)")
    ap.add_argument("--disk-budget", default="512MiB", help="each edge's disk tier")
    ap.add_argument("--setups", type=lambda v: v.split(","), default=["pull", "upper", "auto", "push"],
                    help="which to run, of pull, upper, auto, push (default all four)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    R.add_arg(ap)
    args = ap.parse_args()
    if set(args.setups) - {"pull", "upper", "auto", "push"}:
        ap.error(f"--setups: unknown {', '.join(sorted(set(args.setups) - {'pull', 'upper', 'auto', 'push'}))}")
    if min(args.regions) < 2:
        ap.error("--regions: each count must be at least 2 (r0 is the upper tier, the others fill through it)")
    out = R.Results("upper_tier", args)
    res = asyncio.run(run(args))
    out.table("main", report(res), "Origin egress and latency, with and without the upper tier")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    out.write()
    bad = sum(sum(r["errors"].values()) + r["wrong"] for by in res.values() for r in by.values())
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
