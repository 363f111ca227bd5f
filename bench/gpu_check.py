"""GPU checks, for a machine with CUDA: exact reuse with states loaded onto the GPU, time to first token on
the GPU, and host-to-device copy throughput. One short script, so a lent GPU is spent on one run.

    python -P bench/gpu_check.py [--device cuda] [--lengths 2048,8192] [--repeat 5] [--json out.json]

1. **Exactness on the device.** For each tiny family (attention and hybrids) in fp32 and bf16, on the
   device: compute the chunk states (``extract_chunks``), write them as KDN objects (zstd and raw),
   read them back (``decode_object`` on the host, ``to_torch(device=...)``), build the cache and
   continue; the logits must equal, bit for bit, those of the device's own chunked prefill.
2. **TTFT on the device**, random-init bf16 models of a real shape (Qwen2-0.5B: 24 layers, 2 KV heads
   x 64; Llama-3-8B: 32 layers, 8 KV heads x 128):
   the lean one-shot prefill (``logits_to_keep=1``, what an engine does) against loading the context
   from KDN objects held in host memory as bytes (what a client has after fetching and verifying
   from an edge): decode on the host, copy to the device, build the cache, prefill a 16-token
   suffix. Both end with the first token's logits on the device (synchronized). No network here:
   the fetch is measured on the CPU machine (``bench/ttft.py``).
3. **Host-to-device copy** of pageable and pinned buffers, 64 MiB to 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kdn.adapters.hf import build_cache, continue_from_cache, extract_chunks, load_model, prefill
from kdn.objects import decode_object, encode_object, from_torch, to_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as R  # noqa: E402

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-bamba", "tiny-falconh1", "tiny-zamba2", "tiny-granitemoehybrid",
            "tiny-qwen3next"]
ADDR = "ab" * 32
MID = "cd" * 32


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def blobs_of(chunks, encoding: str) -> list[bytes]:
    out = []
    for c in chunks:
        tensors = from_torch({k: v.detach().to("cpu") for k, v in c.tensors.items()})
        out.append(encode_object(kind=c.kind, address=ADDR, model_id=MID, namespace="public", start=c.start,
                                 end=c.end, position=c.start, parent=None, tensors=tensors, encoding=encoding))
    return out


def exactness(device: str, chunk: int = 32) -> list[dict]:
    rows = []
    n = chunk * 3 + chunk // 2
    for spec in FAMILIES:
        for dtype in (torch.float32, torch.bfloat16):
            t0 = time.perf_counter()
            try:
                model = load_model(spec, dtype=dtype).model.to(device)
                ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(1)).to(device)
                chunks = list(extract_chunks(model, ids, chunk_tokens=chunk))
                k = 3
                own = continue_from_cache(model, prefill(model, ids[:k * chunk], chunk_tokens=chunk), k * chunk,
                                          ids[k * chunk:])
                for encoding in ("zstd", "raw"):
                    loaded = [to_torch(decode_object(b), device=device) for b in blobs_of(chunks[:k], encoding)]
                    cache, n_cached = build_cache(model, loaded)
                    got = continue_from_cache(model, cache, n_cached, ids[k * chunk:])
                    same = bool(torch.equal(got, own))
                    rows.append({"model": spec, "dtype": str(dtype).split(".")[-1], "encoding": encoding,
                                 "bit_identical": same, "max_abs_diff": float((got.float() - own.float()).abs().max()),
                                 "seconds": round(time.perf_counter() - t0, 2)})
                    print(json.dumps(rows[-1]), flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on: one family must not hide the others
                rows.append({"model": spec, "dtype": str(dtype), "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def shaped_model(shape: str, device: str):
    """A random-init bf16 model of a real model's shape (the weights do not matter for timing)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if shape == "qwen2-0.5b-shape":  # 24 layers, 2 KV heads x 64: 12 KiB of KV per token
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)
    elif shape == "llama3-8b-shape":  # 32 layers, 8 KV heads x 128: 128 KiB of KV per token
        cls, cfg = LlamaForCausalLM, LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=40960, rope_theta=500000.0)
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    return model


def ttft(device: str, lengths: list[int], repeat: int, suffix: int = 16, chunk: int = 256,
         shape: str = "qwen2-0.5b-shape") -> list[dict]:
    model = shaped_model(shape, device)
    vocab = model.config.vocab_size
    rows = []
    for length in lengths:
        ids = torch.randint(0, vocab, (length + suffix,), generator=torch.Generator().manual_seed(length)).to(device)
        with torch.inference_mode():
            chunks = list(extract_chunks(model, ids[:length], chunk_tokens=chunk))
        blobs = {enc: blobs_of(chunks, enc) for enc in ("raw", "zstd")}
        del chunks

        def lean() -> torch.Tensor:
            with torch.inference_mode():
                return model(input_ids=ids[None], logits_to_keep=1).logits

        def load(encoding: str) -> torch.Tensor:
            loaded = [to_torch(decode_object(b), device=device) for b in blobs[encoding]]
            cache, n_cached = build_cache(model, loaded)
            with torch.inference_mode():
                return model(input_ids=ids[None, length:], past_key_values=cache, logits_to_keep=1,
                             position_ids=torch.arange(length, length + suffix, device=device)[None]).logits

        cases = {"prefill-lean": lean, "kdn-raw": lambda: load("raw"), "kdn-zstd": lambda: load("zstd")}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for fn in cases.values():  # warm up kernels and allocator
            fn()
        sync(device)
        for _ in range(repeat):
            for name, fn in cases.items():
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["prefill-lean"])
        for name, ts in times.items():
            rows.append({"shape": shape, "length": length, "path": name, "median_ms": round(statistics.median(ts) * 1e3, 2),
                         "min_ms": round(min(ts) * 1e3, 2), "max_ms": round(max(ts) * 1e3, 2),
                         "speedup_vs_lean": round(base / statistics.median(ts), 2),
                         "worst_speedup": round(min(times["prefill-lean"]) / max(ts), 2),
                         "object_mib": round(sum(len(b) for b in blobs.get(name.split("-")[-1], [])) / 2**20, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def h2d(device: str) -> list[dict]:
    rows = []
    if not device.startswith("cuda"):
        return rows
    for mib in (64, 256, 1024):
        n = mib << 20
        for pinned in (False, True):
            src = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            src.fill_(1)
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            dst.copy_(src, non_blocking=pinned)
            sync(device)
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                sync(device)
                ts.append(time.perf_counter() - t0)
            rows.append({"mib": mib, "pinned": pinned, "gb_per_s": round(n / statistics.median(ts) / 1e9, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


SHAPE_NAMES = {"qwen2-0.5b-shape": "Qwen2-0.5B", "llama3-8b-shape": "Llama-3-8B"}


def ttft_table(rows: list[dict]) -> str:
    out = ["| model shape | context | lean prefill (ms) | KDN raw (ms) | vs lean | KDN zstd (ms) | vs lean | "
           "objects (MiB, raw / zstd) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    keys = dict.fromkeys((r["shape"], r["length"]) for r in rows)
    for shape, length in keys:
        by = {r["path"]: r for r in rows if r["shape"] == shape and r["length"] == length}
        lean, raw, z = by["prefill-lean"], by["kdn-raw"], by["kdn-zstd"]
        out.append(f"| {SHAPE_NAMES.get(shape, shape)} | {length:,} | {lean['median_ms']:.1f} ({lean['min_ms']:.1f}-"
                   f"{lean['max_ms']:.1f}) | {raw['median_ms']:.1f} ({raw['min_ms']:.1f}-{raw['max_ms']:.1f}) | "
                   f"{raw['speedup_vs_lean']:.2f}x (worst {raw['worst_speedup']:.2f}x) | {z['median_ms']:.1f} | "
                   f"{z['speedup_vs_lean']:.2f}x | {raw['object_mib']:.0f} / {z['object_mib']:.0f} |")
    return "\n".join(out)


def exactness_table(rows: list[dict]) -> str:
    out = ["| model | dtype | encoding | bit-identical logits | max abs difference |", "| --- | --- | --- | --- | ---: |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['dtype']} | | error: {r['error'][:120]} | |")
        else:
            out.append(f"| {r['model']} | {r['dtype']} | {r['encoding']} | {'yes' if r['bit_identical'] else '**no**'} "
                       f"| {r['max_abs_diff']:.3g} |")
    return "\n".join(out)


def h2d_table(rows: list[dict]) -> str:
    out = ["| buffer | pageable GB/s | pinned GB/s |", "| ---: | ---: | ---: |"]
    for mib in dict.fromkeys(r["mib"] for r in rows):
        by = {r["pinned"]: r["gb_per_s"] for r in rows if r["mib"] == mib}
        out.append(f"| {mib} MiB | {by.get(False, float('nan')):.1f} | {by.get(True, float('nan')):.1f} |")
    return "\n".join(out)


def headline(res: R.Results, out: dict) -> None:
    ex, rows = out.get("exactness"), out.get("ttft")
    if not ex or not rows:
        return
    same = sum(1 for r in ex if r.get("bit_identical"))
    raw = [r for r in rows if r["path"] == "kdn-raw"]
    lo, hi = min(raw, key=lambda r: r["speedup_vs_lean"]), max(raw, key=lambda r: r["speedup_vs_lean"])
    worst = min(r["worst_speedup"] for r in raw)
    word = "faster" if lo["speedup_vs_lean"] >= 1 else "**slower** at worst"
    res.set_headline(
        f"on {out['info'].get('gpu') or out['info']['device']}: exact reuse with states loaded onto the GPU; TTFT from KDN objects in "
        "host memory vs the lean one-shot GPU prefill",
        f"**{same}/{len(ex)}** bit-identical; loading raw objects is {lo['speedup_vs_lean']:.2f}x-"
        f"{hi['speedup_vs_lean']:.2f}x the prefill's speed ({word}), worst {worst:.2f}x",
        "the lean one-shot prefill on the same device (`logits_to_keep=1`), same run",
        [{"shown": f"{same}/{len(ex)}", "table": "exactness", "cell": "yes"},
         {"shown": f"{lo['speedup_vs_lean']:.2f}x-", "table": "ttft", "cell": f"{lo['speedup_vs_lean']:.2f}x"},
         {"shown": f"-{hi['speedup_vs_lean']:.2f}x", "table": "ttft", "cell": f"{hi['speedup_vs_lean']:.2f}x"},
         {"shown": f"{worst:.2f}x", "table": "ttft", "cell": f"worst {worst:.2f}x"}])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shapes", default="qwen2-0.5b-shape", help="comma list: qwen2-0.5b-shape, llama3-8b-shape")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: exactness,ttft,h2d")
    ap.add_argument("--json", default="")
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("gpu_check", args)
    skip = set(filter(None, args.skip.split(",")))
    info = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info), flush=True)
    out = {"info": info}
    if "h2d" not in skip:
        out["h2d"] = h2d(args.device)
    if "exactness" not in skip:
        out["exactness"] = exactness(args.device)
    if "ttft" not in skip:
        out["ttft"] = []
        for shape in args.shapes.split(","):
            out["ttft"] += ttft(args.device, [int(x) for x in args.lengths.split(",")], args.repeat, shape=shape)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if out.get("ttft"):
        res.table("ttft", ttft_table(out["ttft"]))
    if out.get("exactness"):
        res.table("exactness", exactness_table(out["exactness"]))
    if out.get("h2d"):
        res.table("h2d", h2d_table(out["h2d"]))
    headline(res, out)
    res.extra["raw"] = out
    res.write()
    bad = [r for r in out.get("exactness", []) if not r.get("bit_identical")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
