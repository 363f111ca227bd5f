"""Reuse across edited text (opt-in, approximate): read a new version of a document from its old version's states.

    async with KDNClient(edges=["http://127.0.0.1:8100"]) as client:
        old = await client.manifest("public", "harbor-policy")      # the version the KDN holds
        out = await generate_edited(model, tokenizer, old, new_text, "What is the hotel limit?", client)
        print(out.text, out.report.line())

An edit changes the prefix address of every chunk after it, so exact reuse (``agenerate``) stops at the
chunk that holds the edit. When the old version is still published, most of the new version's tokens
are the old ones, moved by the edit. This module:

1. aligns the old and new token ids (``align``: the common prefix and suffix, and ``difflib``'s matching
   blocks in between, runs of at least ``min_run`` tokens; the work is bounded by ``MAX_ALIGN_TOKENS``);
2. loads the new version's tokens before the first change exactly: their states are the old ones at the
   same positions (the chunks wholly before the edit are those of the new chain, the same addresses; the
   tokens of the edited chunk before the edit are sliced from the old one: a causal model's state of a
   token depends on the tokens before it only);
3. reuses every later matching run approximately: the old chunks' K/V of those tokens, sliced by token,
   keys RoPE-shifted by (new position - old position) (``Segment.at``, ``kdn.kernels.blend.compose``);
   they were computed after the old text, so they carry the old version's context;
4. computes the changed tokens and the query fresh, and blends (``blend_prefill``, CacheBlend: the
   ``recompute_ratio`` of the approximately reused tokens whose check-layer K/V deviate most run again
   in the deeper layers). The exact prefix is never checked nor recomputed.

``recompute_ratio=1`` recomputes every token (the exact prefix too): bit for bit ``full_prefill`` of the
new version and the query. Exact reuse stays the default everywhere else; nothing calls this unless asked.
Only for the blend families (``llama``, ``qwen2``, full attention).
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.format import address as A
from kdn.errors import DigestMismatch, InvalidInput, ModelMismatch, SourceError
from kdn.registry.records import Manifest
from kdn.template import encode_text

from kdn.adapters.hf.generate import _pick, decode_loop, model_id, prompt_tokens
from kdn.adapters.hf.blend import SELECTIONS, Blend, Segment, blend_cache, blend_prefill, check_model

DEFAULT_MIN_RUN = 16  # a shorter matching run is computed fresh: its states carry too much of the old context
MAX_ALIGN_TOKENS = 16384  # old + new tokens between the common prefix and suffix that difflib is run over


@dataclass(frozen=True)
class Match:
    """``size`` tokens that are the same in both versions: old ``[old, old + size)`` = new ``[new, new + size)``."""

    old: int
    new: int
    size: int


def align(old: Sequence[int], new: Sequence[int], *, min_run: int = DEFAULT_MIN_RUN,
          max_tokens: int = MAX_ALIGN_TOKENS) -> list[Match]:
    """The runs of ``new`` that are runs of ``old``, in order (both ascending, disjoint).

    The common prefix (any length) and suffix come first; between them, ``difflib.SequenceMatcher``'s
    matching blocks (no junk heuristic) of at least ``min_run`` tokens, only while the two middles hold
    at most ``max_tokens`` tokens together (a rewrite of the whole text is not an edit: prefix and suffix
    only). A suffix shorter than ``min_run`` is left out too.
    """
    if min_run < 1:
        raise InvalidInput(f"min_run must be >= 1, got {min_run}")
    old, new = list(old), list(new)
    n = min(len(old), len(new))
    p = 0
    while p < n and old[p] == new[p]:
        p += 1
    s = 0
    while s < n - p and old[-1 - s] == new[-1 - s]:
        s += 1
    out = [Match(0, 0, p)] if p else []
    om, nm = old[p:len(old) - s], new[p:len(new) - s]
    if om and nm and len(om) + len(nm) <= max_tokens:
        sm = difflib.SequenceMatcher(None, om, nm, autojunk=False)
        out += [Match(p + b.a, p + b.b, b.size) for b in sm.get_matching_blocks() if b.size >= min_run]
    if s >= min_run:
        out.append(Match(len(old) - s, len(new) - s, s))
    return out


@dataclass
class EditPlan:
    """What a reader of ``new`` can take from ``old``'s prefix chain (chunks of ``chunk_tokens``)."""

    old: list[int]
    new: list[int]
    chunk_tokens: int
    matches: list[Match]  # from ``align``; the first is the exact prefix when the versions share one

    @property
    def exact(self) -> int:
        """New tokens ``[0, exact)``: the same as the old ones, their states exact."""
        m = self.matches[0] if self.matches else None
        return m.size if m is not None and m.old == 0 and m.new == 0 else 0

    @property
    def approx(self) -> int:
        """New tokens reused at another position (approximately)."""
        return sum(m.size for m in self.matches) - self.exact

    @property
    def chunks(self) -> list[int]:
        """Indices of the old chain's chunks that hold any token reused."""
        C = self.chunk_tokens
        return sorted({j for m in self.matches for j in range(m.old // C, (m.old + m.size - 1) // C + 1)})


def plan_edit(old: Sequence[int], new: Sequence[int], chunk_tokens: int = A.DEFAULT_CHUNK_TOKENS, *,
              min_run: int = DEFAULT_MIN_RUN) -> EditPlan:
    """Align ``old`` (the tokens of a published prefix chain) with ``new``; see ``align``."""
    if chunk_tokens < 1:
        raise InvalidInput(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not old or not new:
        raise InvalidInput("both versions need at least one token")
    return EditPlan(list(old), list(new), chunk_tokens, align(old, new, min_run=min_run))


def edit_segments(plan: EditPlan, states: Mapping[int, Mapping[str, torch.Tensor] | None],
                  tail: Sequence[int] = ()) -> list[Segment]:
    """The new version as segments: reused runs cut at old chunk boundaries (each a token slice of its chunk's
    states, ``at`` its old position; ``exact`` within the common prefix), fresh segments between them, then
    ``tail`` (fresh). A run whose chunk has no states (``states[j]`` missing or None) is computed fresh."""
    C, new = plan.chunk_tokens, plan.new
    segs: list[Segment] = []

    def fresh(a: int, b: int) -> None:
        if b <= a:
            return
        if segs and segs[-1].kv is None:  # one fresh segment for consecutive fresh tokens
            segs[-1] = Segment(list(segs[-1].ids) + new[a:b])
        else:
            segs.append(Segment(new[a:b]))

    pos, exact = 0, plan.exact
    for m in plan.matches:
        fresh(pos, m.new)
        o, e = m.old, m.old + m.size
        while o < e:
            j = o // C
            b = min(e, (j + 1) * C)
            st = states.get(j)
            nn = m.new + (o - m.old)
            if st is None:
                fresh(nn, nn + b - o)
            else:
                kv = {k: t[:, o - j * C:b - j * C] for k, t in st.items()}  # [H, n, D] slices
                segs.append(Segment(new[nn:nn + b - o], kv, at=o, exact=nn + (b - o) <= exact))
            o = b
        pos = m.new + m.size
    fresh(pos, len(new))
    if tail:
        segs.append(Segment(list(tail)))
    return segs


@dataclass
class EditReport:
    tokens_total: int = 0  # the context: the new version and the tail (the query)
    tokens_exact: int = 0  # loaded as published: the unchanged prefix
    tokens_approx: int = 0  # reused from the old version at a shifted position
    tokens_computed: int = 0  # computed fresh: changed or unmatched tokens, and the tail
    tokens_recomputed: int = 0  # of the reused tokens, recomputed in the deep layers (all of them at ratio 1)
    recompute_share: float = 0.0  # of the approximately reused tokens' layer work, check layers included
    runs: int = 0  # matching runs used (the exact prefix counted)
    chunks_fetched: int = 0
    missing: list[A.Address] = field(default_factory=list)  # old chunks the KDN could not serve (computed)
    sources: dict[str, int] = field(default_factory=dict)
    align_ms: float = 0.0
    fetch_ms: float = 0.0
    blend_ms: float = 0.0
    ttft_ms: float = 0.0
    new_tokens: int = 0

    def line(self) -> str:
        src = ", ".join(f"{k} x{v}" for k, v in sorted(self.sources.items())) or "none"
        return (f"{self.tokens_total} tokens: {self.tokens_exact} exact, {self.tokens_approx} reused approximately "
                f"({self.runs} runs, {self.chunks_fetched} chunks from {src}, {len(self.missing)} missing), "
                f"{self.tokens_computed} computed; recomputed {self.tokens_recomputed} "
                f"({self.recompute_share * 100:.1f}% of the reused tokens' layer work); align {self.align_ms:.1f} ms, "
                f"fetch {self.fetch_ms:.1f} ms, blend {self.blend_ms:.1f} ms; first token after {self.ttft_ms:.1f} ms")


def edit_blend(model: Any, plan: EditPlan, states: Mapping[int, Mapping[str, torch.Tensor] | None],
               tail: Sequence[int], *, recompute_ratio: float = 0.15, check_layer: int = 1,
               selection: str = "deviation-query", n_logits: int = 1,
               report: EditReport | None = None) -> tuple[Blend, EditReport]:
    """Prefill the new version and ``tail`` from the old chain's chunk states (``states``: chunk index ->
    its tensors, as published: ``L{i}.k`` / ``L{i}.v`` ``[H, n, D]`` at the chunk's own positions)."""
    if not tail or n_logits > len(tail):
        raise InvalidInput(f"the tail (the query) must hold the last {n_logits} tokens")
    report = report if report is not None else EditReport()
    segs = edit_segments(plan, states, tail)
    t0 = time.perf_counter()
    b = blend_prefill(model, segs, recompute_ratio=recompute_ratio, check_layer=check_layer, selection=selection,
                      n_logits=n_logits)
    report.blend_ms = (time.perf_counter() - t0) * 1e3
    report.tokens_total = b.n_tokens
    report.tokens_exact, report.tokens_approx = b.n_exact, b.n_reused
    report.tokens_computed = b.n_tokens - b.n_exact - b.n_reused
    report.tokens_recomputed = int(b.recomputed.numel())
    report.recompute_share = b.recompute_share
    report.runs = len(plan.matches)
    return b, report


def read_manifest(manifest: Manifest | Mapping[str, Any]) -> Manifest:
    """``manifest`` as ``KDNClient.manifest`` returns it; a map of one (JSON, a file) is read into one here,
    ``InvalidInput`` for a map that is not a manifest."""
    if isinstance(manifest, Manifest):
        return manifest
    try:
        return Manifest.from_dict(dict(manifest))
    except (InvalidInput, TypeError, ValueError) as e:
        raise InvalidInput(f"not a manifest: {e}") from None


def _manifest_chain(manifest: Manifest, mid: A.ModelId) -> tuple[list[int], list[A.Address], int, str]:
    old, addrs, C, ns, owner = (list(manifest.prefix_tokens), list(manifest.addresses), manifest.chunk_tokens,
                                manifest.namespace, manifest.model_id)
    if owner != mid:
        raise ModelMismatch(f"the old version's states are of model {str(owner)[:16]}..., not this one ({mid[:16]}...)")
    if not old or len(addrs) != len(A.chunk_spans(len(old), C)):
        raise InvalidInput(f"the manifest names {len(addrs)} chunks for {len(old)} tokens of {C}: no prefix chain")
    return old, addrs, C, ns


async def _fetch_old(client: Any, mid: A.ModelId, ns: str, addrs: Sequence[A.Address], wanted: Sequence[int],
                     C: int, n_old: int, device: Any, report: EditReport) -> dict[int, dict | None]:
    """The old chain's chunks ``wanted``, verified against the chain (address, model, namespace, span)."""
    from kdn.format.objects import decode_object, to_torch

    def decode(j: int, blob: Any, cap: int | None) -> dict:
        obj = decode_object(blob, max_decoded=cap)
        h = obj.header
        end = min((j + 1) * C, n_old)
        if (h.address != addrs[j] or h.model_id != mid or h.namespace != ns or h.position != j * C
                or h.end - h.start != end - j * C):
            raise DigestMismatch(f"object {addrs[j][:16]}... is not chunk {j} of the old version's chain")
        return to_torch(obj, device=device)

    async def one(j: int) -> tuple[Any, dict] | None:
        try:
            f = await client.fetch(addrs[j])
        except SourceError:
            return None
        cap = await client.prepare(f)
        return f, await asyncio.to_thread(decode, j, f.blob, cap)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(j) for j in wanted), return_exceptions=True)
    report.fetch_ms = (time.perf_counter() - t0) * 1e3
    failed = next((g for g in got if isinstance(g, BaseException)), None)
    if failed is not None:
        raise failed
    out: dict[int, dict | None] = {}
    for j, g in zip(wanted, got):
        assert not isinstance(g, BaseException)
        if g is None:
            report.missing.append(addrs[j])
            out[j] = None
            continue
        f, tensors = g
        out[j] = tensors
        report.chunks_fetched += 1
        report.sources[f.source] = report.sources.get(f.source, 0) + 1
    return out


def new_tokens_of(tokenizer: Any, manifest: Manifest, new: str | Sequence[int]) -> list[int]:
    """The new version's tokens as the origin would publish them: ids as given, or the text after the old
    manifest's head (``head_tokens``: the template's opening or prefix text, unchanged by an edit)."""
    if isinstance(new, str):
        head = list(manifest.prefix_tokens[:manifest.head_tokens])
        return head + encode_text(tokenizer, new)
    return [int(t) for t in new]


@dataclass
class EditPrefill:
    blend: Blend = field(repr=False)
    report: EditReport
    ids: list[int]  # the whole context: the new version, then the tail
    first_logits: torch.Tensor  # [vocab], of the last position


async def edit_prefill(model: Any, tokenizer: Any, old_manifest: Manifest | Mapping[str, Any], new: str | Sequence[int],
                       query: str | Sequence[int], client: Any, *, recompute_ratio: float = 0.15,
                       check_layer: int = 1, selection: str = "deviation-query", min_run: int = DEFAULT_MIN_RUN,
                       n_logits: int = 1) -> EditPrefill:
    """Prefill the new version of a document and ``query`` from the old version's published chain.

    ``old_manifest``: the old version's manifest (``KDNClient.manifest``, or its map: ``read_manifest``); ``new``: the new version's text
    (after the manifest's head) or its token ids (head included); ``query``: a question (framed as
    ``prompt_tokens`` frames one for the manifest's template) or the tail's token ids. ``client``: a
    ``KDNClient``; a chunk it cannot serve is computed (``report.missing``). Raises ``ModelMismatch`` for
    another model's manifest, ``InvalidInput`` when the versions share no run of ``min_run`` tokens.
    """
    t_start = time.perf_counter()
    check_model(model)
    if selection not in SELECTIONS:
        raise InvalidInput(f"selection must be one of {list(SELECTIONS)}, got {selection!r}")
    mid = model_id(model, tokenizer)
    man = read_manifest(old_manifest)
    old, addrs, C, ns = _manifest_chain(man, mid)
    new_ids = new_tokens_of(tokenizer, man, new)
    if isinstance(query, str):
        tail = prompt_tokens(tokenizer, {"prefix_tokens": [], "template": man.template}, query)
    else:
        tail = [int(t) for t in query]
    report = EditReport()
    t0 = time.perf_counter()
    plan = plan_edit(old, new_ids, C, min_run=min_run)
    report.align_ms = (time.perf_counter() - t0) * 1e3
    if not plan.matches:
        raise InvalidInput(f"nothing to reuse: the new version ({len(new_ids)} tokens) shares no run of {min_run} "
                           f"tokens with the old one ({len(old)}): prefill it, or publish it")
    device = next(model.parameters()).device
    states = await _fetch_old(client, mid, ns, addrs, plan.chunks, C, len(old), device, report)
    loop = asyncio.get_running_loop()

    def run() -> EditPrefill:
        b, _ = edit_blend(model, plan, states, tail, recompute_ratio=recompute_ratio, check_layer=check_layer,
                          selection=selection, n_logits=n_logits, report=report)
        first = b.logits[-1].float()
        report.ttft_ms = (time.perf_counter() - t_start) * 1e3  # (the first token is this logits' argmax)
        return EditPrefill(blend=b, report=report, ids=new_ids + tail, first_logits=first)

    return await loop.run_in_executor(None, run)


@dataclass
class EditGeneration:
    ids: list[int]  # the new tokens
    text: str
    report: EditReport
    first_logits: torch.Tensor  # [vocab]
    blend: Blend = field(repr=False)


async def generate_edited(model: Any, tokenizer: Any, old_manifest: Manifest | Mapping[str, Any],
                          new: str | Sequence[int],
                          query: str | Sequence[int], client: Any, *, recompute_ratio: float = 0.15,
                          check_layer: int = 1, selection: str = "deviation-query", min_run: int = DEFAULT_MIN_RUN,
                          max_new_tokens: int = 32) -> EditGeneration:
    """Answer ``query`` over the new version of a document, reusing the old version's states (``edit_prefill``),
    greedy. Opt-in and approximate below ``recompute_ratio=1``: ``agenerate`` is the exact path."""
    pre = await edit_prefill(model, tokenizer, old_manifest, new, query, client, recompute_ratio=recompute_ratio,
                             check_layer=check_layer, selection=selection, min_run=min_run)
    b, report = pre.blend, pre.report
    eos = getattr(tokenizer, "eos_token_id", None)

    def run() -> list[int]:
        nxt = _pick(pre.first_logits, False, 1.0)
        with torch.inference_mode():
            cache = blend_cache(model, b) if max_new_tokens > 1 else None
            return decode_loop(model, cache, nxt, b.n_tokens, max_new_tokens, eos)

    out = await asyncio.get_running_loop().run_in_executor(None, run)
    report.new_tokens = len(out)
    text = tokenizer.decode(out, skip_special_tokens=True)
    return EditGeneration(ids=out, text=text, report=report, first_logits=pre.first_logits, blend=b)
