"""Reuse across edits on SmolLM2-135M: read an edited document from its old version's published states.

    python -P bench/edits.py [--quick] [--ratios 5,15,30] [--continuation 128]

The old version is the first ~1.7k tokens of a shipped document (``kdn/data/docs``, whole paragraphs),
published with the chat template (the document opens a user turn; a question continues it) as a prefix
chain through a real origin (its own process, an embedded registry) and read through an edge (its own
process, a memory tier), both on 127.0.0.1. Each edit (written here: a sentence
changed, a paragraph inserted, a section of several paragraphs deleted, each near the start, the middle
and the end) makes a new version that is not published. For each edit, paths:

- full prefill: the new version and the question, one forward (``logits_to_keep=1``) - the reference;
- exact reuse: ``agenerate`` (lookup, load the chunks wholly before the edit, prefill the rest), exact;
- approximate reuse at each ``--ratios`` (``kdn.adapters.hf.edits.generate_edited``): the old version's
  states after the edit RoPE-shifted to their new positions and blended (``deviation-query``).

The reader knows only the old manifest (its tokens and chunk addresses) and the new version's tokens:
no oracle alignment. Per path: tokens exact / reused approximately / computed; the NLL of the document's
own next ``--continuation`` tokens after the new version (teacher-forced as the fresh tail of the prefill,
NLL over all but its first token) against the full prefill's; greedy answers to questions on unchanged
parts and on the edited part (answered: the answer string is in the first 24 generated tokens; same: the
24 tokens equal the full prefill's); time to the first token (fetch included), median over the questions.
"""

from __future__ import annotations

import argparse
import asyncio
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

from kdn.adapters.hf import agenerate, load_model  # noqa: E402
from kdn.adapters.hf import prompt_tokens  # noqa: E402
from kdn.adapters.hf.edits import edit_prefill, generate_edited, new_tokens_of, plan_edit  # noqa: E402
from kdn.adapters.hf.extract import _forward, new_cache  # noqa: E402
from kdn.adapters.hf.generate import decode_loop, model_id as engine_model_id  # noqa: E402
from kdn.adapters.hf.rag import full_prefill  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import results as R  # noqa: E402
import ttft as T  # noqa: E402  (origin/edge processes, health checks)

DOCS = Path(__file__).resolve().parents[1] / "kdn" / "data" / "docs"
GEN_TOKENS = 24

# Per document: the old version's paragraphs, questions on parts no edit touches, and the edits. An edit:
# (kind, place, what, question, answer): "sentence" (old sentence, new sentence), "insert" (the paragraph
# it follows, the new paragraph), "delete" (the first and last paragraph deleted, by their openings).
# The question of an insert or a sentence asks for the new text; of a delete, for the text right after it.
SPEC = {
    "harbor-policy": {
        "paragraphs": 33,
        "questions": [("What is the nightly hotel limit in most cities?", "$220"),
                      ("Which class is the standard for all flights?", "Economy")],
        "edits": [
            ("sentence", "start",
             ("We employ about 1,400 people, roughly a third of whom work on the quaysides and in the yards, and the "
              "rest in dispatch, engineering, finance, and customer operations.",
              "We employ about 2,150 people since the merger with Saltmarsh Freight, roughly half of whom work on the "
              "quaysides and in the yards, and the rest in dispatch, engineering, finance, and customer operations."),
             "How many people does Harbor & Finch employ?", "2,150"),
            ("insert", "start",
             ("Harbor & Finch Logistics moves containers",
              "Our fourth terminal, at Kestrel Point, opened in March and handles only refrigerated cargo. Its site "
              "manager is Odile Marchetti, who can be reached on extension 5120."),
             "Who is the site manager of the Kestrel Point terminal?", "Odile Marchetti"),
            ("delete", "start", ("## About This Handbook", "Where this handbook and a local site notice disagree"),
             "Who must approve international trips besides the line manager?", "department head"),
            ("sentence", "middle",
             ("While traveling on company business, you receive a daily meal allowance of $75.",
              "While traveling on company business, you receive a daily meal allowance of $95."),
             "What is the daily meal allowance while traveling?", "$95"),
            ("insert", "middle",
             ("While traveling on company business",
              "### Travel insurance\n\nEvery trip abroad is covered by the company's travel insurance with Meridian "
              "Mutual. The policy number is HF-88213, and the emergency assistance line is open around the clock."),
             "What is the policy number of the company's travel insurance?", "HF-88213"),
            ("delete", "middle", ("### Meals and daily allowance", "Taxis and ride-hailing services"),
             "Through which system must expense claims be submitted?", "Ledgerline"),
            ("sentence", "end",
             ("Staff on call receive a flat allowance of $300 for each week as primary",
              "Staff on call receive a flat allowance of $360 for each week as primary"),
             "How much is the on-call allowance for a week as primary responder?", "$360"),
            ("insert", "end",
             ("Staff on call receive a flat allowance",
              "Staff who are paged more than 17 times in one week receive an extra day of leave, which must be taken "
              "within the following month. This rule was agreed with the Port Calder works council in 2023."),
             "How many pages in one week earn an extra day of leave?", "17"),
            ("delete", "end", ("### Limits and fairness", "Staff on call receive a flat allowance"),
             "Within how many working days does a Severity 1 incident need a written review?", "five"),
        ],
    },
}
QUICK_EDITS = [("harbor-policy", "sentence", "middle")]


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def versions(name: str) -> tuple[list[str], str]:
    """The old version's paragraphs and the text after them (the continuation's source)."""
    paras = (DOCS / f"{name}.md").read_text().split("\n\n")
    n = SPEC[name]["paragraphs"]
    return paras[:n], "\n\n".join(paras[n:])


def apply(paras: list[str], kind: str, what: tuple[str, str]) -> list[str]:
    a, b = what
    if kind == "sentence":
        (i,) = [i for i, p in enumerate(paras) if a in p]
        return paras[:i] + [paras[i].replace(a, b)] + paras[i + 1:]
    if kind == "insert":
        (i,) = [i for i, p in enumerate(paras) if p.startswith(a)]
        return paras[:i + 1] + [b] + paras[i + 1:]
    (i,) = [i for i, p in enumerate(paras) if p.startswith(a)]
    (j,) = [j for j, p in enumerate(paras) if p.startswith(b)]
    assert j >= i + 1, (a, b)
    return paras[:i] + paras[j + 1:]


def text_of(paras: list[str]) -> str:
    return "\n\n".join(paras) + "\n\n"


def tail_of(tok, question: str) -> list[int]:
    """The question after a document published with the chat template: the user turn goes on, then closes."""
    return prompt_tokens(tok, {"prefix_tokens": [], "template": "chat"}, question)


def lean(model, ids: list[int]):
    """One forward of the whole prompt (``logits_to_keep=1``): first token, seconds, the cache."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = new_cache(model)
        out = _forward(model, cache, torch.tensor(ids, dtype=torch.long), 0, logits=False)
        first = int(torch.argmax(out.logits[0, -1].float()))
    return first, time.perf_counter() - t0, cache


def nll_of(logits: torch.Tensor, cont: list[int]) -> float:
    """Mean NLL of ``cont[1:]`` from the logits of ``cont[:-1]`` (``logits``: [len(cont), vocab])."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return -lp[torch.arange(len(cont) - 1), torch.tensor(cont[1:])].mean().item()


async def publish(session, origin: str, name: str, text: str) -> dict:
    headers = {"Authorization": f"Bearer {T.PUBLISH_TOKEN}"}
    body = {"name": name, "text": text, "template": "chat", "encodings": ["zstd", "raw"]}
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

    tmp = Path(tempfile.mkdtemp(prefix="kdn-edits-"))
    procs: list = []
    try:
        origin, edge = T.origin_and_memory_edge(tmp, args.model, args.dtype, procs)
        torch.manual_seed(0)
        lm = load_model(args.model, dtype=getattr(torch, args.dtype))
        model, tok = lm.model, lm.tokenizer
        model.eval()
        docs = sorted({d for d, *_ in args.edits})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-mem" in (b.get("ring") or []))
            mid = engine_model_id(model, tok)
            for d in docs:
                man = await publish(s, origin.url, d, text_of(versions(d)[0]))
                if man["model_id"] != mid:
                    raise RuntimeError(f"origin model id {man['model_id'][:12]} != bench model id {mid[:12]}")
        async with KDNClient(edges=[edge.url]) as client:
            manifests = {d: await client.manifest("public", d) for d in docs}
            for d, man in manifests.items():  # the first read fills the edge: the timed ones hit its memory tier
                assert man is not None, d
                for a in man.addresses:
                    await client.fetch(a)
                log(f"{d}: old version {len(man.prefix_tokens)} tokens, {len(man.addresses)} chunks")
            await measure(args, res, log, model, tok, client, manifests)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def measure(args, res, log, model, tok, client, manifests) -> None:
    loop = asyncio.get_running_loop()
    ratios = args.ratios
    paths = ["full prefill", "exact reuse"] + [f"approximate {r * 100:g}%" for r in ratios]
    rows, agg = [], {p: {"dnll": [], "answered": 0, "same": 0, "n": 0, "speedup": [], "ttft": []} for p in paths}
    # torch's first forwards pay one-off costs
    man0 = next(iter(manifests.values()))
    lean(model, man0.prefix_tokens[:512])
    for doc, kind, place in args.edits:
        spec = SPEC[doc]
        (edit,) = [e for e in spec["edits"] if e[0] == kind and e[1] == place]
        _, _, what, q_edit, a_edit = edit
        paras, after = versions(doc)
        man = manifests[doc]
        assert man.template == "chat"
        new = new_tokens_of(tok, man, text_of(apply(paras, kind, what)))  # the chat head, then the new text
        cont = encode(tok, after)[:args.continuation]
        questions = ([(q_edit, a_edit, "edited")] + [(q, a, "unchanged") for q, a in spec["questions"]])
        questions = questions[:args.questions]
        plan = plan_edit(man.prefix_tokens, new, man.chunk_tokens)
        log(f"{doc} {kind} at the {place}: {len(man.prefix_tokens)} -> {len(new)} tokens, runs "
            f"{[(m.old, m.new, m.size) for m in plan.matches]}")
        # NLL of the continuation: the reference, the exact prefix with the rest computed, each ratio.
        ref = await loop.run_in_executor(None, lambda: full_prefill(model, new + cont, n_logits=len(cont)))
        nll = {"full prefill": nll_of(ref.logits, cont)}
        counts: dict[str, tuple[int, int, int]] = {"full prefill": (0, 0, len(new))}
        if plan.exact:
            ex = await edit_prefill(model, tok, man, new, cont, client, recompute_ratio=0.0, min_run=1 << 30,
                                    n_logits=len(cont))
            nll["exact reuse"] = nll_of(ex.blend.logits, cont)
        else:
            nll["exact reuse"] = nll["full prefill"]  # nothing before the edit: the exact path is the full prefill
        for r, p in zip(ratios, paths[2:]):
            out = await edit_prefill(model, tok, man, new, cont, client, recompute_ratio=r, n_logits=len(cont))
            nll[p] = nll_of(out.blend.logits, cont)
            rep = out.report
            counts[p] = (rep.tokens_exact, rep.tokens_approx, rep.tokens_computed - len(cont))
        # Questions: TTFT and greedy answers per path (the order of the paths rotates per question).
        per = {p: {"ttft": [], "answered": 0, "same": 0, "recomputed": []} for p in paths}
        for qi, (q, a, where) in enumerate(questions):
            tail = tail_of(tok, q)
            got: dict[str, tuple[float, list[int]]] = {}
            for p in paths[qi % len(paths):] + paths[:qi % len(paths)]:
                if p == "full prefill":
                    first, dt, cache = await loop.run_in_executor(None, lean, model, new + tail)
                    ids = await loop.run_in_executor(None, lambda: decode_loop(
                        model, cache, first, len(new) + len(tail), GEN_TOKENS, tok.eos_token_id))
                    got[p] = (dt, ids)
                elif p == "exact reuse":
                    g = await agenerate(model, tok, new + tail, client, plan=False, max_new_tokens=GEN_TOKENS)
                    got[p] = (g.report.ttft_ms / 1e3, g.ids)
                    counts[p] = (g.report.tokens_reused, 0, len(new) - g.report.tokens_reused)
                else:
                    r = ratios[paths.index(p) - 2]
                    g = await generate_edited(model, tok, man, new, tail, client, recompute_ratio=r,
                                              max_new_tokens=GEN_TOKENS)
                    got[p] = (g.report.ttft_ms / 1e3, g.ids)
                    per[p]["recomputed"].append(g.report.recompute_share)
            ref_ids = got["full prefill"][1]
            for p in paths:
                dt, ids = got[p]
                text = tok.decode(ids, skip_special_tokens=True)
                per[p]["ttft"].append(dt)
                per[p]["answered"] += a in text
                per[p]["same"] += ids == ref_ids
                if p == "full prefill" or p == paths[-1]:
                    log(f"  q{qi + 1} ({where}) {p}: {a in text} {text.strip()[:70]!r}")
        t_full = statistics.median(per["full prefill"]["ttft"])
        for p in paths:
            x = per[p]
            t = statistics.median(x["ttft"])
            ex_, ap_, co_ = counts[p]
            dn = (nll[p] - nll["full prefill"]) / nll["full prefill"]
            share = f"{statistics.mean(x['recomputed']) * 100:.1f}%" if x["recomputed"] else "-"
            rows.append(f"| {doc} | {kind} | {place} | {p} | {ex_} / {ap_} / {co_} | {share} | {nll[p]:.3f} "
                        f"| {dn * 100:+.1f}% | {x['answered']}/{len(questions)} | {x['same']}/{len(questions)} "
                        f"| {t * 1e3:.0f} | {t_full / t:.2f}x |")
            g_ = agg[p]
            g_["dnll"].append(dn)
            g_["answered"] += x["answered"]
            g_["same"] += x["same"]
            g_["n"] += len(questions)
            g_["speedup"].append(t_full / t)
            g_["ttft"].append(t)
            log(f"  {p}: {ex_}/{ap_}/{co_} tokens, NLL {nll[p]:.3f} ({dn * 100:+.1f}%), answered {x['answered']}/"
                f"{len(questions)}, same {x['same']}/{len(questions)}, TTFT {t * 1e3:.0f} ms ({t_full / t:.2f}x)")
    med = statistics.median
    load0, load1 = res.load_before, R._load()
    head = [f"{args.model} ({args.dtype}); the old version of each document published as a prefix chain through an "
            f"origin and read from one edge's memory tier over HTTP on 127.0.0.1; the new versions are not published. "
            f"Continuation: the document's next {args.continuation} tokens after the new version; questions: "
            f"{args.questions} per edit (the edited part first), greedy, {GEN_TOKENS} tokens",
            ""]
    main = head + [
        "| document | edit | where | path | tokens exact / approximate / computed | recomputed share of the "
        "approximate | continuation NLL/token | vs full prefill | answered | same answer as full prefill "
        "| TTFT ms (median) | speedup vs full prefill |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows]
    summary = ["| path | continuation NLL vs full prefill (mean, worst) | answered | same answer as full prefill "
               "| speedup vs full prefill (median, worst) |",
               "| --- | ---: | ---: | ---: | ---: |"]
    out = []
    for p in paths:
        g_ = agg[p]
        summary.append(f"| {p} | {statistics.mean(g_['dnll']) * 100:+.1f}% ({max(g_['dnll']) * 100:+.1f}%) "
                       f"| {g_['answered']}/{g_['n']} | {g_['same']}/{g_['n']} | {med(g_['speedup']):.2f}x "
                       f"({min(g_['speedup']):.2f}x) |")
        out.append({"path": p, "dnll_mean": statistics.mean(g_["dnll"]), "dnll_worst": max(g_["dnll"]),
                    "answered": g_["answered"], "same": g_["same"], "n": g_["n"],
                    "speedup_median": med(g_["speedup"])})
    tail = ["", f"Tokens computed: of the document (the question or continuation comes on top). Exact reuse "
            f"loads the chunks wholly before the edit (`agenerate`); the approximate path also the edited chunk's "
            f"tokens before the edit (exact) and every matching run after it (shifted). Machine: "
            f"{platform.machine()}, {os.cpu_count()} cores shared with other work, {torch.get_num_threads()} torch "
            f"threads, torch {torch.__version__}; 1-minute load average {_fmt_load(load0)} at the start, "
            f"{_fmt_load(load1)} at the end. Wall time {time.perf_counter() - res.t0:.0f} s."]
    print()
    res.table("main", "\n".join(main + tail), "Reuse across edits: per edit and path")
    res.table("summary", "\n".join(summary), "Reuse across edits: per path, over all edits")
    res.extra["edits"] = {"summary": out}


def _fmt_load(load) -> str:
    return f"{load[0]:.2f}" if load else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--ratios", default="5,15,30", help="recompute ratios of the approximate path, percent")
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--questions", type=int, default=3, help="per edit: the edited part's, then unchanged parts'")
    ap.add_argument("--quick", action="store_true", help="one edit, one ratio (15%%), one question, 32 tokens")
    R.add_arg(ap)
    args = ap.parse_args()
    args.edits = [(d, e[0], e[1]) for d in SPEC for e in SPEC[d]["edits"]]
    if args.quick:
        args.edits, args.ratios, args.continuation, args.questions = QUICK_EDITS, "15", 32, 1
    args.ratios = [float(x) / 100 for x in str(args.ratios).split(",")]
    R.run_logged("edits", args, run)


if __name__ == "__main__":
    main()
