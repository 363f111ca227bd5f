"""Lossy attention K/V on a hybrid (Mamba2 + attention) model whose SSM state stays lossless: tiny-bamba.

The only hybrid models here offline are the random-init ``tiny-*`` ones, and a random-init model predicts
a near-uniform distribution: its NLL says nothing. So this bench first gives tiny-bamba (3 layers: Mamba2,
attention, Mamba2; ByteTokenizer, one token per byte) something to predict:

1. Training: the shipped documents (``kdn/data/docs/*.md``) are split per document into a train head
   (first 70%), a validation slice (next 5%, early stopping) and a test tail (last 25%, never trained on).
   Plain AdamW in float32 from tiny-bamba's fixed-seed init, on random 1024-byte windows of the train heads, until
   the validation loss stops improving (``--patience`` evaluations), ``--steps`` or ``--time-cap`` s; the
   best-validation weights are kept, cast to bf16, and cached under ``bench/work/quality_hybrid/`` keyed
   by the training config (a re-run loads them instead of retraining).
2. Quality, as in ``bench/quality.py``: contexts of 512 and 1024 tokens cut from the test tails (each with
   the next ``--continuation`` tokens), a chunked prefill (``extract_chunks``, chunks of 256: the exact
   per-chunk KV and the Mamba conv/SSM state at each chunk's end), every chunk pushed through the real
   object path (``encode_object(codec_for=encoding_plan(enc))`` -> bytes -> ``decode_object`` ->
   ``to_torch`` -> ``build_cache``) and the continuation scored against the exact cache: NLL increase %,
   top-1 agreement, KL(exact || lossy). Every object's header must name a lossless codec for each
   ``L{i}.conv`` / ``L{i}.ssm`` tensor and those tensors must decode bit-exact (asserted).

Also reported: the share of each encoding's object bytes that is the (lossless) conv/SSM state, which
caps the size ratio a lossy codec can reach on a hybrid. ``kvtc`` is not measured: its basis fit
(``adapters/hf/transform_fit.py``) walks ``model.model.layers[i].self_attn`` of every layer, i.e. an
all-attention model. Usage::

    python -P bench/quality_hybrid.py --threads 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

import kdn.kernels  # noqa: F401  (registers the lossy codecs)
from kdn.adapters.hf import models as hf_models
from kdn.adapters.hf.extract import extract_chunks
from kdn.kernels.encodings import LOSSLESS_STATE_CODEC
from kdn.format.objects import decode_object, read_header, to_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import results as R  # noqa: E402
from quality import decode_chunks, encode_chunks, metrics, score  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "kdn" / "data" / "docs"
WORK = ROOT / "bench" / "work" / "quality_hybrid"
SPEC = "tiny-bamba"
DEFAULT_ENCODINGS = ["raw", "zstd", "int8", "int4-g64", "cachegen-4", "ans-4", "ans-3"]
TRAIN_END, VALID_END = 0.70, 0.75  # per document: [0, 70%) train, [70%, 75%) validation, [75%, 100%) test
STATE_SUFFIXES = (".conv", ".ssm")
LOSSLESS = {"raw", "zstd", LOSSLESS_STATE_CODEC}
# Controls (not encodings): the prefix's attention K/V, or its conv/SSM states, replaced by zeros.
CONTROLS = {
    "control: K/V zeroed, state exact": lambda name: not name.endswith(STATE_SUFFIXES),
    "control: state zeroed, K/V exact": lambda name: name.endswith(STATE_SUFFIXES),
}


def split_docs(tok, n_docs: int | None) -> list[tuple[str, torch.Tensor]]:
    docs = sorted(p for p in DOCS.glob("*.md") if p.name != "README.md")[:n_docs]
    return [(p.stem, torch.tensor(tok(p.read_text())["input_ids"], dtype=torch.long)) for p in docs]


def bounds(n: int) -> tuple[int, int]:
    return int(n * TRAIN_END), int(n * VALID_END)


@torch.no_grad()
def segment_nll(model, ids: torch.Tensor, start: int, end: int, lead: int = 512) -> tuple[float, int]:
    """Summed NLL (nats) of ``ids[start:end]`` predicted with up to ``lead`` tokens of the document before it."""
    s0 = max(0, start - lead)
    x = ids[s0:end][None]
    logits = model(input_ids=x).logits[0, :-1].float()
    tgt = x[0, 1:]
    nll = torch.nn.functional.cross_entropy(logits, tgt, reduction="none")[start - s0 - 1 if start > s0 else 0:]
    return float(nll.sum()), int(nll.numel())


def split_nll(model, docs, part: str) -> float:
    tot, n = 0.0, 0
    for _, ids in docs:
        a, b = bounds(ids.numel())
        s, e = {"train": (1, a), "valid": (a, b), "test": (b, ids.numel())}[part]
        for lo in range(s, e, 2048):  # the train heads are long: score them in pieces
            t, k = segment_nll(model, ids, lo, min(lo + 2048, e))
            tot, n = tot + t, n + k
    return tot / n


def unigram_nll(docs) -> float:
    """NLL/byte on the test tails of a byte-frequency model fitted on the train heads (add-one): a floor to beat."""
    counts = torch.ones(512)
    for _, ids in docs:
        counts += torch.bincount(ids[: bounds(ids.numel())[0]], minlength=512).float()
    logp = (counts / counts.sum()).log()
    test = torch.cat([ids[bounds(ids.numel())[1]:] for _, ids in docs])
    return float(-logp[test].mean())


def train_config(args, docs) -> dict:
    digest = hashlib.sha256(b"".join(ids.numpy().tobytes() for _, ids in docs)).hexdigest()[:16]
    return {"spec": SPEC, "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "weight_decay": args.weight_decay, "warmup": args.warmup, "eval_every": args.eval_every,
            "patience": args.patience, "split": [TRAIN_END, VALID_END], "docs": digest, "torch": torch.__version__}


def train(args, lm, docs) -> dict:
    """Train ``lm.model`` in place (float32), or load cached weights; returns the training record."""
    model = lm.model
    cfg = train_config(args, docs)
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    wpath, rpath = WORK / f"{SPEC}-{key}.pt", WORK / f"{SPEC}-{key}.json"
    if wpath.exists() and rpath.exists():
        model.load_state_dict(torch.load(wpath, weights_only=True))
        rec = json.loads(rpath.read_text())
        print(f"loaded trained weights {wpath.relative_to(ROOT)} ({rec['steps_done']} steps, "
              f"{rec['train_seconds']:.0f} s when trained)", file=sys.stderr)
        return {**rec, "cached": True}
    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    heads = [ids[: bounds(ids.numel())[0]] for _, ids in docs]
    weights = torch.tensor([h.numel() - args.seq - 1 for h in heads], dtype=torch.float)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))

    model.eval()
    valid0 = split_nll(model, docs, "valid")
    best, best_state, bad, log, run_loss = valid0, None, 0, [], []
    print(f"step     0  valid NLL/byte {valid0:.3f} (ln 512 = {math.log(512):.3f})", file=sys.stderr, flush=True)
    t0, step, stop = time.perf_counter(), 0, "steps"
    while step < args.steps:
        model.train()
        docs_i = torch.multinomial(weights, args.batch, replacement=True, generator=g)
        x = torch.stack([heads[d][o : o + args.seq + 1] for d in docs_i.tolist()
                         for o in [int(torch.randint(0, heads[d].numel() - args.seq - 1, (1,), generator=g))]])
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        run_loss.append(float(loss.detach()))
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            v = split_nll(model, docs, "valid")
            tr = statistics.fmean(run_loss[-args.eval_every:])
            log.append({"step": step, "train_batch_nll": round(tr, 4), "valid_nll": round(v, 4),
                        "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step:5}  train batch NLL/byte {tr:.3f}  valid {v:.3f}  lr {lr_at(step - 1):.2e}  "
                  f"{time.perf_counter() - t0:5.0f} s", file=sys.stderr, flush=True)
            if v < best - 1e-3:
                best, bad = v, 0
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
            else:
                bad += 1
                if bad >= args.patience:
                    stop = f"plateau (valid NLL not better for {args.patience} evaluations)"
                    break
            if time.perf_counter() - t0 > args.time_cap:
                stop = f"time cap {args.time_cap:.0f} s"
                break
    seconds = time.perf_counter() - t0
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    rec = {"config": cfg, "steps_done": step, "stopped": stop, "train_seconds": round(seconds, 1),
           "best_valid_nll": round(best, 4), "valid_nll_init": round(valid0, 4), "log": log}
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), wpath)
    rpath.write_text(json.dumps(rec, indent=1) + "\n")
    return {**rec, "cached": False}


def contexts(docs, lengths: list[int], cont: int, limit: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Non-overlapping (context, continuation) windows from each test tail, context lengths cycling over
    ``lengths``; documents in turn until ``limit``."""
    per_doc = []
    for name, ids in docs:
        tail, out, pos, i = ids[bounds(ids.numel())[1]:], [], 0, 0
        while True:
            n = lengths[i % len(lengths)]
            if pos + n + cont > tail.numel():
                break
            out.append((f"{name}@{pos}:{n}", tail[pos : pos + n], tail[pos + n : pos + n + cont]))
            pos, i = pos + n + cont, i + 1
        per_doc.append(out)
    picked = [c for group in zip(*[d + [None] * (max(map(len, per_doc)) - len(d)) for d in per_doc]) for c in group
              if c is not None]
    return picked[:limit]


def tensor_bytes(blob: bytes) -> dict[str, int]:
    """Stored bytes of each tensor of an object (its safetensors data offsets)."""
    (n,) = struct.unpack("<Q", blob[:8])
    meta = json.loads(blob[8 : 8 + n])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in meta.items() if k != "__metadata__"}


def check_states(blobs: list[bytes], chunks, enc: str) -> None:
    """The conv/SSM states are coded losslessly (header) and decode bit-exact; the encoding did touch K/V."""
    for blob, c in zip(blobs, chunks):
        h = read_header(blob)
        states = [t for name, t in h.tensors.items() if name.endswith(STATE_SUFFIXES)]
        assert states, f"{enc}: no conv/ssm tensors in a {SPEC} object"
        for t in states:
            assert t.codec in LOSSLESS, f"{enc}: {t.name} coded with {t.codec}"
        dec = to_torch(decode_object(blob))
        for t in states:
            assert torch.equal(dec[t.name], c.tensors[t.name]), f"{enc}: {t.name} did not decode exactly"


def run(args, lm, docs) -> tuple[dict[str, list[dict]], int]:
    model, n_layers = lm.model, lm.model.config.num_hidden_layers
    rows: dict[str, list[dict]] = {e: [] for e in args.encodings}
    cases = contexts(docs, args.contexts, args.continuation, args.max_contexts)
    for name, ctx, cont in cases:
        n_ctx = ctx.numel()
        chunks = list(extract_chunks(model, ctx, chunk_tokens=256))
        raw_blobs, _ = encode_chunks(chunks, "raw", lm.model_id, n_layers)
        raw_size = sum(map(len, raw_blobs))
        exact = score(model, [c.tensors for c in chunks], n_ctx, cont)
        for enc in args.encodings:
            blobs, t_enc = encode_chunks(chunks, enc, lm.model_id, n_layers)
            check_states(blobs, chunks, enc)
            decoded, t_dec = decode_chunks(blobs)
            logp = score(model, decoded, n_ctx, cont)
            m = metrics(logp, exact, cont)
            per = [tensor_bytes(b) for b in blobs]
            state = sum(v for p in per for k, v in p.items() if k.endswith(STATE_SUFFIXES))
            kv = sum(v for p in per for k, v in p.items() if not k.endswith(STATE_SUFFIXES))
            raw_kv = sum(v for b in raw_blobs for k, v in tensor_bytes(b).items() if not k.endswith(STATE_SUFFIXES))
            m.update(ratio=raw_size / sum(map(len, blobs)), kv_ratio=raw_kv / kv,
                     state_share=100.0 * state / sum(map(len, blobs)),
                     cap=raw_size / (sum(map(len, blobs)) - kv))  # the ratio if K/V took no bytes at all
            rows[enc].append(m)
            print(f"{name:26} {enc:12} ratio {m['ratio']:5.2f}x (K/V {m['kv_ratio']:5.2f}x)  state "
                  f"{m['state_share']:4.1f}%  nll {m['nll']:.4f} ({m['dnll']:+7.3f}%)  top1 {m['top1']:.3f}  "
                  f"kl {m['kl']:.5f}", file=sys.stderr, flush=True)
        for ctl, zeroed in CONTROLS.items():  # the scale: what losing either part entirely costs
            cut = [{k: torch.zeros_like(v) if zeroed(k) else v for k, v in c.tensors.items()} for c in chunks]
            m = metrics(score(model, cut, n_ctx, cont), exact, cont)
            rows.setdefault(ctl, []).append(m)
            print(f"{name:26} {ctl:12} nll {m['nll']:.4f} ({m['dnll']:+7.3f}%)  top1 {m['top1']:.3f}  "
                  f"kl {m['kl']:.5f}", file=sys.stderr, flush=True)
    return rows, len(cases)


def quality_table(rows: dict[str, list[dict]]) -> str:
    lines = [
        "| encoding | size ratio vs bf16 raw | K/V-only ratio | conv/SSM share of bytes | ratio cap (K/V at 0 B) "
        "| NLL (nats/byte) "
        "| NLL increase %, median / worst | top-1 agreement, median / worst | KL(exact‖lossy) nats, median / worst |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for enc, ms in rows.items():
        if not ms:
            continue
        col = lambda k: [m[k] for m in ms]  # noqa: E731
        med = lambda k: statistics.median(col(k))  # noqa: E731
        sizes = "| – | – | – | – |" if enc in CONTROLS else \
            f"| {med('ratio'):.2f} | {med('kv_ratio'):.2f} | {med('state_share'):.1f}% | {med('cap'):.2f} |"
        lines.append(
            f"| {enc} {sizes} {med('nll'):.4f} "
            f"| {med('dnll'):.3f} / {max(col('dnll')):.3f} | {med('top1'):.3f} / {min(col('top1')):.3f} "
            f"| {med('kl'):.5f} / {max(col('kl')):.5f} |"
        )
    return "\n".join(lines)


def training_table(rec: dict, nll: dict[str, float], unigram: float) -> str:
    return "\n".join([
        "| what | NLL, nats/byte |",
        "| --- | ---: |",
        f"| uniform over the 512-entry vocabulary (ln 512) | {math.log(512):.3f} |",
        f"| untrained tiny-bamba (fixed-seed init), validation slices | {rec['valid_nll_init']:.3f} |",
        f"| byte unigram fitted on the train heads, test tails | {unigram:.3f} |",
        f"| trained, float32: train heads | {nll['train32']:.3f} |",
        f"| trained, float32: validation slices (early stopping) | {nll['valid32']:.3f} |",
        f"| trained, float32: test tails (never trained on) | {nll['test32']:.3f} |",
        f"| trained, bf16 (as measured below): test tails | {nll['test16']:.3f} |",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024], help="context lengths, cycled")
    ap.add_argument("--max-contexts", type=int, default=12)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    ap.add_argument("--docs", type=int, default=None, help="use only the first N documents (a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500, help="training step cap")
    ap.add_argument("--time-cap", type=float, default=360.0, help="training seconds cap (checked at evaluations)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024, help="training window (>= the contexts: positions stay in range)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--patience", type=int, default=4)
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("quality_hybrid", args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = hf_models.load_model(SPEC)  # float32, fixed-seed init
    docs = split_docs(lm.tokenizer, args.docs)
    rec = train(args, lm, docs)
    model = lm.model
    nll = {"train32": split_nll(model, docs, "train"), "valid32": split_nll(model, docs, "valid"),
           "test32": split_nll(model, docs, "test")}
    model.to(torch.bfloat16).eval()
    lm.model_id = hf_models.model_id_of(model, lm.tokenizer)  # the trained bf16 weights' id
    nll["test16"] = split_nll(model, docs, "test")
    unigram = unigram_nll(docs)
    print(f"training: {rec['steps_done']} steps, stopped by {rec['stopped']}, {rec['train_seconds']:.0f} s"
          f"{' (cached weights)' if rec['cached'] else ''}", file=sys.stderr)
    res.table("training", training_table(rec, nll, unigram),
              "tiny-bamba trained on the shipped documents: NLL per byte")
    res.extra["training"] = {**rec, "nll": {k: round(v, 4) for k, v in nll.items()}, "unigram_nll": round(unigram, 4)}
    rows, n_cases = run(args, lm, docs)
    res.table("main", quality_table(rows), f"Lossy attention K/V on tiny-bamba, conv/SSM state lossless "
              f"({n_cases} contexts)")
    res.extra["cases"] = n_cases
    print(f"\n{n_cases} contexts x {len(args.encodings)} encodings in {time.perf_counter() - t0:.0f} s on "
          f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    res.write()


if __name__ == "__main__":
    main()
