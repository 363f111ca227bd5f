"""Emphasis maps: which tokens of a published text matter, stored (and signed) with its manifest.

An origin computes one per published item at publish time -- from spans an operator marks
(``kdn publish --emphasize TEXT``, ``"emphasis"`` in ``POST /v1/publish``) or from the model's own
attention under probe questions -- and stores it in the manifest's ``emphasis`` field, which the
manifest's signature covers (``kdn.registry.signing.payload``). An engine adapter may then steer attention
toward those tokens (``kdn.adapters.hf.steer``: PASTA-style, a bias of ``log(alpha)`` on the
attention of selected heads to the other tokens of ``region``), on loaded KV, without recomputing it.

The map arrives over the network, so it is small and strictly checked: at most ``MAX_SPANS`` spans,
each ``[start, end)`` inside ``region``, sorted and disjoint; ``region`` inside the published tokens;
``alpha`` in ``[MIN_ALPHA, 1]``; at most ``MAX_HEADS`` ``(layer, head)`` pairs. ``from_dict`` raises
``InvalidInput`` for anything else. Positions count in the manifest's ``prefix_tokens`` (template
head included), which are the prompt positions of an engine that reuses the published prefix.

Wire form (a plain map, msgpack in the registry, JSON over HTTP)::

    {"v": 1, "spans": [[412, 431], ...], "region": [27, 1460], "alpha": 0.05,
     "heads": [[12, 3], ...], "default_on": false, "source": "operator",
     "baseline": {"heads": [[9, 2], ...], "null": [198, 198, 45, 14, 32], "sentences": [[27, 41], ...],
                  "scores": [0.0123, ...]}}

``baseline`` (optional; absent from maps made before it, whose signatures are unchanged): what a
content-free question (``null``: its tokens as they follow the document) pays each of the region's
sentences at the retrieval heads ``heads`` -- per sentence, the sum over its tokens of the null question's
mean attention, averaged over the heads -- computed once at publish by the origin's model, so an engine
making the question's own map (``kdn.adapters.hf.question_map``, the vLLM connector) need not run the
content-free question itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kdn.errors import InvalidInput

VERSION = 1
MAX_SPANS = 256
MAX_HEADS = 1024
MAX_LAYER = 4096  # a bound on layer and head indices, far above any real model
MAX_HEAD = 4096
MIN_ALPHA = 1e-6
DEFAULT_ALPHA = 0.05
SOURCES = frozenset({"operator", "probe", "mixed", "question"})  # question: an engine's own, at question time
MAX_KEYS = 16  # a map with more keys than this is refused before its fields are read
_KEYS = ("v", "spans", "region", "alpha", "heads", "default_on", "source", "baseline")
MAX_BASELINE_HEADS = 64  # a question map's retrieval heads (calibrate picks at most 16)
MAX_NULL_TOKENS = 64  # the content-free question's tokens, frame included
MAX_SENTENCES = 8192  # sentences of a baseline's region
_BASELINE_KEYS = ("heads", "null", "sentences", "scores")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidInput(f"emphasis: {what}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pairs(v: object, what: str, limit: int) -> list[tuple[int, int]]:
    _require(isinstance(v, (list, tuple)), f"{what} must be a list of [a, b] pairs")
    assert isinstance(v, (list, tuple))
    _require(len(v) <= limit, f"at most {limit} {what}, got {len(v)}")
    out = []
    for p in v:
        _require(isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(x) for x in p),
                 f"each of {what} must be a pair of ints, got {str(p)[:40]}")
        out.append((int(p[0]), int(p[1])))
    return out


@dataclass(frozen=True)
class Baseline:
    """What the content-free question pays each sentence of a map's region at ``heads`` (module docstring)."""

    heads: tuple[tuple[int, int], ...]  # the retrieval heads the scores average over
    null: tuple[int, ...]  # the content-free question's tokens, as they follow the published ones
    sentences: tuple[tuple[int, int], ...]  # the region's sentences, [start, end), sorted, disjoint
    scores: tuple[float, ...]  # per sentence

    def __post_init__(self) -> None:
        _require(0 < len(self.heads) <= MAX_BASELINE_HEADS and len(set(self.heads)) == len(self.heads),
                 f"baseline: 1 to {MAX_BASELINE_HEADS} distinct heads, got {len(self.heads)}")
        for layer, head in self.heads:
            _require(_is_int(layer) and _is_int(head) and 0 <= layer < MAX_LAYER and 0 <= head < MAX_HEAD,
                     f"baseline head ({layer}, {head}) is out of range")
        _require(0 < len(self.null) <= MAX_NULL_TOKENS and all(_is_int(t) and t >= 0 for t in self.null),
                 f"baseline: null must be 1 to {MAX_NULL_TOKENS} token ids")
        _require(len(self.sentences) <= MAX_SENTENCES, f"baseline: at most {MAX_SENTENCES} sentences")
        _require(len(self.scores) == len(self.sentences), "baseline: one score per sentence")
        _require(all(isinstance(x, float) and math.isfinite(x) for x in self.scores), "baseline: scores must be "
                 "finite numbers")
        prev = -1
        for s, e in self.sentences:
            _require(_is_int(s) and _is_int(e) and prev <= s < e, f"baseline sentence [{s}, {e}) is empty, out "
                     "of order or overlaps another")
            prev = e

    def to_dict(self) -> dict[str, Any]:
        return {"heads": [[la, h] for la, h in self.heads], "null": list(self.null),
                "sentences": [[s, e] for s, e in self.sentences], "scores": list(self.scores)}

    @classmethod
    def from_dict(cls, d: object) -> Baseline:
        _require(isinstance(d, dict) and set(d) == set(_BASELINE_KEYS), f"baseline must be a map of "
                 f"{list(_BASELINE_KEYS)}")
        assert isinstance(d, dict)
        null, scores = d["null"], d["scores"]
        _require(isinstance(null, list) and len(null) <= MAX_NULL_TOKENS, "baseline: null must be a list of "
                 "token ids")
        _require(isinstance(scores, list) and len(scores) <= MAX_SENTENCES and all(
            _is_int(x) or isinstance(x, float) for x in scores), "baseline: scores must be a list of numbers")
        return cls(heads=tuple(_pairs(d["heads"], "baseline heads", MAX_BASELINE_HEADS)), null=tuple(null),
                   sentences=tuple(_pairs(d["sentences"], "baseline sentences", MAX_SENTENCES)),
                   scores=tuple(float(x) for x in scores))


@dataclass(frozen=True)
class EmphasisMap:
    spans: tuple[tuple[int, int], ...]  # emphasized [start, end) token ranges, sorted, disjoint, inside region
    region: tuple[int, int]  # the tokens the bias may touch: the published knowledge (template head left out)
    alpha: float = DEFAULT_ALPHA  # attention of steered heads to region tokens outside spans is scaled by alpha
    heads: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs to steer; empty: the adapter's default
    default_on: bool = False  # steer without the request asking (a request can still turn it off)
    source: str = "operator"
    baseline: Baseline | None = None  # the content-free question's sentence scores, for a question's map

    def __post_init__(self) -> None:
        rs, re_ = self.region
        _require(_is_int(rs) and _is_int(re_) and 0 <= rs < re_, f"region must be [start, end) with 0 <= start < end, "
                 f"got {list(self.region)[:2]}")
        _require(len(self.spans) <= MAX_SPANS, f"at most {MAX_SPANS} spans, got {len(self.spans)}")
        prev = rs
        for s, e in self.spans:
            _require(_is_int(s) and _is_int(e) and s < e, f"span [{s}, {e}) is empty or not ints")
            _require(prev <= s and e <= re_, f"span [{s}, {e}) overlaps another, is out of order, or leaves the "
                     f"region [{rs}, {re_})")
            prev = e
        _require(isinstance(self.alpha, float) and math.isfinite(self.alpha) and MIN_ALPHA <= self.alpha <= 1.0,
                 f"alpha must be a number in [{MIN_ALPHA}, 1], got {str(self.alpha)[:20]}")
        _require(len(self.heads) <= MAX_HEADS, f"at most {MAX_HEADS} heads, got {len(self.heads)}")
        for layer, head in self.heads:
            _require(_is_int(layer) and _is_int(head) and 0 <= layer < MAX_LAYER and 0 <= head < MAX_HEAD,
                     f"head ({layer}, {head}) is out of range")
        _require(len(set(self.heads)) == len(self.heads), "heads are listed twice")
        _require(isinstance(self.default_on, bool), "default_on must be a bool")
        _require(self.source in SOURCES, f"source must be one of {sorted(SOURCES)}")
        if self.baseline is not None:
            _require(isinstance(self.baseline, Baseline), "baseline must be a Baseline")
            _require(all(rs <= s and e <= re_ for s, e in self.baseline.sentences), "baseline sentences must lie "
                     f"inside the region [{rs}, {re_})")

    @property
    def n_emphasized(self) -> int:
        return sum(e - s for s, e in self.spans)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (canonical: the signature covers exactly this)."""
        return {"v": VERSION, "spans": [[s, e] for s, e in self.spans], "region": [self.region[0], self.region[1]],
                "alpha": self.alpha, "heads": [[la, h] for la, h in self.heads], "default_on": self.default_on,
                "source": self.source, **({} if self.baseline is None else {"baseline": self.baseline.to_dict()})}

    @classmethod
    def from_dict(cls, d: object, *, n_tokens: int | None = None) -> EmphasisMap:
        """Parse and check a wire map; ``n_tokens``: the published token count the region must fit in."""
        _require(isinstance(d, dict), f"must be a map, got {type(d).__name__}")
        assert isinstance(d, dict)
        _require(len(d) <= MAX_KEYS, f"a map of at most {MAX_KEYS} keys")
        unknown = [k for k in d if k not in _KEYS]
        _require(not unknown, f"unknown field(s) {[str(k)[:20] for k in unknown[:3]]}")
        _require(d.get("v", VERSION) == VERSION, f"version {str(d.get('v'))[:8]} is not {VERSION}")
        region = _pairs([d.get("region")], "region", 1)[0]
        alpha = d.get("alpha", DEFAULT_ALPHA)
        _require((_is_int(alpha) or isinstance(alpha, float)), "alpha must be a number")
        m = cls(spans=tuple(_pairs(d.get("spans", []), "spans", MAX_SPANS)), region=region, alpha=float(alpha),
                heads=tuple(_pairs(d.get("heads", []), "heads", MAX_HEADS)), default_on=d.get("default_on", False),
                source=d.get("source", "operator"),
                baseline=None if d.get("baseline") is None else Baseline.from_dict(d["baseline"]))
        if n_tokens is not None:
            _require(m.region[1] <= n_tokens, f"region [{m.region[0]}, {m.region[1]}) leaves the {n_tokens} "
                     "published tokens")
        return m

    def shifted(self, offset: int) -> EmphasisMap:
        """The same map for the text placed ``offset`` positions later (a document inside a composed context),
        without its ``baseline``."""
        _require(self.region[0] + offset >= 0, "shifted before position 0")
        # (no baseline: what a content-free question pays the text was measured where it was published)
        return EmphasisMap(spans=tuple((s + offset, e + offset) for s, e in self.spans),
                           region=(self.region[0] + offset, self.region[1] + offset), alpha=self.alpha,
                           heads=self.heads, default_on=self.default_on, source=self.source)


def merge_spans(spans: list[tuple[int, int]], lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """Spans clipped to ``[lo, hi)``, sorted, and overlapping or touching ones merged (an operator's marks may
    overlap); at most ``MAX_SPANS`` (InvalidInput past that)."""
    out: list[list[int]] = []
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans):
        if s >= e:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    _require(len(out) <= MAX_SPANS, f"at most {MAX_SPANS} spans, got {len(out)}")
    return tuple((s, e) for s, e in out)
