"""kdn.adapters.hf.question_map: an emphasis map from the question's own attention, no oracle.

What it must do: score the document's sentences by what the chosen heads' question rows pay them, less a
content-free question's; steer toward the best only when it leads clearly, and otherwise steer nothing
(the unsteered output, bit for bit); calibrate its heads deterministically from calibration examples
alone. The tiny random-init model checks the mechanics; SmolLM2-135M checks that the calibrated heads
find a fact sentence they were not calibrated on.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kdn.adapters.hf import ByteTokenizer, load_model
from kdn.adapters.hf.cache import continue_from_cache
from kdn.adapters.hf.extract import new_cache
from kdn.adapters.hf.generate import decode_loop
from kdn.adapters.hf.question_map import (Example, QuestionSteer, Retrieval, asked, calibrate, head_token_scores,
                                          pick, question_map, region_map, sentence_scores, sentences,
                                          threshold, token_pieces)
from kdn.errors import InvalidInput

TOK = ByteTokenizer()
DOC = ("The river is wide. Bread needs flour and water. The gate code is 7781-K. "
       "Snow lies on the hills. The market opens at dawn.")
QUESTION = "What is the gate code?"


@functools.cache
def tiny():
    return load_model("tiny-llama", dtype=torch.float32).model


def prompt(doc: str = DOC, question: str = QUESTION) -> tuple[list[int], tuple[int, int]]:
    d = TOK.encode(doc)
    return d + TOK.encode(f"\n\n{question}\n"), (0, len(d))


def test_sentences_end_at_stops_and_line_breaks():
    pieces = ["Doc", " 1", ":\n\n", "A", " cat", ".", " B", " dog", "!", "\n\n", "C", " end"]
    assert sentences(pieces, 10) == [(10, 13), (13, 16), (16, 19), (20, 22)]  # the lone "\n\n" is left out


def test_the_map_picks_the_sentence_the_chosen_heads_attend_to(monkeypatch):
    """Heads (1, 0) and (1, 1) read different sentences under the question (the content-free question reads
    all alike): the map follows whichever head it is told to score with."""
    import kdn.adapters.hf.question_map as qmod

    model = tiny()
    ids, region = prompt()
    spans = sentences(token_pieces(TOK, ids[:region[1]]), 0)
    assert len(spans) == 5
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    tail = ids[region[1]:]

    def attention(model, cache, n, rows, keep=False):  # [H, rows, n] per layer, as _attention records them
        p = torch.full((n_layers, n_heads, len(rows), n), 1.0 / n)
        if list(rows) == tail:  # the question: head (1, 0) reads sentence 2, head (1, 1) sentence 4
            for h, (s, e) in ((0, spans[2]), (1, spans[4])):
                p[1, h, :, s:e] += 0.5 / (e - s)
        return {la: p[la] for la in range(n_layers)}, torch.zeros(1, model.config.vocab_size)

    monkeypatch.setattr(qmod, "_attention", attention)
    for head, want in (((1, 0), 2), ((1, 1), 4)):
        cache = new_cache(model)
        qm = question_map(model, TOK, cache, 0, ids, region, Retrieval((head,), min_margin=0.0))
        assert qm.chosen == (want,) and cache.get_seq_length() == region[1]  # the document prefilled
        assert qm.emphasis is not None and qm.emphasis.spans == (spans[want],) and qm.covers(spans[want])


def test_the_content_free_question_removes_what_every_question_reads():
    """A sentence every question reads (a sink: the first one) beats the asked-about one on raw attention;
    less the content-free question's attention, the asked-about one wins."""
    def att(first: float, third: float) -> dict[int, torch.Tensor]:
        p = torch.full((1, 3, 12), 0.01)  # [heads, rows, keys]
        p[..., 0:4] = first
        p[..., 8:12] = third
        return {0: p}

    spans = [(0, 4), (4, 8), (8, 12)]
    question, null = att(0.2, 0.05), att(0.2, 0.0)
    raw = sentence_scores(question[0].mean(1)[None], spans, 0)[0, 0]  # [sentences]
    assert pick(raw, 1)[0] == [0]
    calibrated = sentence_scores(head_token_scores(question, null, (0, 12)), spans, 0)[0, 0]
    chosen, margin = pick(calibrated, 1)
    assert chosen == [2] and margin > 0


def test_an_unsure_map_steers_nothing_and_runs_the_question_as_a_plain_prefill():
    """On a document's cache (what a KDN load gives), an unsure map leaves the request exactly unsteered: the
    question's scoring pass is its plain prefill, kept -- the same logits and cache, bit for bit."""
    model = tiny()
    ids, region = prompt()
    re_ = region[1]

    def doc_cache():
        c = new_cache(model)
        continue_from_cache(model, c, 0, ids[:re_])
        return c

    plain_cache = doc_cache()
    plain = continue_from_cache(model, plain_cache, re_, ids[re_:], last=1)
    unsure = Retrieval(((1, 0),), min_margin=1e9, alpha=0.01, steer_heads=((1, 0), (1, 2)))
    cache = doc_cache()
    n, st, qm = QuestionSteer(region, unsure).prepare(model, TOK, cache, re_, ids)
    assert st is None and qm.emphasis is None and n == len(ids) and qm.logits is not None
    assert torch.equal(qm.logits, plain)
    first = int(plain[-1].argmax())
    assert decode_loop(model, cache, first, n, 6, None) == decode_loop(model, plain_cache, first, n, 6, None)


async def test_generate_steers_by_the_question_map_only_when_sure():
    from kdn.adapters.hf.generate import agenerate

    model = tiny()
    ids, region = prompt()
    kw = dict(use_cache=False, max_new_tokens=6, emphasis={"region": list(region)})
    plain = await agenerate(model, TOK, ids, None, **kw)
    unsure = Retrieval(((1, 0),), min_margin=1e9, alpha=0.01, steer_heads=((1, 0), (1, 2)))
    off = await agenerate(model, TOK, ids, None, steer="question", steer_retrieval=unsure, **kw)
    # (Computed from scratch the document runs in its own forward here: equal up to the float noise of that.)
    torch.testing.assert_close(off.first_logits, plain.first_logits, rtol=1e-5, atol=1e-5)
    assert off.ids == plain.ids and "not sure" in off.report.plan
    sure = Retrieval(((1, 0),), min_margin=0.0, alpha=0.01, steer_heads=((1, 0), (1, 2)))
    on = await agenerate(model, TOK, ids, None, steer="question", steer_retrieval=sure, **kw)
    assert not torch.allclose(on.first_logits, plain.first_logits, atol=1e-4) and "steered toward" in on.report.plan
    with pytest.raises(InvalidInput, match="'question'"):
        await agenerate(model, TOK, ids, None, steer="questions", **kw)


def test_asking_for_the_question_map_needs_calibration_and_a_region():
    ret = Retrieval(((1, 0),))
    with pytest.raises(InvalidInput, match="retrieval"):
        asked({"region": [0, 10]}, None, n_ids=20)
    with pytest.raises(InvalidInput, match="region"):
        asked(None, ret, n_ids=20)
    with pytest.raises(InvalidInput, match="no question"):
        asked({"region": [0, 20]}, ret, n_ids=20)
    assert asked({"region": [2, 10], "spans": [[3, 4]]}, ret, n_ids=20) == QuestionSteer((2, 10), ret)
    assert region_map({"prefix_tokens": list(range(30)), "head_tokens": 5}).region == (5, 30)


def test_the_threshold_steers_only_where_the_hits_outweigh_the_misses():
    # Above 1.0: three hits, no miss (gain 3); above 0.5, one more miss (1); above 0.4, one more hit (2); nothing gains
    # more, so the threshold is 1.0 -- the higher of the thresholds that gain 3 (ties steer less).
    assert threshold([(True, 3.0), (True, 2.0), (True, 1.5), (False, 1.0), (True, 0.8), (False, 0.4)]) == (3.0, 1.0)
    assert threshold([(True, 2.0), (False, 1.0)]) == (1.0, 1.0)
    assert threshold([(False, 2.0), (False, 1.0)]) == (0.0, 2.0)  # no gain anywhere: never sure


def examples(tok, facts: list[tuple[str, str]]) -> list[Example]:
    """One calibration example per (fact, question): the fact in the middle of the same filler text."""
    filler = ["The river is wide and slow in summer.", "Bread needs flour, water and salt.",
              "Snow lies on the hills until spring.", "The market opens at dawn on Saturdays.",
              "The library has a quiet reading room.", "Buses run to the city twice a day."]
    out = []
    for i, (fact, question) in enumerate(facts):
        before, after = " ".join(filler[:3 + i % 2]), " ".join(filler[3 + i % 2:])
        a, f, b = tok.encode(before + " "), tok.encode(fact), tok.encode(" " + after)
        ids = a + f + b + tok.encode(f"\n\n{question}\n")
        out.append(Example(tuple(ids), (0, len(a + f + b)), (len(a), len(a) + len(f))))
    return out


CALIBRATION = [("The gate code is 7781.", "What is the gate code?"),
               ("The ferry leaves at 9:45.", "When does the ferry leave?"),
               ("The key is kept by Marta Quill.", "Who keeps the key?")]


def test_calibration_is_deterministic_and_sees_only_its_examples():
    model = tiny()
    cal = examples(TOK, CALIBRATION)
    evaluation = TOK.encode("Which boat won the regatta?")
    seen: list[list[int]] = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"][0].tolist()),
                                           with_kwargs=True)
    try:
        first = calibrate(model, TOK, cal)
    finally:
        hook.remove()
    assert first == calibrate(model, TOK, cal)
    assert seen and all(bytes(evaluation) not in bytes(x) for x in seen)  # byte ids: no run of the question
    assert first.heads and first.top >= 1 and first.min_margin >= 0


def test_smollm2_calibrated_heads_find_a_fact_they_were_not_calibrated_on():
    lm = load_model("smollm2-135m", dtype=torch.float32)
    model, tok = lm.model, lm.tokenizer
    ret = calibrate(model, tok, examples(tok, CALIBRATION))
    ex = examples(tok, [("The pumpkin contest was won by Greta Okafor.", "Who won the pumpkin contest?")])[0]
    qm = question_map(model, tok, new_cache(model), 0, list(ex.ids), ex.region, ret)
    assert qm.covers(ex.answer), (ret, qm)
