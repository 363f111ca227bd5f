"""Eviction policies at the policy level: ARC and S3-FIFO vs LRU on Zipf object traces, and all
policies on prefix-chain traces (Mooncake's two FAST'25 traces and a synthetic one).

    python -P bench/eviction.py [--objects 20000] [--requests 1000000] [--seed 7]
    python -P bench/eviction.py --trace mooncake [--second TRACE] [--synthetic-seeds 1 2 3] [--plot docs/img/eviction.png]

``--trace zipf`` (the default). Objects are KV-cache blobs: sizes uniform in
1-6 MiB, popularity Zipf(alpha) over a random permutation (size and rank
independent). Each trace is replayed against ``kdn.edge.eviction.ARC``, ``S3FIFO`` and
``LRU`` with a byte budget of 10% and 1% of the working set (the bytes of all
distinct objects requested), doing what a tier does on a miss: walk
``victims()``, remove until the object fits, insert. Counts every request from
a cold start. Prints a markdown table of byte and object hit ratios, ARC and
S3-FIFO over LRU.

``--trace mooncake``. Replays ``bench/traces/mooncake_conversation_trace.jsonl``
in timestamp order: each request is a chain of 256-token chunks, two per
512-token prefix block (``(block, 0)``, ``(block, 1)``), all of one size (a
fixed model's chunk objects are equal). For each request it counts, from the
cache as it stands when the request arrives, the *reusable-prefix tokens*
(256 x the leading chunks of the chain that are all cached: what an engine
loads instead of computing) and the object hits (every cached chunk of the
chain), then walks the chain head to tail as the edge serves and fills it:
a cached chunk is a hit (``on_access``), a missing one is made room for and
inserted (``on_insert``; a chain-aware policy also gets its parent chunk).
Budgets are 1%, 5%, 10% and 30% of the working set (the distinct chunks).
Policies: the edge's ARC (its default) and S3-FIFO (``kdn.edge.eviction``), and
for comparison LRU, W-TinyLFU, the prefix-aware ``PrefixLRU``
(``bench/eviction_policies.py``) and theine's adaptive W-TinyLFU (a reference
implementation, when ``theine`` is installed). The same runs on the release's
second trace, ``bench/traces/mooncake_synthetic_trace.jsonl`` (``--second``),
and on a synthetic trace of our own (Zipf
popularity over documents, each request a prefix of random length of its
document's chunk chain), one per ``--synthetic-seeds`` seed. Prints markdown
tables and, with ``--plot``, a PNG of the reusable-prefix-token hit ratio
against the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdn.edge.eviction import ARC, S3FIFO

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import results as R  # noqa: E402
from eviction_policies import LRU, PrefixLRU, WTinyLFU  # noqa: E402

MiB = 1 << 20
CHUNK_TOKENS = 256
MOONCAKE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"
MOONCAKE_SYNTHETIC = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"


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


# --- prefix-chain traces -----------------------------------------------------


def load_mooncake(path: Path = MOONCAKE) -> list[list[int]]:
    """Requests in timestamp order, each its chain of chunk keys: block ``h`` is chunks ``2h``, ``2h + 1``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])  # stable: equal timestamps keep file order
    return [[2 * h + j for h in r["hash_ids"] for j in (0, 1)] for r in rows]


def synthetic_chains(
    n_docs: int, n_requests: int, alpha: float, max_chunks: int, seed: int
) -> list[list[int]]:
    """Zipf(alpha) over documents (popularity independent of length); each document a chain of
    uniform 2..max_chunks chunks; each request the document's first k chunks, k uniform in 1..len."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_chunks + 1, n_docs)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    weights = 1.0 / np.arange(1, n_docs + 1) ** alpha
    docs = rng.permutation(n_docs)[rng.choice(n_docs, size=n_requests, p=weights / weights.sum())]
    ks = np.floor(rng.random(n_requests) * lengths[docs]).astype(np.int64) + 1
    return [list(range(int(starts[d]), int(starts[d] + k))) for d, k in zip(docs, ks)]


@dataclass
class ChainResult:
    prefix_tokens: int  # reusable-prefix tokens hit
    tokens: int  # tokens requested (256 per chunk)
    object_hits: int
    objects: int
    max_used: int  # the most chunks ever cached at once
    spread: tuple[float, float] | None = None  # prefix ratio min-max over repeated runs (theine)

    @property
    def prefix_ratio(self) -> float:
        return self.prefix_tokens / self.tokens

    @property
    def object_ratio(self) -> float:
        return self.object_hits / self.objects


def _count(chain: list[int], cached: set[int]) -> tuple[int, int]:
    """(leading chunks all cached, cached chunks) of one chain, before it is served."""
    k = 0
    for c in chain:
        if c not in cached:
            break
        k += 1
    return k, k + sum(1 for c in chain[k:] if c in cached)


def replay_chains(factory: Callable[[int], object], chains: list[list[int]], budget: int,
                  chain_aware: bool = False) -> ChainResult:
    """Replay chunk chains against ``factory(budget)`` the way a tier fills them; every chunk is 1 unit."""
    policy = factory(budget)
    cached: set[int] = set()
    prefix = hits = objects = max_used = 0
    for chain in chains:
        k, h = _count(chain, cached)
        prefix += k
        hits += h
        objects += len(chain)
        parent = None
        for c in chain:
            if c in cached:
                policy.on_access(c)
            else:
                if len(cached) + 1 > budget:
                    walk = policy.victims()
                    for v in walk:
                        policy.remove(v)
                        cached.remove(v)
                        if len(cached) + 1 <= budget:
                            break
                    walk.close()
                if len(cached) + 1 <= budget:
                    if chain_aware:
                        policy.on_insert(c, 1, parent=parent)
                    else:
                        policy.on_insert(c, 1)
                    cached.add(c)
            parent = c
        max_used = max(max_used, len(cached))
    return ChainResult(prefix * CHUNK_TOKENS, objects * CHUNK_TOKENS, hits, objects, max_used)


def replay_theine(chains: list[list[int]], budget: int) -> ChainResult:
    """The same replay against theine's Rust W-TinyLFU core (adaptive window), which admits or evicts by itself.

    Used as ``theine.Cache`` uses it: keys are ``spread(hash(key))``, a hit is ``access``, a miss ``set``
    (which returns the keys it evicted, the new one too if it refused it)."""
    from theine_core import TlfuCore, spread

    hashed = {c: spread(hash(c)) for chain in chains for c in chain}
    chains = [[hashed[c] for c in chain] for chain in chains]
    core = TlfuCore(budget)
    cached: set[int] = set()
    prefix = hits = objects = max_used = 0
    for chain in chains:
        k, h = _count(chain, cached)
        prefix += k
        hits += h
        objects += len(chain)
        for c in chain:
            if c in cached:
                core.access([c])
            else:
                cached.add(c)
                cached.difference_update(core.set([(c, 0)]))  # ttl 0: none
        max_used = max(max_used, len(cached))
    return ChainResult(prefix * CHUNK_TOKENS, objects * CHUNK_TOKENS, hits, objects, max_used)


def unbounded(chains: list[list[int]]) -> ChainResult:
    """An infinite cache: the most any policy can hit."""
    return replay_chains(lambda b: LRU(b), chains, 1 << 62)


def replay_theine_runs(chains: list[list[int]], budget: int, runs: int) -> ChainResult:
    """theine hashes its sketch with a fresh random seed per cache (ahash's ``RandomState``), so its
    hit ratios move a little from run to run: replay ``runs`` times, keep the median run, note the spread."""
    results = sorted((replay_theine(chains, budget) for _ in range(runs)), key=lambda r: r.prefix_tokens)
    mid = results[len(results) // 2]
    mid.spread = (results[0].prefix_ratio, results[-1].prefix_ratio)
    return mid


def have_theine() -> bool:
    try:
        import theine_core  # noqa: F401
    except ImportError:
        return False
    return True


def chain_policies(theine_runs: int) -> dict[str, Callable[[list[list[int]], int], ChainResult]]:
    """Name -> ``run(chains, budget)``; literature defaults, nothing tuned to a trace.
    ``theine_runs``: how many times to replay theine's W-TinyLFU (0: leave it out)."""
    runs: dict[str, Callable[[list[list[int]], int], ChainResult]] = {
        "LRU": lambda ch, b: replay_chains(LRU, ch, b),
        "S3-FIFO": lambda ch, b: replay_chains(S3FIFO, ch, b),
        "ARC": lambda ch, b: replay_chains(ARC, ch, b),
        "W-TinyLFU": lambda ch, b: replay_chains(lambda n: WTinyLFU(n, capacity=n), ch, b),
    }
    if theine_runs:
        runs["W-TinyLFU (theine)"] = lambda ch, b: replay_theine_runs(ch, b, theine_runs)
    runs["PrefixLRU"] = lambda ch, b: replay_chains(PrefixLRU, ch, b, chain_aware=True)
    return runs


def working_set(chains: Iterable[list[int]]) -> int:
    return len({c for chain in chains for c in chain})


def run_chains(chains: list[list[int]], fracs: list[float], theine_runs: int = 0) -> dict:
    """{"ws", "bound": ChainResult, "results": {frac: {policy: ChainResult}}}."""
    ws = working_set(chains)
    out: dict = {"ws": ws, "bound": unbounded(chains), "results": {}}
    for frac in fracs:
        budget = max(1, int(ws * frac))
        out["results"][frac] = {name: run(chains, budget) for name, run in chain_policies(theine_runs).items()}
    return out


def _best_other(row: dict[str, float], winner: str) -> tuple[str, float]:
    name = max((n for n in row if n != winner), key=row.__getitem__)
    return name, row[name]


def print_chain_tables(title: str, runs: list[dict], fracs: list[float], res: R.Results | None = None,
                       key: str = "") -> list[tuple[float, str, float, str, float]]:
    """Markdown tables of one trace (several runs = seeds: median (min-max)), kept in ``res`` as
    ``{key}-prefix`` and ``{key}-object``; returns per-budget headlines:
    (frac, winner, its median prefix ratio, strongest other, its median prefix ratio)."""
    res = res or R.Results(key or "eviction")
    names = list(runs[0]["results"][fracs[0]])
    ws = [r["ws"] for r in runs]
    bound_p = [r["bound"].prefix_ratio for r in runs]
    cell = (lambda xs: f"{xs[0]:.4f}") if len(runs) == 1 else (
        lambda xs: f"{statistics.median(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})")
    print(f"\n{title}: working set {'/'.join(f'{w:,}' for w in ws)} chunks; "
          f"an unbounded cache hits {cell(bound_p)} of the tokens as reusable prefix\n")
    heads = []
    for metric, attr in (("reusable-prefix-token hit ratio", "prefix_ratio"), ("object hit ratio", "object_ratio")):
        print(f"{metric}:\n")
        t = res.start_table(f"{key}-{attr.split('_')[0]}", f"{title}: {metric}")
        t.line("| cache | " + " | ".join(names) + " | best / strongest other |")
        t.line("| ---: | " + " | ".join("---:" for _ in names) + " | :--- |")
        for frac in fracs:
            vals = {n: [getattr(r["results"][frac][n], attr) for r in runs] for n in names}
            med = {n: statistics.median(v) for n, v in vals.items()}
            winner = max(med, key=med.__getitem__)
            other, other_v = _best_other(med, winner)
            per_seed = [getattr(r["results"][frac][winner], attr) /
                        max(getattr(r["results"][frac][n], attr) for n in names if n != winner) for r in runs]
            ratio = f"{statistics.median(per_seed):.3f}" + (
                f" (worst {min(per_seed):.3f})" if len(runs) > 1 else "")
            t.line(f"| {frac:.0%} | " + " | ".join(cell(vals[n]) for n in names)
                   + f" | {winner} / {other}: {ratio} |")
            if attr == "prefix_ratio":
                heads.append((frac, winner, med[winner], other, other_v))
        res.end_table(t)
        print()
    gaps = {frac: max((x.spread[1] - x.spread[0] for r in runs for x in r["results"][frac].values() if x.spread),
                      default=None) for frac in fracs}
    if any(g is not None for g in gaps.values()):
        print("W-TinyLFU (theine): the median of repeated runs (it seeds its sketch's hashing at random); "
              "widest max - min of their prefix-token hit ratios: "
              + ", ".join(f"{f:.0%} {g:.4f}" for f, g in gaps.items() if g is not None) + "\n")
    for r in runs:
        for frac in fracs:
            budget = max(1, int(r["ws"] * frac))
            assert all(x.max_used <= budget for x in r["results"][frac].values()), "over budget"
    return heads


def plot_chains(path: Path, panels: list[tuple[str, list[dict]]], fracs: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    xs = [100 * f for f in fracs]
    for ax, (title, runs) in zip(axes[0], panels):
        names = list(runs[0]["results"][fracs[0]])
        for n in names:
            vals = [[r["results"][f][n].prefix_ratio for r in runs] for f in fracs]
            med = [statistics.median(v) for v in vals]
            err = [[m - min(v) for m, v in zip(med, vals)], [max(v) - m for m, v in zip(med, vals)]]
            style = {"PrefixLRU": {"linewidth": 3.5, "alpha": 0.45}, "LRU": {"linestyle": "--", "linewidth": 1.3}}
            ax.errorbar(xs, med, yerr=err if len(runs) > 1 else None, marker="o", capsize=3, label=n,
                        elinewidth=0.8, **style.get(n, {"linewidth": 1.3}))
        bound = statistics.median(r["bound"].prefix_ratio for r in runs)
        ax.axhline(bound, color="grey", linestyle=":", label="unbounded cache")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}%" for x in xs])
        ax.set_xlabel("budget (% of the working set, chunks)")
        ax.set_ylabel("reusable-prefix-token hit ratio")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main_chains(args: argparse.Namespace) -> None:
    res = R.Results("eviction", args)
    t0 = time.perf_counter()
    theine_runs = args.theine_runs if have_theine() else 0
    if not theine_runs:
        print("(no reference W-TinyLFU column: theine is not installed (`pip install theine==2.0.0`) "
              "or --theine-runs is 0)")
    fracs = args.cache or [0.01, 0.05, 0.10, 0.30]
    chains = load_mooncake(args.mooncake)
    mooncake = run_chains(chains, fracs, theine_runs)
    heads = {"mooncake": print_chain_tables(f"Mooncake conversation trace, {len(chains):,} requests", [mooncake], fracs,
                                            res, "mooncake")}
    second = None
    if args.second is not None:
        chains = load_mooncake(args.second)
        second = run_chains(chains, fracs, theine_runs)
        heads["mooncake-synthetic"] = print_chain_tables(
            f"Mooncake synthetic trace (public datasets, Poisson arrivals), {len(chains):,} requests", [second],
            fracs, res, "mooncake-synthetic")
    synth = []
    for seed in args.synthetic_seeds:
        chains = synthetic_chains(args.docs, args.synthetic_requests, args.alpha, args.max_chunks, seed)
        synth.append(run_chains(chains, fracs, theine_runs))
    if synth:
        title = (f"Synthetic: {args.synthetic_requests:,} requests, Zipf({args.alpha:g}) over {args.docs:,} documents "
                 f"of 2-{args.max_chunks} chunks, prefixes of uniform length; seeds "
                 + " ".join(map(str, args.synthetic_seeds)))
        heads["synthetic"] = print_chain_tables(title, synth, fracs, res, "synthetic")
    for trace, hs in heads.items():
        ratios = [w_v / o_v for _, _, w_v, _, o_v in hs]
        print(f"{trace}: " + "; ".join(f"{f:.0%} {w} {w_v:.4f} vs {o} {o_v:.4f} ({w_v / o_v:.2f}x)"
                                      for f, w, w_v, o, o_v in hs)
              + f"; over budgets median {statistics.median(ratios):.2f}x, worst {min(ratios):.2f}x")
    real = [("conversation", mooncake, "mooncake")] + ([("synthetic", second, "mooncake-synthetic")] if second else [])
    names = list(chain_policies(theine_runs))
    print("\nsummed over the budgets:\n")
    t = res.start_table("mooncake-summed", "Mooncake traces: reusable-prefix-token hit ratio summed over the budgets "
                        + "/".join(f"{f:.0%}" for f in fracs))
    t.line("| policy | " + " | ".join(trace for trace, _, _ in real) + " |")
    t.line("| :--- | " + " | ".join("---:" for _ in real) + " |")
    for n in names:
        t.line(f"| {n} | " + " | ".join(f"{sum(r['results'][f][n].prefix_ratio for f in fracs):.4f}"
                                        for _, r, _ in real) + " |")
    res.end_table(t)
    if args.plot:
        panels = [("Mooncake conversation trace", [mooncake])]
        if second:
            panels.append(("Mooncake synthetic trace", [second]))
        if synth:
            panels.append((f"synthetic, Zipf({args.alpha:g}), {len(synth)} seeds: median, min-max", synth))
        plot_chains(args.plot, panels, fracs)
    mooncake_headline(res, real, fracs)
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    res.write()


def mooncake_headline(res: R.Results, real: list[tuple[str, dict, str]], fracs: list[float]) -> None:
    """The README row: the edge's default (ARC) against the strongest other policy on each real trace,
    summed over the budgets (the choice), and its worst single budget (each figure from two table cells)."""
    figs: list[dict] = []

    def ratio(a: float, b: float, table: str) -> str:
        shown = f"{a / b:.2f}x"
        figs.append({"shown": shown, "cells": [f"{a:.4f}", f"{b:.4f}"], "table": table})
        return shown

    per, worst = [], None
    for trace, run, key in real:
        summed = {n: sum(run["results"][f][n].prefix_ratio for f in fracs) for n in run["results"][fracs[0]]}
        other, other_v = _best_other(summed, "ARC")
        per.append(f"{ratio(summed['ARC'], other_v, 'mooncake-summed')} {other} on the {trace} trace")
        for f in fracs:
            row = {n: x.prefix_ratio for n, x in run["results"][f].items()}
            o, o_v = _best_other(row, "ARC")
            if worst is None or row["ARC"] / o_v < worst[0]:
                worst = (row["ARC"] / o_v, row["ARC"], o_v, o, f, trace, key)
    assert worst is not None
    _, a_v, o_v, o, f, trace, key = worst
    res.set_headline(
        "eviction on the Mooncake traces' prefix reuse (reusable-prefix tokens)",
        "ARC, the edge's default, summed over budgets " + "/".join(f"{x:.0%}" for x in fracs) + ": " + "; ".join(per)
        + f"; its worst budget {ratio(a_v, o_v, key + '-prefix')} {o} ({trace}, {f:.0%})",
        "the strongest other policy (of S3-FIFO, LRU, W-TinyLFU, theine's W-TinyLFU, PrefixLRU)",
        figs,
    )


# --- Zipf object traces ------------------------------------------------------


def main_zipf(args: argparse.Namespace) -> None:
    args.cache = args.cache or [0.10, 0.01]
    res = R.Results("eviction", args)
    t0 = time.perf_counter()
    print(f"{args.requests:,} requests over {args.objects:,} objects of 1-6 MiB, seed {args.seed}\n")
    t = res.start_table("zipf", "Zipf object traces: ARC (the edge's default) and S3-FIFO vs LRU")
    t.line(
        "| alpha | cache | working set | byte HR ARC | byte HR S3-FIFO | byte HR LRU | ARC/LRU | S3-FIFO/LRU "
        "| obj HR ARC | obj HR S3-FIFO | obj HR LRU |"
    )
    t.line("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios: dict[str, list[float]] = {"ARC": [], "S3-FIFO": []}
    for alpha in args.alphas:
        ids, sizes_np = zipf_trace(args.objects, args.requests, alpha, args.seed)
        trace, sizes = ids.tolist(), sizes_np.tolist()
        ws = int(sizes_np[np.unique(ids)].sum())
        for frac in args.cache:
            budget = int(ws * frac)
            a_b, a_o = replay(ARC, trace, sizes, budget)
            s_b, s_o = replay(S3FIFO, trace, sizes, budget)
            l_b, l_o = replay(LRU, trace, sizes, budget)
            ratios["ARC"].append(a_b / l_b)
            ratios["S3-FIFO"].append(s_b / l_b)
            t.line(
                f"| {alpha:.1f} | {frac:.0%} | {ws / 2**30:.1f} GiB | {a_b:.4f} | {s_b:.4f} | {l_b:.4f} "
                f"| {a_b / l_b:.3f} | {s_b / l_b:.3f} | {a_o:.4f} | {s_o:.4f} | {l_o:.4f} |"
            )
    res.end_table(t)
    figs, parts = [], []
    for name, rs in ratios.items():
        lo, hi = min(rs), max(rs)
        figs += [{"shown": f"{name} {lo:.2f}-", "cell": f"{lo:.3f}", "table": "zipf"},
                 {"shown": f"-{hi:.2f}x", "cell": f"{hi:.3f}", "table": "zipf"}]
        parts.append(f"{name} {lo:.2f}-{hi:.2f}x")
    res.set_headline(
        "eviction, ARC (the default) and S3-FIFO vs LRU on Zipf traces",
        ", ".join(parts) + f" the byte hit ratio (alpha {'/'.join(f'{a:g}' for a in args.alphas)}, caches of "
        f"{'/'.join(f'{c:.0%}' for c in args.cache)} of the working set)",
        "LRU, same trace and budget",
        figs,
    )
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    res.write()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=["zipf", "mooncake"], default="zipf")
    ap.add_argument("--cache", type=float, nargs="+", default=None,
                    help="budgets as fractions of the working set (zipf: 0.10 0.01; mooncake: 0.01 0.05 0.10 0.30)")
    g = ap.add_argument_group("--trace zipf")
    g.add_argument("--objects", type=int, default=20_000)
    g.add_argument("--requests", type=int, default=1_000_000)
    g.add_argument("--seed", type=int, default=7)
    g.add_argument("--alphas", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    g = ap.add_argument_group("--trace mooncake")
    g.add_argument("--mooncake", type=Path, default=MOONCAKE, help="the trace file")
    g.add_argument("--second", type=Path, default=MOONCAKE_SYNTHETIC,
                   help="a second trace in the same format, replayed beside it (default: Mooncake's synthetic one)")
    g.add_argument("--synthetic-seeds", type=int, nargs="*", default=[1, 2, 3],
                   help="seeds of the synthetic prefix trace run beside it (none: skip it)")
    g.add_argument("--docs", type=int, default=4_000, help="synthetic: documents")
    g.add_argument("--synthetic-requests", type=int, default=12_000, help="synthetic: requests")
    g.add_argument("--alpha", type=float, default=1.0, help="synthetic: Zipf exponent over documents")
    g.add_argument("--max-chunks", type=int, default=190, help="synthetic: longest document, in chunks")
    g.add_argument("--plot", type=Path, default=None, help="write a PNG of prefix-token hit ratio vs budget")
    g.add_argument("--theine-runs", type=int, default=3,
                   help="replays of theine's W-TinyLFU per cell, the median one reported (its hashing is seeded "
                        "at random)")
    R.add_arg(ap)
    args = ap.parse_args()
    (main_chains if args.trace == "mooncake" else main_zipf)(args)


if __name__ == "__main__":
    main()
