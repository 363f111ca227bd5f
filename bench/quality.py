"""Lossy KV codecs: size vs quality on a real model (SmolLM2-135M, bf16, the shipped documents).

For each document and context length L: prefill the first L tokens in chunks
of 256 (``extract_chunks``: the exact per-chunk KV an origin publishes), then
for each encoding push every chunk through the real object path
(``encode_object`` -> bytes -> ``decode_object`` -> ``to_torch`` ->
``build_cache``) and score the next ``--continuation`` tokens of the same
document on top of that cache against the exact cache:

- continuation NLL (nats/token) and perplexity, the NLL increase in %,
- top-1 agreement (argmax of lossy logits == argmax of exact logits),
- mean KL(exact || lossy) over the continuation positions,
- size ratio: bytes of the bf16 ``raw`` objects / bytes of the encoded objects.

Prints a markdown table (medians over documents x contexts, with min-max),
writes a PNG (size ratio vs NLL increase), and with ``--append`` appends both
to docs/benchmarks.md. Usage::

    python -P bench/quality.py --contexts 512 1024 --continuation 256 --png docs/img/quality.png
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import kdn.kernels  # noqa: F401  (registers the lossy codecs)
from kdn.adapters.hf import models as hf_models
from kdn.adapters.hf.cache import build_cache, continue_from_cache
from kdn.adapters.hf.extract import extract_chunks
from kdn.kernels.encodings import encoding_plan
from kdn.format.objects import decode_object, encode_object, from_torch, to_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
import results as R  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "kdn" / "data" / "docs"
DEFAULT_ENCODINGS = [
    "raw", "zstd", "int8", "int8z", "int4-g32", "int4-g64",
    "cachegen-6", "cachegen-4", "cachegen-6-5-4",
    "ans-5", "ans-4", "ans-5-4-3", "ans-4-4-3", "ans-3",
]


def encode_chunks(chunks, encoding: str, model_id: str, n_layers: int) -> tuple[list[bytes], float]:
    """One blob per chunk, through the real object writer; and the seconds it took."""
    plan = encoding_plan(encoding, n_layers=n_layers)
    blobs, parent = [], None
    t0 = time.perf_counter()
    for c in chunks:
        address = f"{c.index + 1:064x}"
        blobs.append(encode_object(
            kind=c.kind, address=address, model_id=model_id, namespace="public", start=c.start, end=c.end,
            position=c.start, parent=parent, tensors=from_torch(c.tensors), encoding=encoding, codec_for=plan,
        ))
        parent = address
    return blobs, time.perf_counter() - t0


def decode_chunks(blobs: list[bytes]) -> tuple[list[dict[str, torch.Tensor]], float]:
    t0 = time.perf_counter()
    out = [to_torch(decode_object(b)) for b in blobs]
    return out, time.perf_counter() - t0


def score(model, chunks: list[dict[str, torch.Tensor]], n_ctx: int, cont: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[m-1, vocab]`` (float32) of ``cont[1:]`` given the cache built from ``chunks``."""
    cache, n = build_cache(model, chunks)
    assert n == n_ctx
    logits = continue_from_cache(model, cache, n_ctx, cont)  # [m, vocab]
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def metrics(logp: torch.Tensor, exact: torch.Tensor, cont: torch.Tensor) -> dict:
    target = cont[1:]
    nll = float(-logp.gather(1, target[:, None]).mean())
    nll_exact = float(-exact.gather(1, target[:, None]).mean())
    kl = float((exact.exp() * (exact - logp)).sum(-1).mean())  # KL(exact || lossy), nats
    return {
        "nll": nll,
        "ppl": math.exp(nll),
        "dnll": 100.0 * (nll - nll_exact) / nll_exact,
        "top1": float((logp.argmax(-1) == exact.argmax(-1)).float().mean()),
        "kl": max(kl, 0.0),
    }


def run(args) -> dict[str, list[dict]]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lm = hf_models.load_model("smollm2-135m")
    model, tok = lm.model, lm.tokenizer
    n_layers = model.config.num_hidden_layers
    rows: dict[str, list[dict]] = {e: [] for e in args.encodings}
    docs = sorted(p for p in DOCS.glob("*.md") if p.name != "README.md")
    for doc in docs:
        ids = torch.tensor(tok(doc.read_text())["input_ids"], dtype=torch.long)
        for n_ctx in args.contexts:
            if ids.numel() < n_ctx + args.continuation:
                print(f"skip {doc.name} @ {n_ctx}: only {ids.numel()} tokens", file=sys.stderr)
                continue
            cont = ids[n_ctx : n_ctx + args.continuation]
            chunks = list(extract_chunks(model, ids[:n_ctx], chunk_tokens=256))
            raw_blobs, _ = encode_chunks(chunks, "raw", lm.model_id, n_layers)
            raw_size = sum(map(len, raw_blobs))
            exact = score(model, [c.tensors for c in chunks], n_ctx, cont)
            for enc in args.encodings:
                blobs, t_enc = encode_chunks(chunks, enc, lm.model_id, n_layers)
                decoded, t_dec = decode_chunks(blobs)
                logp = score(model, decoded, n_ctx, cont)
                m = metrics(logp, exact, cont)
                m.update(ratio=raw_size / sum(map(len, blobs)), enc_mbs=raw_size / t_enc / 1e6, dec_mbs=raw_size / t_dec / 1e6)
                rows[enc].append(m)
                print(f"{doc.stem[:16]:16} L={n_ctx:5} {enc:16} ratio {m['ratio']:5.2f}x  nll {m['nll']:.4f} "
                      f"(+{m['dnll']:6.2f}%)  top1 {m['top1']:.3f}  kl {m['kl']:.5f}", file=sys.stderr, flush=True)
    return rows


def _cell(vals: list[float], fmt: str) -> str:
    return f"{statistics.median(vals):{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})"


def table(rows: dict[str, list[dict]]) -> str:
    lines = [
        "| encoding | size ratio vs bf16 | NLL | perplexity | NLL increase % | top-1 agreement | KL(exact‖lossy) nats | encode / decode MB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for enc, ms in rows.items():
        if not ms:
            continue
        col = lambda k: [m[k] for m in ms]  # noqa: E731
        lines.append(
            f"| {enc} | {_cell(col('ratio'), '.2f')} | {statistics.median(col('nll')):.4f} | {statistics.median(col('ppl')):.3f} "
            f"| {_cell(col('dnll'), '.2f')} | {_cell(col('top1'), '.3f')} | {_cell(col('kl'), '.4f')} "
            f"| {statistics.median(col('enc_mbs')):.0f} / {statistics.median(col('dec_mbs')):.0f} |"
        )
    return "\n".join(lines)


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for enc, ms in rows.items():
        if not ms:
            continue
        x = statistics.median(m["ratio"] for m in ms)
        y = statistics.median(m["dnll"] for m in ms)
        lo, hi = min(m["dnll"] for m in ms), max(m["dnll"] for m in ms)
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
        ax.annotate(enc, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.axvline(5.0, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("size ratio vs bf16 raw objects (higher is smaller)")
    ax.set_ylabel("continuation NLL increase, % (median, min-max)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title("SmolLM2-135M: lossy KV codecs, size vs quality")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the 2-core VM is shared: 1 is steadier)")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--append", type=Path, default=None, help="append the table to this markdown file (docs/benchmarks.md)")
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("quality", args)
    t0 = time.perf_counter()
    rows = run(args)
    res.table("main", table(rows), "Lossy codecs: size vs quality (medians over the cases, min-max)")
    # No README headline: bench/quality_transform.py (36 contexts, worst cases) carries the lossy one.
    print(f"\n{sum(map(len, rows.values()))} runs in {time.perf_counter() - t0:.0f} s on {platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.png:
        plot(rows, args.png)
    res.write()


if __name__ == "__main__":
    main()
