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
from kdn.errors import InvalidInput, KDNError
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


# --- the same map in vLLM: the request the caller builds, the spec the scheduler resolves ----------------


def _request():
    model = tiny()
    doc, region, null = _published()
    emap = EmphasisMap(spans=(), region=region, baseline=baseline_of(model, TOK, doc, region, HEADS, null))
    ids = prompt_tokens(TOK, {"prefix_tokens": doc, "template": None}, QUESTION)
    return model, emap, ids


def test_a_vllm_question_request_carries_what_its_pass_needs_and_is_refused_without_it():
    import dataclasses

    from kdn.adapters.vllm.question import QuestionSpec, request_params, spec_of

    model, emap, ids = _request()
    ret = Retrieval(HEADS, top=2, min_margin=0.5, alpha=0.02, steer_heads=((1, 1),))
    kdn, salt = request_params(emap, ret, ids, TOK, salt_prefix="tenant-")
    assert kdn["steer"] == "question" and salt.startswith("tenant-kdn-steer-")
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    spec = spec_of(kdn, n_layers=n_layers, n_heads=n_heads, n_ids=len(ids), cache_salt=salt)
    assert isinstance(spec, QuestionSpec) and spec.query_from == emap.region[1] and spec.n_ids == len(ids)
    assert spec.retrieval == ((0, (2,)), (1, (0, 1))) and spec.last_layer == 1 and spec.n_retrieval == 3
    assert spec.steer == ((1, (1,)),) and spec.top == 2 and spec.alpha == 0.02
    with pytest.raises(InvalidInput, match="cache_salt"):
        spec_of(kdn, n_layers=n_layers, n_heads=n_heads, n_ids=len(ids), cache_salt="tenant-")
    other = {**kdn, "question": {**kdn["question"], "heads": [[1, 0]]}}
    with pytest.raises(InvalidInput, match="retrieval heads"):
        spec_of(other, n_layers=n_layers, n_heads=n_heads, n_ids=len(ids), cache_salt=salt)
    for bad, match in (({"top": 0}, "top"), ({"top": 10**6}, "top"), ({"min_margin": -1.0}, "min_margin"),
                       ({"alpha": 0.0}, "alpha"), ({"steer_heads": [[99, 0]]}, "not in this model"),
                       ({"extra": 1}, "at most")):
        with pytest.raises(KDNError, match=match):
            spec_of({**kdn, "question": {**kdn["question"], **bad}}, n_layers=n_layers, n_heads=n_heads,
                    n_ids=len(ids), cache_salt=salt)
    with pytest.raises(InvalidInput, match="no question"):
        spec_of(kdn, n_layers=n_layers, n_heads=n_heads, n_ids=emap.region[1], cache_salt=salt)
    with pytest.raises(InvalidInput, match="--question-heads"):  # no content-free scores with the map
        request_params(dataclasses.replace(emap, baseline=None), ret, ids, TOK)
    with pytest.raises(InvalidInput, match="other retrieval heads"):
        request_params(emap, Retrieval(HEADS[:1]), ids, TOK)


def test_the_vllm_decision_is_the_transformers_adapter_s_from_the_same_scores():
    """``QuestionSpec.decide`` (what vLLM's steerer calls with the question's attention) picks what
    ``question_map`` picks from the same token scores, and is unsure where it would be."""
    from kdn.adapters.hf.question_map import pick, sentence_scores
    from kdn.adapters.vllm.question import request_params, spec_of

    model, emap, ids = _request()
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    tok = torch.rand(emap.region[1] - emap.region[0], generator=torch.Generator().manual_seed(3))
    base = emap.baseline
    want, margin = pick(sentence_scores(tok, base.sentences, 0) - torch.tensor(base.scores), 1)
    for min_margin, sure in ((margin / 2, True), (margin * 2, False)):
        kdn, salt = request_params(emap, Retrieval(HEADS, min_margin=min_margin), ids, TOK)
        plan, lead = spec_of(kdn, n_layers=n_layers, n_heads=n_heads, n_ids=len(ids), cache_salt=salt).decide(tok)
        assert lead == pytest.approx(margin) and (plan is not None) == sure
        if sure:
            assert plan.spans == (base.sentences[want[0]],) and plan.query_from == emap.region[1]
