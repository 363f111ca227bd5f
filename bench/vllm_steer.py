"""Attention steering inside vLLM (the KDN connector with ``steer: true``) on the needle set, against transformers.

    python -P bench/vllm_steer.py [--cases 48] [--k 24] [--alpha 0.03] [--map operator|question] [--quick]

The cases, emphasis maps and heads are ``bench/steer.py``'s: the same 48 needle-in-the-middle cases (seed 1),
the operator's map (the fact's sentence), heads ranked on its tuning split (seed 1001) by the attention the
question pays the fact, the first ``--k``; ``--k`` and ``--alpha`` default to what ``bench/steer.py`` chose
on that split (24 heads, alpha 0.03). Each case is run from a full prefill, greedy, up to 24 tokens:

- transformers (``kdn.adapters.hf.steer``), without and with steering: ``bench/steer.py``'s full prefill;
- vLLM 0.32 (CPU, float32, in this process; the connector loads nothing: ``load: false``), without and with
  steering (``kdn.adapters.vllm.steer.request_params``); every case in one ``generate`` call each way.

Reports accuracy per engine, how often vLLM's verdict (answered or not) and its tokens agree with
transformers' for the same case and setting, and vLLM's wall time per pass: the cost of recomputing the
steered rows after vLLM's kernel.

``--map question`` (no oracle): the map each engine makes from the question itself, on a document vLLM's
prefix cache holds (each pass runs the cases 8 at a time, each group's documents first prefilled under its
requests' salts, untimed: as a KDN hit or an earlier reader leaves them; a sure map reruns the question from the
block before it). The retrieval heads are
calibrated on the tuning split (``question_map.calibrate``); each test case's content-free scores are
computed as an origin computes them at publish (``baseline_of``, one forward) and sent with the map; the
transformers adapter makes the map with its own passes (``question_map``) and re-runs the question steered,
vLLM makes it inside the question's own pass (``kdn.adapters.vllm.question``) and steers from the last
retrieval layer on. Reports the maps' outcomes in vLLM (sure / unsure) and how often its map covers the fact.
"""

from __future__ import annotations

import argparse
import platform
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cases", type=int, default=48)
    ap.add_argument("--tune-cases", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--k", type=int, default=24, help="steered heads (bench/steer.py's choice)")
    ap.add_argument("--alpha", type=float, default=0.03, help="steering alpha (bench/steer.py's choice)")
    ap.add_argument("--map", choices=("operator", "question"), default="operator",
                    help="the operator's map (the fact's sentence: an oracle) or the question's own (no oracle)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 cases, 2 tuning cases")
    import results as R

    R.add_arg(ap)
    args = ap.parse_args()
    from vllm_ttft import vllm_env  # vLLM's CPU build in this process (may restart it with Intel's OpenMP)

    vllm_env()
    if args.quick:
        args.cases, args.tune_cases = 3, 2
    import torch

    import needle as N
    import steer as S
    from kdn.adapters.hf import extract_chunks, load_model
    from kdn.adapters.hf.models import model_folder
    from kdn.adapters.hf.steer import plan
    from kdn.adapters.vllm.steer import request_params

    res = R.Results("vllm_steer", args)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    lm = load_model(args.model, dtype=torch.float32)
    model, tok = lm.model, lm.tokenizer
    S.EOS = tok.eos_token_id
    vocab = model.config.vocab_size
    tune = [S.prepare(tok, c, vocab) for c in N.make_cases(args.tune_cases, args.seed + 1000)]
    test = [S.prepare(tok, c, vocab) for c in N.make_cases(args.cases, args.seed)]
    tune_chunks = [[c.tensors for c in extract_chunks(model, p.published, chunk_tokens=256)] for p in tune]
    heads = S.select_heads(model, tune, tune_chunks)[:args.k]
    print(f"heads: {heads}", flush=True)

    ret, maps = None, [p.emap for p in test]
    if args.map == "question":
        ret, maps, t_cal = question_maps(model, tok, tune, test, heads, args.alpha)
        print(f"retrieval: {ret} ({t_cal:.0f} s)", flush=True)
    hf: dict[bool, list[list[int]]] = {False: [], True: []}
    hf_hits = 0
    for i, p in enumerate(test):
        cache = S.prefill_published(model, p)
        st = plan(model, p.emap, alpha=args.alpha, heads=heads)
        if ret is not None:  # the transformers adapter's own map, on the full prefill's cache
            import copy

            from kdn.adapters.hf.question_map import question_map
            qm = question_map(model, tok, copy.deepcopy(cache), len(p.published), p.ids, p.emap.region, ret,
                              baseline=maps[i].baseline)
            hf_hits += qm.emphasis is not None and qm.covers(p.emap.spans[0])
            st = plan(model, qm.emphasis, alpha=args.alpha, heads=heads) if qm.emphasis is not None else None
        for s in (False, True):
            hf[s].append(S.gen_full(model, tok, p, cache, st if s else None))
        print(f"transformers: case {i + 1}/{len(test)}", flush=True)
    t_hf = time.perf_counter() - t_start

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p.ids) for p in test)
    llm = LLM(model=str(model_folder(args.model, "float32")), dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=True, max_model_len=longest + S.MAX_NEW + 16,
              gpu_memory_utilization=0.3,
              kv_transfer_config={"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                                  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                  # never contacted: every request says load: false
                                  "kv_connector_extra_config": {"origin": "http://127.0.0.1:9", "steer": True}})
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    steerer = get_kv_transfer_group().steerer

    def run(steered: bool) -> tuple[list[list[int]], float]:
        prompts, params = [], []
        run_salt = secrets.token_hex(4)  # nothing from an earlier pass in vLLM's prefix cache
        for p in test:
            kdn: dict = {"load": False}
            salt = f"plain-{run_salt}"
            if steered and ret is not None:
                from kdn.adapters.vllm.question import request_params as question_params

                extra, salt = question_params(maps[len(prompts)], ret, p.ids, tok, alpha=args.alpha, heads=heads,
                                              salt_prefix=run_salt)
                kdn.update(extra)
            elif steered:
                extra, salt = request_params(p.emap, alpha=args.alpha, heads=heads, salt_prefix=run_salt)
                kdn.update(extra)
            prompts.append(TokensPrompt(prompt_token_ids=p.ids, cache_salt=salt))
            params.append(SamplingParams(max_tokens=S.MAX_NEW, temperature=0.0, detokenize=False,
                                         stop_token_ids=[S.EOS] if S.EOS is not None else None,
                                         extra_args={"kv_transfer_params": {"kdn": kdn}}))
        # --map question: GROUP cases at a time, each group's documents in vLLM's prefix cache first (untimed),
        # as a KDN hit or an earlier reader leaves them (all 48 would not stay in its cache at once).
        step = GROUP if ret is not None else len(prompts)
        outs, took = [], 0.0
        for g in range(0, len(prompts), step):
            if ret is not None:
                llm.generate([TokensPrompt(prompt_token_ids=p.published, cache_salt=pr["cache_salt"])
                              for p, pr in zip(test[g:g + step], prompts[g:g + step])],
                             SamplingParams(max_tokens=1, detokenize=False, extra_args={"kv_transfer_params": {
                                 "kdn": {"load": False}}}), use_tqdm=False)
            t0 = time.perf_counter()
            outs += llm.generate(prompts[g:g + step], params[g:g + step], use_tqdm=False)
            took += time.perf_counter() - t0
        if steered and ret is not None:  # what vLLM's maps decided, case by case
            decided.clear()  # (vLLM suffixes the request ids it was given: matched by prefix)
            by_id = {k.rsplit("-", 1)[0]: v for k, v in steerer.decided.items()}
            decided.extend(steerer.decided.get(o.request_id, by_id.get(o.request_id)) for o in outs)
            print(f"vLLM's maps so far: {dict(steerer.maps)}", flush=True)
        return [list(o.outputs[0].token_ids) for o in outs], took

    decided: list = []

    run(False)  # one-off engine costs (first forward, allocations) out of the timed passes
    vl: dict[bool, list[list[int]]] = {}
    secs: dict[bool, list[float]] = {False: [], True: []}
    for order in ((False, True), (True, False)):  # both orders: neither pass always runs on a warmer machine
        for s in order:
            vl[s], t = run(s)
            secs[s].append(t)
            print(f"vLLM {'steered' if s else 'plain'}: {t:.1f} s", flush=True)
    rows_steered = steerer.rows

    n = len(test)

    def acc(outs: list[list[int]]) -> float:
        return sum(S.answered(tok, o, p.case.answer) for o, p in zip(outs, test)) / n

    def agree(s: bool) -> tuple[int, int]:
        verdict = sum(S.answered(tok, a, p.case.answer) == S.answered(tok, b, p.case.answer)
                      for a, b, p in zip(hf[s], vl[s], test))
        same = sum(b[:len(a)] == a for a, b in zip(hf[s], vl[s]))  # transformers stops once answered
        return verdict, same

    lines = ["| engine | accuracy, no steering | accuracy, steering | lift | vLLM s per pass (no / with) |",
             "| --- | ---: | ---: | ---: | ---: |",
             f"| transformers (`kdn.adapters.hf.steer`) | {acc(hf[False]):.3f} | {acc(hf[True]):.3f} "
             f"| {acc(hf[True]) - acc(hf[False]):+.3f} | |",
             f"| vLLM 0.32 + KDN connector (`kdn.adapters.vllm.steer`) | {acc(vl[False]):.3f} | {acc(vl[True]):.3f} "
             f"| {acc(vl[True]) - acc(vl[False]):+.3f} | {min(secs[False]):.1f} / {min(secs[True]):.1f} |"]
    (v0, s0), (v1, s1) = agree(False), agree(True)
    lengths = [len(p.ids) for p in test]
    if ret is not None:
        sure = [d for d in decided if d is not None]
        covers = sum(d is not None and any(s < p.emap.spans[0][1] and p.emap.spans[0][0] < e for s, e in d.spans)
                     for d, p in zip(decided, test))
        lines[2] = lines[2].replace("(`kdn.adapters.hf.steer`)", "(`question_map`: the question re-run steered)")
        lines[3] = lines[3].replace("(`kdn.adapters.vllm.steer`)", "(`kdn.adapters.vllm.question`: made in its pass, the question rerun)")
        lines += ["", f"The question's own map, no oracle: retrieval heads {list(ret.heads)} calibrated on the tuning "
                  f"split (top {ret.top}, steered when the lead exceeds {ret.min_margin:.2f} sd); content-free "
                  f"scores computed once per case as an origin does at publish. vLLM's maps: sure in {len(sure)} of "
                  f"{n}, covering the fact's sentence in {covers} (steered); the transformers adapter's: "
                  f"{hf_hits} sure and covering it. vLLM makes its map in the question's first computation, at "
                  f"layer {ret.heads[-1][0]} (the last retrieval layer), then computes the question again, steered "
                  f"in every steered layer ({steerer.maps.get('rerun', 0)} reruns in all passes), as the "
                  f"transformers adapter re-runs it. vLLM ran the cases {GROUP} per generate call, each group's "
                  f"documents in its prefix cache first (untimed): the s per pass are of these calls."]
    lines += ["", f"{args.model} (float32), {n} needle cases (seed {args.seed}), prompts {min(lengths)}-{max(lengths)} "
              f"tokens; full prefill, greedy, answered = the answer in the first {S.MAX_NEW} tokens; steering: "
              f"{'the question' if ret is not None else 'the operator'}'s map, K={args.k} heads (ranked on {len(tune)} tuning cases, seed {args.seed + 1000}), "
              f"alpha={args.alpha:g}. vLLM against transformers, case by case: the same verdict in {v0}/{n} "
              f"(no steering) and {v1}/{n} (steering) cases, the same tokens in {s0}/{n} and {s1}/{n} (float32 "
              f"kernels differ in rounding, so a near tie can flip a greedy token). vLLM: "
              f"{f'{GROUP} cases' if ret is not None else f'all {n} cases'} per generate call, the faster of two passes each way (orders alternated); {rows_steered} "
              f"steered query rows x layers recomputed. Transformers: {t_hf:.0f} s for both settings, one case "
              f"at a time. Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}. Wall time {time.perf_counter() - t_start:.0f} s."]
    res.table("main", "\n".join(lines), "Steering in vLLM against the transformers adapter, needle in the middle")
    res.write()


GROUP = 8  # --map question: cases per generate call (their documents fit vLLM's prefix cache together)


def question_maps(model, tok, tune, test, heads, alpha: float):
    """(the calibrated retrieval, each test case's map of its document with the content-free scores an origin
    would publish, the calibration's seconds)."""
    from kdn.adapters.hf.question_map import baseline_of, calibrate, null_tail
    from kdn.emphasis import EmphasisMap
    from steer_question import examples

    t0 = time.perf_counter()
    ret = calibrate(model, tok, examples(tune), alpha=alpha, steer_heads=tuple(heads))
    t_cal = time.perf_counter() - t0
    maps = []
    for p in test:
        rs, re_ = p.emap.region
        base = baseline_of(model, tok, p.ids[:re_], (rs, re_), ret.heads, null_tail(tok, p.ids[re_:], ret.null))
        maps.append(EmphasisMap(spans=(), region=(rs, re_), alpha=alpha, source="question", baseline=base))
    return ret, maps, t_cal


if __name__ == "__main__":
    main()
