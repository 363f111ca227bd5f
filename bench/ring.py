"""Balance and movement of the edge hash ring (``kdn.ring.Ring``), and its lookup rate.

    python -P bench/ring.py [--addresses 100000] [--vnodes 320] [--seed 7]

For N edges named ``edge-0 .. edge-{N-1}``: each edge's share of a sample of
random addresses (and of the hash space, exactly from the ring's arcs),
relative to 1/N; then each edge in turn leaves, and the sample is re-owned:
the share of addresses that moved (goal <= 1.1/N) and how many moved between
two survivors (must be 0). Lookups/s of ``Ring.owner`` (address validation
included), of the uhashring xxh3 ring under it (no validation), and of
uhashring's default (md5) ring, in the same run. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

from uhashring import HashRing

from kdn.ring import Ring

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import results as R  # noqa: E402


def lookups_per_s(fn, sample: list[str], repeat: int = 5) -> tuple[float, float, float]:
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for a in sample:
            fn(a)
        rates.append(len(sample) / (time.perf_counter() - t0))
    return statistics.median(rates), min(rates), max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addresses", type=int, default=100_000)
    ap.add_argument("--vnodes", type=int, default=320)
    ap.add_argument("--seed", type=int, default=7)
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("ring", args)
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    sample = [rng.randbytes(32).hex() for _ in range(args.addresses)]
    print(f"{args.addresses:,} random addresses, {args.vnodes} vnodes per edge, seed {args.seed}\n")
    t = res.start_table("main", f"{args.vnodes} vnodes per edge")
    t.line(
        "| edges | share max x N (sampled) | share min x N (sampled) | exact max / min x N "
        "| moved on leave x N: mean | worst | worst vs goal 1.1/N | moved between survivors "
        "| owner() lookups/s (min-max) | same ring, no validation | uhashring md5 |"
    )
    t.line("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    worst_all, between_all = [], 0
    for n in (3, 4, 8, 16):
        nodes = [f"edge-{i}" for i in range(n)]
        ring = Ring(nodes, vnodes=args.vnodes)
        before = [ring.owner(a) for a in sample]
        counts = {x: 0 for x in nodes}
        for o in before:
            counts[o] += 1
        sampled = [c * n / len(sample) for c in counts.values()]
        exact = [s * n for s in ring.shares().values()]
        moved_shares, between = [], 0
        for gone in nodes:
            after = Ring((x for x in nodes if x != gone), vnodes=args.vnodes)
            moved = 0
            for a, b in zip(sample, before):
                o = after.owner(a)
                if o != b:
                    moved += 1
                    between += b != gone
            moved_shares.append(moved * n / len(sample))
        rate, lo, hi = lookups_per_s(ring.owner, sample[:50_000])
        raw_rate, _, _ = lookups_per_s(ring._ring.get_node, sample[:50_000])  # the uhashring xxh3 ring underneath
        md5 = HashRing(nodes, vnodes=args.vnodes)  # uhashring's default hash, the baseline
        md5_rate, _, _ = lookups_per_s(md5.get_node, sample[:50_000])
        worst = max(moved_shares)
        worst_all.append(f"{worst:.4f}")
        between_all += between
        t.line(
            f"| {n} | {max(sampled):.3f} | {min(sampled):.3f} | {max(exact):.3f} / {min(exact):.3f} "
            f"| {statistics.mean(moved_shares):.3f} | {worst:.4f} | {'met' if worst <= 1.1 else 'over'} "
            f"| {between} | {rate / 1e3:,.0f}k ({lo / 1e3:,.0f}k-{hi / 1e3:,.0f}k) "
            f"| {raw_rate / 1e3:,.0f}k | {md5_rate / 1e3:,.0f}k |"
        )
    res.end_table(t)
    top = max(worst_all, key=float)
    shown = f"{math.ceil(float(top) * 100) / 100:.2f}/N"
    res.set_headline(
        "ring, one of N edges leaves",
        f"<= {shown} of keys move (worst departure, N = 3-16, {args.vnodes} vnodes), "
        f"{'none' if between_all == 0 else between_all} between survivors",
        "the ideal 1/N of a perfectly even ring (goal: 1.1/N)",
        [{"shown": shown, "cell": top, "table": "main"}],
    )
    print(f"\n({time.perf_counter() - t_start:.1f} s)")
    res.write()


if __name__ == "__main__":
    main()
