"""A vLLM engine in its own process, driven by a test over stdin/stdout (one JSON object a line).

    python driver.py '{"model": FOLDER, "dtype": "float32", "kv": {...kv_transfer_config...}, ...}'

Answers start with ``@@ `` (vLLM logs to stdout too). Operations:

- ``generate``: ``prompts`` (token id lists), ``max_tokens``, ``load`` (ask the KDN?), ``salt``
  (vLLM's cache salt: keeps its own prefix cache apart per salt, the KDN lookup is unchanged), or
  ``salts`` (one per prompt), ``kdn`` (per prompt: more of its ``kdn`` params, e.g. steering)
  -> per prompt ``tokens``, ``logprobs`` (of the chosen tokens), ``cached`` (vLLM's num_cached_tokens)
- ``abort_while_loading``: add ``prompt``, step until its KDN load is in flight, abort it, step until the
  engine is idle -> ``steps``
- ``blocks``: free and total KV blocks of the scheduler's pool
- ``stats``: the connector's totals since start, and what its scheduler side still tracks
- ``quit``
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: its parts are inspectable


def answer(obj: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=cfg["model"], dtype=cfg["dtype"], skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=cfg.get("max_model_len", 4096), max_num_batched_tokens=cfg.get("batch_tokens", 256),
              gpu_memory_utilization=cfg.get("memory", 0.25), enable_prefix_caching=True)
    if cfg.get("blocks"):
        kw["num_gpu_blocks_override"] = cfg["blocks"]
    if cfg.get("kv"):
        kw["kv_transfer_config"] = cfg["kv"]
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler
    preempted = [0]
    preempt = sched._preempt_request

    def counting_preempt(*a, **k):
        preempted[0] += 1
        return preempt(*a, **k)

    sched._preempt_request = counting_preempt

    def connector(role: str):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return sched.connector if role == "scheduler" else get_kv_transfer_group()

    def params(op: dict, extra: dict | None = None) -> SamplingParams:
        kdn = {"load": op.get("load", True), **(extra or {})}
        return SamplingParams(max_tokens=op.get("max_tokens", 16), temperature=0.0, logprobs=0, detokenize=False,
                              ignore_eos=True, extra_args={"kv_transfer_params": {"kdn": kdn}})

    def prompt(tokens: list[int], salt: str | None):
        return TokensPrompt(prompt_token_ids=tokens, **({"cache_salt": salt} if salt else {}))

    answer({"ready": True})
    for line in sys.stdin:
        op = json.loads(line)
        try:
            if op["op"] == "generate":
                t0 = time.perf_counter()
                n = len(op["prompts"])
                salts = op.get("salts") or [op.get("salt")] * n
                extra = op.get("kdn") or [None] * n  # per prompt: more of its "kdn" params (steering)
                outs = llm.generate([prompt(p, s) for p, s in zip(op["prompts"], salts)],
                                    [params(op, e) for e in extra], use_tqdm=False)
                res = []
                for o in outs:
                    c = o.outputs[0]
                    lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
                    res.append({"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens})
                answer({"outputs": res, "seconds": time.perf_counter() - t0})
            elif op["op"] == "abort_while_loading":
                engine = llm.llm_engine
                engine.add_request("doomed", prompt(op["prompt"], op.get("salt")), params(op))
                steps, aborted = 0, False
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    engine.step()
                    steps += 1
                    # vLLM suffixes the id it was given: find the request by its prefix
                    req = next((r for rid, r in sched.requests.items() if rid.startswith("doomed")), None)
                    if not aborted and req is not None and req.status.name == "WAITING_FOR_REMOTE_KVS":
                        engine.abort_request(["doomed"])  # its load was handed to the worker this step
                        aborted = True
                    if aborted and req is None and not engine.has_unfinished_requests():
                        break
                    time.sleep(0.005)
                gone = not any(rid.startswith("doomed") for rid in sched.requests)
                answer({"steps": steps, "aborted_while_loading": aborted, "gone": gone})
            elif op["op"] == "blocks":
                pool = sched.kv_cache_manager.block_pool
                answer({"free": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks})
            elif op["op"] == "stats":
                w, s = connector("worker").worker, sched.connector.sched
                steerer = getattr(connector("worker"), "steerer", None)
                answer({"totals": w.totals.data, "steered_rows": steerer.rows if steerer else 0,
                        "question_maps": dict(steerer.maps) if steerer else {},
                        "steer_refused": s.steer_refused,
                        "blend_refused": s.blender.refused if s.blender is not None else 0, "lookups": len(s._lookups), "plans": len(s._plans),
                        "refused_records": s.client.rejected_records if s.client is not None else 0,
                        "ready": len(s._ready), "saves": len(s._saves), "running": len(w._running),
                        "preempted": preempted[0], "requests": len(sched.requests),
                        "planner": s.planner.snapshot() if s.planner is not None else None,
                        "probes_pending": sum(not f.done() for f in s._probes)})
            elif op["op"] == "age_planner":  # the planner's last measured load made stale (PROBE_AFTER_S old)
                from kdn.planner import PROBE_AFTER_S

                sp = sched.connector.sched.planner.speeds
                sp.last_load, sp.last_probe = time.monotonic() - PROBE_AFTER_S - 1, None
                if op.get("load_bps"):
                    sp.load_bps = float(op["load_bps"])
                answer({"aged": True})
            elif op["op"] == "quit":
                answer({"bye": True})
                break
        except Exception as e:  # noqa: BLE001 -- report to the test, keep serving
            answer({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})


if __name__ == "__main__":
    main()
