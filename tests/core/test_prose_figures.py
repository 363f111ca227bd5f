"""Figures quoted in prose, checked against the results of the bench they name (#52 item 5).

The README's headline rows and docs/benchmarks.md's tables are rendered from ``bench/results/*.json``
(``bench/run_all.py --render/--check``, held by tests/bench/test_run_all.py), so they cannot drift; the sentences
around them are hand-written and could. This holds them to the same: in README.md and docs/*.md, a ratio written
like ``**4.9x**``, ``12.5x``, ``0.42x-0.53x`` or ``18.5-32.5x`` in a clause that names a bench script
(``bench/ttft.py``, or a link to its section, ``benchmarks.md#...-benchttftpy``) must be a ratio of that bench's
results -- a table cell or the headline of any of its runs (``ttft.json``, ``ttft-rows.json``, ...) -- as the doc
rounds it (``10.0x`` for a recorded ``9.99x``).

A clause is a sentence, cut at semicolons too, or one cell of a hand-written table. Left out: the rendered regions
(checked where they are rendered), code blocks, headings. A figure quoted from elsewhere (an earlier run that was
not kept, a general fact) is named in ``QUOTED`` with why; an entry that no longer matches a figure fails, so the
list only shrinks. Where a figure is simply stale, write the recorded one instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (doc, figure as written without its "x", the benches its clause names joined by "+"): why it is not in their results.
QUOTED: dict[tuple[str, str, str], str] = {
    ("docs/benchmarks.md", "10", "gpu_check"): "'a prefill 10-100x faster' on a GPU: an order of magnitude, not a run",
    ("docs/benchmarks.md", "100", "gpu_check"): "'a prefill 10-100x faster' on a GPU: an order of magnitude, not a run",
    ("docs/benchmarks.md", "1.21", "ttft"): "a bench/vllm_plan.py run between the recorded ones, not kept; the clause "
                                            "names bench/ttft.py for another run",
    ("docs/benchmarks.md", "0.17", "ttft"): "the same unkept bench/vllm_plan.py run (what the load would have cost)",
}

# A ratio: digits, "x" (or "×"); the first end of a range whose second end carries the "x" counts too.
FIGURE = re.compile(r"(?<![\w.,])(\d+(?:\.\d+)?)(?:[x×]|(?=[-–]\d+(?:\.\d+)?[x×]))(?!\w)")
RATIO = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)[x×](?!\w)")
SCRIPT = re.compile(r"(?<![\w/])bench/(\w+)\.py\b")
ANCHOR = re.compile(r"\]\([^)\s]*#[\w-]*?-bench([a-z0-9_]+?)py(?=[)-])")
RENDERED_BEGIN = re.compile(r"^<!-- (?:bench:[\w.-]+:[\w.-]+|headlines):begin -->$")
RENDERED_END = re.compile(r"^<!-- (?:bench:[\w.-]+:[\w.-]+|headlines):end -->$")
CLAUSE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\[*`_\"])|;\s+")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load_results(folder: Path = ROOT / "bench" / "results") -> dict[str, list[dict]]:
    """Every run's results by the bench script that made it (``ring`` -> ring.json, ring-v160.json)."""
    out: dict[str, list[dict]] = {}
    for p in sorted(folder.glob("*.json")):
        data = json.loads(p.read_text())
        out.setdefault(data["bench"], []).append(data)
    return out


def ratios(runs: list[dict]) -> set[Decimal]:
    """Every ratio the runs record: in their tables' cells and their headlines (quoted or not)."""
    texts = [t["markdown"] for d in runs for t in d.get("tables", [])]
    texts += [h["result"] for d in runs for h in (d.get("headline"), d.get("headline_unquoted")) if h]
    return {Decimal(m.group(1).replace(",", "")) for t in texts for m in RATIO.finditer(t)}


def shown(figure: str, recorded: set[Decimal]) -> bool:
    """Whether ``figure`` (as the doc writes it) is one of ``recorded`` rounded to the doc's digits."""
    want = Decimal(figure)
    step = Decimal(1).scaleb(-len(figure.partition(".")[2]))  # 1, 0.1, 0.01, ...: the digits the doc wrote
    return any(r.quantize(step, rounding=mode) == want for r in recorded for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def prose(text: str) -> Iterator[str]:
    """The hand-written paragraphs and table cells of a markdown text (rendered regions, code and headings out)."""
    para: list[str] = []
    fenced = rendered = code = False
    blank = True  # the line before was blank (an indented line after one starts a code block)

    def flush() -> Iterator[str]:
        if para:
            yield " ".join(para)
            para.clear()

    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if RENDERED_BEGIN.match(line):
            rendered = True
        if fenced or rendered or line.startswith(("```", "#")):
            rendered = rendered and not RENDERED_END.match(line)
            yield from flush()
            continue
        if not line.strip():
            yield from flush()
            blank, code = True, False
            continue
        code = line.startswith("    ") and (blank or code) and not re.match(r"\s*([-*+]|\d+\.)\s", line)
        blank = False
        if code:
            yield from flush()
        elif line.lstrip().startswith("|"):
            yield from flush()
            yield from (c for c in line.strip().strip("|").split("|") if not re.fullmatch(r"\s*:?-+:?\s*", c))
        else:
            para.append(line.strip())
    yield from flush()


def clauses(text: str) -> Iterator[str]:
    for p in prose(text):
        yield from CLAUSE_END.split(p)


def benches_named(clause: str) -> set[str]:
    return set(SCRIPT.findall(clause)) | set(ANCHOR.findall(clause))


def misses(doc: str, text: str, results: dict[str, list[dict]]) -> list[tuple[str, str, str, str]]:
    """(doc, figure, benches, clause) for each figure beside a bench that is not in that bench's results."""
    out = []
    for clause in clauses(text):
        named = benches_named(clause)
        figures = FIGURE.findall(clause) if named else []
        if not figures:
            continue
        recorded = ratios([d for b in named for d in results.get(b, [])])
        for f in figures:
            if not shown(f, recorded):
                out.append((doc, f, "+".join(sorted(named)), clause))
    return out


def all_misses() -> list[tuple[str, str, str, str]]:
    results = load_results()
    return [m for p in docs() for m in misses(p.relative_to(ROOT).as_posix(), p.read_text(), results)]


def test_every_figure_beside_a_bench_is_in_its_results():
    bad = [m for m in all_misses() if m[:3] not in QUOTED]
    assert not bad, "figures quoted beside a bench that its bench/results/*.json do not record (write the " \
        "recorded figure, or name it in QUOTED with why):\n" + "\n".join(
            f"{doc}: {fig}x ({benches}): ...{clause[:160]}..." for doc, fig, benches, clause in bad)


def test_every_quoted_exception_is_still_needed():
    stale = sorted(set(QUOTED) - {m[:3] for m in all_misses()})
    assert not stale, f"no longer quoted (or now recorded): remove {stale} from QUOTED"


# The reader itself, on made-up results: what counts as a figure, a bench, a clause, and rounding.

RESULTS = {"ttft": [{"tables": [{"markdown": "| model | speedup |\n| --- | ---: |\n| a | 4.93x |\n| b | 12.5x |"}],
                     "headline": {"result": "**0.42x-0.53x** the bound"}}],
           "geo": [{"tables": [{"markdown": "| p50 | 9.99x |"}], "headline": None,
                    "headline_unquoted": {"result": "1,234.5x"}}]}


def _figures(text: str) -> list[str]:
    return [m[1] for m in misses("doc.md", text, {})]  # no results: every figure beside a bench misses


def test_the_reader_finds_figures_beside_a_bench_only():
    assert _figures("A hit is **4.9x** faster (`bench/ttft.py`).") == ["4.9"]
    assert _figures("At 8k 18.5-32.5x, 0.42x-0.53x the bound, 3.40x / 2.10x (`bench/ttft.py`).") == \
        ["18.5", "32.5", "0.42", "0.53", "3.40", "2.10"]
    assert _figures("Measured 2.1x, [benchmarks](docs/benchmarks.md#vllm-hit-benchvllm_ttftpy)).") == ["2.1"]
    assert _figures("No bench named here: 4.9x.") == []
    assert _figures("It is 10 x capacity, 0x1f, x86 and tests/bench/test_geo.py 3x.") == []
    # one clause per sentence, per semicolon, per table cell
    assert _figures("It is 4.9x. That is `bench/ttft.py`; and 5.0x") == []
    assert _figures("| 4.9x | `bench/ttft.py` |\n| --- | --- |") == []
    # rendered regions, code and headings are not prose
    assert _figures("<!-- bench:ttft:main:begin -->\n| 4.9x `bench/ttft.py` |\n<!-- bench:ttft:main:end -->") == []
    assert _figures("Run it:\n\n    python -P bench/ttft.py   # 4.9x\n\nDone.") == []
    assert _figures("```\nbench/ttft.py 4.9x\n```") == []
    assert _figures("## Ratio 4.9x (`bench/ttft.py`)") == []
    # a list item's continuation lines are prose, however far indented
    assert _figures("1. **A fetch**\n     is 4.9x faster (`bench/ttft.py`).") == ["4.9"]


def test_a_figure_is_its_results_rounded_as_the_doc_writes_it():
    def missing(text: str) -> list[str]:
        return [m[1] for m in misses("doc.md", text, RESULTS)]

    assert missing("smollm2 **4.9x**, qwen2 12.5x; the bound 0.42x-0.53x (`bench/ttft.py`).") == []
    assert missing("A hit is 4.93x, or 5x (`bench/ttft.py`).") == []
    assert missing("A hit is 5.0x (`bench/ttft.py`).") == ["5.0"]  # 4.93 is 4.9 at one digit
    assert missing("A hit is 4.930x (`bench/ttft.py`).") == []
    assert missing("A hit is 4.94x (`bench/ttft.py`).") == ["4.94"]
    assert missing("p50 10.0x, 10x, and 1234.5x (`bench/geo.py`).") == []  # 9.99x rounded; an unquoted headline
    assert missing("p50 4.9x (`bench/geo.py`).") == ["4.9"]  # another bench's figure
    assert missing("p50 4.9x (`bench/geo.py`, `bench/ttft.py`).") == []  # either bench named
    assert missing("A hit is 4.9x (`bench/nothing_recorded.py`).") == ["4.9"]
