"""Non-prefix reuse on SmolLM2-135M: ``generate_rag`` from an edge, fetch included, vs the lean one-shot prefill.

    python -P bench/blend.py [--quick] [--questions 32] [--passages 4] [--configs compose:0,deviation:15:1,...]
                             [--png docs/img/blend.png]

A RAG-like set: the shipped docs (``kdn/data/docs``, 16 questions) plus four
generated reference documents (``bench/blend_text.py``, fixed seed, 16 more
questions), each cut at paragraph boundaries into passages of at most
``--passage-tokens`` tokens. For each question the context is a chat prompt
holding ``--passages`` passages: the one with the answer (never first) and
passages of the other documents, drawn with a fixed seed.

Every passage used is published as standalone chunks (``"standalone": true,
"prefix": false``) through a real origin (its own process, an embedded
registry) in ``--encodings`` (default ``zstd,raw``, both lossless: the client
picks per chunk by its measured link, raw on loopback, as an engine next to its
edge would) and read once through an edge (its own process, a 1 GiB memory tier,
alone in its region), all on 127.0.0.1, so the timed reads are memory-tier
hits. Per question and configuration the timed path is ``generate_rag`` as an
application calls it: tokenize, address, look up each chunk's record, fetch
and verify (BLAKE3) each blob, decode it, RoPE-shift and compose, blend, pick
the first token (``RagReport.ttft_ms``). The baseline is the lean one-shot
prefill of the same prompt tokens (one forward, ``logits_to_keep=1``, as
``bench/ttft.py``'s ``prefill-lean``), timed in the same loop; the order of the
paths rotates per question.

Quality: the NLL of the reference answer's tokens, teacher-forced: its first
token from the first-token logits, the rest by continuing from the cache the
path left (the lean prefill's cache; the blend's K/V). NLL increase = (blend -
full) / full over all answer tokens; per question the increase in nats per
answer token (median and worst).

Recomputed share (check layers included) = recomputed (reused token, layer)
pairs / (reused tokens x layers): ``R(c+1) + r(L-c-1)`` for ``deviation``
(CacheBlend: layers 0..c in full for every reused token, then r selected
tokens), ``Rc + Rf + r(L-c)`` for ``deviation-kv`` (layers 0..c-1 in full,
the check layer's K/V projections only, f = their share of a layer's matmul
weights) and ``deviation-query`` (the same check; tokens ranked by deviation times
the root of the question's attention to them), ``rL`` for ``chunk-start`` (the
first tokens of each chunk, EPIC-style).

``--seeds 11,13`` runs every seed's questions (their own generated documents and
passage draws) in one run and gives the NLL increase per seed too: the held-out
check of ratios chosen on the default seed.
"""

from __future__ import annotations

import asyncio
import argparse
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/ttft.py: spinning OpenMP threads on 2 shared cores

import torch  # noqa: E402

from kdn.adapters.hf import load_model  # noqa: E402
from kdn.adapters.hf.extract import _forward, new_cache  # noqa: E402
from kdn.adapters.hf.generate import model_id as engine_model_id  # noqa: E402
from kdn.adapters.hf.rag import blend_cache, generate_rag, rag_frame  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import blend_text  # noqa: E402
import results as R  # noqa: E402
import ttft as T  # noqa: E402  (origin/edge processes, health checks)

DOCS = Path(__file__).resolve().parents[1] / "kdn" / "data" / "docs"
SYSTEM = "Answer the question in a few words, using only the documents."
# name:ratio%[:check layer]; compose = pure composition (ratio 0)
CONFIGS = ("compose:0,deviation:15:1,deviation-kv:12:1,deviation-kv:15:1,deviation-query:10:1,deviation-query:12:1,"
           "deviation-query:15:1,chunk-start:15")
QUICK_CONFIGS = "compose:0,deviation:15:1,deviation-query:15:1,chunk-start:15"


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def passages(tok, text: str, limit: int) -> list[str]:
    """Consecutive paragraphs grouped into passages of at most ``limit`` tokens (a longer paragraph stands alone)."""
    out, cur = [], ""
    for para in [p.strip() for p in text.split("\n\n") if p.strip()]:
        cand = f"{cur}{para}\n\n"
        if cur and len(encode(tok, cand)) > limit:
            out.append(cur)
            cand = f"{para}\n\n"
        cur = cand
    if cur:
        out.append(cur)
    return out


def question_set(n: int, seed: int) -> tuple[dict[str, str], list[dict]]:
    """Documents by name and ``n`` questions, alternating shipped and generated ones (all documents covered)."""
    import json

    docs = {p.stem: p.read_text() for p in sorted(DOCS.glob("*.md")) if p.stem != "README"}
    shipped = json.loads((DOCS / "questions.json").read_text())
    gen_docs, generated = blend_text.generate(seed)
    docs.update(gen_docs)
    qs = [q for pair in zip(shipped, generated) for q in pair]
    qs += shipped[len(generated):] + generated[len(shipped):]
    if n > len(qs):
        raise SystemExit(f"--questions {n}: the set has {len(qs)}")
    return docs, qs[:n]


def build_contexts(tok, docs: dict[str, str], qs: list[dict], n_passages: int, limit: int, seed: int):
    rng = random.Random(seed)
    by_doc = {name: passages(tok, text, limit) for name, text in docs.items()}
    out = []
    for qi, q in enumerate(qs):
        own = by_doc[q["doc"]]
        key = q["answer"].split()[0] if q["answer"] not in "".join(own) else q["answer"]
        gold = next(p for p in own if key in p)
        others = [p for d, ps in by_doc.items() if d != q["doc"] for p in ps]
        ctx = rng.sample(others, n_passages - 1)
        ctx.insert(1 + qi % (n_passages - 1), gold)  # never first
        out.append((q, ctx))
    return out, by_doc


def parse_configs(text: str) -> list[tuple[str, str, float, int]]:
    """``name:ratio[:check]`` items -> (label, selection, ratio, check_layer)."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        sel, ratio = parts[0], float(parts[1]) / 100
        check = int(parts[2]) if len(parts) > 2 else 1
        if sel == "compose":
            sel, ratio = "deviation", 0.0
            label = "compose (0%)"
        else:
            label = f"{sel} {ratio * 100:g}%" + (f", check layer {check}" if sel != "chunk-start" else "")
        out.append((label, sel, ratio, check))
    return out


def lean(model, ids: list[int]):
    """The lean one-shot prefill (``bench/ttft.py`` prefill-lean): one forward, logits of the last token only.
    Returns (first token, its logits, the cache, seconds); only the forward and the argmax are timed."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = new_cache(model)
        out = _forward(model, cache, torch.tensor(ids, dtype=torch.long), 0, logits=False)
        first = int(torch.argmax(out.logits[0, -1].float()))
    dt = time.perf_counter() - t0
    return first, out.logits[0, -1].float(), cache, dt


def answer_nll(model, cache, pos: int, first_logits: torch.Tensor, ans: list[int]) -> tuple[float, torch.Tensor]:
    """Summed NLL of ``ans`` teacher-forced after a prefill (its first-token logits, its cache at ``pos``)."""
    with torch.inference_mode():
        rest = (_forward(model, cache, torch.tensor(ans[:-1], dtype=torch.long), pos, logits=True).logits[0].float()
                if len(ans) > 1 else first_logits[:0])
    lg = torch.cat([first_logits[None], rest])  # [A, vocab]
    lp = torch.log_softmax(lg, dim=-1)
    return -lp[torch.arange(len(ans)), torch.tensor(ans)].sum().item(), lg.argmax(-1)


async def publish_standalone(session, origin: str, name: str, tokens: list[int], encodings: list[str]) -> dict:
    headers = {"Authorization": f"Bearer {T.PUBLISH_TOKEN}"}
    body = {"name": name, "tokens": tokens, "standalone": True, "prefix": False, "encodings": encodings}
    async with session.post(f"{origin}/v1/publish", json=body, headers=headers) as r:
        job = await r.json()
        if r.status != 202:
            raise RuntimeError(f"publish {name}: HTTP {r.status} {job}")
    while True:
        async with session.get(f"{origin}{job['url']}", headers=headers) as r:
            st = await r.json()
        if st["state"] == "done":
            return st["manifest"]
        if st["state"] == "failed":
            raise RuntimeError(f"publish {name} failed: {st.get('error')}")
        await asyncio.sleep(0.1)


async def run(args, res: R.Results, log) -> None:
    import aiohttp

    from kdn.client import KDNClient

    configs = parse_configs(args.configs)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-blend-"))
    procs: list = []
    try:
        origin, edge = T.origin_and_memory_edge(tmp, args.model, args.dtype, procs)
        torch.manual_seed(0)
        lm = load_model(args.model, dtype=getattr(torch, args.dtype))
        model, tok = lm.model, lm.tokenizer
        model.eval()
        contexts, by_doc = [], {}
        for seed in args.seeds:
            docs, qs = question_set(args.questions, seed)
            ctxs, bd = build_contexts(tok, docs, qs, args.passages, args.passage_tokens, seed)
            contexts += [({**q, "seed": seed}, ctx) for q, ctx in ctxs]
            by_doc.update({(name, tuple(ps)): ps for name, ps in bd.items()})  # one entry per distinct text
        used = list(dict.fromkeys(p for _, ctx in contexts for p in ctx))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-mem" in (b.get("ring") or []))
            t0 = time.perf_counter()
            mid = engine_model_id(model, tok)
            n_chunks = 0
            for i, p in enumerate(used):
                man = await publish_standalone(s, origin.url, f"blend-{i}", encode(tok, p),
                                               args.encodings.split(","))
                if man["model_id"] != mid:
                    raise RuntimeError(f"origin model id {man['model_id'][:12]} != bench model id {mid[:12]}")
                n_chunks += len(man["standalone"])
            t_pub = time.perf_counter() - t0
            log(f"published {len(used)} passages ({n_chunks} standalone chunks) in {t_pub:.1f} s")
        client = KDNClient(edges=[edge.url])
        try:
            # Warm: the first read fills the edge from the origin, the second must come from its memory tier;
            # and torch's first forwards pay one-off costs.
            q0, ctx0 = contexts[0]
            for q, ctx in contexts:
                await generate_rag(model, tok, q["question"], ctx, client, system=SYSTEM, recompute_ratio=0.0,
                                   max_new_tokens=1)
            w = await generate_rag(model, tok, q0["question"], ctx0, client, system=SYSTEM, max_new_tokens=1)
            log(f"warm: {w.report.line()}")
            head, tail = rag_frame(tok, q0["question"], SYSTEM)
            lean(model, encode(tok, head) + [t for p in ctx0 for t in encode(tok, p)] + encode(tok, tail))
            await measure(args, res, log, model, tok, client, contexts, configs, by_doc, len(used), n_chunks, t_pub)
        finally:
            await client.close()
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def measure(args, res, log, model, tok, client, contexts, configs, by_doc, n_used, n_chunks, t_pub) -> None:
    loop = asyncio.get_running_loop()
    paths = ["lean"] + [c[0] for c in configs]
    per = {c[0]: {"speedup": [], "ttft": [], "fetch": [], "blend": [], "dnll": [], "nll": [], "agree": [],
                  "share": [], "tokens": [], "sources": {}, "encodings": {}} for c in configs}
    lean_ttft, lengths, nll_ref, n_ans = [], [], [], 0
    for qi, (q, ctx) in enumerate(contexts):
        head, tail = rag_frame(tok, q["question"], SYSTEM)
        ids = encode(tok, head) + [t for p in ctx for t in encode(tok, p)] + encode(tok, tail)
        ans = encode(tok, " " + q["answer"])
        lengths.append(len(ids))
        n_ans += len(ans)
        got: dict[str, tuple] = {}
        order = paths[qi % len(paths):] + paths[:qi % len(paths)]  # rotate: spread drift over paths
        for path in order:
            if path == "lean":
                first, logits, cache, dt = await loop.run_in_executor(None, lean, model, ids)
                nll, top = answer_nll(model, cache, len(ids), logits, ans)
                got[path] = (dt, nll, top)
                continue
            _, sel, ratio, check = next(c for c in configs if c[0] == path)
            out = await generate_rag(model, tok, q["question"], ctx, client, system=SYSTEM, recompute_ratio=ratio,
                                     check_layer=check, selection=sel, max_new_tokens=1)
            r = out.report
            assert r.tokens_total == len(ids) and r.chunks_computed == 0, r.line()
            nll, top = answer_nll(model, blend_cache(model, out.blend), r.tokens_total, out.first_logits, ans)
            got[path] = (r.ttft_ms / 1e3, nll, top, r)
        tf, nr, top_ref = got["lean"]
        lean_ttft.append(tf)
        nll_ref.append(nr)
        for label, *_ in configs:
            tb, nll, top, r = got[label]
            row = per[label]
            row["ttft"].append(tb)
            row["speedup"].append(tf / tb)
            row["fetch"].append(r.fetch_ms)
            row["blend"].append(r.blend_ms)
            row["nll"].append(nll)
            row["dnll"].append((nll - nr) / len(ans))
            row["agree"].append((top == top_ref).float().mean().item())
            row["share"].append((r.recompute_share, r.tokens_reused, r.tokens_total))
            for k, v in r.sources.items():
                row["sources"][k] = row["sources"].get(k, 0) + v
            for k, v in r.encodings.items():
                row["encodings"][k] = row["encodings"].get(k, 0) + v
        log(f"q{qi + 1}/{len(contexts)} {len(ids)} tokens: lean {tf * 1e3:.0f} ms; "
            + "; ".join(f"{lab} {got[lab][0] * 1e3:.0f} ms ({tf / got[lab][0]:.2f}x)" for lab, *_ in configs))

    med = statistics.median
    total_ref = sum(nll_ref) / n_ans
    srcs = sorted({k for row in per.values() for k in row["sources"]})
    encs = {}
    for row in per.values():
        for k, v in row["encodings"].items():
            encs[k] = encs.get(k, 0) + v
    seeds = list(args.seeds)
    lines = [f"{args.model} ({args.dtype}), {len(contexts)} questions over {len(by_doc)} documents "
             f"({len(set((q['doc'], q['seed']) for q, _ in contexts))} of them hold answers; "
             f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}), {args.passages} passages each "
             f"(answer passage never first), context {min(lengths)}-{max(lengths)} tokens (median "
             f"{med(lengths):.0f}); {n_used} passages published as {n_chunks} standalone chunks through an origin "
             f"({t_pub:.0f} s, not timed; encodings {args.encodings}), read from one edge's memory tier over HTTP on "
             f"127.0.0.1 (sources: {', '.join(srcs)}; chunks fetched per encoding: "
             f"{', '.join(f'{k} x{v}' for k, v in sorted(encs.items()))}); lean one-shot prefill TTFT median {med(lean_ttft) * 1e3:.0f} ms "
             f"({min(lean_ttft) * 1e3:.0f}-{max(lean_ttft) * 1e3:.0f})",
             "",
             "| selection | recomputed share, check layers included | TTFT ms, fetch included (median, min-max) "
             "| of which fetch + verify + decode, ms (median) | speedup vs lean prefill (median, worst) "
             "| answer NLL/token: blend vs full | NLL increase | per-question NLL increase, nats/token "
             "(median, worst) | top-1 agreement (median, min) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    summary = []
    of_seed = {sd: [i for i, (q, _) in enumerate(contexts) if q["seed"] == sd] for sd in seeds}
    ref_of_seed = {sd: sum(nll_ref[i] for i in mine) for sd, mine in of_seed.items()}
    for label, sel, ratio, check in configs:
        row = per[label]
        tot = sum(row["nll"]) / n_ans
        inc = (tot - total_ref) / total_ref
        by_seed = {sd: (sum(row["nll"][i] for i in mine) - ref_of_seed[sd]) / ref_of_seed[sd]
                   for sd, mine in of_seed.items()}
        inc_cell = f"{inc * 100:+.1f}%"
        if len(seeds) > 1:
            inc_cell += " (" + ", ".join(f"seed {sd}: {v * 100:+.1f}%" for sd, v in by_seed.items()) + ")"
        share = sum(sh * n for sh, n, _ in row["share"]) / sum(n for _, n, _ in row["share"])
        summary.append({"label": label, "selection": sel, "ratio": ratio, "check_layer": check,
                        "share": share, "speedup": med(row["speedup"]), "worst_speedup": min(row["speedup"]),
                        "nll_increase": inc, "worst_dnll": max(row["dnll"]),
                        "nll_increase_by_seed": {str(k): v for k, v in by_seed.items()}})
        lines.append(
            f"| {label} | {share * 100:.1f}% | {med(row['ttft']) * 1e3:.0f} ({min(row['ttft']) * 1e3:.0f}-"
            f"{max(row['ttft']) * 1e3:.0f}) | {med(row['fetch']):.0f} | {med(row['speedup']):.2f}x "
            f"({min(row['speedup']):.2f}x) | {tot:.3f} vs {total_ref:.3f} | {inc_cell} "
            f"| {med(row['dnll']):+.3f} ({max(row['dnll']):+.3f}) "
            f"| {med(row['agree']) * 100:.0f}% ({min(row['agree']) * 100:.0f}%) |")
    load0, load1 = res.load_before, R._load()
    lines += ["", f"Recomputed share: recomputed (reused token, layer) pairs / (reused tokens x layers), over all "
              f"questions; deviation: R(c+1) + r(L-c-1); deviation-kv and deviation-query: Rc + Rf + r(L-c), f = "
              f"{_kv_f(model) * 100:.1f}% (the K/V projections' share of a layer's matmul weights); chunk-start: "
              f"rL (R reused tokens, r selected, L = {model.config.num_hidden_layers} layers, c the check layer). "
              f"NLL increase: over all {n_ans} answer tokens, (blend - full) / full. "
              f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other work, "
              f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; 1-minute load average "
              f"{_fmt_load(load0)} at the start, {_fmt_load(load1)} at the end. "
              f"Wall time {time.perf_counter() - res.t0:.0f} s."]
    print()
    res.table("main", "\n".join(lines), "Blending from an edge, fetch included, vs the lean one-shot prefill")
    res.extra["blend"] = {"summary": summary, "load_1min": {"start": load0 and load0[0], "end": load1 and load1[0]},
                          "lean_ttft_s": lean_ttft, "lengths": lengths}
    headline(res, summary, lengths)
    if args.png:
        plot(summary, Path(args.png))
        print(f"wrote {args.png}")


def _kv_f(model) -> float:
    from kdn.adapters.hf.rag import kv_share

    return kv_share(model.model.layers[0])


def _fmt_load(load) -> str:
    return f"{load[0]:.2f}" if load else "unknown"


def headline(res: R.Results, summary: list[dict], lengths: list[int]) -> None:
    """The README row: the default configuration (``generate_rag``'s selection and ratio), the fastest within +2%
    NLL (aggregate) on this set, and CacheBlend's own at 15%. A ratio picked as the fastest on this set is not
    a held-out result: the target is called met only for the default."""
    import inspect

    from kdn.adapters.hf.rag import generate_rag

    params = inspect.signature(generate_rag).parameters
    sel, ratio, check = (params[k].default for k in ("selection", "recompute_ratio", "check_layer"))
    default = next((x for x in summary if (x["selection"], x["ratio"], x["check_layer"]) == (sel, ratio, check)), None)
    ok = [x for x in summary if x["nll_increase"] <= 0.02 and 0 < x["ratio"] < 1]
    if default is None or not ok:
        return
    best = max(ok, key=lambda x: x["speedup"])
    figs: list[dict] = []

    def cfg(x: dict, *, bold: bool) -> str:
        sp, worst, inc, share = (f"{x['speedup']:.2f}x", f"{x['worst_speedup']:.2f}x",
                                 f"{x['nll_increase'] * 100:+.1f}%", f"{x['share'] * 100:.1f}%")
        figs.extend({"shown": v, "cell": v, "table": "main"} for v in (sp, worst, inc, share))
        b = "**" if bold else ""
        return (f"{x['label']}: {b}{sp}{b} faster (worst question {worst}) at {inc} NLL, recomputing {share} of the "
                f"reused tokens' layer work")

    text = "the default, " + cfg(default, bold=True)
    if best is not default:
        text += "; the fastest within +2% NLL on this set, " + cfg(best, bold=False)
    cb = next((x for x in summary if x["selection"] == "deviation" and x["ratio"] == 0.15), None)
    if cb and cb is not default and cb is not best:
        sp2, inc2 = f"{cb['speedup']:.2f}x", f"{cb['nll_increase'] * 100:+.1f}%"
        text += f" (CacheBlend's full check, 15%: {sp2} at {inc2})"
        figs += [{"shown": sp2, "cell": sp2, "table": "main"}, {"shown": inc2, "cell": inc2, "table": "main"}]
    met = default["speedup"] >= 3.3 and default["nll_increase"] <= 0.02
    text += f"; the 3.3x-within-2% target is {'met at the median' if met else '**not met**'} by the default"
    if not met and best["speedup"] >= 3.3:
        text += " (the faster ratio meets it on this set only: see the held-out run in docs/benchmarks.md)"
    res.set_headline(f"non-prefix reuse (blend) from an edge, fetch + verify + decode included, "
                     f"{min(lengths) / 1e3:.1f}k-{max(lengths) / 1e3:.1f}k-token RAG prompts", text,
                     "the lean one-shot prefill of the same prompt (`logits_to_keep=1`), same run", figs)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for sel, marker in (("deviation", "o"), ("deviation-kv", "s"), ("deviation-query", "D"), ("chunk-start", "^")):
        pts = sorted((x["speedup"], x["nll_increase"] * 100, x["ratio"]) for x in summary if x["selection"] == sel)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker + "-", label=sel)
        for s, i, r in pts:
            ax.annotate(f"{r * 100:g}%", (s, i), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(2.0, ls="--", c="grey", lw=0.8)
    ax.axvline(3.3, ls="--", c="grey", lw=0.8)
    ax.set_xlabel("TTFT speedup vs lean one-shot prefill, fetch included (median)")
    ax.set_ylabel("answer NLL increase vs full prefill (%)")
    ax.set_title("Blending on SmolLM2-135M (labels: recompute ratio)")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=480)
    ap.add_argument("--configs", default=None, help=f"name:ratio%%[:check layer], comma list (default {CONFIGS})")
    ap.add_argument("--seed", type=int, default=7, help="draws the generated documents and each question's passages")
    ap.add_argument("--seeds", default=None,
                    help="several seeds, comma list: every seed's questions in one run, the NLL increase also per seed")
    ap.add_argument("--encodings", default="zstd,raw",
                    help="encodings the origin publishes; the client picks per chunk by measured link (raw on loopback)")
    ap.add_argument("--quick", action="store_true", help=f"4 questions, configs {QUICK_CONFIGS}")
    ap.add_argument("--png", default="docs/img/blend.png")
    R.add_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.questions = min(args.questions, 4)
    args.configs = args.configs or (QUICK_CONFIGS if args.quick else CONFIGS)
    args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    R.run_logged("blend", args, run)


if __name__ == "__main__":
    main()
