"""An emphasis map from the question itself, at question time: no oracle, no map published in advance.

    ret = calibrate(model, tokenizer, examples)                        # once per model, on calibration cases
    qm = question_map(model, tokenizer, cache, n, ids, region, ret)    # per request, before the question runs
    st = plan(model, qm.emphasis, heads=...)                           # None when the map is not sure
    # or, end to end: agenerate(..., steer="question", steer_retrieval=ret, emphasis=<names the region>)

How (in-context retrieval by attention: ICR, ICLR 2025; query-focused retrieval heads: QRHead, EMNLP 2025;
the map feeding PASTA-style steering: AutoPASTA): the question's tokens run once on top of the document's
cache, unsteered, with their attention recorded at a few *retrieval heads*; a content-free question
(``"N/A"`` in the same frame) runs in the same place, and what it pays each document token is subtracted
(attention sinks, the recency and newline tokens every question reads). The rest is grouped into
sentences (spans that end at ``.``, ``!``, ``?`` or a line break), each sentence scored by its sum, and the
top ``top`` sentences become the map's spans -- when the map is sure: the gap between the best sentence
and the best one left out, in standard deviations of all sentences' scores, must exceed ``min_margin``;
otherwise there is no map and nothing is steered. Both passes are cropped off the cache afterwards -- but
for ``keep``: an unsure map then leaves the question's pass (a plain prefill of it) as the request's own,
so on a loaded document cache the output is the unsteered model's, bit for bit.

The retrieval heads are chosen once per model (``calibrate``) on calibration examples whose answer sentence
is known, by what each head *retrieves* -- how often its own question-minus-content-free ranking puts the
answer's sentence first, then the answer sentence's lead in standard deviations -- not by the attention
mass it puts on the answer (a head can pay a sentence much attention under every question). ``calibrate``
sees only the examples it is given: the evaluation's questions never reach it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdn.emphasis import DEFAULT_ALPHA, Baseline, EmphasisMap
from kdn.errors import InvalidInput, ModelMismatch
from kdn.registry.records import Manifest
from kdn.template import chat_frame, encode_frame, encode_text

from kdn.adapters.hf.cache import continue_from_cache
from kdn.adapters.hf.extract import _forward
from kdn.adapters.hf.steer import Steer, attention_to, plan

NULL_QUESTION = "N/A"  # the content-free question (ICR's calibration query)
ENDS = (".", "!", "?")  # a token whose text ends with one of these (or holds a line break) ends a sentence
HEAD_COUNTS = (1, 2, 4, 8, 16)  # the numbers of retrieval heads calibrate tries
TOPS = (1, 2)  # the numbers of steered sentences calibrate tries
# What steering toward a wrong sentence costs, in answers, against the one that steering toward the right one
# gains: calibrate's threshold keeps a map unsure unless, on the calibration examples, the hits it would
# steer outweigh the misses this many times over. Twice is a guess on the safe side, not a measurement.
MISS_COST = 2.0

Head = tuple[int, int]


@dataclass(frozen=True)
class Retrieval:
    """A model's calibrated question map (``calibrate``): which heads score, how many sentences, how sure."""

    heads: tuple[Head, ...]  # (layer, head) pairs whose question attention scores the document
    top: int = 1  # sentences steered toward
    min_margin: float = 0.0  # steer only if the best sentence leads the best left out by more (in std devs)
    alpha: float = DEFAULT_ALPHA  # the map's alpha
    steer_heads: tuple[Head, ...] = ()  # the map's heads (empty: the adapter's default)
    null: str = NULL_QUESTION

    def __post_init__(self) -> None:
        if not self.heads or self.top < 1 or not self.min_margin >= 0.0:
            raise InvalidInput("a question map needs retrieval heads, top >= 1 and min_margin >= 0")


@dataclass(frozen=True)
class QuestionMap:
    """One request's map: the sentences, their scores, what was chosen and whether it is sure enough."""

    sentences: tuple[tuple[int, int], ...]  # absolute [start, end) spans of the region's sentences
    scores: tuple[float, ...]  # per sentence: question attention less the content-free question's
    chosen: tuple[int, ...]  # indices of the top sentences, best first
    margin: float  # the best sentence's lead over the best one left out, in std devs
    emphasis: EmphasisMap | None  # None: not sure, steer nothing
    logits: torch.Tensor | None = None  # unsure, asked to keep: the question's plain prefill's last logits
    published: bool = False  # the content-free question's scores came with the map (no pass of our own)

    def summary(self) -> str:
        """One line for a request's report."""
        null = ", content-free scores published" if self.published else ""
        if self.emphasis is None:
            return f"question map not sure (lead {self.margin:.2f} sd{null}): not steered"
        return (f"question map: steered toward {', '.join(f'[{s}, {e})' for s, e in self.emphasis.spans)} "
                f"(lead {self.margin:.2f} sd{null})")

    def covers(self, span: tuple[int, int]) -> bool:
        """Whether a chosen sentence overlaps ``span`` (the map's hit, where the answer is known)."""
        return any(self.sentences[i][0] < span[1] and span[0] < self.sentences[i][1] for i in self.chosen)


def sentences(pieces: Sequence[str], start: int) -> list[tuple[int, int]]:
    """Sentence spans of tokens whose texts are ``pieces`` (the first at position ``start``); spans with no
    letter or digit (a lone line break) are left out."""
    out, s, words = [], 0, False
    for i, p in enumerate(pieces):
        words = words or any(c.isalnum() for c in p)
        if "\n" in p or p.rstrip().endswith(ENDS) or i == len(pieces) - 1:
            if words:
                out.append((start + s, start + i + 1))
            s, words = i + 1, False
    return out


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's text, one at a time (byte pieces of a split character decode as a replacement mark)."""
    return [tokenizer.decode([int(t)]) for t in ids]


def null_tail(tokenizer: Any, tail: Sequence[int], null: str = NULL_QUESTION) -> list[int]:
    """The content-free question in the frame ``tail`` (the tokens after the document) uses, as
    ``prompt_tokens`` builds it: the chat template's close when the tail ends with it, else a line break."""
    try:
        close = encode_frame(tokenizer, chat_frame(tokenizer)[1])
    except InvalidInput:
        close = []
    if close and list(tail[-len(close):]) == close:
        return encode_text(tokenizer, f"\n\n{null}") + close
    return encode_text(tokenizer, f"\n\n{null}\n")


def _attention(model: Any, cache: Any, n: int, rows: Sequence[int], *,
               keep: bool = False) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """(``{layer: [H, len(rows), n]}``: what ``rows``, run at positions ``n``... as a plain prefill, pay the
    first ``n`` keys; the last row's logits ``[1, vocab]``). The cache is cropped back to ``n`` unless ``keep``."""
    if not hasattr(cache, "crop"):
        raise ModelMismatch("a question map needs a cache it can crop (attention K/V)")
    with attention_to(model, last_rows=len(rows)) as att:
        logits = continue_from_cache(model, cache, n, list(rows), last=1)
    if not keep:
        _crop(cache, n)
    return {la: p[..., :n] for la, p in att.items()}, logits


def _crop(cache: Any, n: int) -> None:
    """Keep the first ``n`` tokens of ``cache`` (a count to remove: transformers deprecates a length)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def head_token_scores(question: dict[int, torch.Tensor], null: dict[int, torch.Tensor] | None,
                      region: tuple[int, int]) -> torch.Tensor:
    """``[layers, heads, region tokens]``: the mean attention the question's rows pay each region token,
    less the content-free question's (``null``; None: nothing subtracted)."""
    rs, re_ = region
    layers = sorted(question)
    q = torch.stack([question[la][:, :, rs:re_].mean(1) for la in layers])  # [L, H, R]
    if null is None:
        return q
    z = torch.stack([null[la][:, :, rs:re_].mean(1) for la in layers])  # [L, H, R]
    return q - z


def sentence_scores(tok_scores: torch.Tensor, spans: Sequence[tuple[int, int]], rs: int) -> torch.Tensor:
    """``[..., sentences]``: the sum of token scores over each sentence (``tok_scores``' last dim from ``rs``)."""
    return torch.stack([tok_scores[..., s - rs:e - rs].sum(-1) for s, e in spans], dim=-1)


def pick(scores: torch.Tensor, top: int) -> tuple[list[int], float]:
    """The ``top`` best sentences (best first, ties to the earlier one) and the best one's lead over the best
    sentence left out, in standard deviations of all the scores (``inf`` when nothing is left out)."""
    order = sorted(range(scores.numel()), key=lambda i: (-float(scores[i]), i))
    chosen = order[:top]
    if len(order) <= top:
        return chosen, float("inf")
    sd = float(scores.std()) if scores.numel() > 1 else 0.0
    gap = float(scores[chosen[0]] - scores[order[top]])
    return chosen, gap / sd if sd > 0 else 0.0


def question_map(model: Any, tokenizer: Any, cache: Any, n: int, ids: Sequence[int], region: tuple[int, int],
                 ret: Retrieval, *, keep: bool = False, baseline: Baseline | None = None) -> QuestionMap:
    """The map of the question ``ids[region[1]:]`` over the document ``ids[region[0]:region[1]]``.

    ``cache`` holds ``ids[:n]``; the document's missing tokens (``n < region[1]``) are prefilled into it
    unsteered (tokens past the document are cropped), so on return it holds ``ids[:region[1]]`` -- the
    scoring passes are cropped off. With ``keep``, an unsure map leaves the question's pass in the cache
    (holding all ``ids``) and its last logits in ``logits``: the question ran as a plain prefill on top of
    the document, so the request goes on from there exactly as it would have unsteered. ``baseline``: the
    content-free question's scores published with the map (``baseline_of``), used when ``fits`` says they stand
    for this request's own content-free pass, which is then not run."""
    rs, re_ = region
    if not 0 <= rs < re_ < len(ids):
        raise InvalidInput(f"a question map needs the document [{rs}, {re_}) before a question ({len(ids)} tokens)")
    if n > re_:  # a cache that runs into the question: the question runs again on top of the document
        if not hasattr(cache, "crop"):
            raise ModelMismatch("a question map needs a cache it can crop (attention K/V)")
        _crop(cache, re_)
    elif n < re_:
        dev = next(model.parameters()).device
        with torch.inference_mode():
            _forward(model, cache, torch.tensor(list(ids[n:re_]), dtype=torch.long, device=dev), n, logits=False)
    tail = list(ids[re_:])
    null_ids = null_tail(tokenizer, tail, ret.null)
    spans = sentences(token_pieces(tokenizer, ids[rs:re_]), rs)
    if baseline is not None and not fits(baseline, ret, null_ids, spans):
        baseline = None  # measured for other heads, another frame or other sentences: our own pass instead
    z = None if baseline is not None else _attention(model, cache, re_, null_ids)[0]
    q, logits = _attention(model, cache, re_, tail, keep=True)  # last: an unsure map keeps it
    sc = (sentence_scores(_heads_mean(head_token_scores(q, z, region), ret.heads, q), spans, rs) if spans
          else torch.zeros(0))  # [S]
    if baseline is not None and spans:
        sc = sc - torch.tensor(baseline.scores, dtype=sc.dtype)
    chosen, margin = pick(sc, ret.top) if spans else ([], 0.0)
    sure = margin > ret.min_margin
    if sure or not keep:
        _crop(cache, re_)
    emap = EmphasisMap(spans=tuple(spans[i] for i in sorted(chosen)), region=region, alpha=ret.alpha,
                       heads=ret.steer_heads, source="question") if sure else None
    return QuestionMap(tuple(spans), tuple(float(x) for x in sc), tuple(chosen), margin, emap,
                       None if sure or not keep else logits, published=baseline is not None)


def fits(baseline: Baseline, ret: Retrieval, null_ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> bool:
    """Whether published content-free scores stand for this request's own pass: the same retrieval heads, the
    same content-free question in the same frame, the same sentences."""
    return (set(baseline.heads) == set(ret.heads) and tuple(baseline.null) == tuple(null_ids)
            and baseline.sentences == tuple(spans))


def baseline_of(model: Any, tokenizer: Any, tokens: Sequence[int], region: tuple[int, int], heads: Sequence[Head],
                null_ids: Sequence[int]) -> Baseline:
    """What the content-free question ``null_ids`` pays each sentence of ``region`` when it follows ``tokens``
    (as ``prompt_tokens`` appends a question): the origin's pass, once per publish (``Producer.derive_emphasis``),
    so that a question's map (here or in vLLM) needs no content-free pass of its own."""
    from kdn.adapters.hf.extract import new_cache

    rs, re_ = region
    if not (0 <= rs < re_ == len(tokens)):
        raise InvalidInput(f"a baseline's region [{rs}, {re_}) must end where the {len(tokens)} published tokens do")
    cache = new_cache(model)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        _forward(model, cache, torch.tensor(list(tokens), dtype=torch.long, device=dev), 0, logits=False)
    z, _ = _attention(model, cache, re_, list(null_ids))
    spans = sentences(token_pieces(tokenizer, tokens[rs:re_]), rs)
    tok = _heads_mean(head_token_scores(z, None, region), heads, z)  # [R]
    sc = sentence_scores(tok, spans, rs) if spans else torch.zeros(0)
    return Baseline(heads=tuple((int(a), int(b)) for a, b in heads), null=tuple(int(t) for t in null_ids),
                    sentences=tuple(spans), scores=tuple(float(x) for x in sc))


def _heads_mean(tok: torch.Tensor, heads: Sequence[Head], recorded: dict[int, torch.Tensor]) -> torch.Tensor:
    """The mean over ``heads`` of ``tok`` (``[layers, heads, R]``, layers as ``recorded`` lists them)."""
    row = {la: i for i, la in enumerate(sorted(recorded))}
    for la, h in heads:
        if la not in row or not 0 <= h < tok.shape[1]:
            raise ModelMismatch(f"retrieval head ({la}, {h}) is not in this model")
    return torch.stack([tok[row[la], h] for la, h in heads]).mean(0)


@dataclass(frozen=True)
class QuestionSteer:
    """A request that asked for its question's map (``agenerate(..., steer="question")``): the map is made
    once the document's cache is ready, before the question runs; ``alpha`` / ``heads`` override the
    retrieval's, as ``steer_alpha`` / ``steer_heads`` do a published map's."""

    region: tuple[int, int]
    retrieval: Retrieval
    alpha: float | None = None
    heads: tuple[Head, ...] | None = None
    baseline: Baseline | None = None  # the manifest's map's content-free scores, if it has them

    def prepare(self, model: Any, tokenizer: Any, cache: Any, n: int,
                ids: Sequence[int]) -> tuple[int, Steer | None, QuestionMap]:
        """(the tokens the cache then holds; the plan, None when unsure; the map). Sure, the cache holds the
        document and the question is to run steered; unsure, it holds the question too, run plain, and the
        map's ``logits`` are its last position's: nothing is left to run before decoding."""
        qm = question_map(model, tokenizer, cache, n, ids, self.region, self.retrieval, keep=True,
                          baseline=self.baseline)
        if qm.emphasis is None:
            return len(ids), None, qm
        return self.region[1], plan(model, qm.emphasis, alpha=self.alpha, heads=self.heads), qm


def asked(emphasis: EmphasisMap | dict | None, retrieval: Retrieval | None, *, alpha: float | None = None,
          heads: Sequence[Head] | None = None, n_ids: int) -> QuestionSteer:
    """The ``QuestionSteer`` of a request: the document's region from ``emphasis`` (a manifest's map; its
    spans are not used; ``region_map`` makes one for a manifest without), the calibration ``retrieval``."""
    if retrieval is None:
        raise InvalidInput("steer='question' needs the model's calibrated retrieval heads (steer_retrieval=)")
    if emphasis is None:
        raise InvalidInput("steer='question' needs the document's region: emphasis=manifest['emphasis'] or "
                           "question_map.region_map(manifest)")
    emap = emphasis if isinstance(emphasis, EmphasisMap) else EmphasisMap.from_dict(emphasis)
    if emap.region[1] >= n_ids:
        raise InvalidInput(f"the document covers {emap.region[1]} tokens, the prompt has {n_ids}: no question")
    return QuestionSteer(emap.region, retrieval, alpha, None if heads is None else tuple(
        (int(a), int(b)) for a, b in heads), emap.baseline)


def region_map(manifest: Manifest | Mapping[str, Any]) -> EmphasisMap:
    """A map with no spans that names a manifest's document: its tokens after the template's head. ``manifest``:
    as ``KDNClient.manifest`` returns it, or a map of its ``prefix_tokens`` and ``head_tokens``."""
    if isinstance(manifest, Manifest):
        return EmphasisMap(spans=(), region=(manifest.head_tokens, len(manifest.prefix_tokens)), source="question")
    n = len(manifest["prefix_tokens"])
    return EmphasisMap(spans=(), region=(int(manifest.get("head_tokens", 0) or 0), n), source="question")


# --- calibration -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """A calibration case: the prompt (document, then question), the document's region, the answer's span."""

    ids: tuple[int, ...]
    region: tuple[int, int]
    answer: tuple[int, int]  # absolute [start, end) of the answer's sentence (or of the answer)


def example_scores(model: Any, tokenizer: Any, ex: Example) -> tuple[torch.Tensor, int]:
    """Per head, every sentence's score for one example (``[layers, heads, sentences]``; one prefill and two
    short passes), and the index of the sentence that holds the answer."""
    from kdn.adapters.hf.extract import new_cache

    rs, re_ = ex.region
    cache = new_cache(model)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        _forward(model, cache, torch.tensor(list(ex.ids[:re_]), dtype=torch.long, device=dev), 0, logits=False)
    tail = list(ex.ids[re_:])
    z, _ = _attention(model, cache, re_, null_tail(tokenizer, tail))
    q, _ = _attention(model, cache, re_, tail)
    spans = sentences(token_pieces(tokenizer, ex.ids[rs:re_]), rs)
    gold = [i for i, (s, e) in enumerate(spans) if s < ex.answer[1] and ex.answer[0] < e]
    if not gold:
        raise InvalidInput(f"the answer [{ex.answer[0]}, {ex.answer[1]}) is in no sentence of the region")
    return sentence_scores(head_token_scores(q, z, ex.region), spans, rs), gold[0]


def rank_heads(per_example: Sequence[tuple[torch.Tensor, int]]) -> list[Head]:
    """Every head, best retriever first: by how many examples its own top sentence is the answer's, then by the
    answer sentence's mean lead over the best other sentence in std devs; ties to the lower (layer, head)."""
    leads = []
    for sc, g in per_example:  # sc: [L, H, S]
        other = sc.clone()
        other[..., g] = float("-inf")
        leads.append((sc[..., g] - other.max(-1).values) / sc.std(-1).clamp_min(1e-12))  # [L, H]
    lead = functools.reduce(torch.add, leads)  # [L, H], summed in the examples' order
    hits = functools.reduce(torch.add, [(d > 0).to(torch.float32) for d in leads])  # [L, H]
    n_heads = hits.shape[1]
    keys = [(-float(hits.flatten()[i]), -float(lead.flatten()[i]), i) for i in range(hits.numel())]
    return [(i // n_heads, i % n_heads) for *_, i in sorted(keys)]


def calibrate(model: Any, tokenizer: Any, examples: Sequence[Example], *, alpha: float = DEFAULT_ALPHA,
              steer_heads: Sequence[Head] = ()) -> Retrieval:
    """The model's ``Retrieval`` from ``examples`` only (deterministic: same examples, same result).

    Heads ranked by ``rank_heads``; then the number of heads (``HEAD_COUNTS``), of sentences (``TOPS``) and
    the threshold (``threshold``) whose sure maps gain most on the examples -- a hit it steers counts 1, a
    miss ``-MISS_COST`` -- ties to fewer heads and sentences. Nothing gains: the highest threshold, a map
    that is never sure."""
    if not examples:
        raise InvalidInput("calibration needs at least one example")
    per = [example_scores(model, tokenizer, ex) for ex in examples]
    ranked = rank_heads(per)
    best: tuple[tuple[float, int, int], int, int, float] | None = None  # (key, heads, top, margin)
    for k in HEAD_COUNTS:
        for top in TOPS:
            gain, margin = threshold([_outcome(sc, g, ranked[:k], top) for sc, g in per])
            key = (gain, -k, -top)
            if best is None or key > best[0]:
                best = (key, k, top, margin)
    assert best is not None
    _, k, top, margin = best
    return Retrieval(tuple(ranked[:k]), top=top, min_margin=margin, alpha=alpha, steer_heads=tuple(steer_heads))


def threshold(outcomes: Sequence[tuple[bool, float]]) -> tuple[float, float]:
    """(the gain, the ``min_margin``) that gains most over ``(hit, margin)`` outcomes: the maps sure above it
    count 1 per hit and ``-MISS_COST`` per miss; ties to the higher threshold (steer less)."""
    finite = [m for _, m in outcomes if m != float("inf")]
    best = (0.0, max([0.0, *finite]))  # above every margin: nothing steered, nothing gained
    for t in sorted({0.0, *finite}, reverse=True):
        gain = sum(1.0 if hit else -MISS_COST for hit, m in outcomes if m > t)
        if gain > best[0]:
            best = (gain, t)
    return best


def _outcome(sc: torch.Tensor, gold: int, heads: Sequence[Head], top: int) -> tuple[bool, float]:
    """(whether the map of ``heads`` covers the answer's sentence, its margin) for one example's scores."""
    s = torch.stack([sc[la, h] for la, h in heads]).mean(0)  # [S]
    chosen, margin = pick(s, top)
    return gold in chosen, margin
