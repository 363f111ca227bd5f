"""A manifest's hits and what they saved, for its console page (issue #30).

Each edge counts, on each object it caches, the whole reads it answered from that copy (edge/tierbase.py
``Entry.reads``), and tells them on the HEAD ``where_cached`` sends already (``X-KDN-Reads``, parsed and bounded
by ``kdn.client.holding.parse_reads``). Per region this sums them over the manifest's checked chunks, by tier, and
turns them into:

- **tokens served from the KDN**: each chunk's reads x its tokens;
- **compute saved**: the prefill FLOPs those tokens would have cost a reader, each chunk at its position
  (``PrefillModel.flops(tokens, start)``, from this origin's model config: origin/speed.py);
- **time saved at the origin's speed**: those FLOPs at the FLOP rate this origin measured on its own publish
  jobs since it started (origin/speed.py); "not measured yet" before it computed a chunk.

What it does not see: reads at edges other than each chunk's owner in its region (a non-owner's hot copy),
the read that filled a copy, range reads and HEADs (not whole reads), and reads before a copy's eviction or its
edge's restart (a new copy counts from 0). A manifest of another model than this origin's: reads and tokens
only (its shape is not known here).
"""

from __future__ import annotations

from typing import Any

from kdn.format.address import chunk_spans
from kdn.origin.console.edges import MAX_CHECKED
from kdn.origin.console.pages import e
from kdn.origin.speed import PublishSpeed, chunk_flops
from kdn.registry import Manifest
from kdn.units import format_duration

_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_flops(x: float) -> str:
    """``3.2 TFLOP``: FLOPs with an SI prefix, three significant digits."""
    for scale, prefix in _PREFIXES:
        if x >= scale:
            return f"{x / scale:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"


def region_savings(regions: dict[str, dict[str, Any]] | None, m: Manifest,
                   speed: PublishSpeed | None) -> dict[str, dict[str, Any]]:
    """Per region (``where_cached``'s rows): reads by tier, tokens served, FLOPs saved (None without
    ``speed``'s model: another model's manifest) and seconds saved (None: not measured yet)."""
    spans = chunk_spans(m.tokens, m.chunk_tokens) if m.tokens > 0 else []
    out: dict[str, dict[str, Any]] = {}
    for region, r in sorted((regions or {}).items()):
        tokens, flops = 0, 0.0
        for i, n in r.get("chunk_reads", {}).items():
            if i < len(spans):
                s, t = spans[i]
                tokens += n * (t - s)
                if speed is not None:
                    flops += n * chunk_flops(speed.prefill, s, t)
        out[region] = {"reads": dict(r.get("reads", {})), "tokens": tokens,
                       "flops": flops if speed is not None else None,
                       "seconds": speed.seconds_for(flops) if speed is not None else None}
    return out


def savings_table(regions: dict[str, dict[str, Any]] | None, m: Manifest, speed: PublishSpeed | None) -> str:
    head = "<h2>Its reads at the edges, and what they saved</h2>"
    if regions is None:
        return head + '<p class="err">The edges did not all answer: no reads to count.</p>'
    rows_in = region_savings(regions, m, speed)
    if not rows_in:
        return head + '<p class="note">No live edge in the registry.</p>'
    rows = []
    for region, r in rows_in.items():
        reads = r["reads"]
        flops = "-" if r["flops"] is None else format_flops(r["flops"])
        took = _time_cell(r["seconds"], speed)
        rows.append(f'<tr data-region="{e(region)}"><td>{e(region)}</td>'
                    f'<td class="n memory">{reads.get("memory", 0):,}</td><td class="n disk">{reads.get("disk", 0):,}'
                    f'</td><td class="n tokens">{r["tokens"]:,}</td><td class="n flops">{e(flops)}</td>'
                    f'<td class="n seconds">{e(took)}</td></tr>')
    return (head + '<table class="saved"><thead><tr><th>region</th><th>memory reads</th><th>disk reads</th>'
            "<th>tokens served from the KDN</th><th>compute saved (prefill)</th>"
            "<th>time saved, at the origin's speed</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
            + _savings_note(m, speed))


def _time_cell(seconds: float | None, speed: PublishSpeed | None) -> str:
    if speed is None:
        return "-"
    if seconds is None:
        return "not measured yet"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else format_duration(round(seconds, 1))


def _savings_note(m: Manifest, speed: PublishSpeed | None) -> str:
    checked = f" of its first {MAX_CHECKED} chunks" if len(m.addresses) > MAX_CHECKED else ""
    parts = [f"Reads since each edge cached the chunk{checked}: whole reads that each chunk's owner edge in the "
             "region answered from its memory or disk copy (the read that filled it, range reads, HEADs and other "
             "edges' copies are not counted; an eviction or a restart of the edge starts a copy's count at 0). "
             "Tokens served: each chunk's reads times its tokens."]
    if speed is None:
        parts.append(" Another model than this origin's: its prefill's shape is not known here, so no compute.")
    else:
        parts.append(" Compute saved: the prefill FLOPs those tokens would have cost a reader, each chunk after "
                     "the tokens before it (2 x the weights a token multiplies, plus attention), from this origin's "
                     "model config.")
        rate = speed.tokens_per_s
        if rate is None:
            parts.append(" Time saved: the origin has not measured its speed yet (it times the chunks its "
                         "publish jobs compute, since it started).")
        else:
            parts.append(f" Time saved at the origin's speed: {format_flops(speed.flops_per_s or 0)}/s "
                         f"({rate:,.0f} tokens/s), measured over the {speed.chunks:,} chunks its publish jobs "
                         "computed since it started (forward passes and the writing of their blobs); a reader's "
                         "engine may be faster or slower.")
    return '<p class="note">' + e("".join(parts)) + "</p>"
