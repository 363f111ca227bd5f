"""The question's own emphasis map inside vLLM: made in the question's own pass, no oracle, no second pass.

The transformers adapter (``kdn.adapters.hf.question_map``) runs the question once unsteered, reads the
attention it pays the document at the calibrated retrieval heads, decides, and runs the question again,
steered. A vLLM connector cannot run a pass of its own, and needs none: the forward computes the layers in
order, so the attention the question's rows pay at the retrieval heads is known once the last retrieval layer
has run. ``Steerer`` (``steer.py``) reads it there, from the paged cache and the step's queries, and decides.
Sure, it has vLLM compute the question again: the last block computed before the question's step is reported
as a failed load (``get_block_ids_with_load_errors``), so the engine, whose ``kv_load_failure_policy`` is
``"recompute"``, recomputes from that block and drops the step's token; that block's K/V come out the same
(nothing before the question is steered), and the question's second computation is steered in every steered
layer, as the transformers adapter's second pass is (tested against it on the same weights, steered layers
before the retrieval layer included). Where vLLM cannot be asked (the question's step starts the request,
several KV cache groups, a policy that fails failed loads), that step is steered from the last retrieval
layer on (its queries do not depend on its own output) and the answer's rows in every steered layer.

The content-free question's side of the score cannot run in vLLM either: it comes with the manifest's
map (its ``baseline``: ``kdn publish --question-heads``, computed once by the origin), and
``request_params`` checks, with the caller's tokenizer, that it stands for this prompt's own pass (the
same heads, frame and sentences) before sending anything.

    kdn, salt = request_params(manifest.emphasis, retrieval, ids, tokenizer)
    llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt=salt),
                 SamplingParams(..., extra_args={"kv_transfer_params": {"kdn": kdn}}))

Unsure (the best sentence does not lead by ``min_margin``), nothing is steered: the request's output is
vLLM's own. The question must be computed in one step (it is, unless a chunked prefill splits it); a
question split across steps runs unsteered, logged and counted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput

from kdn.adapters import steering
from kdn.adapters.steering import SteerSpec

Heads = tuple[tuple[int, tuple[int, ...]], ...]
_KEYS = frozenset({"heads", "top", "min_margin", "alpha", "steer_heads"})
MAX_TOP = 64  # sentences a map may steer toward (calibrate tries 1 and 2)


@dataclass(frozen=True)
class QuestionSpec:
    """A request's question map, resolved: small and picklable (it travels in the per-step metadata)."""

    retrieval: Heads  # (layer, query heads) whose question attention scores the document, layers ascending
    region: tuple[int, int]  # the document
    sentences: tuple[tuple[int, int], ...]
    baseline: tuple[float, ...]  # per sentence: what the content-free question pays it (the map's baseline)
    top: int
    min_margin: float
    steer: Heads  # the heads steered once the map is sure
    alpha: float
    n_ids: int  # the prompt's length: the question is [region[1], n_ids)
    n_retrieval: int = field(init=False)
    # Per layer, asked on every step's layers: made once (as ``SteerSpec``'s), not a dict or a scan per call.
    _retrieval_at: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _steered: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_retrieval", sum(len(hs) for _, hs in self.retrieval))
        object.__setattr__(self, "_retrieval_at", dict(self.retrieval))
        object.__setattr__(self, "_steered", frozenset(la for la, _ in self.steer))

    @property
    def query_from(self) -> int:
        return self.region[1]

    @property
    def last_layer(self) -> int:
        return self.retrieval[-1][0]

    def retrieval_heads(self, layer: int) -> tuple[int, ...]:
        return self._retrieval_at.get(layer, ())

    def steers(self, layer: int) -> bool:
        return layer in self._steered

    def decide(self, token_scores: torch.Tensor) -> tuple[SteerSpec | None, float]:
        """(the plan, None when unsure; the lead) from the mean over the retrieval heads of what the question's
        rows pay each document token (``[region tokens]``), as ``question_map`` decides."""
        from kdn.adapters.hf.question_map import pick, sentence_scores

        if not self.sentences:
            return None, 0.0
        sc = sentence_scores(token_scores, self.sentences, self.region[0]) - torch.tensor(self.baseline,
                                                                                          dtype=token_scores.dtype)
        chosen, margin = pick(sc, self.top)
        if not margin > self.min_margin:
            return None, margin
        spans = tuple(self.sentences[i] for i in sorted(chosen))
        return SteerSpec(self.steer, self.region, spans, self.alpha, self.query_from), margin


def request_params(emphasis: EmphasisMap | dict, retrieval: Any, ids: Sequence[int], tokenizer: Any, *,
                   alpha: float | None = None, heads: Sequence[Sequence[int]] | None = None,
                   salt_prefix: str = "") -> tuple[dict[str, Any], str]:
    """``(the "kdn" part of kv_transfer_params, the cache_salt)`` of a request steered by its question's map.

    ``emphasis``: the manifest's map (its region is the document; its ``baseline`` the content-free scores);
    ``retrieval``: the model's calibration (``question_map.calibrate``); ``ids``: the prompt. ``InvalidInput``
    when the map has no content-free scores or they do not stand for this prompt's own pass."""
    from kdn.adapters.hf.question_map import fits, null_tail, sentences, token_pieces

    emap = emphasis if isinstance(emphasis, EmphasisMap) else EmphasisMap.from_dict(emphasis)
    rs, re_ = emap.region
    if re_ >= len(ids):
        raise InvalidInput(f"the document covers {re_} tokens, the prompt has {len(ids)}: no question")
    base = emap.baseline
    if base is None:
        raise InvalidInput("a question map in vLLM needs the content-free question's scores with the map: publish "
                           "with --question-heads (emphasis.question_heads) set to the calibration's heads")
    spans = sentences(token_pieces(tokenizer, ids[rs:re_]), rs)
    if not fits(base, retrieval, null_tail(tokenizer, list(ids[re_:]), retrieval.null), spans):
        raise InvalidInput("the map's content-free scores were made for other retrieval heads, another question "
                           "frame or other sentences than this prompt's: publish again with this calibration's "
                           "--question-heads")
    q = {"heads": [list(p) for p in retrieval.heads], "top": retrieval.top, "min_margin": retrieval.min_margin,
         "alpha": retrieval.alpha if alpha is None else alpha,
         "steer_heads": [list(p) for p in (retrieval.steer_heads if heads is None else heads)]}
    kdn = {"steer": "question", "emphasis": emap.to_dict(), "question": q}
    return kdn, salt_prefix + salt(kdn)


def salt(kdn: dict[str, Any]) -> str:
    """The plan's name in the cache salt: a question's K/V in a steered layer depend on the map, which the
    question's tokens (in the block hashes) and these inputs decide."""
    body = {"emphasis": kdn.get("emphasis"), "question": kdn.get("question")}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return "kdn-steer-" + digest[:16]


def spec_of(params: dict, *, n_layers: int, n_heads: int, n_ids: int, cache_salt: str | None) -> QuestionSpec:
    """A ``"steer": "question"`` request's spec; ``InvalidInput`` / ``ModelMismatch`` for a bad one."""
    q, emphasis = params.get("question"), params.get("emphasis")
    if not isinstance(q, dict) or set(q) - _KEYS or "heads" not in q:
        raise InvalidInput(f"'question' must be a map with 'heads' and at most {sorted(_KEYS)}")
    if emphasis is None:
        raise InvalidInput("a question map needs the manifest's map (its region and content-free scores)")
    emap = EmphasisMap.from_dict(emphasis, n_tokens=n_ids)
    if emap.baseline is None:
        raise InvalidInput("a question map in vLLM needs the content-free scores with the map (--question-heads)")
    if emap.region[1] >= n_ids:
        raise InvalidInput(f"the document covers {emap.region[1]} tokens, the prompt has {n_ids}: no question")
    retrieval = steering.by_layer(q["heads"], n_layers, n_heads) if isinstance(q["heads"], list) else ()
    if not retrieval or {(la, h) for la, hs in retrieval for h in hs} != set(emap.baseline.heads):
        raise InvalidInput("the question's retrieval heads must be the ones the map's content-free scores were "
                           "made for")
    top, margin, alpha = q.get("top", 1), q.get("min_margin", 0.0), q.get("alpha", emap.alpha)
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_TOP:
        raise InvalidInput(f"question 'top' must be an int in [1, {MAX_TOP}]")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
        raise InvalidInput("question 'min_margin' must be a finite number >= 0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
        raise InvalidInput("question 'alpha' must be in (0, 1]")
    pairs = q.get("steer_heads") or list(emap.heads) or steering.default_heads(n_layers, n_heads)
    if not isinstance(pairs, list):
        raise InvalidInput("question 'steer_heads' must be a list of [layer, head] pairs")
    steer = steering.by_layer(pairs, n_layers, n_heads)
    want = salt(params)
    if want not in (cache_salt or ""):
        raise InvalidInput(f"a steered request needs a cache_salt containing {want!r} (request_params gives it): "
                           "vLLM's prefix cache would otherwise mix steered and unsteered K/V")
    return QuestionSpec(retrieval, emap.region, emap.baseline.sentences, emap.baseline.scores, top, float(margin),
                        steer, float(alpha), n_ids)
