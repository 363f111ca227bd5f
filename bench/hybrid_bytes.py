"""A hybrid model's load moves its recurrent state once: bytes moved before and after, measured and modelled.

    python -P bench/hybrid_bytes.py [--lengths 2048,8192] [--repeat 7] [--piece-bytes 64KiB]

Every chunk object of a hybrid model carries the conv and recurrent states as they stand at its end, and a load
keeps only the last loaded chunk's. Before: every object came whole, so an 8k-token load moved every chunk's
states. After (``CacheBuilder.needs`` -> ``KDNClient.fetch_prefix(needs=)`` -> ``kdn.client.parts.fetch_kept``):
every chunk but the last brings only its attention K/V, by range requests verified piece by piece, and the last
one comes whole.

Measured: an origin and one edge (memory tier) as processes on 127.0.0.1, a random-init bf16 Qwen3-Next-style
model built with Qwen3.5-A3B's proportions at a small scale (8 layers, every 4th full attention; per 256-token
chunk 1.6 MiB of states against 128 KiB of K/V: 12.6x, Qwen3.5-A3B's is 12.4x), its records' pieces at
``--piece-bytes`` (the default 1 MiB would be a tenth of this small model's chunk; 64 KiB is to it what 1 MiB
is to Qwen3.5-A3B's 67 MiB). Per context, in alternating order, ``--repeat`` loads of the same prefix into a
``CacheBuilder`` through each path, from the edge's memory: the body bytes received (``kdn.wire.bodyget.Tally``,
exact, the same every run) and the load's time, median (worst). Both builders' caches are compared tensor by
tensor and by the next token's logits: ``identical`` is ``torch.equal`` on all of them.

Modelled (config arithmetic, not a measurement): Qwen3.5-A3B's shape (40 layers, every 4th full attention:
10 x 2 KV heads x 256; 30 gated-delta-net layers of 16 key / 32 value heads x 128, conv kernel 4; bf16 with
fp32 recurrent states) at 1 MiB pieces: one chunk object of that shape encoded as an origin encodes it (zeros;
the layout is what counts: widest dtype first, then by name, so the fp32 recurrent states lead and the bf16
conv states sit between the K/V), its pieces counted with the same ``piece_runs`` the client uses, times the
chunks of the context.
"""

from __future__ import annotations

import argparse
import math
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
import ttft as T  # noqa: E402  (server processes, publish)
from ports import free_port  # noqa: E402

MiB = 1 << 20
SEED = 5
PATHS = ("whole", "kept")


def small_config():
    """Qwen3.5-A3B's proportions, small: 6 gated-delta-net layers (16 value heads x 64 x 64 fp32 each) and
    2 attention layers (1 KV head x 64)."""
    import transformers as Tr

    return Tr.Qwen3NextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, num_hidden_layers=8, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_num_key_heads=4, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, max_position_embeddings=16384, tie_word_embeddings=False)


def model_folder() -> Path:
    """The bench's model, built once (seeded) under bench/work/."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = ROOT / "bench" / "work" / "hybrid-bytes-qwen3next"
    if not (folder / "config.json").exists():
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(small_config(), dtype=torch.float32).to(torch.bfloat16)
        tmp = Path(tempfile.mkdtemp(prefix=".hybrid-bytes.", dir=folder.parent))
        model.save_pretrained(tmp)
        tmp.rename(folder)
    return folder


# --- modelled: Qwen3.5-A3B's shape ----------------------------------------------------------------------


def qwen35_object(tokens: int = 256) -> bytes:
    """One Qwen3.5-A3B-shaped chunk object of ``tokens`` tokens (zeros), encoded raw as an origin encodes it."""
    from kdn.format.objects import RawTensor, encode_object

    conv_dim = 2 * 16 * 128 + 32 * 128
    shapes = {}
    for i in range(40):
        if i % 4 == 3:  # full attention: K and V [2, tokens, 256] bf16
            shapes |= {f"L{i}.k": ("BF16", (2, tokens, 256)), f"L{i}.v": ("BF16", (2, tokens, 256))}
        else:  # gated delta net: conv [conv_dim, 4] bf16, recurrent [32, 128, 128] fp32
            shapes |= {f"L{i}.conv": ("BF16", (conv_dim, 4)), f"L{i}.ssm": ("F32", (32, 128, 128))}
    zeros = memoryview(bytes(32 * 128 * 128 * 4))
    tensors = {n: RawTensor(n, dt, shape, zeros[:math.prod(shape) * (4 if dt == "F32" else 2)])
               for n, (dt, shape) in shapes.items()}
    return encode_object(kind="hybrid", address="ab" * 32, model_id="cd" * 32, namespace="public", start=7936,
                         end=7936 + tokens, position=7936, parent="ef" * 32, tensors=tensors, encoding="raw")


def modelled(tokens: int, blob: bytes, piece_bytes: int = MiB, chunk: int = 256) -> dict:
    """Bytes a load of ``tokens`` tokens moves, whole vs K/V-only but the last: the pieces of one real object's
    layout (``blob``) counted as the client counts them (``piece_runs``), times the chunks."""
    from kdn.client.parts import piece_runs
    from kdn.format.objects import head_length, read_layout

    size = len(blob)
    hl = head_length(blob[:8])
    layout = read_layout(blob[:hl], size)
    kv = [layout.span(n) for n in layout.offsets if n.endswith((".k", ".v"))]
    held = -(-hl // piece_bytes)  # the pieces the header spans (its first, here)
    kept = min(held * piece_bytes, size) + sum(min(e * piece_bytes, size) - b * piece_bytes
                                               for b, e in piece_runs(kv, piece_bytes, held))
    chunks = tokens // chunk
    kv_bytes = sum(e - b for b, e in kv)
    states = sum(e - b for n in layout.offsets if not n.endswith((".k", ".v")) for b, e in [layout.span(n)])
    return {"chunks": chunks, "object": size, "states": states, "kv": kv_bytes, "whole": chunks * size,
            "kept": (chunks - 1) * kept + size, "ideal": chunks * kv_bytes + states, "per_chunk": kept}


# --- measured ---------------------------------------------------------------------------------------


async def load(client, lm, hit, path: str) -> tuple[object, int, float]:
    """One load of ``hit`` into a fresh ``CacheBuilder`` through ``path``: (builder, bytes moved, seconds)."""
    from kdn.adapters.hf import CacheBuilder
    from kdn.wire.bodyget import Tally

    builder = CacheBuilder(lm.model, hit.token_counts())
    tally, t0 = Tally(), time.perf_counter()
    await client.fetch_prefix(hit, into=builder.add, scatter=builder, tally=tally,
                              needs=builder.needs if path == "kept" else None)
    return builder, tally.bytes, time.perf_counter() - t0


def identical(lm, builders: dict, next_id: int) -> bool:
    """Both paths' caches equal, tensor by tensor, and the next token's logits after them."""
    import torch

    from kdn.adapters.hf import continue_from_cache

    a, b = builders["whole"], builders["kept"]
    same = all(torch.equal(x, y) for i in a.kv for x, y in zip(a.kv[i], b.kv[i]))
    same = same and set(a.last) == set(b.last) and all(torch.equal(a.last[n], b.last[n]) for n in a.last)
    (ca, n), (cb, _) = a.finish(), b.finish()
    return same and torch.equal(continue_from_cache(lm.model, ca, n, [next_id], last=1),
                                continue_from_cache(lm.model, cb, n, [next_id], last=1))


async def measure(args, log) -> list[dict]:
    import aiohttp
    import torch

    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.extract import layer_layout
    from kdn.client import KDNClient

    folder = model_folder()
    lm = load_model(str(folder))
    layout = layer_layout(lm.model)
    states = sum(math.prod(st.shape) * torch.empty(0, dtype=st.dtype).element_size()
                 for s in layout for st in s.states)
    kv_token = sum(2 * s.kv[0] * s.kv[1] * 2 for s in layout if s.kv)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-hybrid-bytes-"))
    procs, rows = [], []
    try:
        (tmp / "tokens").write_text(T.PUBLISH_TOKEN + " admin *\n")
        registry = f"file:{tmp / 'registry.sqlite3'}"
        origin = T.start("origin", "origin", dict(model=str(folder), dtype="bfloat16", registry=registry,
                                                  store=str(tmp / "store"), host="127.0.0.1", port=free_port(),
                                                  token_file=str(tmp / "tokens"), node_id="origin-1", fsync=False,
                                                  piece_bytes=args.piece_bytes), tmp)
        procs.append(origin)
        edge = T.start("edge", "edge", dict(region="eu", registry=registry, origin=origin.url, mem_budget=2 << 30,
                                            disk=None, host="127.0.0.1", port=free_port(), node_id="edge-1",
                                            prefetch=0, lease_ttl=10.0, fsync=False), tmp)
        procs.append(edge)
        g = torch.Generator().manual_seed(SEED)
        doc = torch.randint(0, lm.model.config.vocab_size, (max(args.lengths) + 1,), generator=g).tolist()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-1" in (b.get("ring") or []))
            t0 = time.perf_counter()
            man = await T.publish(s, origin.url, "hybrid-bytes", doc[:max(args.lengths)], encodings=["raw"])
            log(f"published {max(args.lengths)} tokens in {time.perf_counter() - t0:.1f} s")
            if man["model_id"] != lm.model_id:
                raise RuntimeError("the origin's model id is not the bench's")
        async with KDNClient(edges=[edge.url], max_hedges=0) as client:
            for L in args.lengths:
                hit = await client.lookup(doc[:L], lm.model_id)
                if hit.tokens != L:
                    raise RuntimeError(f"the lookup found {hit.tokens} of {L} tokens")
                sizes = [r.encodings["raw"].size for r in hit.records]
                moved: dict[str, set[int]] = {p: set() for p in PATHS}
                times: dict[str, list[float]] = {p: [] for p in PATHS}
                same = True
                for r in range(args.repeat + 1):  # the first round warms the edge's memory and the connections
                    builders = {}
                    for p in PATHS if r % 2 else PATHS[::-1]:
                        builders[p], nbytes, dt = await load(client, lm, hit, p)
                        if r:
                            moved[p].add(nbytes)
                            times[p].append(dt)
                    same = same and identical(lm, builders, doc[L])
                if any(len(v) != 1 for v in moved.values()):
                    raise RuntimeError(f"bytes moved differ between runs: {moved}")
                row = {"tokens": L, "chunks": hit.chunks, "object": statistics.mean(sizes), "states": states,
                       "kv": 256 * kv_token, "whole": moved["whole"].pop(), "kept": moved["kept"].pop(),
                       "ideal": L * kv_token + states, "records": sum(sizes), "times": times, "identical": same}
                if row["whole"] != row["records"]:
                    raise RuntimeError(f"the whole path moved {row['whole']} B, its records say {row['records']}")
                rows.append(row)
                log(f"[L={L}] whole {row['whole'] / MiB:.2f} MiB, kept {row['kept'] / MiB:.2f} MiB, "
                    f"identical {same}")
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _mib(n: float) -> str:
    return f"{n / MiB:,.2f}"


def _ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.1f} ({max(ts) * 1e3:.1f})"


async def run(args, res: R.Results, log) -> None:
    rows = await measure(args, log)
    t = res.start_table("main", "bytes a hybrid load moves, whole objects vs K/V-only but the last (measured)")
    t.line("| model | context | chunks | states per chunk, MiB | K/V per chunk, MiB | before: whole objects, MiB "
           "| after: K/V but the last, MiB | before / after | ideal (all K/V + one set of states), MiB "
           "| after / ideal | load before, ms | load after, ms | identical |")
    t.line("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        t.line(f"| small Qwen3-Next (bf16, {args.piece_bytes >> 10} KiB pieces) | {r['tokens']:,} | {r['chunks']} "
               f"| {_mib(r['states'])} | {_mib(r['kv'])} | {_mib(r['whole'])} | {_mib(r['kept'])} "
               f"| {r['whole'] / r['kept']:.2f}x | {_mib(r['ideal'])} | {r['kept'] / r['ideal']:.2f}x "
               f"| {_ms(r['times']['whole'])} | {_ms(r['times']['kept'])} | {'yes' if r['identical'] else 'NO'} |")
    res.end_table(t)
    m = res.start_table("model", "the same for Qwen3.5-A3B's shape at 1 MiB pieces (config arithmetic, not measured)")
    m.line("| shape | context | chunks | object, MiB | states per chunk, MiB | K/V-only fetch per chunk, MiB "
           "| before: whole objects, MiB | after: K/V but the last, MiB | before / after | ideal, MiB "
           "| after / ideal |")
    m.line("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    blob = qwen35_object()
    for L in args.lengths:
        q = modelled(L, blob)
        m.line(f"| Qwen3.5-A3B (model) | {L:,} | {q['chunks']} | {_mib(q['object'])} | {_mib(q['states'])} "
               f"| {_mib(q['per_chunk'])} | {_mib(q['whole'])} | {_mib(q['kept'])} | {q['whole'] / q['kept']:.2f}x | {_mib(q['ideal'])} "
               f"| {q['kept'] / q['ideal']:.2f}x |")
    res.end_table(m)
    if not all(r["identical"] for r in rows):
        raise SystemExit("the two paths' caches differ")


def main() -> int:
    from kdn.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192", help="context lengths, whole chunks of 256 tokens")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--piece-bytes", default="64KiB", help="the origin's piece size (kdn/format/pieces.py)")
    R.add_arg(ap)
    args = ap.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    args.piece_bytes = parse_size(args.piece_bytes)
    if any(L % 256 for L in args.lengths):
        ap.error("--lengths must be whole chunks (multiples of 256)")
    R.run_logged("hybrid_bytes", args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
