"""The content-free question's scores, computed once at publish and stored (signed) with the emphasis map.

What it must do: the scores an origin stores (``baseline_of``) are the ones a request's own content-free pass
would give, so a question's map made with them is the map made without them (same sentences, same choice,
scores within float rounding) and runs one pass fewer; scores that do not stand for the request's own pass
(other heads, another frame, other sentences) are not used; the wire form is strictly checked; an origin
stores them when asked (``question_heads``) and refuses heads its model lacks
(``tests/origin/test_publish_emphasis.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kdn.adapters.hf import ByteTokenizer, load_model
from kdn.adapters.hf.extract import new_cache
from kdn.adapters.hf.generate import prompt_tokens
from kdn.adapters.hf.question_map import NULL_QUESTION, Retrieval, baseline_of, question_map
from kdn.emphasis import Baseline, EmphasisMap
from kdn.errors import InvalidInput
from kdn.origin.publish import parse_request

TOK = ByteTokenizer()
DOC = ("The river is wide. Bread needs flour and water. The gate code is 7781-K. "
       "Snow lies on the hills. The market opens at dawn.")
QUESTION = "What is the gate code?"
HEADS = ((1, 0), (1, 1), (0, 2))


@functools.cache
def tiny():
    return load_model("tiny-llama", dtype=torch.float32).model


def _published() -> tuple[list[int], tuple[int, int], list[int]]:
    doc = TOK.encode(DOC)
    null = prompt_tokens(TOK, {"prefix_tokens": [], "template": None}, NULL_QUESTION)
    return doc, (0, len(doc)), null


def test_published_scores_give_the_map_the_requests_own_pass_gives(monkeypatch):
    import kdn.adapters.hf.question_map as qmod

    model = tiny()
    doc, region, null = _published()
    base = baseline_of(model, TOK, doc, region, HEADS, null)
    assert base.heads == HEADS and base.null == tuple(null) and len(base.sentences) == 5 == len(base.scores)
    ids = prompt_tokens(TOK, {"prefix_tokens": doc, "template": None}, QUESTION)
    ret = Retrieval(HEADS, top=1, min_margin=0.0)
    live = question_map(model, TOK, new_cache(model), 0, ids, region, ret)

    passes = []
    real = qmod._attention
    monkeypatch.setattr(qmod, "_attention", lambda *a, **kw: passes.append(a[3]) or real(*a, **kw))
    got = question_map(model, TOK, new_cache(model), 0, ids, region, ret, baseline=base)
    assert passes == [ids[region[1]:]]  # the question's pass only: no content-free one
    assert got.published and not live.published
    assert got.sentences == live.sentences and got.chosen == live.chosen
    assert torch.allclose(torch.tensor(got.scores), torch.tensor(live.scores), atol=1e-6)
    assert got.margin == pytest.approx(live.margin, rel=1e-4)
    assert (got.emphasis is None) == (live.emphasis is None)


@pytest.mark.parametrize("change", ["heads", "null", "sentences"])
def test_scores_that_do_not_stand_for_the_requests_pass_are_not_used(change, monkeypatch):
    import dataclasses

    import kdn.adapters.hf.question_map as qmod

    model = tiny()
    doc, region, null = _published()
    base = baseline_of(model, TOK, doc, region, HEADS, null)
    other = {"heads": {"heads": HEADS[:2]}, "null": {"null": tuple(TOK.encode("\n\nnone\n"))},
             "sentences": {"sentences": base.sentences[:-1] + ((base.sentences[-1][0], base.sentences[-1][1] - 1),)}}
    base = dataclasses.replace(base, **other[change])
    passes = []
    real = qmod._attention
    monkeypatch.setattr(qmod, "_attention", lambda *a, **kw: passes.append(a[3]) or real(*a, **kw))
    ids = prompt_tokens(TOK, {"prefix_tokens": doc, "template": None}, QUESTION)
    got = question_map(model, TOK, new_cache(model), 0, ids, region, Retrieval(HEADS), baseline=base)
    assert not got.published and passes[0] == null  # its own content-free pass, as without a baseline


def test_the_wire_form_round_trips_and_leaves_old_maps_as_they_were():
    doc, region, null = _published()
    base = Baseline(heads=HEADS, null=tuple(null), sentences=((0, 18), (18, 47)), scores=(0.25, -0.5))
    m = EmphasisMap(spans=(), region=region, baseline=base)
    assert EmphasisMap.from_dict(m.to_dict()) == m
    plain = EmphasisMap(spans=((3, 5),), region=region)
    assert "baseline" not in plain.to_dict()  # a map without one signs exactly as before
    assert m.shifted(10).baseline is None  # measured where it was published: not at another place


@pytest.mark.parametrize("change, match", [
    ({"heads": []}, "distinct heads"),
    ({"heads": [[1, 0], [1, 0]]}, "distinct heads"),
    ({"heads": [[1, -1]]}, "out of range"),
    ({"null": []}, "null must be"),
    ({"null": [1.5]}, "null must be"),
    ({"null": list(range(65))}, "null must be"),
    ({"scores": [0.1]}, "one score per sentence"),
    ({"scores": [float("nan"), 0.0]}, "finite"),
    ({"scores": ["high", 0.0]}, "list of numbers"),
    ({"sentences": [[18, 47], [0, 18]]}, "out of order"),
    ({"sentences": [[0, 18], [18, 400]]}, "inside the region"),
    ({"extra": 1}, "must be a map of"),
])
def test_hostile_baselines_are_refused(change, match):
    doc, region, null = _published()
    wire = {"heads": [[1, 0]], "null": null, "sentences": [[0, 18], [18, 47]], "scores": [0.25, -0.5], **change}
    with pytest.raises(InvalidInput, match=match):
        EmphasisMap.from_dict({"spans": [], "region": list(region), "baseline": wire})


def test_a_publish_asks_for_question_heads_alone_and_gets_the_null_tokens():
    spec = parse_request({"name": "d", "text": DOC, "emphasis": {"question_heads": [[1, 0], [0, 2]]}},
                         tokenizer=TOK, vocab_size=TOK.vocab_size, max_tokens=4096)
    assert spec.emphasis is not None and spec.emphasis.spans == () and spec.baseline_heads == ((1, 0), (0, 2))
    assert list(spec.baseline_null) == TOK.encode(f"\n\n{NULL_QUESTION}\n")
    for bad in ([[1]], [[1, 0], [1, 0]], "1:0", [[True, 0]]):
        with pytest.raises(InvalidInput, match="question_heads"):
            parse_request({"name": "d", "text": DOC, "emphasis": {"question_heads": bad}}, tokenizer=TOK,
                          vocab_size=TOK.vocab_size, max_tokens=4096)
