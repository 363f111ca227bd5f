"""GPU checks, for a machine with CUDA: exact reuse with states loaded onto the GPU, time to first token on
the GPU against the lean prefill, and host-to-device copy throughput. One short script, so a lent GPU is
spent on one run (about 8 minutes on an H200 with the defaults below).

    python -P bench/gpu_check.py [--device cuda] [--shapes qwen2-0.5b-shape,llama3-8b-shape]
                                 [--lengths 2048,8192,32768] [--repeat 3] [--results out.json]
    python -P bench/gpu_check.py --device cpu --quick      # the dry run the tests make (tiny shapes)

On a lent machine, keep what a cut-off run measured (each row is printed as it is measured):

    python -P bench/gpu_check.py --device cuda --results $OUT/gpu_check.json --json $OUT/raw.json 2>&1 | tee $OUT/log.txt

1. **Exactness on the device.** For each tiny family (attention and hybrids) in fp32 and bf16, on the
   device: compute the chunk states (``extract_chunks``), write them as KDN objects (zstd and raw),
   load them with the engine's loader (``CacheBuilder`` onto the device) and continue; the logits must
   equal, bit for bit, those of the device's own chunked prefill.
2. **TTFT on the device**, random-init bf16 models of a real shape (Qwen2-0.5B: 24 layers, 2 KV heads
   x 64; Llama-3-8B: 32 layers, 8 KV heads x 128), a 16-token suffix:
   - ``prefill-lean``: the one-shot prefill (``logits_to_keep=1``, what an engine runs);
   - ``host-raw`` / ``host-zstd``: the context's KDN objects already in host memory (fetched and
     verified: what a client holds), in page-locked arena buffers; ``CacheBuilder`` onto the device
     (one host-to-device copy per chunk on a stream of its own, then slices placed on the device; zstd
     decoded on the host first) and the suffix;
   - ``edge-raw``: the same objects through a real edge process on loopback (an origin serves them
     from its store; the edge's memory tier is warmed first): ``KDNClient.fetch_prefix`` into the
     device's ``CacheBuilder``, fetch and verification included;
   - ``planner``: what ``kdn.planner`` picks for the edge path from this run's measured speeds (the
     lean prefill timed here, the edge path's bytes/s), and its time: the chosen path's. It is fed this
     run's own medians, so it shows the choice given exact speeds (whether the planner's model picks the
     faster path), not how well an engine's live estimates forecast them (``bench/vllm_plan.py`` does).
   The table gives each path's median (min-max), its speed against the lean prefill, the effective
   host-to-device GB/s of ``host-raw`` (copied bytes / time in the copies), and the planner's choice.
3. **Host-to-device copy** of pageable and pinned buffers, 64 MiB to 1 GiB: the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdn.format import address as A
from kdn.adapters.hf import CacheBuilder, build_cache, continue_from_cache, extract_chunks, load_model, prefill
from kdn.format.objects import ObjectView, decode_object, encode_object, from_torch, to_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as R  # noqa: E402

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-bamba", "tiny-falconh1", "tiny-zamba2", "tiny-granitemoehybrid",
            "tiny-qwen3next"]
ADDR = "ab" * 32
MID = "cd" * 32
CHUNK = 256


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def blobs_of(chunks, encoding: str, addresses: list[str] | None = None) -> list[bytes]:
    out = []
    for c in chunks:
        tensors = from_torch({k: v.detach().to("cpu") for k, v in c.tensors.items()})
        a = addresses[c.index] if addresses else ADDR
        out.append(encode_object(kind=c.kind, address=a, model_id=MID, namespace="public", start=c.start,
                                 end=c.end, position=c.start, parent=None, tensors=tensors, encoding=encoding))
    return out


def exactness(device: str, chunk: int = 32, families=FAMILIES) -> list[dict]:
    rows = []
    n = chunk * 3 + chunk // 2
    for spec in families:
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
                    blobs = blobs_of(chunks[:k], encoding)
                    # the engine's loader onto the device (one copy per chunk, then placed there)
                    builder = CacheBuilder(model, [c.end - c.start for c in chunks[:k]], device=device,
                                           staged=True)
                    for i, b in enumerate(blobs):
                        builder.add(i, ObjectView(bytearray(b)))
                    cache, n_cached = builder.finish()
                    got = continue_from_cache(model, cache, n_cached, ids[k * chunk:])
                    # and the plain way, decoded on the host, for comparison
                    plain, _ = build_cache(model, [to_torch(decode_object(b), device=device) for b in blobs])
                    also = continue_from_cache(model, plain, n_cached, ids[k * chunk:])
                    same = bool(torch.equal(got, own)) and bool(torch.equal(also, own))
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
    elif shape == "tiny-shape":  # the CPU dry run: 2 layers, 2 KV heads x 64
        cls, cfg = LlamaForCausalLM, LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    return model


class EdgeWorld:
    """An origin serving the objects from its store and one edge in front of it, as processes on loopback."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []

    async def start(self, objects: dict[str, dict[str, bytes]], *, mem_budget: int) -> str:
        import aiohttp

        import ttft as T  # server processes and their health checks
        from kdn.origin.store import ObjectStore
        from kdn.registry import Encoding, ObjectRecord, open_registry

        registry = f"file:{self.tmp / 'registry.sqlite3'}"
        store = ObjectStore(self.tmp / "store", fsync=False)
        records = []
        for a, encs in objects.items():
            infos = {e: store.put(a, e, b) for e, b in encs.items()}
            h = ObjectView(next(iter(encs.values()))).header
            records.append(ObjectRecord(address=a, model_id=h.model_id, namespace="public", kind=h.kind,
                                        start=h.start, end=h.end, parent=None, standalone=False, origin="gpu-check",
                                        encodings={e: Encoding(e, i.size, i.digest) for e, i in infos.items()}))
        async with open_registry(registry) as reg:
            await reg.put_objects(records)
        (self.tmp / "tokens").write_text(T.PUBLISH_TOKEN + " admin *\n")
        origin = T.start("origin", "origin", dict(model="tiny-llama", registry=registry, store=str(self.tmp / "store"),
                                                  host="127.0.0.1", port=T.free_port(), token_file=str(self.tmp / "tokens"),
                                                  node_id="origin-1", fsync=False), self.tmp)
        self.procs.append(origin)
        edge = T.start("edge", "edge", dict(region="eu", registry=registry, origin=origin.url, mem_budget=mem_budget,
                                            host="127.0.0.1", port=T.free_port(), node_id="edge-1", prefetch=0,
                                            lease_ttl=10.0, fsync=False), self.tmp)
        self.procs.append(edge)
        async with aiohttp.ClientSession() as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-1" in (b.get("ring") or []))
        return edge.url

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []


def ttft(device: str, lengths: list[int], repeat: int, suffix: int = 16, shape: str = "qwen2-0.5b-shape",
         edge: bool = True) -> list[dict]:
    from kdn.client import KDNClient
    from kdn.kernels.pinned import host_arena
    from kdn.planner import Chunk, PrefillModel, Speeds, plan

    model = shaped_model(shape, device)
    cfg = model.config
    vocab = cfg.vocab_size
    arena = host_arena(24 << 30)
    rows = []
    for length in lengths:
        ids = torch.randint(0, vocab, (length + suffix,), generator=torch.Generator().manual_seed(length)).to(device)
        tokens = [int(t) for t in ids[:length].tolist()]
        addrs = A.prefix_addresses(MID, "public", tokens, CHUNK)
        with torch.inference_mode():
            chunks = list(extract_chunks(model, ids[:length], chunk_tokens=CHUNK))
        blobs = {enc: blobs_of(chunks, enc, addrs) for enc in ("raw", "zstd")}
        counts = [c.end - c.start for c in chunks]
        del chunks
        # what a client holds after fetching and verifying: the bodies in page-locked arena buffers
        held = {}
        for enc, bs in blobs.items():
            held[enc] = []
            for b in bs:
                lease = arena.take(len(b))
                lease.view[:] = b
                held[enc].append(lease)

        def suffix_forward(cache, n_cached):
            with torch.inference_mode():
                return model(input_ids=ids[None, n_cached:], past_key_values=cache, logits_to_keep=1,
                             position_ids=torch.arange(n_cached, length + suffix, device=device)[None]).logits

        def lean() -> torch.Tensor:
            with torch.inference_mode():
                return model(input_ids=ids[None], logits_to_keep=1).logits

        copies = {"bytes": 0, "seconds": 0.0, "calls": 0, "chunks": 0}  # host-raw's copies onto and on the device

        def host(encoding: str) -> torch.Tensor:
            # room: the suffix is written after the prefix in place, not concatenated onto it
            builder = CacheBuilder(model, counts, device=device, arena=arena, staged=True, room=suffix)
            for i, lease in enumerate(held[encoding]):
                builder.add(i, ObjectView(lease.view))
            cache, n_cached = builder.finish()
            if encoding == "raw":
                copies["bytes"] += builder.h2d_bytes
                copies["seconds"] += builder.h2d_seconds
                copies["calls"] += builder.device_copies
                copies["chunks"] += len(counts)
            return suffix_forward(cache, n_cached)

        cases = {"prefill-lean": lean, "host-raw": lambda: host("raw"), "host-zstd": lambda: host("zstd")}
        world = client = loop = None
        if edge:
            world = EdgeWorld(Path(tempfile.mkdtemp(prefix="kdn-gpu-check-")))
            loop = asyncio.new_event_loop()
            url = loop.run_until_complete(world.start({a: {"raw": blobs["raw"][i]} for i, a in enumerate(addrs)},
                                                      mem_budget=sum(map(len, blobs["raw"])) + (256 << 20)))
            client = KDNClient(edges=[url], hedge=False, arena=arena)
            hit = loop.run_until_complete(client.lookup(tokens, MID, chunk_tokens=CHUNK))
            assert hit.tokens == length, (hit.tokens, length)

            def from_edge() -> torch.Tensor:
                builder = CacheBuilder(model, hit.token_counts(), device=device, arena=arena, staged=True,
                                       room=suffix)
                loop.run_until_complete(client.fetch_prefix(hit, encoding="raw", into=builder.add))
                cache, n_cached = builder.finish()
                return suffix_forward(cache, n_cached)

            cases["edge-raw"] = from_edge
        try:
            times: dict[str, list[float]] = {k: [] for k in cases}
            for fn in cases.values():  # warm up kernels, the allocator, the edge's memory tier
                fn()
            sync(device)
            copies.update(bytes=0, seconds=0.0, calls=0, chunks=0)
            for r in range(repeat):
                order = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]
                for name in order:
                    sync(device)
                    t0 = time.perf_counter()
                    cases[name]()
                    sync(device)
                    times[name].append(time.perf_counter() - t0)
        finally:
            if client is not None:
                loop.run_until_complete(client.close())
            if world is not None:
                world.stop()
                shutil.rmtree(world.tmp, ignore_errors=True)
            if loop is not None:
                loop.close()
            for leases in held.values():
                for lease in leases:
                    lease.release()
        base = statistics.median(times["prefill-lean"])
        # The planner, on this run's measurements: the lean prefill (its model scaled by that timing) and
        # the edge path's bytes/s as the link; its time is that of the path it picks.
        heads = cfg.num_attention_heads
        pm = PrefillModel(params=sum(p.numel() for p in model.parameters()), layers=cfg.num_hidden_layers,
                          attn_width=heads * (cfg.hidden_size // heads))
        pm.observe(length + suffix, 0, base)
        via = "edge-raw" if "edge-raw" in times else "host-raw"
        wire = sum(map(len, blobs["raw"]))
        bps = wire / statistics.median(times[via])
        decision = plan([Chunk(n, len(b)) for n, b in zip(counts, blobs["raw"])], length + suffix,
                        link=lambda nbytes: nbytes / bps, speeds=Speeds(pm))
        choice = "load" if decision.load == len(counts) else ("compute" if not decision.loads_anything
                                                              else f"load {decision.load} of {len(counts)}")
        times["planner"] = times[via] if decision.load == len(counts) else times["prefill-lean"]
        h2d_gbps = copies["bytes"] / copies["seconds"] / 1e9 if copies["seconds"] else float("nan")
        for name, ts in times.items():
            rows.append({"shape": shape, "length": length, "path": name,
                         "median_ms": round(statistics.median(ts) * 1e3, 2),
                         "min_ms": round(min(ts) * 1e3, 2), "max_ms": round(max(ts) * 1e3, 2),
                         "speedup_vs_lean": round(base / statistics.median(ts), 2),
                         "worst_speedup": round(min(times["prefill-lean"]) / max(ts), 2),
                         "object_mib": round(sum(len(b) for b in blobs.get(name.split("-")[-1], [])) / 2**20, 1),
                         **({"h2d_gbps": round(h2d_gbps, 1),
                             "copies_per_chunk": round(copies["calls"] / max(copies["chunks"], 1), 2)}
                            if name == "host-raw" else {}),
                         **({"choice": choice, "reason": decision.reason} if name == "planner" else {})})
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


SHAPE_NAMES = {"qwen2-0.5b-shape": "Qwen2-0.5B", "llama3-8b-shape": "Llama-3-8B", "tiny-shape": "tiny"}


def ttft_table(rows: list[dict]) -> str:
    out = ["| model shape | context | lean prefill (ms) | KDN host raw (ms) | vs lean | H2D GB/s | device copies a chunk | "
           "KDN host zstd | KDN edge raw (ms) | vs lean | planner: choice, vs lean (worst) | objects (MiB, raw / zstd) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    keys = dict.fromkeys((r["shape"], r["length"]) for r in rows)
    for shape, length in keys:
        by = {r["path"]: r for r in rows if r["shape"] == shape and r["length"] == length}
        lean, raw, z, pl = by["prefill-lean"], by["host-raw"], by["host-zstd"], by["planner"]
        e = by.get("edge-raw")

        def ms(r):
            return f"{r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})"

        out.append(f"| {SHAPE_NAMES.get(shape, shape)} | {length:,} | {ms(lean)} | {ms(raw)} | "
                   f"{raw['speedup_vs_lean']:.2f}x (worst {raw['worst_speedup']:.2f}x) | {raw.get('h2d_gbps', float('nan')):.1f} | "
                   f"{raw.get('copies_per_chunk', '—')} | {z['median_ms']:.1f} ({z['speedup_vs_lean']:.2f}x) | " + (f"{ms(e)} | {e['speedup_vs_lean']:.2f}x | "
                                                                                if e else "— | — | ")
                   + f"{pl['choice']}, {pl['speedup_vs_lean']:.2f}x (worst {pl['worst_speedup']:.2f}x) | "
                   f"{raw['object_mib']:.0f} / {z['object_mib']:.0f} |")
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
    raw = [r for r in rows if r["path"] == "host-raw"]
    pl = [r for r in rows if r["path"] == "planner"]
    lo, hi = min(raw, key=lambda r: r["speedup_vs_lean"]), max(raw, key=lambda r: r["speedup_vs_lean"])
    worst = min(r["speedup_vs_lean"] for r in pl)
    res.set_headline(
        f"on {out['info'].get('gpu') or out['info']['device']}: exact reuse with states loaded onto the GPU; TTFT from KDN objects in "
        "host memory and through an edge on loopback vs the lean one-shot GPU prefill (`bench/gpu_check.py`)",
        f"**{same}/{len(ex)}** bit-identical; host-memory loads {lo['speedup_vs_lean']:.2f}x-"
        f"{hi['speedup_vs_lean']:.2f}x the prefill's speed; with the planner no row below {worst:.2f}x",
        "the lean one-shot prefill on the same device (`logits_to_keep=1`), same run",
        [{"shown": f"{same}/{len(ex)}", "table": "exactness", "cell": "yes"},
         {"shown": f"{lo['speedup_vs_lean']:.2f}x-", "table": "ttft", "cell": f"{lo['speedup_vs_lean']:.2f}x"},
         {"shown": f"-{hi['speedup_vs_lean']:.2f}x", "table": "ttft", "cell": f"{hi['speedup_vs_lean']:.2f}x"},
         {"shown": f"{worst:.2f}x", "table": "ttft", "cell": f"{worst:.2f}x"}])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default="qwen2-0.5b-shape,llama3-8b-shape",
                    help="comma list: qwen2-0.5b-shape, llama3-8b-shape, tiny-shape")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: exactness,ttft,h2d,edge")
    ap.add_argument("--quick", action="store_true", help="the CPU dry run: tiny shape, 512 tokens, two families, "
                    "one repeat")
    ap.add_argument("--json", default="")
    R.add_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.lengths, args.repeat = "tiny-shape", "512", 1
    res = R.Results("gpu_check", args)
    skip = set(filter(None, args.skip.split(",")))
    info = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info), flush=True)
    out = {"info": info}
    t0 = time.perf_counter()
    if "h2d" not in skip:
        out["h2d"] = h2d(args.device)
    if "exactness" not in skip:
        out["exactness"] = exactness(args.device, families=FAMILIES[:2] if args.quick else FAMILIES)
    if "ttft" not in skip:
        out["ttft"] = []
        for shape in args.shapes.split(","):
            out["ttft"] += ttft(args.device, [int(x) for x in args.lengths.split(",")], args.repeat, shape=shape,
                                edge="edge" not in skip)
    out["seconds"] = round(time.perf_counter() - t0, 1)
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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
