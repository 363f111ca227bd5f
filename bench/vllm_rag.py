"""RAG in vLLM: documents published alone, composed at question time, vs vLLM's own prefill of the prompt.

    python -P bench/vllm_rag.py [--cases 24] [--docs 4,8] [--per-doc 2] [--ratios 15] [--answer-tokens 24]

The set: SQuAD 2.0 reading-comprehension cases (``bench/data/squad-steer.json``, its test split; see
``bench/squad_qa.py`` for its source and license): each question's paragraph among three others of the
same Wikipedia article, and paragraphs of other articles (the next cases') up to ``--docs`` documents of
``--per-doc`` paragraphs each (about 300 tokens at 2); the case's own paragraphs are never the first
document. Each document is published once with ``"standalone": true`` (no prefix chain) through an origin
(transformers, bf16, its own process, an embedded registry) and read once through an edge (its own
process, a memory tier) before the timed runs, all on 127.0.0.1. The prompt: SmolLM2-135M-Instruct's chat
template, the documents in the case's order, the question (``kdn.adapters.vllm.blend.rag_prompt``).

One vLLM engine (CPU, bf16, in this process, prefix caching on) with the KDN connector (``blend`` on).
Per case, in rotating order, the time to the first token (``LLM.generate``, one output token):

- ``prefill``: vLLM computes the prompt (a fresh cache salt: its prefix cache holds nothing for it);
- ``blend R%``: a fresh salt with the blend's: the connector asks the edge for the documents' records,
  fetches and verifies each chunk, shifts it into place and recomputes ``R%`` of the documents' tokens past
  the check layer (``deviation-query``), all inside the step; vLLM computes the prompt's last block;
- ``compose``: the same at 0% (nothing recomputed): the floor of this design;
- ``local-hit``: vLLM's own prefix cache holds this very prompt (warmed just before): the bound, what
  any cache can do at best (an oracle: it needs this exact prompt seen before).

Accuracy: greedy answers of ``--answer-tokens`` tokens per path (untimed, a fresh salt each); a case is
answered when one of its annotated answers appears in the text (case folded), as ``bench/steer.py`` scores
the same set; and how many answers are token for token vLLM's own prefill's. SmolLM2-135M answers few of
these SQuAD cases at all, so ``--needles`` adds ``bench/steer.py``'s needle cases (3-5 generated documents,
a synthetic fact in a middle one, 1-2k tokens), which it answers about a third of the time. Reported beside
vLLM's own prefill on the same cases; with the worst case (slowest speedup).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))
import results as R  # noqa: E402
from ports import free_port  # noqa: E402
from vllm_ttft import PUBLISH_TOKEN, Proc, machine, publish, vllm_env  # noqa: E402

MODEL = "smollm2-135m"
DATA = ROOT / "bench" / "data" / "squad-steer.json"


def cases(n: int, n_docs: int, per_doc: int) -> list[dict]:
    """``n`` test cases, each with ``n_docs`` documents of ``per_doc`` paragraphs: the case's own four
    paragraphs (the answer's among them) in the second and later documents, the rest other articles'."""
    test = json.loads(DATA.read_text())["test"]
    if n > len(test):
        raise SystemExit(f"--cases {n}: the set has {len(test)}")
    out = []
    for i, c in enumerate(test[:n]):
        own = list(c["paragraphs"])
        others: list[str] = []
        j = i + 1
        while len(own) + len(others) < n_docs * per_doc:
            o = test[j % len(test)]["paragraphs"]
            others += [p for p in o if p not in own and p not in others][:per_doc]
            j += 1
        paras = others[:per_doc] + own + others[per_doc:]
        paras = paras[:n_docs * per_doc]
        docs = ["\n\n".join(paras[k:k + per_doc]) for k in range(0, len(paras), per_doc)]
        out.append({"question": c["question"], "answers": c["answers"], "docs": docs})
    return out


def needle_cases(n: int) -> list[dict]:
    """``bench/steer.py``'s needle cases (test seed 1): 3-5 generated documents, a synthetic fact in a middle one."""
    import needle

    return [{"question": c.question, "answers": [c.answer], "docs": c.documents} for c in needle.make_cases(n, 1)]


def answered(text: str, answers: list[str]) -> bool:
    t = text.casefold()
    return any(a.casefold() in t for a in answers)


def run(args, log) -> dict:
    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.models import model_folder

    folder = str(model_folder(MODEL, "bfloat16"))
    tok = load_model(MODEL, dtype="bfloat16").tokenizer
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-rag-"))
    procs: list[Proc] = []
    try:
        (tmp / "tokens").write_text(PUBLISH_TOKEN + " admin *\n")
        registry = f"file:{tmp / 'registry.sqlite3'}"
        op, ep = free_port(), free_port()
        origin = Proc("origin", ["kdn", "origin", "serve", "--model", folder, "--dtype", "bfloat16", "--registry",
                                 registry, "--store", str(tmp / "store"), "--port", str(op), "--token-file",
                                 str(tmp / "tokens")], tmp / "origin.log")
        procs.append(origin)
        origin.wait(f"http://127.0.0.1:{op}/healthz")
        edge = Proc("edge", ["kdn", "edge", "serve", "--region", "bench", "--registry", registry, "--origin",
                             f"http://127.0.0.1:{op}", "--port", str(ep), "--mem-budget", "2GiB"], tmp / "edge.log")
        procs.append(edge)
        edge.wait(f"http://127.0.0.1:{ep}/healthz")
        sets = {f"squad, {k} documents": cases(args.cases, k, args.per_doc) for k in args.docs}
        if args.needles:
            sets["needles, 3-5 documents"] = needle_cases(args.needles)
        texts = sorted({d for cs in sets.values() for c in cs for d in c["docs"]})
        t0 = time.perf_counter()
        for i, d in enumerate(texts):
            publish(f"http://127.0.0.1:{op}", f"p{i}", None, ["zstd", "raw"],
                    body={"text": d, "standalone": True, "prefix": False})
        log(f"published {len(texts)} documents in {time.perf_counter() - t0:.1f} s")
        return measure(args, log, folder, tok, ep, sets)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def measure(args, log, folder: str, tok, ep: int, sets: dict[int, list[dict]]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from kdn.adapters.vllm.blend import blend_params, rag_prompt

    llm = LLM(model=folder, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
              enable_prefix_caching=True, max_model_len=8192, gpu_memory_utilization=0.3,
              kv_transfer_config={"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                                  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"edges": [f"http://127.0.0.1:{ep}"], "blend": True,
                                                                "plan": False, "load_timeout": 30}})
    worker = get_kv_transfer_group().worker

    def gen(ids: list[int], kdn: dict, salt: str, n: int) -> tuple[float, list[int], int]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=False,
                            extra_args={"kv_transfer_params": {"kdn": kdn}})
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], sp, use_tqdm=False)[0]
        return (time.perf_counter() - t) * 1e3, list(out.outputs[0].token_ids), out.num_cached_tokens

    paths = ["prefill", *[f"blend {r:g}%" for r in args.ratios], "compose", "local-hit"]
    rows = {}
    for n_docs, cs in sets.items():
        per: dict[str, dict] = {p: {"ms": [], "ok": [], "cached": [], "phases": []} for p in paths}
        gen(rag_prompt(tok, cs[0]["question"], cs[0]["docs"])[0][:64], {"load": False}, "warm", 1)
        for ci, c in enumerate(cs):
            ids, spans = rag_prompt(tok, c["question"], c["docs"])
            specs = {"prefill": ({"load": False}, "")}
            for r in args.ratios:
                specs[f"blend {r:g}%"] = blend_params(spans, ratio=r / 100)
            specs["compose"] = blend_params(spans, ratio=0.0)
            kdn, s = specs[f"blend {args.ratios[0]:g}%"]
            gen(ids, kdn, s + secrets.token_hex(4), 1)  # the edge's memory tier, filled from the origin
            order = paths[ci % len(paths):] + paths[:ci % len(paths)]
            for p in order:
                if p == "local-hit":
                    salt = secrets.token_hex(4)
                    gen(ids, {"load": False}, salt, 1)  # this very prompt, into vLLM's own cache
                    ms, _, cached = gen(ids, {"load": False}, salt, 1)
                else:
                    kdn, s = specs[p]
                    seen = len(worker.blender.recent)
                    ms, _, cached = gen(ids, kdn, s + secrets.token_hex(4), 1)
                    if len(worker.blender.recent) > seen:  # this request's blend: where its time went
                        per[p]["phases"].append({k: v * 1e3 for k, v in worker.blender.recent[-1].phases.items()})
                per[p]["ms"].append(ms)
                per[p]["cached"].append(cached)
            answer0: list[int] = []
            for p in paths:  # answers, untimed (local-hit answers as prefill does: the same cache)
                if p == "local-hit":
                    per[p]["ok"].append(per["prefill"]["ok"][-1])
                    per[p].setdefault("same", []).append(True)
                    continue
                kdn, s = specs[p]
                _, toks, _ = gen(ids, kdn, s + secrets.token_hex(4), args.answer_tokens)
                answer0 = answer0 or toks  # (prefill's comes first)
                per[p]["ok"].append(answered(tok.decode(toks, skip_special_tokens=True), c["answers"]))
                per[p].setdefault("same", []).append(toks == answer0)
            log(f"[{n_docs}] case {ci + 1}/{len(cs)} ({len(ids)} tokens): " + ", ".join(
                f"{p} {per[p]['ms'][-1]:.0f} ms{' ok' if per[p]['ok'][-1] else ''}" for p in paths))
        rows[n_docs] = {"tokens": [len(rag_prompt(tok, c["question"], c["docs"])[0]) for c in cs], "paths": per}
    rows_blend = worker.totals.data.get("blend", {})
    return {"rows": rows, "blend_totals": rows_blend, "paths": paths}


def table(out: dict, ratios: list[float]) -> str:
    paths = out["paths"]
    lines = ["| set | prompt tokens (median) | path | TTFT ms, median (min-max) | prefill / path, median "
             "(worst case) | accuracy | vs prefill (points) | answer = prefill's |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for n_docs, r in out["rows"].items():
        pre = r["paths"]["prefill"]
        acc0 = 100 * sum(pre["ok"]) / len(pre["ok"])
        for p in paths:
            d = r["paths"][p]
            ms = d["ms"]
            sp = [a / b for a, b in zip(pre["ms"], ms)]
            acc = 100 * sum(d["ok"]) / len(d["ok"])
            vs = "" if p == "prefill" else f"{acc - acc0:+.1f}"
            speed = "" if p == "prefill" else f"{statistics.median(sp):.2f}x ({min(sp):.2f}x)"
            same = "" if p == "prefill" else f"{sum(d['same'])}/{len(d['same'])}"
            lines.append(f"| {n_docs} | {statistics.median(r['tokens']):.0f} | {p} | {statistics.median(ms):,.0f} "
                         f"({min(ms):,.0f}-{max(ms):,.0f}) | {speed} | {acc:.1f}% | {vs} | {same} |")
    return "\n".join(lines)


def phase_table(out: dict) -> str:
    lines = ["| set | path | fetch ms | segments ms | layers ms | write ms | rest of the step (vLLM's last "
             "block, scheduling) ms |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for n_docs, r in out["rows"].items():
        for p, d in r["paths"].items():
            if not d["phases"]:
                continue
            med = {k: statistics.median(x[k] for x in d["phases"]) for k in d["phases"][0]}
            rest = statistics.median(d["ms"]) - sum(med.values())
            lines.append(f"| {n_docs} | {p} | {med['fetch']:.0f} | {med['segments']:.0f} | {med['layers']:.0f} "
                         f"| {med['write']:.0f} | {rest:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--docs", default="4,8", help="documents per prompt, comma-separated")
    ap.add_argument("--per-doc", type=int, default=2, help="SQuAD paragraphs per document (about 150 tokens each)")
    ap.add_argument("--ratios", default="15", help="recompute ratios in percent, comma-separated")
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--needles", type=int, default=24, help="needle cases too (bench/needle.py; 0: none)")
    ap.add_argument("--quick", action="store_true", help="4 cases, 4 documents")
    R.add_arg(ap)
    args = ap.parse_args(argv)
    args.docs = [4] if args.quick else [int(x) for x in args.docs.split(",")]
    args.ratios = [float(x) for x in args.ratios.split(",")]
    if args.quick:
        args.cases, args.needles = 4, 2
    vllm_env()
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_all:7.1f}s {msg}", flush=True)

    res = R.Results("vllm_rag", args)
    out = run(args, log)
    print(f"\nMachine: {machine()}\n")
    res.table("main", table(out, args.ratios))
    res.table("phases", phase_table(out))
    res.extra["rows"] = {str(k): v for k, v in out["rows"].items()}
    res.extra["blend_totals"] = out["blend_totals"]
    res.write()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
