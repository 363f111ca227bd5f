"""Publishing: a request becomes token ids, chunk addresses, stored objects, and records.

The order of effects is what makes a publish safe to kill at any point:

1. each chunk's blob is written to the store (temp file, fsync, rename);
2. only then is its object record written to the registry;
3. once every chunk is stored and recorded, the manifest is written in one
   transaction, and the last partial chunk is listed on its parent's record.

A publish killed midway leaves stored blobs and records that point at them,
never a record or a manifest that points at a missing object. Re-publishing
the same text is idempotent: the addresses are the same, stored blobs are
never rewritten, and chunks already stored are not recomputed: the model
resumes from a cache rebuilt from them.

The model work (``Producer.produce``) is a generator advanced on one
dedicated thread; registry writes happen on the event loop between steps.
A body's ``emphasis`` (texts, spans, probe questions) is parsed by ``publish_emphasis.py``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kdn.format import address as A
from kdn.format.address import Address
from kdn.emphasis import EmphasisMap, merge_spans
from kdn.format.encodings import KVTC_AUTO, LOSSLESS_PREFERENCE, kvtc_bits
from kdn.errors import InvalidInput, KDNError
from kdn.registry import ObjectRecord, Policy
from kdn.format.store import validate_encoding
from kdn.template import chat_frame, encode_frame, encode_text

from kdn.origin.publish_emphasis import emphasis_spans_of_texts as emphasis_spans_of_texts  # (importable here too)
from kdn.origin.publish_emphasis import parse_emphasis
from kdn.origin.publish_emphasis import token_char_ends as token_char_ends  # (importable here too)
from kdn.origin.store import ObjectStore

if TYPE_CHECKING:  # (torch and the kernels load with the model, not with this module)
    from kdn.kernels.transform import Basis

TEMPLATES = ("none", "chat")


@dataclass(frozen=True)
class PublishSpec:
    """A validated publish request, tokenized."""

    name: str
    namespace: str
    tokens: list[int]  # exactly the token ids published: head (template / prefix text) + document
    head_tokens: int  # how many leading tokens came from the template or prefix text
    template: str | None
    prefix: bool = True
    standalone: bool = False
    encodings: tuple[str, ...] = ("zstd",)
    emphasis: EmphasisMap | None = None  # stored (and signed) with the manifest
    probes: tuple[tuple[int, ...], ...] = ()  # probe questions' tokens: the model adds the spans they attend to
    # Retrieval heads whose content-free scores the map carries (its ``baseline``), and that question's tokens
    baseline_heads: tuple[tuple[int, int], ...] = ()
    baseline_null: tuple[int, ...] = ()
    # Once published, send the objects to these regions' edges (() every region; None: leave any push as it
    # is; False: end the push this publish set): a push policy, as `kdn policy set --push` writes one.
    push: tuple[str, ...] | None | bool = None
    push_rate: int | None = None  # bytes a second per edge, with push


MAX_PUSH_REGIONS = 256


def push_policy_name(namespace: str, name: str) -> str:
    """The name of the push policy a publish of ``namespace/name`` sets (a policy name: at most 128 characters)."""
    full = f"push.{namespace}.{name}"
    return full if len(full) <= 128 else "push." + A.blob_digest(full.encode())[:40]


def push_policy(spec: PublishSpec) -> Policy:
    """The push policy ``spec`` asks for (``spec.push`` is a tuple of regions, empty for every region)."""
    assert isinstance(spec.push, tuple), spec.push
    extra: dict[str, object] = {}
    if spec.push:
        extra["regions"] = list(spec.push)
    if spec.push_rate is not None:
        extra["rate_bytes"] = spec.push_rate
    return Policy(push_policy_name(spec.namespace, spec.name), "push", manifest=f"{spec.namespace}/{spec.name}",
                  extra=extra)


# How often a namespace's publishes may set a push (#51 item 11): each is a fleet-wide fill that evicts what the
# named regions' edges held, so a namespace may set PUSH_BURST at once, then one every PUSH_EVERY_S (an
# operator's `kdn policy set --push` and the console's form are not counted: they are one person's act each).
PUSH_BURST, PUSH_EVERY_S = 8, 60.0
MAX_PUSH_NAMESPACES = 4096  # namespaces the budget remembers (the least recently seen is forgotten: a full bucket)


class PushBudget:
    """Pushes set by publishes, per namespace: a token bucket each (``burst`` at once, then one each ``every``
    seconds), in a table of at most ``limit`` namespaces, the least recently seen forgotten first (as the
    console's sign-ins per address: ``origin/console/sessions.py`` ``SignIns``). Per origin process: origins
    sharing a registry each keep their own."""

    def __init__(self, burst: int = PUSH_BURST, every: float = PUSH_EVERY_S, limit: int = MAX_PUSH_NAMESPACES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert burst >= 1 and every > 0 and limit >= 1
        self.burst, self.every, self.limit, self.clock = burst, every, limit, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # namespace -> (pushes left, when)

    def take(self, namespace: str) -> float:
        """One push for ``namespace``: 0 if it may go ahead (and is counted), else the seconds until one may."""
        now = self.clock()
        left, at = self._buckets.pop(namespace, (float(self.burst), now))
        left = min(float(self.burst), left + max(0.0, now - at) / self.every)
        wait = 0.0 if left >= 1 else (1 - left) * self.every
        self._buckets[namespace] = (left - 1 if not wait else left, now)  # (moved to the end: most recently seen)
        while len(self._buckets) > self.limit:
            self._buckets.popitem(last=False)
        return wait

    def give_back(self, namespace: str) -> None:
        """Return the push ``take`` counted for a publish that did not start after all (the job queue was full)."""
        if namespace in self._buckets:
            left, at = self._buckets[namespace]
            self._buckets[namespace] = (min(float(self.burst), left + 1), at)


def _parse_push(push: object, rate: object) -> tuple[tuple[str, ...] | None | bool, int | None]:
    """A publish body's ``push`` (true: every region; a list of region names; false: end this name's push) and
    ``push_rate`` (bytes a second per edge)."""
    if rate is not None and not (isinstance(rate, int) and not isinstance(rate, bool) and 0 < rate < 1 << 53):
        raise InvalidInput("'push_rate' must be a positive integer below 2**53: bytes a second per edge")
    if push is None or push is False:
        if push is None and rate is not None:
            raise InvalidInput("'push_rate' goes with 'push'")
        return push, None  # (push false ends a push: a rate means nothing then)
    if push is True:
        return (), rate
    if not (isinstance(push, list) and 0 < len(push) <= MAX_PUSH_REGIONS):
        raise InvalidInput(f"'push' must be true (every region), false, or a list of 1-{MAX_PUSH_REGIONS} region names")
    return tuple(sorted({A.validate_name(r) for r in push})), rate


@dataclass
class Plan:
    spans: list[tuple[int, int]]
    addresses: list[Address]
    standalone: list[Address] = field(default_factory=list)

    @property
    def tail(self) -> tuple[Address, int] | None:
        """(parent address, tail length) when the last chunk is partial and has a parent."""
        if len(self.spans) < 2 or not self.addresses:
            return None
        s, e = self.spans[-1]
        s0, e0 = self.spans[0]
        if e - s == e0 - s0:
            return None
        return self.addresses[-2], e - s


@dataclass(frozen=True)
class Step:
    """One unit of progress: records to write (their blobs are already stored)."""

    records: list[ObjectRecord]
    computed: bool  # True if the model ran for this step


def head_text(tokenizer, template: str | None, prefix_text: str | None, system: str | None) -> str:
    """The text that precedes the document in the published tokens."""
    if template in (None, "none"):
        if system is not None:
            raise InvalidInput("'system' needs template 'chat'")
        return prefix_text or ""
    if template != "chat":
        raise InvalidInput(f"unknown template {str(template)[:30]!r}: use one of {list(TEMPLATES)}")
    return chat_frame(tokenizer, system, generation_prompt=False)[0] + (prefix_text or "")


def parse_request(body: dict, *, tokenizer, vocab_size: int, max_tokens: int,
                  default_encodings: Sequence[str] = ("zstd",)) -> PublishSpec:
    """Validate a publish body (see the README's HTTP section) and tokenize it. Raises InvalidInput.
    ``default_encodings``: what a body without ``encodings`` gets (the origin's :func:`default_encodings`)."""
    name = A.validate_name(body.get("name"))
    namespace = A.validate_namespace(body.get("namespace", A.PUBLIC_NAMESPACE))
    text, ids = body.get("text"), body.get("tokens")
    if (text is None) == (ids is None):
        raise InvalidInput("give exactly one of 'text' or 'tokens'")
    template = body.get("template")
    prefix_text, system = body.get("prefix_text"), body.get("system")
    for key, value in (("template", template), ("prefix_text", prefix_text), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise InvalidInput(f"'{key}' must be a string")
    prefix, standalone = body.get("prefix", True), body.get("standalone", False)
    if not isinstance(prefix, bool) or not isinstance(standalone, bool):
        raise InvalidInput("'prefix' and 'standalone' must be booleans")
    if not (prefix or standalone):
        raise InvalidInput("nothing to publish: 'prefix' and 'standalone' are both false")
    push, push_rate = _parse_push(body.get("push"), body.get("push_rate"))
    encodings = _parse_encodings(body.get("encodings", list(default_encodings)))
    # The template's frame with its control tokens; the publisher's prefix text as text (never control ids)
    frame = head_text(tokenizer, template, None, system)
    head_ids = (encode_frame(tokenizer, frame) if frame else []) + (encode_text(tokenizer, prefix_text)
                                                                    if prefix_text else [])
    doc_ids = _document_tokens(text, ids, tokenizer=tokenizer, vocab_size=vocab_size)
    tokens = head_ids + doc_ids
    if len(tokens) > max_tokens:
        raise InvalidInput(f"document is {len(tokens)} tokens; this model's context is {max_tokens}")
    emphasis = body.get("emphasis")
    emap, probes, qheads, null_ids = (None, [], (), []) if emphasis is None else parse_emphasis(
        emphasis, tokenizer=tokenizer, doc=text, doc_ids=doc_ids, head=len(head_ids),
        template=template if template not in (None, "none") else None)
    return PublishSpec(
        name=name,
        namespace=namespace,
        tokens=tokens,
        head_tokens=len(head_ids),
        template=template if template not in (None, "none") else None,
        prefix=prefix,
        standalone=standalone,
        encodings=tuple(dict.fromkeys(encodings)),
        emphasis=emap,
        probes=tuple(tuple(p) for p in probes),
        baseline_heads=qheads,
        baseline_null=tuple(null_ids),
        push=push,
        push_rate=push_rate,
    )


def _parse_encodings(encodings: object) -> list[str]:
    """A publish body's ``encodings``: 1-4 names, each one this origin can encode. Raises InvalidInput."""
    if not isinstance(encodings, list) or not encodings or len(encodings) > 4:
        raise InvalidInput("'encodings' must be a list of 1-4 encoding names")
    for enc in encodings:
        validate_encoding(enc)
        if enc not in ("raw", "zstd"):
            from kdn.kernels import encoding_plan

            encoding_plan(enc, n_layers=1_000)  # raises InvalidInput for an unknown encoding
    return encodings


def _document_tokens(text: object, ids: object, *, tokenizer, vocab_size: int) -> list[int]:
    """The document's tokens: ``text`` tokenized as text (never control ids), or ``tokens`` as given, checked
    against the vocabulary. Raises InvalidInput."""
    if text is not None:
        if not isinstance(text, str):
            raise InvalidInput("'text' must be a string")
        if not text.strip():
            raise InvalidInput("'text' is empty")
        return encode_text(tokenizer, text)
    if not isinstance(ids, list) or not ids:
        raise InvalidInput("'tokens' must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise InvalidInput(f"'tokens' must be integers in [0, {vocab_size})")
    return ids


# ``--raw-copies auto``: a raw copy beside zstd while the store's file system keeps this share, or this many
# bytes, free (a quarter of a small disk; on a large one, 32 GiB of room is room enough, whatever its share).
RAW_MIN_FREE = 0.25
RAW_MIN_FREE_BYTES = 32 << 30
RAW_COPIES = ("auto", "always", "never")


def default_encodings(raw_copies: str, free: tuple[int, int] | None) -> tuple[str, ...]:
    """What a publish that names no encodings stores: ``zstd`` (1.45x smaller: WAN fills and disk tiers),
    and ``raw`` beside it unless told not to, or (``auto``) once the store's disk is filling: ``free`` is its
    (free bytes, total bytes), None for a store with no disk to fill (a bucket); raw is kept while a quarter of
    the disk or 32 GiB is free.

    Why both: which is cheaper to load depends on the link and the receiver. Next to an engine on a fast
    link, raw is a copy and zstd a decode at 0.4-1.5 GB/s a core; across a WAN zstd's fewer bytes win.
    The client chooses per object from its measured link and decode speeds (``KDNClient.choose_encoding``),
    and can only choose what the origin stored.
    """
    if raw_copies not in RAW_COPIES:
        raise InvalidInput(f"raw copies must be one of {', '.join(RAW_COPIES)}, not {raw_copies!r}")
    room = free is None or free[0] >= RAW_MIN_FREE_BYTES or free[0] >= RAW_MIN_FREE * free[1]
    raw = raw_copies == "always" or (raw_copies == "auto" and room)
    return ("zstd", "raw") if raw else ("zstd",)


class Producer:
    """Runs the model over a spec and stores one object per chunk. Blocking: run on the model thread."""

    def __init__(self, loaded, store: ObjectStore, origin_id: str) -> None:
        import transformers

        self.loaded = loaded
        self.store = store
        self.origin_id = origin_id
        self.engine = f"transformers {transformers.__version__}"  # named on every record it writes
        self.basis: Basis | None = None  # the model's kvtc basis (kdn.kernels.transform.Basis), if the origin has one
        from kdn.adapters.hf.kvtc_rate import RateSettings

        self.rate = RateSettings()  # kvtc-auto's per-object rate control (kdn.adapters.hf.kvtc_rate)

    @property
    def chunk_tokens(self) -> int:
        return self.loaded.chunk_tokens

    def plan(self, spec: PublishSpec) -> Plan:
        mid, c = self.loaded.model_id, self.chunk_tokens
        spans = A.chunk_spans(len(spec.tokens), c)
        addrs = A.prefix_addresses(mid, spec.namespace, spec.tokens, c) if spec.prefix else []
        alone = A.standalone_addresses(mid, spec.namespace, spec.tokens, c) if spec.standalone else []
        return Plan(spans, addrs, alone)

    def _stored(self, address: Address, spec: PublishSpec) -> bool:
        return all(self.store.has(address, enc) for enc in spec.encodings)

    def produce(self, spec: PublishSpec, plan: Plan) -> Iterator[Step]:
        """Yield one Step per chunk (prefix chain first, then standalone chunks)."""
        if spec.prefix:
            yield from self._prefix_chain(spec, plan)
        auto = self._auto(spec) if spec.standalone else None
        for i, (s, e) in enumerate(plan.spans if spec.standalone else []):
            addr = plan.standalone[i]
            computed = False
            if not self._stored(addr, spec):
                from kdn.adapters.hf import standalone_chunk

                state = standalone_chunk(self.loaded.model, spec.tokens[s:e])
                self._store(addr, spec, state.kind, s, e, 0, None, state.tensors, auto, alone=True)
                computed = True
            yield Step([self._record(addr, spec, self._kind(), s, e, None, standalone=True)], computed)

    def _prefix_chain(self, spec: PublishSpec, plan: Plan) -> Iterator[Step]:
        have = [self._stored(a, spec) for a in plan.addresses]
        first_missing = have.index(False) if False in have else len(have)
        if first_missing < len(have) and not any(e in LOSSLESS_PREFERENCE for e in spec.encodings):
            first_missing = 0  # nothing lossless to resume from: recompute (stored blobs are kept as they are)
        kind = self._kind()
        for i in range(first_missing):  # already stored: records only, no model
            s, e = plan.spans[i]
            yield Step([self._record(plan.addresses[i], spec, kind, s, e, self._parent(plan, i))], False)
        if first_missing == len(have):
            return
        from kdn.adapters.hf import extract_chunks

        cache, cached = self._resume_cache(spec, plan, first_missing)
        auto = self._auto(spec)
        if auto is not None:
            auto.resume(cache)
        start = plan.spans[first_missing][0]
        for state in extract_chunks(self.loaded.model, spec.tokens[start:], chunk_tokens=self.chunk_tokens,
                                    start_position=start, cache=cache, cached_tokens=cached):
            i = first_missing + state.index
            s, e = plan.spans[i]
            addr, parent = plan.addresses[i], self._parent(plan, i)
            if not have[i]:  # never rewrite a stored blob: edges may hold it under its digest
                self._store(addr, spec, state.kind, s, e, s, parent, state.tensors, auto)
            if auto is not None:
                auto.advance(state.tensors)
            yield Step([self._record(addr, spec, state.kind, s, e, parent)], True)

    def _resume_cache(self, spec: PublishSpec, plan: Plan, n: int):
        """A cache rebuilt from the first ``n`` stored chunks, so they are not recomputed.

        Only from a lossless encoding: resuming from lossy states would make every later chunk inexact.
        """
        if n == 0:
            return None, 0
        from kdn.adapters.hf import build_cache
        from kdn.format.objects import decode_object, to_torch

        enc = next(e for e in spec.encodings if e in LOSSLESS_PREFERENCE)
        chunks = []
        for a in plan.addresses[:n]:
            got = self.store.get(a, enc)
            if got is None:  # dropped since the plan saw it (a collection, or its bytes failed their digest)
                raise KDNError(f"stored chunk {a[:16]} ({enc}) went missing while the publish resumed from it: "
                               "publish again to compute it")
            blob, info = got
            chunks.append(to_torch(decode_object(blob, expected_digest=info.digest)))
        cache, cached = build_cache(self.loaded.model, chunks)
        assert cached == plan.spans[n - 1][1], (cached, plan.spans[n - 1])
        return cache, cached

    def derive_emphasis(self, spec: PublishSpec) -> EmphasisMap | None:
        """``spec.emphasis`` with the spans the model attends to under ``spec.probes`` added (model thread).

        One forward over the published tokens and each probe; the probe's last token's attention, summed
        over the map's heads (default: ``kdn.adapters.hf.steer.default_heads``), picks the region's top
        positions (``kdn.adapters.hf.steer.derive_emphasis``).
        With ``spec.baseline_heads``, the map's ``baseline``: one more forward, the content-free question's
        (``kdn.adapters.hf.question_map.baseline_of``).
        """
        emap = spec.emphasis
        if emap is None or not (spec.probes or spec.baseline_heads):
            return emap
        spans, baseline = emap.spans, None
        if spec.probes:
            from kdn.adapters.hf.steer import derive_emphasis

            derived = derive_emphasis(self.loaded.model, spec.tokens, emap.region, spec.probes,
                                      heads=list(emap.heads) or None, alpha=emap.alpha)
            spans = merge_spans([*emap.spans, *derived.spans], *emap.region)
        if spec.baseline_heads:
            from kdn.adapters.hf.question_map import baseline_of

            baseline = baseline_of(self.loaded.model, self.loaded.tokenizer, spec.tokens, emap.region,
                                   spec.baseline_heads, spec.baseline_null)
        return EmphasisMap(spans=spans, region=emap.region, alpha=emap.alpha, heads=emap.heads,
                           default_on=emap.default_on, source=emap.source, baseline=baseline)

    def _auto(self, spec: PublishSpec):
        """This publish's ``kvtc-auto`` rate control (``kdn.adapters.hf.kvtc_rate.Publication``), if it asks for it."""
        if KVTC_AUTO not in spec.encodings:
            return None
        from kdn.adapters.hf.kvtc_rate import Publication

        return Publication(self.loaded.model, self.basis, self.rate, spec.tokens)

    def _kind(self) -> str:
        from kdn.adapters.hf.extract import kind_of, layer_layout

        return kind_of(layer_layout(self.loaded.model))

    @staticmethod
    def _parent(plan: Plan, i: int) -> Address | None:
        return plan.addresses[i - 1] if i > 0 else None

    def _store(self, addr: Address, spec: PublishSpec, kind: str, s: int, e: int, position: int,
               parent: Address | None, tensors, auto=None, *, alone: bool = False) -> None:
        from kdn.kernels import encode_as
        from kdn.format.objects import from_torch

        raw = from_torch(tensors)
        for enc in spec.encodings:
            if self.store.has(addr, enc):
                continue
            fields = dict(kind=kind, address=addr, model_id=self.loaded.model_id, namespace=spec.namespace, start=s,
                          end=e, position=position, parent=parent)
            if enc == KVTC_AUTO:  # the rate control probes the model, so it needs this publish's context
                blob = auto.encode(tensors, alone=alone, **fields)
            else:
                blob = encode_as(enc, n_layers=self.loaded.model.config.num_hidden_layers,
                                 tensors=tensors if kvtc_bits(enc) else raw, basis=self.basis, **fields)
            self.store.put(addr, enc, blob)

    def _record(self, addr: Address, spec: PublishSpec, kind: str, s: int, e: int, parent: Address | None, *,
                standalone: bool = False) -> ObjectRecord:
        encs = {}
        for enc in spec.encodings:
            info = self.store.info(addr, enc)
            assert info is not None, f"{addr}.{enc} must be stored before its record is written"
            encs[enc] = info.encoding(enc)
        return ObjectRecord(address=addr, model_id=self.loaded.model_id, namespace=spec.namespace, kind=kind,
                            start=s, end=e, parent=parent, standalone=standalone, encodings=encs,
                            origin=self.origin_id, engine=self.engine)


class VllmProducer(Producer):
    """Computes with vLLM (``kdn.adapters.vllm.produce``); stores and records like the transformers one.

    The engine's connector writes each chunk's blob into the store folder
    during the prefill; afterwards the blobs are indexed here and recorded in
    order, so the effects stay ordered as the module docstring says (blob,
    then record, then manifest).
    """

    def __init__(self, loaded, store: ObjectStore, origin_id: str, engine) -> None:
        super().__init__(loaded, store, origin_id)
        self.vllm = engine
        self.engine = engine.engine_name()

    def derive_emphasis(self, spec: PublishSpec) -> EmphasisMap | None:
        if spec.probes or spec.baseline_heads:
            raise InvalidInput("emphasis probes and question_heads are run by an origin with --engine hf")
        return spec.emphasis

    def produce(self, spec: PublishSpec, plan: Plan) -> Iterator[Step]:
        if spec.standalone:
            raise InvalidInput("standalone chunks are computed by an origin with --engine hf")
        yield from self._prefix_chain(spec, plan)

    def _prefix_chain(self, spec: PublishSpec, plan: Plan) -> Iterator[Step]:
        have = [self._stored(a, spec) for a in plan.addresses]
        if not all(have):
            self.vllm.compute(spec.tokens, spec.namespace, spec.encodings)
            for a in plan.addresses:
                for enc in spec.encodings:
                    if not self.store.has(a, enc):
                        self.store.adopt(a, enc)
        kind = self._kind()
        for i, (s, e) in enumerate(plan.spans):
            addr = plan.addresses[i]
            if not self._stored(addr, spec):
                raise KDNError(f"vLLM did not store chunk {i} [{s}, {e}) of {spec.namespace}/{spec.name}; "
                               "the origin's log says why")
            yield Step([self._record(addr, spec, kind, s, e, self._parent(plan, i))], not have[i])
