"""Non-prefix reuse for HF Llama-family models: compose standalone chunks in any order, blend, generate.

    async with KDNClient(edges=["http://127.0.0.1:8100"]) as client:
        out = await generate_rag(model, tokenizer, "What is the hotel limit?", [doc_a, doc_b], client)
        print(out.text, out.report.line())

The context is ``[head][chunk 1]..[chunk k][query]``. Each document chunk's KV
was computed on its own at positions ``0..n-1`` (the origin publishes them with
``"standalone": true``); ``head`` (system prompt / chat-template opening) and
``query`` are computed fresh. They are blended by ``kdn.adapters.hf.blend.blend_prefill`` (CacheBlend: the
reused tokens whose states deviate most are recomputed), and the answer generated
from the blended cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.format import address as A
from kdn.emphasis import EmphasisMap, merge_spans
from kdn.errors import DigestMismatch, InvalidInput, SourceError
from kdn.template import chat_frame, encode_frame, encode_text

from kdn.adapters.hf.blend import SELECTIONS, Blend, Segment, blend_cache, blend_prefill, check_model
from kdn.adapters.hf.extract import standalone_chunk
from kdn.adapters.hf.generate import _pick, decode_loop, model_id
from kdn.adapters.hf.steer import Steer, plan, steering

# The blend moved to kdn.adapters.hf.blend; these names are still imported from here.
from kdn.adapters.hf.blend import chunk_start_tokens as chunk_start_tokens
from kdn.adapters.hf.blend import full_prefill as full_prefill
from kdn.adapters.hf.blend import kv_share as kv_share

# --- generate_rag: fetch standalone chunks from the KDN, blend, generate -------------------------------


@dataclass
class RagReport:
    tokens_total: int = 0
    tokens_reused: int = 0  # document tokens whose KV was loaded (fetched or computed alone here)
    tokens_recomputed: int = 0  # of those, recomputed in the deep layers
    recompute_share: float = 0.0  # of the reused tokens' layer work, recomputed (check layers included)
    chunks_fetched: int = 0
    chunks_computed: int = 0  # not in the KDN: computed locally, alone
    missing: list[A.Address] = field(default_factory=list)  # addresses the KDN could not serve
    sources: dict[str, int] = field(default_factory=dict)
    encodings: dict[str, int] = field(default_factory=dict)  # chunks fetched per encoding (the client's pick)
    fetch_ms: float = 0.0  # lookup-free fetch, verify and decode of every chunk, to the last one decoded
    compute_ms: float = 0.0  # local fallback
    blend_ms: float = 0.0
    ttft_ms: float = 0.0
    new_tokens: int = 0

    def line(self) -> str:
        src = ", ".join(f"{k} x{v}" for k, v in sorted(self.sources.items())) or "none"
        return (f"reused {self.tokens_reused}/{self.tokens_total} tokens ({self.chunks_fetched} chunks fetched "
                f"from {src}, {self.chunks_computed} computed here), recomputed {self.tokens_recomputed} "
                f"({self.recompute_share * 100:.1f}% of their layer work); "
                f"fetch {self.fetch_ms:.1f} ms, local {self.compute_ms:.1f} ms, blend {self.blend_ms:.1f} ms; "
                f"first token after {self.ttft_ms:.1f} ms")


@dataclass
class RagGeneration:
    ids: list[int]
    text: str
    report: RagReport
    first_logits: torch.Tensor  # [vocab]
    blend: Blend = field(repr=False)


def rag_frame(tokenizer: Any, query: str, system: str | None) -> tuple[str, str]:
    """Text before the documents and after them (the query), from the chat template if there is one."""
    if getattr(tokenizer, "chat_template", None):
        head, tail = chat_frame(tokenizer, system)
        return head, f"\n\n{query}{tail}"
    return (f"{system}\n\n" if system else ""), f"\n\n{query}\n"


async def fetch_chunks(client: Any, mid: A.ModelId, namespace: str, addrs: Sequence[A.Address], device: Any,
                        report: RagReport) -> list[dict | None]:
    """Each address's tensors, or ``None`` where the KDN cannot serve it (a miss is a recompute).

    A pipeline per chunk: each is decoded off the event loop as soon as it has arrived and been
    verified, while the others are still on the wire. ``report.fetch_ms`` runs to the last decode.
    """
    from kdn.format.objects import decode_object, to_torch

    if client is None:
        report.missing.extend(addrs)
        return [None] * len(addrs)

    def decode(a: A.Address, blob: bytes, cap: int | None) -> dict:
        obj = decode_object(blob, max_decoded=cap)
        h = obj.header
        if h.address != a or h.model_id != mid or h.namespace != namespace or h.position != 0:
            raise DigestMismatch(f"object {a[:16]}... is not the standalone chunk of this model/namespace")
        return to_torch(obj, device=device)

    async def one(a: A.Address) -> tuple[Any, dict] | None:
        try:
            f = await client.fetch(a)
        except SourceError:
            return None
        cap = await client.prepare(f)  # a kvtc object: its basis, fetched once, and its decode limit
        return f, await asyncio.to_thread(decode, a, f.blob, cap)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(a) for a in addrs), return_exceptions=True)  # every chunk settles first
    report.fetch_ms = (time.perf_counter() - t0) * 1e3
    failed = next((g for g in got if isinstance(g, BaseException)), None)
    if failed is not None:
        raise failed
    out: list[dict | None] = []
    for a, g in zip(addrs, got):
        assert not isinstance(g, BaseException)
        if g is None:
            report.missing.append(a)
            out.append(None)
            continue
        f, tensors = g
        out.append(tensors)
        report.chunks_fetched += 1
        report.sources[f.source] = report.sources.get(f.source, 0) + 1
        report.encodings[f.encoding] = report.encodings.get(f.encoding, 0) + 1
    return out


async def generate_rag(model: Any, tokenizer: Any, query: str, documents: Sequence[str], client: Any, *,
                       namespace: str = "public", recompute_ratio: float = 0.15, system: str | None = None,
                       max_new_tokens: int = 32, chunk_tokens: int = A.DEFAULT_CHUNK_TOKENS,
                       check_layer: int = 1, selection: str = "deviation-query",
                       emphasis: Sequence[EmphasisMap | dict | None] | None = None,
                       steer: bool | None = None, steer_alpha: float | None = None,
                       steer_heads: list[tuple[int, int]] | None = None) -> RagGeneration:
    """Answer ``query`` over ``documents`` (in this order) reusing their standalone chunks from the KDN.

    ``client`` is a ``kdn.client.KDNClient`` (or ``None``: compute every chunk
    here). Each document is tokenized as the origin does, cut into chunks of
    ``chunk_tokens``, and each chunk fetched by its standalone address; a
    chunk the KDN does not have is computed locally, alone, and reported.
    ``recompute_ratio``, ``check_layer`` and ``selection`` are ``blend_prefill``'s.
    From a script: ``SyncKDNClient.run(generate_rag(..., sync_client.aclient))``.

    ``emphasis``: one map (or None) per document, from each document's manifest (published without a
    template, so its region starts at the document's first token); with ``steer=True``, or a map that
    says ``default_on``, the query and the answer attend to them (``kdn.adapters.hf.steer``).
    """
    t_start = time.perf_counter()
    check_model(model)
    if selection not in SELECTIONS:
        raise InvalidInput(f"selection must be one of {list(SELECTIONS)}, got {selection!r}")
    if not documents:
        raise InvalidInput("generate_rag needs at least one document")
    mid = model_id(model, tokenizer)
    head_text, tail_text = rag_frame(tokenizer, query, system)
    head, tail = encode_frame(tokenizer, head_text), encode_frame(tokenizer, tail_text)
    pieces: list[list[int]] = []
    for d in documents:
        toks = encode_text(tokenizer, d)
        if not toks:
            raise InvalidInput("an empty document")
        pieces += [toks[s:e] for s, e in A.chunk_spans(len(toks), chunk_tokens)]
    addrs = [A.standalone_address(mid, namespace, p) for p in pieces]
    st = _rag_plan(model, tokenizer, head, documents, emphasis, steer, steer_alpha, steer_heads)
    report = RagReport()
    device = next(model.parameters()).device
    states = await fetch_chunks(client, mid, namespace, addrs, device, report)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, _run, model, tokenizer, head, pieces, states, tail, report,
                                      recompute_ratio, check_layer, selection, max_new_tokens, t_start, st)


def compose_emphasis(maps: Sequence[EmphasisMap | None], starts: Sequence[int], lengths: Sequence[int]) -> EmphasisMap | None:
    """One map for documents placed at ``starts`` (their lengths given): each map's region moved to its
    document's start, the spans united; the region runs from the first document to the last. Alpha, heads
    and default_on come from the first map that has any (None when no document has a map)."""
    first = next((m for m in maps if m is not None), None)
    if first is None:
        return None
    spans: list[tuple[int, int]] = []
    for m, s0 in zip(maps, starts):
        if m is not None:
            spans += m.shifted(s0 - m.region[0]).spans
    region = (starts[0], starts[-1] + lengths[-1])
    return EmphasisMap(spans=merge_spans(spans, *region), region=region, alpha=first.alpha, heads=first.heads,
                       default_on=any(m is not None and m.default_on for m in maps), source=first.source)


def _rag_plan(model, tokenizer, head, documents, emphasis, steer, alpha, heads) -> Steer | None:
    if emphasis is None:
        if steer:
            raise InvalidInput("steer=True needs the documents' emphasis maps")
        return None
    if len(emphasis) != len(documents):
        raise InvalidInput(f"{len(emphasis)} emphasis maps for {len(documents)} documents")
    maps = [m if m is None or isinstance(m, EmphasisMap) else EmphasisMap.from_dict(m) for m in emphasis]
    lengths = [len(encode_text(tokenizer, d)) for d in documents]
    starts = [len(head) + sum(lengths[:i]) for i in range(len(documents))]
    for m, n in zip(maps, lengths):
        if m is not None and m.region[1] - m.region[0] != n:
            raise InvalidInput(f"an emphasis map covers {m.region[1] - m.region[0]} tokens, its document {n}")
    emap = compose_emphasis(maps, starts, lengths)
    if emap is None or not (steer if steer is not None else emap.default_on):
        return None
    return plan(model, emap, alpha=alpha, heads=heads)


def _run(model, tokenizer, head, pieces, states, tail, report, ratio, check_layer, selection, max_new_tokens,
         t_start, st=None):
    t0 = time.perf_counter()
    for j, state in enumerate(states):
        if state is None:
            states[j] = standalone_chunk(model, pieces[j]).tensors
            report.chunks_computed += 1
    report.compute_ms = (time.perf_counter() - t0) * 1e3
    segments = ([Segment(head)] if head else []) + [Segment(p, kv) for p, kv in zip(pieces, states)] + [Segment(tail)]
    t0 = time.perf_counter()
    b = blend_prefill(model, segments, recompute_ratio=ratio, check_layer=check_layer, selection=selection, steer=st)
    report.blend_ms = (time.perf_counter() - t0) * 1e3
    report.tokens_total, report.tokens_reused = b.n_tokens, b.n_reused
    report.tokens_recomputed = int(b.recomputed.numel())
    report.recompute_share = b.recompute_share
    first_logits = b.logits[-1].float()
    nxt = _pick(first_logits, False, 1.0)
    report.ttft_ms = (time.perf_counter() - t_start) * 1e3
    eos = getattr(tokenizer, "eos_token_id", None)
    with torch.inference_mode(), steering(model, st):
        cache = blend_cache(model, b) if max_new_tokens > 1 else None
        out = decode_loop(model, cache, nxt, b.n_tokens, max_new_tokens, eos)
    report.new_tokens = len(out)
    text = tokenizer.decode(out, skip_special_tokens=True)
    return RagGeneration(ids=out, text=text, report=report, first_logits=first_logits, blend=b)
