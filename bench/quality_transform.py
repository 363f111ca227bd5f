"""The kvtc transform codec vs the other lossy encodings: size vs quality on SmolLM2-135M, many documents.

Machinery from ``bench/quality.py`` (the real object path, the same metrics);
this adds a wider corpus, the basis fit and the kvtc rows:

1. Basis: fitted on CALIBRATION text only (``--basis``: reused if the file
   exists, else fitted and written there): Newton's *Opticks* chars
   150,000-200,000 and the pydoc topics ``types`` and ``formatstrings``
   (statistics pass); the pydoc topic ``string-methods`` (sensitivity pass,
   on a float32 copy of the model).
2. Evaluation: each document of EVAL_DOCS (none overlaps the calibration
   text) at contexts of ``--contexts`` tokens, continuation ``--continuation``
   tokens. Sources (all offline on this machine; a missing file is skipped):
   the 4 shipped kdn/data/docs, CPython 3.11's LICENSE.txt, the GPL-3.0 text
   of the Rust toolchain, *Opticks* chars 430,000-450,000 (Project Gutenberg
   text shipped in tvm_ffi's libbacktrace test data), the pydoc topic
   ``compound`` and IDLE's NEWS.txt (first 20,000 chars).

Size ratio = bytes of the bf16 ``raw`` objects / bytes of the encoded objects
(whole objects: container header, exact sink rows, scales, rANS words). The
basis is a separate, once-per-model object, reported on its own line.

    python -P bench/quality_transform.py --basis /tmp/kvtc-smollm2.basis \\
        --png docs/img/quality_transform.png --json /tmp/kvtc.jsonl

``--docs`` runs a subset (two processes can split the documents);
``--from-json`` tabulates and plots the JSON rows of earlier runs.
"""

from __future__ import annotations

import argparse
import json
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality as q  # noqa: E402  (bench/quality.py: the object path and the metrics)
import results as R  # noqa: E402

import kdn.kernels  # noqa: E402, F401  (registers the codecs)
from kdn.adapters.hf import models as hf_models  # noqa: E402
from kdn.adapters.hf.extract import extract_chunks  # noqa: E402
from kdn.kernels.transform import Basis, allocate, encode_kvtc_object, register_basis  # noqa: E402

PY = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
PYENV_PY = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
OPTICKS = PYENV_PY / "site-packages/tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
GPL3 = Path("/root/.rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/licenses/GPL-3.0-or-later.txt")
ALPHA_WINDOWS, ALPHA_SIGMA2 = 4, 0.05
DEFAULT_ENCODINGS = ["int8", "int4-g64", "cachegen-4", "ans-4"]


def _topics() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("pydoc_topics", PYENV_PY / "pydoc_data" / "topics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.topics


def eval_docs() -> dict[str, str]:
    docs = {p.stem: p.read_text() for p in sorted(q.DOCS.glob("*.md")) if p.name != "README.md"}
    docs["python-license"] = (PYENV_PY / "LICENSE.txt").read_text() if (PYENV_PY / "LICENSE.txt").exists() else None
    docs["gpl-3.0"] = GPL3.read_text() if GPL3.exists() else None
    docs["opticks-430k"] = OPTICKS.read_text(encoding="utf-8")[430_000:450_000] if OPTICKS.exists() else None
    docs["pydoc-compound"] = _topics().get("compound")
    news = PYENV_PY / "idlelib" / "NEWS.txt"
    docs["idle-news"] = news.read_text()[:20_000] if news.exists() else None
    return {k: v for k, v in docs.items() if v}


def calibration_text() -> tuple[str, str]:
    t = _topics()
    stats = OPTICKS.read_text(encoding="utf-8")[150_000:200_000] + "\n\n" + t["types"] + "\n\n" + t["formatstrings"]
    return stats, t["string-methods"]


def fit(lm, path: Path, window: int = 1024) -> Basis:
    from kdn.adapters.hf.transform_fit import fit_basis

    stats_text, alpha_text = calibration_text()
    ids = torch.tensor(lm.tokenizer(stats_text)["input_ids"], dtype=torch.long)
    windows = [ids[i : i + window] for i in range(0, ids.numel() - window + 1, window)]
    aids = torch.tensor(lm.tokenizer(alpha_text)["input_ids"], dtype=torch.long)
    alpha_windows = [aids[i : i + 640] for i in range(0, min(aids.numel() - 640, ALPHA_WINDOWS * 640), 640)]
    print(f"fit: {len(windows)} x {window} calibration tokens, {len(alpha_windows)} sensitivity windows", file=sys.stderr)
    t0 = time.perf_counter()
    f32 = hf_models.load_model("smollm2-135m", dtype=torch.float32).model  # sensitivities without bf16 noise
    basis = fit_basis(lm.model, lm.model_id, windows, alpha_windows, alpha_model=f32, sigma2_frac=ALPHA_SIGMA2)
    path.write_bytes(basis.to_bytes())
    print(f"fit: {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    return basis


def encode_kvtc(chunks, basis: Basis, theta: float, name: str, model_id: str, rho: float = 0.5) -> tuple[list[bytes], float]:
    blobs, parent = [], None
    t0 = time.perf_counter()
    for c in chunks:
        address = f"{c.index + 1:064x}"
        blobs.append(encode_kvtc_object(basis, theta, tensors=c.tensors, position=c.start, encoding=name, rho=rho,
                                        kind=c.kind, address=address, model_id=model_id, namespace="public",
                                        start=c.start, end=c.end, parent=parent))
        parent = address
    return blobs, time.perf_counter() - t0


def run(args) -> tuple[dict[str, list[dict]], Basis, dict[str, float]]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lm = hf_models.load_model("smollm2-135m")
    model, tok = lm.model, lm.tokenizer
    n_layers = model.config.num_hidden_layers
    basis = Basis.from_bytes(args.basis.read_bytes()) if args.basis.exists() else fit(lm, args.basis)
    register_basis(basis)
    thetas = {f"kvtc-{b:g}": allocate(basis, b).theta for b in args.budgets}
    rows: dict[str, list[dict]] = {e: [] for e in [*args.encodings, *thetas]}
    for doc, text in eval_docs().items():
        if args.docs and doc not in args.docs:
            continue
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
        for n_ctx in args.contexts:
            if ids.numel() < n_ctx + args.continuation:
                print(f"skip {doc} @ {n_ctx}: only {ids.numel()} tokens", file=sys.stderr)
                continue
            cont = ids[n_ctx : n_ctx + args.continuation]
            chunks = list(extract_chunks(model, ids[:n_ctx], chunk_tokens=256))
            raw_size = sum(map(len, q.encode_chunks(chunks, "raw", lm.model_id, n_layers)[0]))
            exact = q.score(model, [c.tensors for c in chunks], n_ctx, cont)
            for enc in rows:
                if enc in thetas:
                    blobs, t_enc = encode_kvtc(chunks, basis, thetas[enc], enc, lm.model_id)
                else:
                    blobs, t_enc = q.encode_chunks(chunks, enc, lm.model_id, n_layers)
                decoded, t_dec = q.decode_chunks(blobs)
                m = q.metrics(q.score(model, decoded, n_ctx, cont), exact, cont)
                m.update(ratio=raw_size / sum(map(len, blobs)), enc_mbs=raw_size / t_enc / 1e6, dec_mbs=raw_size / t_dec / 1e6,
                         doc=doc, ctx=n_ctx)
                rows[enc].append(m)
                if args.json:
                    with args.json.open("a") as f:
                        f.write(json.dumps({"encoding": enc, **m}) + "\n")
                print(f"{doc[:16]:16} L={n_ctx:5} {enc:16} ratio {m['ratio']:5.2f}x  nll {m['nll']:.4f} "
                      f"(+{m['dnll']:6.2f}%)  top1 {m['top1']:.3f}  kl {m['kl']:.5f}", file=sys.stderr, flush=True)
    return rows, basis, thetas


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    """Two panels against the median size ratio: NLL increase (median and worst), and median KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    kv = [(e, ms) for e, ms in rows.items() if ms and e.startswith("kvtc")]
    other = [(e, ms) for e, ms in rows.items() if ms and not e.startswith("kvtc")]
    for group, color in ((kv, "tab:blue"), (other, "tab:orange")):
        if not group:
            continue
        x = [statistics.median(m["ratio"] for m in ms) for _, ms in group]
        med = [statistics.median(m["dnll"] for m in ms) for _, ms in group]
        worst = [max(m["dnll"] for m in ms) for _, ms in group]
        kl = [statistics.median(m["kl"] for m in ms) for _, ms in group]
        ls = "-" if group is kv else "none"
        ax.plot(x, worst, marker="v", ls=ls, color=color, label=f"{'kvtc' if group is kv else 'existing'}: worst case")
        ax.plot(x, med, marker="o", ls=ls, color=color, alpha=0.5, label=f"{'kvtc' if group is kv else 'existing'}: median")
        bx.plot(x, kl, marker="o", ls=ls, color=color)
        for (e, _), xi, yi, ki in zip(group, x, worst, kl):
            ax.annotate(e, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
            bx.annotate(e, (xi, ki), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for a in (ax, bx):
        a.axvline(8.0, color="grey", ls=":", lw=0.8)
        a.set_xlabel("size ratio vs bf16 raw objects (median; higher is smaller)")
        a.grid(alpha=0.3)
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_ylabel("continuation NLL increase, % (symlog)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.legend(fontsize=7)
    bx.set_ylabel("KL(exact || lossy), nats/token (median)")
    n = len(next(iter(rows.values())))
    fig.suptitle(f"SmolLM2-135M, {n} contexts: kvtc (PCA + water-filling + rANS) vs the existing lossy encodings")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def from_json(paths: list[Path]) -> dict[str, list[dict]]:
    """Rows of earlier runs (``--json`` files), by encoding, in file order."""
    rows: dict[str, list[dict]] = {}
    for p in paths:
        for line in p.read_text().splitlines():
            m = json.loads(line)
            rows.setdefault(m.pop("encoding"), []).append(m)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--basis", type=Path, required=True, help="basis file: read if it exists, else fitted and written")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.5, 1.65, 1.75, 2.0, 2.5], help="kvtc budgets, estimated bits/value")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 1536, 2048])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--docs", nargs="+", default=None, help="only these documents (names as in eval_docs)")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, help="no runs: tabulate and plot these --json files")
    ap.add_argument("--json", type=Path, default=None, help="append one JSON line per (context, encoding) here")
    ap.add_argument("--png", type=Path, default=None)
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("quality_transform", args)
    t0 = time.perf_counter()
    if args.from_json:
        rows = from_json(args.from_json)
        basis = Basis.from_bytes(args.basis.read_bytes())
        thetas = {e: allocate(basis, float(e.split("-", 1)[1])).theta for e in rows if e.startswith("kvtc-")}
    else:
        rows, basis, thetas = run(args)
    n_ctx = len(next(iter(rows.values())))
    res.table("main", q.table(rows), f"size vs quality, SmolLM2-135M, {n_ctx} contexts: median (min-max)")
    headline(res, rows)
    if not args.from_json:
        print(f"\n{n_ctx} contexts x {len(rows)} encodings in {time.perf_counter() - t0:.0f} s on {platform.machine()}, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    size = len(basis.to_bytes())
    print(f"basis {basis.address[:16]}...: {size / 1e6:.2f} MB once per model "
          f"(= the raw bf16 KV of {size / (2 * 2 * basis.n_layers * basis.channels):.0f} tokens)")
    for name, theta in thetas.items():
        a = allocate(basis, float(name.split("-", 1)[1]))
        kept = sum(m for pair in a.kept for m in pair)
        print(f"{name}: theta {theta:.4g}, {kept}/{2 * basis.n_layers * basis.channels} coefficients kept, "
              f"estimated {a.est_bits:.3f} bits/value")
    worst = {e: max(m["dnll"] for m in ms) for e, ms in rows.items() if ms}
    print("worst NLL increase %: " + ", ".join(f"{e} {w:.2f}" for e, w in worst.items()))
    print("median NLL increase %: " + ", ".join(f"{e} {statistics.median(m['dnll'] for m in ms):.2f}"
                                                for e, ms in rows.items() if ms))
    if args.png:
        plot(rows, args.png)
    res.write()


def headline(res: R.Results, rows: dict[str, list[dict]]) -> None:
    """The README row: the largest ratio whose WORST case stays within +1% NLL, and what >= 8x costs at worst,
    beside the best of the earlier codecs -- medians and worst cases both (issue: a median alone hides a +34%)."""
    summ = {e: (statistics.median(m["ratio"] for m in ms), [m["dnll"] for m in ms]) for e, ms in rows.items() if ms}
    cell = {e: (q._cell([m["ratio"] for m in rows[e]], ".2f"), q._cell(d, ".2f")) for e, (_, d) in summ.items()}
    safe = [e for e, (_, d) in summ.items() if max(d) <= 1.0]
    big = [e for e, (r, _) in summ.items() if r >= 8.0]
    parts, figs = [], []

    def quote(e: str, lead: str) -> None:
        r, d = summ[e]
        w, med = max(d), statistics.median(d)
        parts.append(f"{lead}{e} {r:.2f}x at worst {w:+.2f}% NLL (median {med:+.2f}%)")
        figs.extend([{"shown": f"{r:.2f}x", "cell": cell[e][0], "table": "main"},
                     {"shown": f"{w:+.2f}%", "cell": cell[e][1], "table": "main"}])

    if safe:
        quote(max(safe, key=lambda e: summ[e][0]), "**best within +1% everywhere:** ")
    if big:
        quote(min(big, key=lambda e: max(summ[e][1])), "at >= 8x: ")
    old = [e for e in safe if not e.startswith("kvtc")]
    if old:
        quote(max(old, key=lambda e: summ[e][0]), "the best earlier codec within +1%: ")
    n = len(next(iter(rows.values())))
    res.set_headline(f"lossy codecs, size vs continuation quality, {n} contexts (SmolLM2-135M)",
                     "; ".join(parts) + ". The 8x-at-worst-+1% target is "
                     + ("met" if any(e in safe for e in big) else "**not met**"),
                     "bf16 `raw` objects for size; the exact cache for NLL", figs)


if __name__ == "__main__":
    main()
