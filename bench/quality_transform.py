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

``--auto SETTINGS`` adds ``kvtc-auto``: per-object rate control
(``kdn.adapters.hf.kvtc_rate``), each context published as the origin would (one
rate control per context; an object's probe is the context's own tokens after it,
or its own last tokens: never the scored continuation). ``--heldout`` runs
``int8``, the kvtc budgets and ``kvtc-auto`` on HELDOUT_DOCS too, documents not
used to tune the settings: the Apache-2.0 and MPL-2.0 licence texts (Debian's
common-licenses), the pydoc topic ``specialnames`` and *Opticks* chars
300,000-320,000.

``--continuation 1024 --min-continuation 384`` judges on long continuations (the issue's measure: one
1,024-token continuation's NLL delta is far less chance than a 256-token one's) over the same 36 contexts: a
context whose document ends sooner is scored on the tokens it has, at least ``--min-continuation`` (the four
shipped documents hold 2,441-2,743 tokens, so their 2,048-token contexts keep 393-695).

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
from kdn.adapters.hf import kvtc_rate as kr  # noqa: E402
from kdn.adapters.hf.extract import extract_chunks  # noqa: E402
from kdn.format.encodings import KVTC_AUTO  # noqa: E402
from kdn.kernels.transform import Basis, allocate, encode_kvtc_object, register_basis  # noqa: E402

PY = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
PYENV_PY = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
OPTICKS = PYENV_PY / "site-packages/tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
LICENSES = Path("/usr/share/common-licenses")
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


def heldout_docs() -> dict[str, str]:
    """Documents never used to choose the rate-control settings (see the module docstring)."""
    docs = {name: (LICENSES / f).read_text() if (LICENSES / f).exists() else None
            for name, f in (("apache-2.0", "Apache-2.0"), ("mpl-2.0", "MPL-2.0"))}
    docs["pydoc-specialnames"] = _topics().get("specialnames")
    docs["opticks-300k"] = OPTICKS.read_text(encoding="utf-8")[300_000:320_000] if OPTICKS.exists() else None
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


def encode_auto(chunks, ids: torch.Tensor, model, basis: Basis, settings: kr.RateSettings,
                model_id: str) -> tuple[list[bytes], float, kr.RateControl]:
    """One context published as ``kvtc-auto``: one rate control; each object probed on the context's own tokens."""
    control = kr.RateControl(settings)
    blobs, parent = [], None
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        address = f"{c.index + 1:064x}"
        blob, _ = kr.encode_auto(model, basis, control, tensors=c.tensors, position=c.start,
                                 prefix=[x.tensors for x in chunks[:i]], after_ids=ids[c.end :], own_ids=ids[c.start : c.end],
                                 kind=c.kind, address=address, model_id=model_id, namespace="public",
                                 start=c.start, end=c.end, parent=parent)
        blobs.append(blob)
        parent = address
    return blobs, time.perf_counter() - t0, control


SETS = ("eval", "heldout", "long")  # the tables: main, heldout, long


def run(args) -> tuple[dict[str, dict[str, list[dict]]], Basis, dict[str, float]]:
    """Rows by set (SETS) and encoding."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lm = hf_models.load_model("smollm2-135m")
    basis = Basis.from_bytes(args.basis.read_bytes()) if args.basis.exists() else fit(lm, args.basis)
    register_basis(basis)
    thetas = {f"kvtc-{b:g}": allocate(basis, b).theta for b in args.budgets}
    auto = [KVTC_AUTO] if args.auto is not None else []
    # the held-out and long sets: the noise floor (int8), kvtc at about kvtc-auto's size and safe, kvtc-auto
    lossy = ["int8", *[e for e in thetas if e in ("kvtc-1.65", "kvtc-2", "kvtc-2.5")], *auto]
    sets = {"eval": (eval_docs(), args.contexts, args.continuation, [*args.encodings, *thetas, *auto])}
    if args.heldout:
        sets["heldout"] = (heldout_docs(), args.contexts, args.continuation, lossy)
    if args.long:
        sets["long"] = (eval_docs(), [args.long], args.long, lossy)
    out: dict[str, dict[str, list[dict]]] = {}
    for where, (docs, contexts, n_cont, encodings) in sets.items():
        rows = out[where] = {e: [] for e in encodings}
        for doc, text in docs.items():
            if args.docs and doc not in args.docs:
                continue
            ids = torch.tensor(lm.tokenizer(text)["input_ids"], dtype=torch.long)
            for n_ctx in contexts:
                least = min(n_cont, args.min_continuation or n_cont)
                if ids.numel() < n_ctx + least:
                    print(f"skip {doc} @ {n_ctx}: only {ids.numel()} tokens", file=sys.stderr)
                    continue
                context(args, lm, basis, thetas, rows, doc, ids, n_ctx, min(n_cont, ids.numel() - n_ctx), where)
    return out, basis, thetas


def context(args, lm, basis: Basis, thetas: dict[str, float], rows: dict[str, list[dict]], doc: str, ids: torch.Tensor,
            n_ctx: int, n_cont: int, where: str) -> None:
    """Every encoding of ``rows`` on one context: ``ids[:n_ctx]``, scored on the next ``n_cont`` tokens."""
    model, n_layers = lm.model, lm.model.config.num_hidden_layers
    cont = ids[n_ctx : n_ctx + n_cont]
    chunks = list(extract_chunks(model, ids[:n_ctx], chunk_tokens=256))
    raw_size = sum(map(len, q.encode_chunks(chunks, "raw", lm.model_id, n_layers)[0]))
    exact = q.score(model, [c.tensors for c in chunks], n_ctx, cont)
    for enc in rows:
        extra: dict = {}
        if enc == KVTC_AUTO:
            blobs, t_enc, control = encode_auto(chunks, ids[:n_ctx], model, basis, args.auto, lm.model_id)
            extra = {"bits": control.mean_bits(), "up": sum(map(bool, control.chosen)) / len(control.chosen)}
        elif enc in thetas:
            blobs, t_enc = encode_kvtc(chunks, basis, thetas[enc], enc, lm.model_id)
        else:
            blobs, t_enc = q.encode_chunks(chunks, enc, lm.model_id, n_layers)
        decoded, t_dec = q.decode_chunks(blobs)
        m = q.metrics(q.score(model, decoded, n_ctx, cont), exact, cont)
        m.update(ratio=raw_size / sum(map(len, blobs)), enc_mbs=raw_size / t_enc / 1e6, dec_mbs=raw_size / t_dec / 1e6,
                 doc=doc, ctx=n_ctx, cont=len(cont), **extra)
        rows[enc].append(m)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({"encoding": enc, "set": where, **m}) + "\n")
        print(f"{doc[:16]:16} L={n_ctx:5} {enc:16} ratio {m['ratio']:5.2f}x  nll {m['nll']:.4f} "
              f"(+{m['dnll']:6.2f}%)  top1 {m['top1']:.3f}  kl {m['kl']:.5f}", file=sys.stderr, flush=True)


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    """Two panels against the median size ratio: NLL increase (median and worst), and median KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    kv = [(e, ms) for e, ms in rows.items() if ms and e.startswith("kvtc-") and e != KVTC_AUTO]
    other = [(e, ms) for e, ms in rows.items() if ms and not e.startswith("kvtc")]
    auto = [(e, ms) for e, ms in rows.items() if ms and e == KVTC_AUTO]
    for group, color, label, ls in ((kv, "tab:blue", "kvtc", "-"), (other, "tab:orange", "existing", "none"),
                                    (auto, "tab:green", "kvtc-auto", "none")):
        if not group:
            continue
        x = [statistics.median(m["ratio"] for m in ms) for _, ms in group]
        med = [statistics.median(m["dnll"] for m in ms) for _, ms in group]
        worst = [max(m["dnll"] for m in ms) for _, ms in group]
        kl = [statistics.median(m["kl"] for m in ms) for _, ms in group]
        ax.plot(x, worst, marker="v", ls=ls, color=color, label=f"{label}: worst case")
        ax.plot(x, med, marker="o", ls=ls, color=color, alpha=0.5, label=f"{label}: median")
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


def from_json(paths: list[Path]) -> dict[str, dict[str, list[dict]]]:
    """Rows of earlier runs (``--json`` files), by set and encoding, in file order."""
    out: dict[str, dict[str, list[dict]]] = {}
    for p in paths:
        for line in p.read_text().splitlines():
            m = json.loads(line)
            out.setdefault(m.pop("set", "eval"), {}).setdefault(m.pop("encoding"), []).append(m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--basis", type=Path, required=True, help="basis file: read if it exists, else fitted and written")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.5, 1.65, 1.75, 2.0, 2.5], help="kvtc budgets, estimated bits/value")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 1536, 2048])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--min-continuation", type=int, default=0, metavar="M",
                    help="score a context whose document ends before its full continuation on the M or more tokens it "
                         "has (default: skip it)")
    ap.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    ap.add_argument("--auto", type=kr.RateSettings.parse, default=None, metavar="SETTINGS",
                    help='add kvtc-auto with these rate-control settings ("ladder=1.5,2.5 kl=0.01 target=1.75 probe=64")')
    ap.add_argument("--heldout", action="store_true", help="also run int8, kvtc and kvtc-auto on the held-out documents")
    ap.add_argument("--long", type=int, default=0, metavar="N",
                    help="also run int8, kvtc and kvtc-auto at N-token contexts scored on N-token continuations "
                         "(less noise in each context's NLL)")
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
        sets = from_json(args.from_json)
        basis = Basis.from_bytes(args.basis.read_bytes())
        thetas = {e: allocate(basis, float(e.split("-", 1)[1])).theta for e in sets["eval"]
                  if e.startswith("kvtc-") and e != KVTC_AUTO}
    else:
        sets, basis, thetas = run(args)
    rows = sets["eval"]
    n_ctx = len(next(iter(rows.values())))
    conts = sorted({m.get("cont", args.continuation) for ms in rows.values() for m in ms})
    scored = f"{conts[0]}" if len(conts) == 1 else f"{conts[0]}-{conts[-1]}"
    res.table("main", q.table(rows), f"size vs quality, SmolLM2-135M, {n_ctx} contexts, each scored on its next "
                                     f"{scored} tokens: median (min-max)")
    for where, title in (("heldout", "held-out documents (not used to tune kvtc-auto)"),
                         ("long", f"{args.long}-token contexts scored on {args.long}-token continuations")):
        if any(sets.get(where, {}).values()):
            n = len(next(iter(sets[where].values())))
            res.table(where, q.table(sets[where]), f"{title}, {n} contexts: median (min-max)")
    auto_summary(sets)
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


def auto_summary(sets: dict[str, dict[str, list[dict]]]) -> None:
    """What kvtc-auto spent: mean ladder bits per context and the share of objects sent up the ladder."""
    for name, table in sets.items():
        ms = table.get(KVTC_AUTO) or []
        if ms and "bits" in ms[0]:
            print(f"kvtc-auto ({name}): ladder bits per value, median {statistics.median(m['bits'] for m in ms):.3f} "
                  f"(max {max(m['bits'] for m in ms):.3f}); objects sent up the ladder {statistics.mean(m['up'] for m in ms):.0%}; "
                  f"worst NLL increase {max(m['dnll'] for m in ms):+.2f}% ({max(ms, key=lambda m: m['dnll'])['doc']})")


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

    best = max(safe, key=lambda e: summ[e][0]) if safe else None
    if best is not None:
        quote(best, "**best within +1% everywhere:** ")
    if big and (at8 := min(big, key=lambda e: max(summ[e][1]))) != best:
        quote(at8, "at >= 8x: ")
    old = [e for e in safe if not e.startswith("kvtc")]
    if old:
        quote(max(old, key=lambda e: summ[e][0]), "the best earlier codec within +1%: ")
    n = len(next(iter(rows.values())))
    longest = max(m.get("cont", 0) for ms in rows.values() for m in ms)
    over = f", next {longest:,} tokens" if longest != 256 else ""
    res.set_headline(f"lossy codecs, size vs continuation quality, {n} contexts{over} (SmolLM2-135M)",
                     "; ".join(parts) + ". The 8x-at-worst-+1% target is "
                     + ("met" if any(e in safe for e in big) else "**not met**"),
                     "bf16 `raw` objects for size; the exact cache for NLL", figs)


if __name__ == "__main__":
    main()
