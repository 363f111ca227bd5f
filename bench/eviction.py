"""S3-FIFO against LRU on seeded Zipf traces of multi-MiB objects, at the policy level.

    python -P bench/eviction.py [--objects 20000] [--requests 1000000] [--seed 7]

Objects are KV-cache blobs: sizes uniform in 1-6 MiB, popularity Zipf(alpha)
over a random permutation (size and rank independent). Each trace is replayed
against ``kdn.edge.eviction.S3FIFO`` and ``LRU`` with a byte budget of 10% and
1% of the working set (the bytes of all distinct objects requested), doing
what a tier does on a miss: walk ``victims()``, remove until the object fits,
insert. Counts every request from a cold start. Prints a markdown table of
byte and object hit ratios, S3-FIFO over LRU.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kdn.edge.eviction import LRU, S3FIFO

MiB = 1 << 20


def zipf_trace(n_objects: int, n_requests: int, alpha: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1 * MiB, 6 * MiB + 1, n_objects)
    weights = 1.0 / np.arange(1, n_objects + 1) ** alpha
    ranks = rng.choice(n_objects, size=n_requests, p=weights / weights.sum())
    ids = rng.permutation(n_objects)[ranks]  # popularity rank -> object id, independent of size
    return ids, sizes


def replay(policy_cls, trace: list[int], sizes: list[int], budget: int) -> tuple[float, float]:
    policy = policy_cls(budget)
    cached: set[int] = set()
    used = hits = hit_bytes = total_bytes = 0
    for k in trace:
        s = sizes[k]
        total_bytes += s
        if k in cached:
            hits += 1
            hit_bytes += s
            policy.on_access(k)
            continue
        if s > budget:
            continue
        if used + s > budget:
            walk = policy.victims()
            for v in walk:
                policy.remove(v)
                cached.discard(v)
                used -= sizes[v]
                if used + s <= budget:
                    break
            walk.close()
        policy.on_insert(k, s)
        cached.add(k)
        used += s
    return hit_bytes / total_bytes, hits / len(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=20_000)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    ap.add_argument(
        "--cache", type=float, nargs="+", default=[0.10, 0.01], help="budget as a fraction of the working set"
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    print(f"{args.requests:,} requests over {args.objects:,} objects of 1-6 MiB, seed {args.seed}\n")
    print(
        "| alpha | cache | working set | byte HR S3-FIFO | byte HR LRU | S3-FIFO/LRU "
        "| obj HR S3-FIFO | obj HR LRU | S3-FIFO/LRU |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for alpha in args.alphas:
        ids, sizes_np = zipf_trace(args.objects, args.requests, alpha, args.seed)
        trace, sizes = ids.tolist(), sizes_np.tolist()
        ws = int(sizes_np[np.unique(ids)].sum())
        for frac in args.cache:
            budget = int(ws * frac)
            s_b, s_o = replay(S3FIFO, trace, sizes, budget)
            l_b, l_o = replay(LRU, trace, sizes, budget)
            print(
                f"| {alpha:.1f} | {frac:.0%} | {ws / 2**30:.1f} GiB | {s_b:.4f} | {l_b:.4f} | {s_b / l_b:.3f} "
                f"| {s_o:.4f} | {l_o:.4f} | {s_o / l_o:.3f} |",
                flush=True,
            )
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
