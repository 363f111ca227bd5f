"""A publish body's ``emphasis``: the marked texts, token spans and probe questions, in published-token positions.

An operator marks what a document's readers should attend to (``kdn.emphasis``): texts are found in the
document and turned into token spans by the tokenizer's offsets, spans are counted from the document's first
token and moved past the template's head, and probe questions are tokenized as a reader would ask them (the
origin's model then adds the spans they attend to: ``Producer.derive_emphasis``). ``parse_request``
(``publish.py``) calls ``parse_emphasis``; the map is stored, and signed, with the manifest.
"""

from __future__ import annotations

from kdn.emphasis import DEFAULT_ALPHA, MAX_BASELINE_HEADS, MAX_LAYER, MAX_SPANS, EmphasisMap, merge_spans
from kdn.errors import InvalidInput

MAX_EMPHASIS_TEXTS = 64
MAX_EMPHASIS_TEXT_CHARS = 4096
MAX_PROBES = 4
MAX_PROBE_CHARS = 512
_EMPHASIS_KEYS = frozenset({"texts", "spans", "probes", "alpha", "heads", "default_on", "question_heads"})
Head = tuple[int, int]


def token_char_ends(tokenizer, text: str, ids: list[int]) -> list[int] | None:
    """Each token's end offset in ``text`` (characters), when the tokenizer can say; else None.

    A fast HF tokenizer gives offsets directly (checked against ``ids``); the byte tokenizer of the tiny
    models maps one token to one UTF-8 byte.
    """
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offs = enc.get("offset_mapping") if hasattr(enc, "get") else None
        if offs is not None and list(enc["input_ids"]) == list(ids):
            return [int(e) for _, e in offs]
    except (TypeError, ValueError, NotImplementedError):
        pass
    if getattr(tokenizer, "name", None) == "kdn-bytes-v1" and len(text.encode("utf-8")) == len(ids):
        ends, n = [], 0
        for ch in text:  # a character's bytes all end where the character does
            n_b = len(ch.encode("utf-8"))
            ends += [n + 1] * n_b
            n += 1
        return ends
    return None


def emphasis_spans_of_texts(tokenizer, doc: str, doc_ids: list[int], texts: list[str]) -> list[tuple[int, int]]:
    """Token spans (document coordinates) of every occurrence of each text in ``doc``."""
    import bisect

    ends = token_char_ends(tokenizer, doc, doc_ids)
    if ends is None:
        raise InvalidInput("this model's tokenizer gives no token offsets: mark emphasis with 'spans' (token ranges)")
    spans = []
    for t in texts:
        at, found = doc.find(t), False
        while at >= 0:
            found = True
            first = bisect.bisect_right(ends, at)  # the first token ending after the text starts
            last = bisect.bisect_left(ends, at + len(t))  # the token holding the text's last character
            spans.append((first, min(last + 1, len(doc_ids))))
            if len(spans) > MAX_SPANS:
                raise InvalidInput(f"emphasis: the marked texts occur more than {MAX_SPANS} times")
            at = doc.find(t, at + len(t))
        if not found:
            raise InvalidInput(f"emphasis text {t[:40]!r} does not occur in the document")
    return spans


def parse_emphasis(value: object, *, tokenizer, doc: str | None, doc_ids: list[int], head: int,
                   template: str | None = None) -> tuple[EmphasisMap, list[list[int]], tuple[Head, ...], list[int]]:
    """The publish body's ``emphasis`` field -> a map in published-token positions, probe tokens, and the
    retrieval heads and content-free question tokens of the map's ``baseline`` (none asked: ``()``, ``[]``).

    ``{"texts": [...]}`` marks each occurrence of each text (needs ``text`` in the body); ``{"spans":
    [[s, e], ...]}`` marks token ranges counted from the document's first token (the template head is
    not counted); ``{"probes": [question, ...]}`` asks the origin's model which tokens those questions
    attend to (``Producer.derive_emphasis``, at publish); ``alpha``, ``heads``, ``default_on`` as in
    ``kdn.emphasis``. Probes come back as the tokens that follow the published ones, as
    ``kdn.adapters.hf.prompt_tokens`` would append them. ``{"question_heads": [[layer, head], ...]}`` (a model's
    calibrated retrieval heads, ``kdn.adapters.hf.question_map.calibrate``) asks the origin's model for the
    content-free question's scores at those heads (the map's ``baseline``), so that engines making a question's
    own map need not run the content-free question; it may come alone (a map that marks nothing).
    """
    if not isinstance(value, dict) or not value:
        raise InvalidInput("'emphasis' must be a map with 'texts', 'spans', 'probes' and/or 'question_heads'")
    unknown = [k for k in value if k not in _EMPHASIS_KEYS]
    if unknown:
        raise InvalidInput(f"'emphasis' has unknown field(s) {[str(k)[:20] for k in unknown[:3]]}; "
                           f"it takes {sorted(_EMPHASIS_KEYS)}")
    texts, spans, probes = value.get("texts", []), value.get("spans", []), value.get("probes", [])
    if not isinstance(texts, list) or len(texts) > MAX_EMPHASIS_TEXTS or not all(
            isinstance(t, str) and 0 < len(t) <= MAX_EMPHASIS_TEXT_CHARS and t.strip() for t in texts):
        raise InvalidInput(f"'emphasis.texts' must be a list of at most {MAX_EMPHASIS_TEXTS} non-empty strings "
                           f"of at most {MAX_EMPHASIS_TEXT_CHARS} characters")
    if not isinstance(probes, list) or len(probes) > MAX_PROBES or not all(
            isinstance(t, str) and 0 < len(t) <= MAX_PROBE_CHARS and t.strip() for t in probes):
        raise InvalidInput(f"'emphasis.probes' must be a list of at most {MAX_PROBES} non-empty strings "
                           f"of at most {MAX_PROBE_CHARS} characters")
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        raise InvalidInput(f"'emphasis.spans' must be a list of at most {MAX_SPANS} [start, end) pairs")
    qheads = _question_heads(value.get("question_heads", []))
    if not texts and not spans and not probes and not qheads:
        raise InvalidInput("'emphasis' marks nothing: give 'texts', 'spans', 'probes' or 'question_heads'")
    n = len(doc_ids)
    marked: list[tuple[int, int]] = []
    for p in spans:
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
                and 0 <= p[0] < p[1] <= n):
            raise InvalidInput(f"'emphasis.spans' entries must be [start, end) with 0 <= start < end <= {n} "
                               f"(document tokens), got {str(p)[:40]}")
        marked.append((p[0], p[1]))
    if texts:
        if doc is None:
            raise InvalidInput("'emphasis.texts' needs the document as 'text'; with 'tokens' mark 'spans'")
        marked += emphasis_spans_of_texts(tokenizer, doc, doc_ids, texts)
    wire = {"spans": [list(s) for s in merge_spans([(s + head, e + head) for s, e in marked], head, head + n)],
            "region": [head, head + n], "alpha": value.get("alpha", DEFAULT_ALPHA),
            "heads": value.get("heads", []), "default_on": value.get("default_on", False),
            "source": "operator" if not probes else ("mixed" if marked else "probe")}
    emap = EmphasisMap.from_dict(wire, n_tokens=head + n)
    probe_ids, null_ids = _suffixes(tokenizer, template, probes, bool(qheads))
    return emap, probe_ids, qheads, null_ids


def _suffixes(tokenizer, template: str | None, probes: list[str], null: bool) -> tuple[list[list[int]], list[int]]:
    """The probes' tokens, and the content-free question's (``null``), as they follow the published tokens."""
    if not probes and not null:
        return [], []
    from kdn.adapters.hf.generate import prompt_tokens
    from kdn.adapters.hf.question_map import NULL_QUESTION

    frame: dict[str, object] = {"prefix_tokens": [], "template": template}
    return ([prompt_tokens(tokenizer, frame, q) for q in probes],
            prompt_tokens(tokenizer, frame, NULL_QUESTION) if null else [])


def _question_heads(v: object) -> tuple[Head, ...]:
    if not (isinstance(v, list) and len(v) <= MAX_BASELINE_HEADS and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                        and 0 <= x < MAX_LAYER for x in p) for p in v)):
        raise InvalidInput(f"'emphasis.question_heads' must be a list of at most {MAX_BASELINE_HEADS} "
                           "[layer, head] pairs")
    if len({tuple(p) for p in v}) != len(v):
        raise InvalidInput("'emphasis.question_heads' lists a head twice")
    return tuple((int(a), int(b)) for a, b in v)
