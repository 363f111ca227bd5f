"""Attention steering from emphasis maps (issue #16 item 4) on a needle-in-the-middle set, SmolLM2-135M-Instruct.

    python -P bench/steer.py [--cases 48] [--tune-cases 16] [--quick]

The set (``bench/needle.py``): each case is 3-5 procedurally written prose documents (1.2-1.7k tokens in
all) with one synthetic fact -- a code, a time or a name -- inside a middle document, and a question
whose answer is that fact. Greedy decoding; a case counts as answered when the answer appears in the
first 24 generated tokens.

Each case is published as the origin publishes it (``origin.publish.parse_request``: chat template,
system message, and the operator's emphasis ``{"texts": [fact sentence]}`` resolved to token spans), and
the question is appended with ``prompt_tokens``. Three ways to get the context's KV:

- full prefill: the published prefix computed here in one forward (no stored state), the question on top;
- prefix reuse: the published prefix's chunk states (``extract_chunks``, 256-token chunks: what the
  origin stores) loaded with ``build_cache``, then the question on top (what ``agenerate`` does, without
  the network);
- blend: each document's standalone chunks (positions 0..n-1, as published with ``standalone``),
  RoPE-shifted and blended by ``blend_prefill`` at its default recompute ratio (15%).

each without and with steering (``kdn.adapters.hf.steer``: the question and generated tokens' attention
in the selected heads scaled by ``alpha`` on document tokens outside the emphasized spans). The heads and
``alpha`` are chosen on a tuning split drawn from a different seed (never on the test cases): heads by
the attention mass the question's last token puts on the fact, then (K heads, alpha) by tuning-split
accuracy (prefix reuse) among the settings whose unrelated-continuation NLL increase on the tuning split
stays within ``--nll-budget`` (1%). ``--map probe`` replaces the operator's map by the model-derived one
(``derive_emphasis`` under a probe question that does not name the fact); ``--map question`` makes each
test case's map from its own question at question time (``kdn.adapters.hf.question_map``: retrieval heads
calibrated on the tuning split, a content-free question's attention subtracted, sentences scored, steered
only when the map is sure; ``bench/steer_question.py``) and compares it with the operator's map, an
oracle. The cost side: NLL of an unrelated continuation (a paragraph of other prose
after the documents, teacher-forced) with and without steering.
"""

from __future__ import annotations

import argparse
import bisect
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kdn.adapters.hf import build_cache, extract_chunks, load_model, prompt_tokens, standalone_chunk
from kdn.adapters.hf.extract import _forward, new_cache
from kdn.adapters.hf.rag import Segment, blend_cache, blend_prefill
from kdn.adapters.hf.steer import Steer, attention_to, derive_emphasis, head_scores, plan, steering
from kdn.format.address import chunk_spans
from kdn.emphasis import EmphasisMap
from kdn.origin.publish import parse_request, token_char_ends

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import needle as N  # noqa: E402
import results as R  # noqa: E402
import squad_qa as Q  # noqa: E402
import steer_question as SQ  # noqa: E402

SYSTEM = "Answer the question in a few words, using only the documents."
MAX_NEW = 24
BLEND_RATIO = 0.15  # blend_prefill's default


@dataclass
class Prepared:
    case: N.Case
    published: list[int]  # what the origin publishes: chat head + documents
    ids: list[int]  # published + question + assistant opening
    emap: EmphasisMap  # the operator's map, as parse_request resolves it
    doc_ids: list[list[int]]  # each document's tokens, separators included (for blend)
    head: int  # template head tokens


def prepare(tok, case: N.Case, vocab: int) -> Prepared:
    sep = "\n\n"
    text = sep.join(case.documents)
    spec = parse_request({"name": "needle", "text": text, "template": "chat", "system": SYSTEM,
                          "emphasis": {"texts": [case.fact.rstrip(".")]}}, tokenizer=tok, vocab_size=vocab,
                         max_tokens=8192)
    assert spec.emphasis is not None
    manifest = {"prefix_tokens": spec.tokens, "template": "chat"}
    ids = prompt_tokens(tok, manifest, case.question)
    # Per-document pieces for the blend: the published document's tokens cut where each document starts
    # (by the tokenizer's offsets), so the blended context holds exactly the published tokens.
    body = spec.tokens[spec.head_tokens:]
    ends = token_char_ends(tok, text, body)
    assert ends is not None
    starts, at = [0], 0
    for d in case.documents[:-1]:
        at += len(d) + len(sep)
        starts.append(bisect.bisect_right(ends, at - 1))  # the first token ending past the separator
    doc_ids = [body[a:b] for a, b in zip(starts, starts[1:] + [len(body)])]
    return Prepared(case, spec.tokens, ids, spec.emphasis, doc_ids, spec.head_tokens)


def answered(tok, out: list[int], answer: str) -> bool:
    text = tok.decode(out, skip_special_tokens=True)
    return answer.casefold() in text.casefold() if FOLD else answer in text


FOLD = False  # case-folded matching (--set squad: a written answer's case is not the question)


def decode(model, tok, cache, first: int, pos: int, answer: str) -> list[int]:
    """Greedy decoding of up to MAX_NEW tokens; stops at EOS, or as soon as the answer has appeared (which
    cannot change whether it appears in the first MAX_NEW tokens)."""
    out, nxt = [], first
    while True:
        out.append(nxt)
        if len(out) >= MAX_NEW or nxt == EOS or answered(tok, out, answer):
            return out
        step = _forward(model, cache, torch.tensor([nxt]), pos, logits=True)
        pos += 1
        nxt = int(step.logits[0, -1].argmax())


def prefill_published(model, p: Prepared):
    """The published prefix computed here, in one forward (no stored state): the full prefill's cache."""
    with torch.inference_mode():
        cache = new_cache(model)
        _forward(model, cache, torch.tensor(p.published), 0, logits=False)
        return cache


def gen_full(model, tok, p: Prepared, published_cache, st: Steer | None) -> list[int]:
    """Full prefill: the prefix from ``prefill_published`` (copied: both runs start from it), the question on
    top (steered, if at all, from here: steering never touches the document's own rows), then decoding."""
    import copy

    with torch.inference_mode(), steering(model, st):
        cache = copy.deepcopy(published_cache)
        n = len(p.published)
        logits = _forward(model, cache, torch.tensor(p.ids[n:]), n, logits=False).logits[0, -1]
        return decode(model, tok, cache, int(logits.argmax()), len(p.ids), p.case.answer)


def gen_reuse(model, tok, p: Prepared, chunks: list[dict], st: Steer | None) -> list[int]:
    """The published prefix's chunk states loaded (``build_cache``), the question on top, then decoding."""
    with torch.inference_mode(), steering(model, st):
        cache, n = build_cache(model, chunks)
        logits = _forward(model, cache, torch.tensor(p.ids[n:]), n, logits=False).logits[0, -1]
        return decode(model, tok, cache, int(logits.argmax()), len(p.ids), p.case.answer)


def gen_blend(model, tok, p: Prepared, segs: list[Segment], st: Steer | None) -> list[int]:
    b = blend_prefill(model, segs, recompute_ratio=BLEND_RATIO, steer=st)
    with torch.inference_mode(), steering(model, st):
        return decode(model, tok, blend_cache(model, b), int(b.logits[-1].argmax()), b.n_tokens, p.case.answer)


def blend_segments(model, p: Prepared) -> tuple[list[Segment], list[int]]:
    """Head fresh, each document's standalone chunks, the question fresh; and the composed token ids."""
    segs = [Segment(p.published[:p.head])]
    for d in p.doc_ids:
        segs += [Segment(d[s:e], standalone_chunk(model, d[s:e]).tensors) for s, e in chunk_spans(len(d), 256)]
    segs.append(Segment(p.ids[len(p.published):]))  # the question, fresh
    return segs, [t for s in segs for t in s.ids]


def nll_continuation(model, chunks: list[dict], cont: list[int], st: Steer | None) -> float:
    """Mean NLL of ``cont`` teacher-forced after the published prefix (loaded from its chunks); steering,
    if any, on the continuation's queries."""
    with torch.inference_mode(), steering(model, st):
        cache, n = build_cache(model, chunks)
        logits = _forward(model, cache, torch.tensor(cont), n, logits=True).logits[0, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits, torch.tensor(cont[1:])).item())


PROBE = "Which code, time or name do the documents give?"


def probe_map(model, p: Prepared, probe: list[int], heads) -> EmphasisMap:
    """The model-derived map an origin publishes for ``emphasis: {"probes": [PROBE]}``; counts whether it
    covers the fact (``PROBE_HITS``)."""
    fact = p.emap
    m = derive_emphasis(model, p.published, fact.region, [probe], heads=heads)
    PROBE_HITS.append(any(s < fe and fs < e for s, e in m.spans for fs, fe in fact.spans))
    return m


PROBE_HITS: list[bool] = []


def select_heads(model, tune: list[Prepared], tune_chunks: list[list[dict]]) -> list[tuple[int, int]]:
    """All heads ranked by the attention mass the prompt's last token puts on the fact (tuning split; the
    published prefix loaded from its chunks, the question run on top with its attention recorded)."""
    total = None
    for p, chunks in zip(tune, tune_chunks):
        pos = [i for s, e in p.emap.spans for i in range(s, e)]
        with torch.inference_mode(), attention_to(model) as att:
            cache, n = build_cache(model, chunks)
            _forward(model, cache, torch.tensor(p.ids[n:]), n, logits=False)
        sc = head_scores(att, pos)  # [layers, heads]
        total = sc if total is None else total + sc
    assert total is not None
    order = torch.argsort(total.flatten(), descending=True).tolist()
    H = total.shape[1]
    return [(i // H, i % H) for i in order]


EOS: int | None = None


def split_name(args, tuning: bool) -> str:
    if args.set == "squad":
        return f"SQuAD 2.0 dev, bench/data/squad-steer.json, {'tuning' if tuning else 'test'} articles"
    return f"seed {args.seed + 1000 if tuning else args.seed}"


def main() -> None:
    global EOS, FOLD
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cases", type=int, default=48)
    ap.add_argument("--tune-cases", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1, help="test split seed (the tuning split uses seed + 1000)")
    ap.add_argument("--k", default="24,32,40", help="numbers of heads to try on the tuning split")
    ap.add_argument("--alphas", default="0.03,0.05,0.07", help="alphas to try on the tuning split")
    # Half the 1% target: the first budgeted run chose +0.62% on the tuning split and measured +1.13% on
    # the test split (steer.json before this default), so the tuning split needs a margin.
    ap.add_argument("--nll-budget", type=float, default=0.005,
                    help="the largest unrelated-continuation NLL increase a tuned setting may cost (tuning split)")
    ap.add_argument("--nll-cases", type=int, default=16, help="cases whose context gets the continuation NLL check")
    ap.add_argument("--map", default="operator", choices=["operator", "probe", "question"],
                    help="operator: the fact's sentence marked at publish; probe: the origin's model-derived map "
                         "(derive_emphasis under --probe, which does not name the fact); question: each question's "
                         "own map at question time, against the operator's (bench/steer_question.py)")
    ap.add_argument("--set", default="needle", choices=["needle", "squad"],
                    help="needle: bench/needle.py's generated cases; squad: bench/data/squad-steer.json (SQuAD 2.0 "
                         "questions, their paragraph among 3 of the same article; bench/squad_qa.py)")
    ap.add_argument("--probe", default=PROBE, help="the probe question of --map probe")
    ap.add_argument("--fixed", action="store_true", help="take the one --k and --alphas given as chosen (by an "
                    "earlier run on the same tuning split) instead of tuning them here: no tuning grid")
    ap.add_argument("--contexts", default="full,reuse", help="--map question: the contexts to run (full, reuse)")
    ap.add_argument("--no-headline", action="store_true", help="no README headline (a side run)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 test cases, 2 tuning cases, one (K, alpha)")
    R.add_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.cases, args.tune_cases, args.k, args.alphas, args.nll_cases = 2, 2, "16", "0.05", 1
    res = R.Results("steer", args)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    lm = load_model(args.model, dtype=torch.float32)
    model, tok = lm.model, lm.tokenizer
    EOS = tok.eos_token_id
    vocab = model.config.vocab_size
    if args.set == "squad":  # its own fixed splits (other articles for tuning); --seed draws nothing
        FOLD = True
        tune = [prepare(tok, c, vocab) for c in Q.make_cases("tune", args.tune_cases)]
        test = [prepare(tok, c, vocab) for c in Q.make_cases("test", args.cases)]
    else:
        tune = [prepare(tok, c, vocab) for c in N.make_cases(args.tune_cases, args.seed + 1000)]
        test = [prepare(tok, c, vocab) for c in N.make_cases(args.cases, args.seed)]

    # --- tuning split: heads, then (K, alpha) --------------------------------------------------------
    t0 = time.perf_counter()
    tune_chunks = [[c.tensors for c in extract_chunks(model, p.published, chunk_tokens=256)] for p in tune]
    ranked = select_heads(model, tune, tune_chunks)
    ks, alphas = [int(k) for k in args.k.split(",")], [float(a) for a in args.alphas.split(",")]
    if args.fixed and len(ks) * len(alphas) != 1:
        raise SystemExit("--fixed takes one --k and one --alphas")
    if args.map == "probe":  # replace the operator's maps by what the model marks under a generic probe
        probe = prompt_tokens(tok, {"prefix_tokens": [], "template": "chat"}, args.probe)
        for p in tune + test:
            p.emap = probe_map(model, p, probe, ranked[:max(ks)])
    tune_maps: list[EmphasisMap | None] = [p.emap for p in tune]
    ret, t_cal = None, 0.0
    if args.map == "question":  # heads calibrated on the tuning split; its own questions' maps tune K and alpha
        ret, t_cal = SQ.calibrated(model, tok, tune)
        qmaps = [SQ.reuse_map(model, tok, p, ch, ret) for p, ch in zip(tune, tune_chunks)]
        tune_maps = [q.emphasis for q in qmaps]
        print(SQ.describe(ret, t_cal) + f"; tuning split: {sum(SQ.hit(q, p) for q, p in zip(qmaps, tune))} hits, "
              f"{sum(m is not None for m in tune_maps)} sure, of {len(tune)}", flush=True)

    def tune_acc(k: int, a: float) -> float:
        return sum(answered(tok, gen_reuse(model, tok, p, ch, plan(model, m, alpha=a, heads=ranked[:k])
                                           if k else None), p.case.answer)
                   for p, ch, m in zip(tune, tune_chunks, tune_maps)) / len(tune)

    if args.fixed:  # the one (K, alpha) given, as an earlier run chose it on this tuning split: no grid here
        best_k, best_a = ks[0], alphas[0]
        heads = ranked[:best_k]
        res.table("tune", f"Fixed, not tuned in this run: K={best_k}, alpha={best_a:g}; heads (layer, head), ranked "
                  f"on the tuning split ({len(tune)} cases, {split_name(args, True)}): "
                  + ", ".join(f"({la},{h})" for la, h in heads) + f". {time.perf_counter() - t0:.0f} s.",
                  "Tuning split: the steered heads (K and alpha fixed)")
    else:
        trng = random.Random(args.seed + 2000)
        tune_conts = [list(tok.encode("\n\n" + N.continuation(trng), add_special_tokens=False))[:128] for _ in tune]
        tune_nll0 = statistics.fmean(nll_continuation(model, ch, c, None) for ch, c in zip(tune_chunks, tune_conts))

        def tune_nll(k: int, a: float) -> float:
            """The tuning split's unrelated-continuation NLL increase with this steering (relative)."""
            on = statistics.fmean(nll_continuation(model, ch, c, plan(model, m, alpha=a, heads=ranked[:k]))
                                  for m, ch, c in zip(tune_maps, tune_chunks, tune_conts))
            return (on - tune_nll0) / tune_nll0

        base_tune = tune_acc(0, 1.0)
        grid, cost = {}, {}
        for k in ks:
            for a in alphas:
                grid[(k, a)], cost[(k, a)] = tune_acc(k, a), tune_nll(k, a)
                print(f"tune K={k} alpha={a}: {grid[(k, a)]:.3f} (unsteered {base_tune:.3f}), "
                      f"NLL {cost[(k, a)] * 100:+.2f}%", flush=True)
        # The best accuracy among settings within the NLL budget on the tuning split (ties: fewer heads, gentler
        # alpha); if none fits, the one that costs least.
        fits = [x for x in grid if cost[x] <= args.nll_budget]
        best_k, best_a = (max(fits, key=lambda x: (grid[x], -x[0], x[1])) if fits else min(cost, key=cost.__getitem__))
        heads = ranked[:best_k]
        t_tune = time.perf_counter() - t0
        tl = ["| K heads | " + " | ".join(f"alpha {a:g}: accuracy, NLL" for a in alphas) + " |",
              "| ---: | " + " | ".join("---:" for _ in alphas) + " |"]
        for k in ks:
            tl.append(f"| {k} | " + " | ".join(f"{grid[(k, a)]:.3f}, {cost[(k, a)] * 100:+.2f}%" for a in alphas) + " |")
        tl += ["", f"Tuning split: {len(tune)} cases ({split_name(args, True)}), prefix reuse, unsteered accuracy "
               f"{base_tune:.3f}; NLL: unrelated-continuation NLL increase on the same contexts; chosen: the best "
               f"accuracy within a {args.nll_budget * 100:g}% NLL budget, K={best_k}, alpha={best_a:g}; heads "
               "(layer, head): " + ", ".join(f"({la},{h})" for la, h in heads) + f". {t_tune:.0f} s."]
        res.table("tune", "\n".join(tl), "Tuning split: accuracy and continuation NLL by number of steered heads and alpha "
                  "(prefix reuse)")
    if ret is not None:
        return SQ.test_split(sys.modules[__name__], model, tok, test, ret, t_cal, heads, best_a, args, res, t_start)

    # --- test split --------------------------------------------------------------------------------------
    modes = ["full", "reuse", "blend"]
    hits = {(m, s): 0 for m in modes for s in (False, True)}
    secs = {(m, s): 0.0 for m in modes for s in (False, True)}
    rng = random.Random(args.seed + 7)
    nll_off, nll_on = [], []
    lengths = []
    for i, p in enumerate(test):
        st = plan(model, p.emap, alpha=best_a, heads=heads)
        lengths.append(len(p.ids))
        chunks = [c.tensors for c in extract_chunks(model, p.published, chunk_tokens=256)]
        published_cache = prefill_published(model, p)
        segs, blend_ids = blend_segments(model, p)
        assert blend_ids == p.ids, "the blended context must hold the published tokens"
        for s in (False, True):
            for m in modes:
                t0 = time.perf_counter()
                if m == "full":
                    out = gen_full(model, tok, p, published_cache, st if s else None)
                elif m == "reuse":
                    out = gen_reuse(model, tok, p, chunks, st if s else None)
                else:
                    out = gen_blend(model, tok, p, segs, st if s else None)
                secs[(m, s)] += time.perf_counter() - t0
                hits[(m, s)] += answered(tok, out, p.case.answer)
        if i < args.nll_cases:
            cont = list(tok.encode("\n\n" + N.continuation(rng), add_special_tokens=False))[:128]
            nll_off.append(nll_continuation(model, chunks, cont, None))
            nll_on.append(nll_continuation(model, chunks, cont, st))
        print(f"case {i + 1}/{len(test)}: " + " ".join(f"{m}{'+s' if s else ''}={hits[(m, s)]}"
                                                     for m in modes for s in (False, True)), flush=True)

    n = len(test)
    acc = {k: v / n for k, v in hits.items()}
    label = {"full": "full prefill", "reuse": "prefix reuse (KV loaded from stored chunks)",
             "blend": f"blend ({BLEND_RATIO:.0%} recompute)"}
    lines = ["| context | accuracy, no steering | accuracy, steering | lift | s per case (no / with) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for m in modes:
        lines.append(f"| {label[m]} | {acc[(m, False)]:.3f} | {acc[(m, True)]:.3f} "
                     f"| {acc[(m, True)] - acc[(m, False)]:+.3f} "
                     f"| {secs[(m, False)] / n:.1f} / {secs[(m, True)] / n:.1f} |")
    med = statistics.median
    mo, mn = statistics.fmean(nll_off), statistics.fmean(nll_on)
    nll_inc = (mn - mo) / mo
    lines += ["", f"{args.model} (float32), {n} test cases ({split_name(args, False)}), prompts {min(lengths)}-{max(lengths)} "
              f"tokens (median {med(lengths):.0f}); greedy, answered = the answer in the first {MAX_NEW} tokens; "
              f"steering: K={best_k} heads, alpha={best_a:g} (chosen on the tuning split), "
              + ("the operator's map (the fact's sentence). " if args.map == "operator" else
                 f"the model-derived map (probe {args.probe!r}: its 8 most-attended positions +-4 tokens; it "
                 f"covers the fact in {sum(PROBE_HITS[len(tune):])} of {n} test cases). ")
              + f"Unrelated continuation ({len(nll_off)} contexts, 128 tokens of other prose "
              f"after the documents): NLL {mo:.4f} without, {mn:.4f} with steering ({nll_inc * 100:+.2f}%). "
              f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}. "
              f"Wall time {time.perf_counter() - t_start:.0f} s."]
    res.table("main", "\n".join(lines), "Needle in the middle: accuracy with and without steering")
    lift = acc[("full", True)] - acc[("full", False)]
    figs = [{"shown": f"{acc[('full', False)]:.3f}", "cell": f"{acc[('full', False)]:.3f}", "table": "main"},
            {"shown": f"{acc[('full', True)]:.3f}", "cell": f"{acc[('full', True)]:.3f}", "table": "main"},
            {"shown": f"{acc[('blend', True)]:.3f}", "cell": f"{acc[('blend', True)]:.3f}", "table": "main"}]
    met = lift >= 0.10 and nll_inc <= 0.01 and acc[("blend", True)] >= acc[("full", False)]
    if args.no_headline:
        res.write()
        return
    res.set_headline(
        "attention steering from the manifest's emphasis map, needle in the middle" + (
            " (the operator's map: it marks the answer's sentence, an oracle)" if args.map == "operator" else
            " (the origin's probe map: no question known)"),
        f"accuracy {acc[('full', False)]:.3f} -> {acc[('full', True)]:.3f} (full prefill), blend + steering "
        f"{acc[('blend', True)]:.3f}; unrelated-continuation NLL {nll_inc * 100:+.2f}%; the targets are "
        + ("met" if met else "**not met**" + (f" (the NLL-within-1% one; accuracy +{lift:.3f} and blend + steering "
                                                  f">= full prefill are met)" if lift >= 0.10 and acc[("blend", True)]
                                                  >= acc[("full", False)] and nll_inc > 0.01 else "")),
        f"full prefill without steering, same {n} cases", figs)
    res.write()


if __name__ == "__main__":
    main()
