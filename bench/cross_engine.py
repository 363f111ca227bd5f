"""States made by one engine, loaded by the other: how far from the loading engine's own prefill.

    python -P bench/cross_engine.py [--models tiny-llama64,tiny-qwen3next64,smollm2-135m] [--docs 4] [--new 32]

A KDN model id names the weights, not the engine: transformers and vLLM find
each other's states. Their kernels round differently, so the bytes differ.
Per model, two small CDNs on 127.0.0.1 (``kdn`` CLI, embedded registries):
one whose origin computes with transformers, one whose origin computes with
vLLM (``--engine vllm``). The same documents are published on both. Then:

- **vLLM loads transformers-made states**: a vLLM engine (CPU, connector on
  the first CDN's edge) answers ``document + question`` once from the KDN and
  once from its own prefill (a warm request with the same cache salt), greedy;
- **transformers loads vLLM-made states**: the transformers model builds its
  cache from the second CDN's objects, and from its own chunked prefill.

Reported per direction: greedy tokens that agree before the first difference
(of ``--new``), and the largest difference of the log-probability of the
chosen token (vLLM: over the agreeing tokens; transformers: teacher-forced on
its own greedy tokens, all of them). Loading an engine's own states is exact
(the tests assert it bit for bit), so these numbers are the whole cost of
crossing engines; beside them, the same engine's own rounding noise:
transformers prefilling the document in one pass instead of 256-token chunks.
Prints a table, writes ``bench/work/cross_engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work"
sys.path.insert(0, str(ROOT / "bench"))

import results as R  # noqa: E402
from vllm_ttft import PUBLISH_TOKEN, Proc, free_port, publish, vllm_env  # noqa: E402

DTYPES = {"tiny-llama64": "float32", "tiny-qwen3next64": "bfloat16", "smollm2-135m": "bfloat16"}
LENGTHS = {"tiny-llama64": 1100, "tiny-qwen3next64": 1700, "smollm2-135m": 1100}


def documents(model: str, n: int, tokenizer) -> list[list[int]]:
    """``n`` documents of the model's length, as token ids: the shipped docs (SmolLM2) or random words."""
    import random

    length = LENGTHS[model]
    if model == "smollm2-135m":
        texts = [p.read_text() for p in sorted((ROOT / "kdn" / "data" / "docs").glob("*.md"))]
        ids = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        return [(d * (length // len(d) + 1))[:length] for d in ids][:n]
    out = []
    for seed in range(n):
        rng = random.Random(seed)
        out.append([rng.randrange(3, 259) for _ in range(length)])
    return out


def question(model: str, tokenizer, seed: int) -> list[int]:
    if model == "smollm2-135m":
        return list(tokenizer.encode(f"\n\nQuestion {seed}: what does the text above say first?\n",
                                     add_special_tokens=False))
    import random

    rng = random.Random(1000 + seed)
    return [rng.randrange(3, 259) for _ in range(40)]


def cdn(tmp: Path, name: str, folder: str, dtype: str, engine: str, procs: list) -> tuple[str, str]:
    d = tmp / name
    d.mkdir()
    (d / "tokens").write_text(PUBLISH_TOKEN + " admin *\n")
    registry = f"file:{d / 'registry.sqlite3'}"
    op, ep = free_port(), free_port()
    o = Proc(f"origin-{name}", ["kdn", "origin", "serve", "--model", folder, "--dtype", dtype, "--engine", engine,
                                "--registry", registry, "--store", str(d / "store"), "--port", str(op),
                                "--token-file", str(d / "tokens")], d / "origin.log")
    procs.append(o)
    o.wait(f"http://127.0.0.1:{op}/healthz")
    e = Proc(f"edge-{name}", ["kdn", "edge", "serve", "--region", "x", "--registry", registry, "--origin",
                              f"http://127.0.0.1:{op}", "--port", str(ep)], d / "edge.log")
    procs.append(e)
    e.wait(f"http://127.0.0.1:{ep}/healthz")
    return f"http://127.0.0.1:{op}", f"http://127.0.0.1:{ep}"


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def vllm_side(folder: str, dtype: str, edge: str, prompts: list[list[int]], new: int) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
              max_model_len=4096, max_num_batched_tokens=256, gpu_memory_utilization=0.25,
              kv_transfer_config={"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                                  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"edges": [edge]}})

    def run(ids: list[int], load: bool, salt: str, n: int = new) -> tuple[list[int], list[float], int]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"kdn": {"load": load}}})
        o = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], sp, use_tqdm=False)[0].outputs[0]
        return list(o.token_ids), [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)], 0

    rows = []
    for ids, doc_len in prompts:
        s = secrets.token_hex(4)
        run(ids[:doc_len] + [ids[doc_len] ^ 1], False, s, 1)  # the engine's own prefill of the document
        own, own_lp, _ = run(ids, False, s)
        got, got_lp, _ = run(ids, True, secrets.token_hex(4))
        k = agree(own, got)
        rows.append({"agree": k, "max_dlogprob": max((abs(a - b) for a, b in zip(own_lp[:k], got_lp[:k])), default=0.0)})
    return rows


def hf_side(folder: str, dtype: str, edge: str, prompts: list[list[int]], new: int) -> list[dict]:
    import asyncio

    import torch

    from kdn.adapters.hf import build_cache, continue_from_cache, load_model, prefill
    from kdn.adapters.hf.generate import decode_loop
    from kdn.client import KDNClient
    from kdn.format.objects import to_torch

    lm = load_model(folder, dtype=dtype)

    async def fetch(ids: list[int]) -> list:
        async with KDNClient(edges=[edge]) as c:
            hit = await c.lookup(ids, lm.model_id)
            st = await c.fetch_prefix(hit)
            return [to_torch(o) for o in st.objects]

    def greedy_and_lps(make_cache, n: int, suffix: list[int], ref: list[int] | None) -> tuple[list[int], list[float]]:
        with torch.inference_mode():
            cache = make_cache()
            logits = continue_from_cache(lm.model, cache, n, suffix)[-1].float()
            first = int(torch.argmax(logits))
            toks = decode_loop(lm.model, cache, first, n + len(suffix), new, None)
            ref = ref or toks
            cache = make_cache()  # teacher-forced on ``ref``: logprobs of the same tokens from both caches
            lg = continue_from_cache(lm.model, cache, n, suffix + ref[:-1])[len(suffix) - 1:].float()
            lps = torch.log_softmax(lg, -1)[torch.arange(len(ref)), torch.tensor(ref)].tolist()
        return toks, lps

    rows, floor = [], []
    for ids, doc_len in prompts:
        chunks = asyncio.run(fetch(ids))
        n = sum(_tokens(c) for c in chunks)
        own, own_lp = greedy_and_lps(lambda: prefill(lm.model, ids[:n], chunk_tokens=256), n, ids[n:], None)
        got, got_lp = greedy_and_lps(lambda: build_cache(lm.model, chunks)[0], n, ids[n:], own)
        rows.append({"agree": agree(own, got), "max_dlogprob": max(abs(a - b) for a, b in zip(own_lp, got_lp)),
                     "reused": n})
        # The same engine's own rounding noise: the document in one forward pass instead of 256-token chunks.
        one, one_lp = greedy_and_lps(lambda: prefill(lm.model, ids[:n], chunk_tokens=None), n, ids[n:], own)
        floor.append({"agree": agree(own, one), "max_dlogprob": max(abs(a - b) for a, b in zip(own_lp, one_lp))})
    return rows, floor


def _tokens(chunk: dict) -> int:
    k = next(t for name, t in chunk.items() if name.endswith(".k"))
    return int(k.shape[1])  # [kv_heads, n, head_dim]


def one_model(model: str, docs: int, new: int, log) -> dict:
    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.models import model_folder

    dtype = DTYPES[model]
    folder = str(model_folder(model, dtype))
    tok = load_model(folder, dtype=dtype).tokenizer
    texts = documents(model, docs, tok)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-cross-"))
    procs: list = []
    try:
        hf_origin, hf_edge = cdn(tmp, "hf", folder, dtype, "hf", procs)
        vl_origin, vl_edge = cdn(tmp, "vllm", folder, dtype, "vllm", procs)
        prompts = []
        for i, d in enumerate(texts):
            for origin in (hf_origin, vl_origin):
                publish(origin, f"d{i}", d)
            prompts.append((d + question(model, tok, i), len(d)))
        log(f"[{model}] published {len(texts)} documents of {LENGTHS[model]} tokens on both CDNs")
        hf_rows, floor = hf_side(folder, dtype, vl_edge, prompts, new)
        log(f"[{model}] transformers loading vLLM-made states: {hf_rows}")
        vl_rows = vllm_side(folder, dtype, hf_edge, prompts, new)
        log(f"[{model}] vLLM loading transformers-made states: {vl_rows}")
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"model": model, "dtype": dtype, "tokens": LENGTHS[model], "new": new,
            "vllm_loads_hf": vl_rows, "hf_loads_vllm": hf_rows, "hf_one_shot_vs_chunked": floor}


def table(results: list[dict]) -> str:
    out = ["| model | dtype | direction | greedy tokens agreeing (min / median of N) | max logprob difference |",
           "| --- | --- | --- | ---: | ---: |"]
    for r in results:
        for key, label in (("vllm_loads_hf", "vLLM loads transformers-made"),
                           ("hf_loads_vllm", "transformers loads vLLM-made"),
                           ("hf_one_shot_vs_chunked", "(noise floor) transformers, one-shot vs chunked prefill")):
            rows = r[key]
            ag = sorted(x["agree"] for x in rows)
            out.append(f"| {r['model']} | {r['dtype']} | {label} | {ag[0]} / {ag[len(ag) // 2]} of {r['new']} "
                       f"({len(rows)} docs) | {max(x['max_dlogprob'] for x in rows):.2e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-llama64,tiny-qwen3next64,smollm2-135m")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", default=str(WORK / "cross_engine.json"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    R.add_arg(ap)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t0:7.1f}s {msg}", flush=True)

    if args.one:
        vllm_env()
        Path(args.one).write_text(json.dumps(one_model(args.models, args.docs, args.new, log)))
        return 0
    res = R.Results("cross_engine", args)
    results = []
    for m in [m.strip() for m in args.models.split(",") if m.strip()]:
        if m not in DTYPES:
            ap.error(f"unknown model {m!r}: one of {sorted(DTYPES)}")
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, "-P", __file__, "--one", f.name, "--models", m, "--docs", str(args.docs),
                            "--new", str(args.new)], check=True, env={**os.environ})
            results.append(json.loads(Path(f.name).read_text()))
    print()
    print(f"Command: python -P bench/cross_engine.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print()
    res.table("main", table(results))
    res.extra["models"] = results
    res.write()
    if args.json:
        WORK.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
