"""``bench/steer.py --map question``: steering from the question's own map (``kdn.adapters.hf.question_map``).

No oracle: the retrieval heads are calibrated on the tuning split (``calibrate``: its cases' fact sentences
are known; the test split's never reach it), then every test case's map is made from its own question at
question time -- on the cache each context mode has (a full prefill's, or the chunks loaded for prefix
reuse) -- and the run steers toward the map's top sentences only when the map is sure. Each case runs
unsteered, with the question's map, and with the operator's map (the oracle: the fact's sentence) at the
same heads and alpha, in the full-prefill and prefix-reuse contexts (the blend is left out: its question
runs inside ``blend_prefill``, after the map would have to be made). The map's hit rate: how often its top
sentences cover the fact's sentence, whether or not it was sure enough to steer.
"""

from __future__ import annotations

import copy
import platform
import random
import statistics
import time
from typing import Any

import torch

from kdn.adapters.hf import build_cache
from kdn.adapters.hf.question_map import Example, QuestionMap, Retrieval, calibrate, question_map
from kdn.adapters.hf.steer import plan

import needle as N

# ``S`` below is bench/steer.py's running module (passed in: importing it here would load a second copy,
# without the EOS id its main() sets).

MODES = ("full", "reuse")  # --contexts picks among these
SETTINGS = ("off", "question", "oracle")


def examples(prepared: list[Any]) -> list[Example]:
    """Calibration examples: the prompt, the document's region, the fact's sentence (the operator's span)."""
    return [Example(tuple(p.ids), p.emap.region, p.emap.spans[0]) for p in prepared]


def calibrated(model, tok, tune: list[Any]) -> tuple[Retrieval, float]:
    t0 = time.perf_counter()
    ret = calibrate(model, tok, examples(tune))
    return ret, time.perf_counter() - t0


def reuse_map(model, tok, p: Any, chunks: list[dict], ret: Retrieval) -> QuestionMap:
    """The question's map on the published prefix loaded from its chunks (what ``agenerate`` would make)."""
    with torch.inference_mode():
        cache, n = build_cache(model, chunks)
    return question_map(model, tok, cache, n, p.ids, p.emap.region, ret)


def full_map(model, tok, p: Any, published_cache, ret: Retrieval) -> QuestionMap:
    """The question's map on the full prefill's cache (a copy: the runs after it start from the original)."""
    return question_map(model, tok, copy.deepcopy(published_cache), len(p.published), p.ids, p.emap.region, ret)


def hit(qm: QuestionMap, p: Any) -> bool:
    return qm.covers(p.emap.spans[0])


def describe(ret: Retrieval, t: float) -> str:
    return (f"retrieval heads (layer, head), calibrated on the tuning split in {t:.0f} s: "
            + ", ".join(f"({la},{h})" for la, h in ret.heads)
            + f"; top {ret.top} sentence(s); steered when the lead over the next sentence exceeds "
            f"{ret.min_margin:.2f} std devs")


def run_case(S, model, tok, p: Any, ret: Retrieval, heads, alpha: float, acc: dict, secs: dict, maps: dict,
             nll: bool) -> tuple[list[dict], object]:
    """One test case in the contexts of ``maps`` and all three settings; returns (its chunks, when prefix reuse
    or the NLL check needs them; the first context's question-map plan)."""
    from kdn.adapters.hf import extract_chunks

    chunks = ([c.tensors for c in extract_chunks(model, p.published, chunk_tokens=256)]
              if nll or "reuse" in maps else [])
    published_cache = S.prefill_published(model, p)
    oracle = plan(model, p.emap, alpha=alpha, heads=heads)
    st_full = None
    for m in maps:
        t0 = time.perf_counter()
        qm = full_map(model, tok, p, published_cache, ret) if m == "full" else reuse_map(model, tok, p, chunks, ret)
        t_map = time.perf_counter() - t0
        maps[m].append(qm)
        q = plan(model, qm.emphasis, alpha=alpha, heads=heads)
        st_full = q if st_full is None and m == next(iter(maps)) else st_full
        for s, st in zip(SETTINGS, (None, q, oracle)):
            t0 = time.perf_counter()
            out = (S.gen_full(model, tok, p, published_cache, st) if m == "full"
                   else S.gen_reuse(model, tok, p, chunks, st))
            secs[(m, s)] += time.perf_counter() - t0 + (t_map if s == "question" else 0.0)
            acc[(m, s)] += S.answered(tok, out, p.case.answer)
    return chunks, st_full


def test_split(S, model, tok, test: list[Any], ret: Retrieval, t_cal: float, heads, alpha: float, args,
               res, t_start: float) -> None:
    """The test split's table (see the module's docstring) and its unrelated-continuation NLL check."""
    modes = [m for m in MODES if m in args.contexts.split(",")]
    acc = {(m, s): 0 for m in modes for s in SETTINGS}
    secs = {(m, s): 0.0 for m in modes for s in SETTINGS}
    maps: dict[str, list[QuestionMap]] = {m: [] for m in modes}  # the contexts run, in order
    rng = random.Random(args.seed + 7)
    nll_off, nll_on = [], []
    for i, p in enumerate(test):
        chunks, st = run_case(S, model, tok, p, ret, heads, alpha, acc, secs, maps, i < args.nll_cases)
        if i < args.nll_cases:
            cont = list(tok.encode("\n\n" + N.continuation(rng), add_special_tokens=False))[:128]
            nll_off.append(S.nll_continuation(model, chunks, cont, None))
            nll_on.append(S.nll_continuation(model, chunks, cont, st))
        last = maps[modes[0]][-1]
        print(f"case {i + 1}/{len(test)}: " + " ".join(f"{m}:{s}={acc[(m, s)]}" for m in modes for s in SETTINGS)
              + f" hit={hit(last, p)} sure={last.emphasis is not None}", flush=True)
    table(S, test, ret, t_cal, alpha, len(heads), acc, secs, maps, nll_off, nll_on, args, res, t_start)


def table(S, test, ret, t_cal, alpha, k, acc, secs, maps, nll_off, nll_on, args, res, t_start) -> None:
    n = len(test)
    label = {"full": "full prefill", "reuse": "prefix reuse (KV loaded from stored chunks)"}
    lines = ["| context | no steering | question's map | oracle map (the answer's sentence) | lift, question's map "
             "| s per case (no / question / oracle) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for m in maps:
        a = {s: acc[(m, s)] / n for s in SETTINGS}
        lines.append(f"| {label[m]} | {a['off']:.3f} | {a['question']:.3f} | {a['oracle']:.3f} "
                     f"| {a['question'] - a['off']:+.3f} | "
                     + " / ".join(f"{secs[(m, s)] / n:.1f}" for s in SETTINGS) + " |")
    first = next(iter(maps))
    fm = maps[first]
    agree = (f" (the prefix-reuse maps agree in {sum(a.chosen == b.chosen for a, b in zip(fm, maps['reuse']))} of {n})"
             if first != "reuse" and "reuse" in maps else "")
    hits = [hit(q, p) for q, p in zip(fm, test)]
    sure = [q.emphasis is not None for q in fm]
    sure_hits = sum(h for h, s in zip(hits, sure) if s)
    mo, mn = statistics.fmean(nll_off), statistics.fmean(nll_on)
    chose = ("fixed: the value the oracle run chose on the needles' tuning split" if args.fixed else
             "chosen on the tuning split with the question's maps")
    answered = "(case folded) " if S.FOLD else ""
    lines += ["", f"{args.model} (float32), {n} test cases ({S.split_name(args, False)}); greedy, answered = the "
              f"answer {answered}in the first {S.MAX_NEW} tokens. The question's map ({label[first]}): its top "
              f"sentences cover the answer's sentence in {sum(hits)} of {n} cases; sure enough to steer in "
              f"{sum(sure)} of {n}, of which {sure_hits} cover it{agree}. Steering: K={k} heads, alpha={alpha:g} "
              f"({chose}), the same for the oracle map. {describe(ret, t_cal)}. Unrelated continuation "
              f"({len(nll_off)} contexts, 128 tokens): NLL {mo:.4f} without, {mn:.4f} steered by the question's "
              f"map ({(mn - mo) / mo * 100:+.2f}%). Machine: {platform.machine()}, {torch.get_num_threads()} "
              f"threads, torch {torch.__version__}. Wall time {time.perf_counter() - t_start:.0f} s."]
    what = "SQuAD paragraphs" if args.set == "squad" else "Needle in the middle"
    res.table("main", "\n".join(lines), f"{what}: steering from the question's own map (no oracle)")
    res.write()
