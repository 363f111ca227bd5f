"""The engine side: look up the longest cached prefix, load it, prefill only the rest, generate.

    from kdn.client.sync import SyncKDNClient
    from kdn.adapters.hf import generate, prompt_tokens

    with SyncKDNClient(edges=["http://127.0.0.1:8100"]) as client:
        manifest = client.manifest("public", "harbor-policy")
        ids = prompt_tokens(tokenizer, manifest, "How much is the hotel limit?")
        out = generate(model, tokenizer, ids, client, max_new_tokens=32)
        print(out.text, out.report)

Loading is exact: the cache is built from the objects' tensors as stored (a hybrid model's conv and
recurrent states from its last loaded chunk, the only ones moved: the other chunks' K/V come by verified
range requests, ``CacheBuilder.needs``), and
the remaining tokens run with explicit ``position_ids`` (Bamba needs them), so
the logits equal those of the model continuing from its own cache after the
same chunked prefill. States are only loaded into the model whose ``ModelId``
produced them.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import weakref
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Any

import torch

from kdn.format.address import ModelId
from kdn.wire.arena import Arena, ArenaFull
from kdn.wire.bodyget import Tally
from kdn.emphasis import EmphasisMap
from kdn.errors import DigestMismatch, InvalidInput, ModelMismatch, SourceError
from kdn.planner import cold_deadline, decide
from kdn.registry.records import Manifest
from kdn.template import chat_frame, encode_frame, encode_text

from kdn.adapters.hf.cache import MAX_ROOM, CacheBuilder, continue_from_cache
from kdn.adapters.hf.extract import _forward, kind_of, layer_layout, new_cache
from kdn.adapters.hf.models import model_id_of
from kdn.adapters.hf.plan import (Believed, await_load, believe, chunks_of, cold_fills_of, cold_given_up,
                                  kv_bytes_per_token, speeds_of, start_probe)
from kdn.adapters.hf.question_map import QuestionSteer, Retrieval, asked
from kdn.adapters.hf.steer import Steer, resolve, steering

_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Report:
    tokens_total: int = 0
    tokens_reused: int = 0
    chunks_reused: int = 0
    lookup_ms: float = 0.0
    fetch_ms: float = 0.0
    decode_ms: float = 0.0  # decoding left after the last byte arrived, plus finishing the cache
    prefill_ms: float = 0.0  # the tokens not reused
    ttft_ms: float = 0.0  # from the call to the first generated token
    new_tokens: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    plan: str = ""  # what the load planner chose and why ("" when it did not run), and how the load ended
    arena_full: int = 0  # loads the host arena refused memory (kdn.wire.arena): what they could not load was computed
    bytes_moved: int = 0  # body bytes from the sources (not the host tier); a hybrid's chunks but the last: K/V

    def line(self) -> str:
        src = ", ".join(f"{k} x{v}" for k, v in sorted(self.sources.items())) or "none"
        return (f"reused {self.tokens_reused}/{self.tokens_total} tokens ({self.chunks_reused} chunks from {src}); "
                f"lookup {self.lookup_ms:.1f} ms, fetch {self.fetch_ms:.1f} ms, decode {self.decode_ms:.1f} ms, "
                f"prefill {self.prefill_ms:.1f} ms; first token after {self.ttft_ms:.1f} ms"
                + (f"; plan: {self.plan}" if self.plan else ""))


@dataclass
class Generation:
    ids: list[int]  # the new tokens
    text: str
    report: Report
    first_logits: torch.Tensor  # logits of the prompt's last position [vocab]


_ARENA: list[Arena] = []
DEFAULT_ARENA_BYTES = 4 << 30
ROOM_FOR_NEW_TOKENS = 1024  # generated tokens a load reserves room for (past them, the cache concatenates)


def default_arena() -> Arena:
    """This process's loading arena (``kdn.wire.arena``; page-locked on a CUDA host), made at first use:
    ``$KDN_ARENA`` bytes (e.g. ``8GiB``), default 4 GiB. It holds what its largest load used, not its budget."""
    if not _ARENA:
        import os

        from kdn.kernels.pinned import host_arena
        from kdn.units import parse_size

        _ARENA.append(host_arena(parse_size(os.environ.get("KDN_ARENA") or DEFAULT_ARENA_BYTES)))
    return _ARENA[0]


def model_id(model: Any, tokenizer: Any) -> ModelId:
    """The ModelId of a loaded model, computed once per model object (weights are hashed)."""
    mid = _IDS.get(model)
    if mid is None:
        dtype = next(model.parameters()).dtype
        mid = _IDS[model] = model_id_of(model, tokenizer, dtype)
    return mid


def prompt_tokens(tokenizer: Any, manifest: Manifest | Mapping[str, Any], question: str) -> list[int]:
    """A prompt that begins with exactly the tokens a manifest published, then the question. ``manifest``: as
    ``KDNClient.manifest`` returns it, or a map of its ``prefix_tokens`` and ``template`` (a publish's answer).

    For a manifest published with the chat template, the question continues the
    user turn that holds the document, the turn is closed, and the assistant's
    turn opened, as the template renders it. Re-tokenizing the whole text
    instead could merge tokens across the boundary and silently miss the cache.
    """
    if isinstance(manifest, Manifest):
        published, template = list(manifest.prefix_tokens), manifest.template
    else:
        published, template = list(manifest["prefix_tokens"]), manifest.get("template")
    if template == "chat":  # the question as text, the template's close with its control tokens
        return published + encode_text(tokenizer, f"\n\n{question}") + encode_frame(tokenizer, chat_frame(tokenizer)[1])
    return published + encode_text(tokenizer, f"\n\n{question}\n")


async def agenerate(model: Any, tokenizer: Any, prompt: str | list[int], client, *, namespace: str = "public",
                    model_id_: str | None = None, chunk_tokens: int = 256, max_new_tokens: int = 32,
                    do_sample: bool = False, temperature: float = 1.0, eos_token_id: int | None = None,
                    use_cache: bool = True, emphasis: EmphasisMap | dict | None = None,
                    steer: bool | str | None = None, steer_alpha: float | None = None,
                    steer_heads: list[tuple[int, int]] | None = None, steer_retrieval: Retrieval | None = None,
                    arena: Arena | None = None,
                    plan: bool = True, load_deadline: float = 30.0) -> Generation:
    """Generate from ``prompt`` reusing the longest prefix the KDN holds (``use_cache=False``: plain prefill).

    ``arena``: where fetched bodies and the loaded cache's memory come from (default: the client's, else
    ``default_arena()``, one per process). An arena too full for a load is a recompute, never an error
    (``Report.arena_full`` counts it).

    ``plan`` (default on): load only what is faster to load than to compute (``kdn.planner``, on this
    process's measured prefill and load speeds; ``Report.plan`` says what it chose and why); a load that
    runs past its deadline (at most ``load_deadline`` seconds; one the entry edge said it must fill first,
    a multiple of the prefill: ``kdn.planner.cold_deadline``) uses what arrived and computes the rest.
    ``plan=False`` loads whatever the lookup found.

    ``emphasis``: the manifest's emphasis map (``manifest.emphasis``); with ``steer=True``, or with
    ``steer=None`` and a map that says ``default_on``, the question and the generated tokens attend to
    it (``kdn.adapters.hf.steer``; ``steer_alpha`` / ``steer_heads`` override the map's). Off by default.
    ``steer="question"``: the map is made from the question itself, once the document's cache is ready
    (``kdn.adapters.hf.question_map``: ``steer_retrieval`` is the model's calibration, ``emphasis`` names
    the document's region, its spans unused); an unsure map steers nothing (``Report.plan`` says which).
    """
    t_start = time.perf_counter()
    if isinstance(prompt, str):
        ids = encode_text(tokenizer, prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidInput("empty prompt")
    real_id = model_id(model, tokenizer)
    if model_id_ is not None and model_id_ != real_id:
        raise ModelMismatch(f"states of model {model_id_[:16]}... cannot be loaded into this model ({real_id[:16]}...)")
    report = Report(tokens_total=len(ids))
    st: Steer | QuestionSteer | None
    if steer == "question":
        st = asked(emphasis, steer_retrieval, alpha=steer_alpha, heads=steer_heads, n_ids=len(ids))
    elif isinstance(steer, str):
        raise InvalidInput(f"steer is True, False, None or 'question', got {steer[:20]!r}")
    else:
        st = _steer_plan(model, emphasis, steer, steer_alpha, steer_heads, len(ids))
    speeds = speeds_of(model)
    builder, upto = None, None
    if use_cache:
        builder, upto = await _load(model, ids, client, real_id, report, speeds, namespace=namespace,
                                    chunk_tokens=chunk_tokens, plan=plan, load_deadline=load_deadline, arena=arena,
                                    new_tokens=max_new_tokens)
    gen = await asyncio.get_running_loop().run_in_executor(None, _run, model, tokenizer, ids, builder, report,
                                                           max_new_tokens, do_sample, temperature, eos_token_id,
                                                           t_start, st, upto)
    # This engine's prefill speed, for the next plan: the tokens it computed, after those it loaded.
    speeds.observe_prefill(report.tokens_total - report.tokens_reused, report.tokens_reused, report.prefill_ms / 1e3)
    return gen


async def _load(model: Any, ids: list[int], client: Any, real_id: ModelId, report: Report, speeds: Any, *,
                namespace: str, chunk_tokens: int, plan: bool, load_deadline: float,
                arena: Arena | None, new_tokens: int = 0) -> tuple[CacheBuilder | None, int | None]:
    """The longest cached prefix of ``ids`` looked up, what to load of it planned, and that loaded into a
    ``CacheBuilder``: (the builder, or None when nothing is loaded; the chunks of it to use, None for all)."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    hit = await client.lookup(ids, real_id, namespace, chunk_tokens=chunk_tokens)
    report.lookup_ms = (time.perf_counter() - t0) * 1e3
    if hit.tokens >= len(ids) and hit.chunks:
        # Everything is cached, but the next token needs the last position's logits: attention KV
        # is cut back one token after loading; a Mamba state cannot be, so its last chunk is not fetched.
        layout = await loop.run_in_executor(None, layer_layout, model)
        if kind_of(layout) != "kv":
            hit = hit.head(hit.chunks - 1)
    if not hit.tokens:
        return None, None
    whole = await loop.run_in_executor(None, chunks_of, hit, client, model)
    if plan:  # (the planner costs what the host holds at the host's speed)
        whole = await _held_by_host(client, hit, whole)
    kept = await loop.run_in_executor(None, _kept_bytes, hit, whole, client, model)
    took = believe(hit, whole, client)  # (before the fetch: it makes them warm)
    hit, decision = took.hit, None
    if plan:
        hit, decision = _plan_load(hit, _moved(whole, kept, hit.chunks), len(ids), client, speeds, load_deadline,
                                   took, report)
    if not hit.tokens:
        return None, None
    # The rest of the prompt and the tokens to generate are written into room after the loaded prefix, not
    # concatenated onto it (``room.RoomLayer``: one copy of the whole prefix less per step).
    room = min(MAX_ROOM, max(0, len(ids) - hit.tokens) + min(max(0, new_tokens), ROOM_FOR_NEW_TOKENS))
    # Each object is decoded straight into its slice of the cache as it arrives (CacheBuilder); the
    # receive buffers and the cache's memory come from a reused arena (no first-touch page faults).
    pool = arena if arena is not None else (getattr(client, "arena", None) or default_arena())
    builder = await _builder(model, hit, pool, room, report)
    if builder is None:  # the host arena is full: the request computes (kdn.wire.arena's contract)
        return None, None
    return await _fetch_into(model, client, _Loading(hit, _moved(whole, kept, hit.chunks), decision, took, pool,
                                                     builder), real_id, report, speeds)


async def _held_by_host(client: Any, hit: Any, chunks: list) -> list:
    """``chunks`` with those the machine's host tier holds marked (``kdn.chunk.Chunk.host``): the planner costs them at the
    host's own speed, not the link's. No host tier (or one that does not answer at once): unchanged."""
    host = getattr(client, "host", None)
    if host is None or not chunks:
        return chunks
    from kdn.client.hosted import held_of

    got = await held_of(host, hit, client.host_stats, len(chunks))
    return [replace(c, host=True) if i < len(hit.records) and got.pick(i, list(hit.records[i].encodings))
            else c for i, c in enumerate(chunks)]


def _kept_bytes(hit: Any, chunks: list, client: Any, model: Any) -> list[int | None]:
    """Per chunk, about the bytes a load moves when it fetches only the chunk's K/V (a hybrid model's chunks
    but the last, ``CacheBuilder.needs``, where the record has piece digests): the object's K/V share, plus
    a piece for its header and one for rounding; None: the whole object is fetched."""
    layout = layer_layout(model)
    states = sum(math.prod(st.shape) * torch.empty(0, dtype=st.dtype).element_size()
                 for spec in layout for st in spec.states)
    out: list[int | None] = [None] * len(chunks)
    if not states:
        return out
    per_token = kv_bytes_per_token(model)
    for i, (c, rec) in enumerate(zip(chunks, hit.records)):
        e = rec.encodings.get(client.choose_encoding(rec.encodings) or "")
        if e is not None and e.pieces:
            kv = c.tokens * per_token
            out[i] = min(c.size, -(-c.size * kv // (kv + states)) + 2 * e.piece_bytes)
    return out


def _moved(whole: list, kept: list[int | None], k: int) -> list:
    """The planner's chunks when the first ``k`` are loaded: all but the ``k``-th with their K/V only (where
    ``kept`` says so), the ``k``-th whole (its states are the ones used)."""
    return [c if i == k - 1 or n is None else replace(c, size=n) for i, (c, n) in enumerate(zip(whole, kept))]


def _plan_load(hit: Any, chunks: list, n_ids: int, client: Any, speeds: Any, load_deadline: float, took: Believed,
               report: Report) -> tuple[Any, Any]:
    """Load only what is faster to load than to compute (``kdn.planner``, on this engine's measured speeds):
    the lookup cut to what is loaded, and the decision."""
    decision = decide(chunks, n_ids, link=took.link, speeds=speeds, max_deadline_s=load_deadline, probe=took.warm)
    if not took.warm and decision.loads_anything:
        # The entry edge fills these first: its upstream's time is not the client's to estimate, so the bound
        # is what the request can afford, a multiple of its prefill (not the whole cap: a lying edge that
        # said "cold" and stalled cost every request the 30 s).
        decision = replace(decision, deadline_s=cold_deadline(decision.expected_load_s, load_deadline,
                                                              decision.compute_all_s))
    report.plan = decision.reason
    if took.doubted:
        report.plan += (f"; the last cold load from {', '.join(took.doubted)} was given up: its cold loads are "
                        "expected to move as that one did")
    if decision.probe_s:  # computes it all; the link is timed beside this request, not inside it
        start_probe(hit, client, speeds, decision.probe_s)
    if decision.load < hit.chunks:
        hit = hit.head(decision.load)
    return hit, decision


async def _builder(model: Any, hit: Any, pool: Arena, room: int, report: Report) -> CacheBuilder | None:
    """A ``CacheBuilder`` for ``hit`` from ``pool``, with ``room`` after the prefix, else without (the first
    new token then concatenates); None when the arena has no room for even that (counted: the request
    computes, as the arena's contract says, never fails)."""
    loop = asyncio.get_running_loop()
    make = functools.partial(CacheBuilder, model, hit.token_counts(), arena=pool)
    refused: ArenaFull | None = None
    for kw in ({"room": room}, {}) if room else ({},):
        try:
            return await loop.run_in_executor(None, functools.partial(make, **kw))
        except ArenaFull as full:
            refused = full
    report.arena_full += 1
    _say(report, f"nothing loaded, the host arena is full ({refused}): the prompt computed")
    return None


@dataclass
class _Loading:
    """A planned prefix on its way into a builder."""

    hit: Any
    chunks: list
    decision: Any  # the plan (None: plan=False)
    took: Believed
    pool: Arena  # the receive buffers' and the cache's memory
    builder: CacheBuilder
    tally: Tally = field(default_factory=Tally)

    @property
    def nbytes(self) -> int:
        return sum(c.size for c in self.chunks[:self.hit.chunks])


async def _fetch_into(model: Any, client: Any, ld: _Loading, real_id: ModelId, report: Report, speeds: Any
                      ) -> tuple[CacheBuilder | None, int | None]:
    """The planned prefix fetched into its builder, within the plan's deadline: past it (or refused memory by
    a full arena), what arrived is used and the rest computed. (The builder, or None if nothing arrived in
    time; the chunks to use.)"""
    hit, builder, t0 = ld.hit, ld.builder, time.perf_counter()
    fetch = asyncio.ensure_future(client.fetch_prefix(hit, into=builder.add, arena=ld.pool, scatter=builder,
                                                      tally=ld.tally, needs=builder.needs))
    try:
        # Given up before its deadline, too, once its progress shows it would overrun it (a cold load: from
        # its first byte on, the wait for that byte being the edge's fill).
        states = await await_load(fetch, tally=ld.tally, total=ld.nbytes, cold=not ld.took.warm, started=t0,
                                  deadline_s=ld.decision.deadline_s if ld.decision else None)
    except (TimeoutError, ArenaFull, SourceError, DigestMismatch) as stop:
        # (SourceError / DigestMismatch: every source of a chunk failed it, e.g. the host tier and the edge both
        # died mid-load: what arrived before it is used, the rest computed, as at a deadline)
        return await _cut_short(model, client, ld, fetch, stop, time.perf_counter() - t0, report, speeds)
    report.fetch_ms, report.sources, report.bytes_moved = states.fetch_s * 1e3, states.sources, ld.tally.bytes
    report.decode_ms = states.decode_s * 1e3  # decoding runs as objects arrive: what came after
    for obj in states.objects:
        if obj.header.model_id != real_id:
            raise ModelMismatch(f"object {obj.header.address[:16]}... was produced by model "
                                f"{obj.header.model_id[:16]}..., not this one ({real_id[:16]}...)")
    if set(states.sources) == {"host"}:  # wholly from the machine's host tier: its own speed
        speeds.observe_load(ld.nbytes, time.perf_counter() - t0, host=True)
    elif ld.took.warm:  # a load the edge had to fill measures the edge's upstream, not this loader
        # (what crossed the link, where the host gave part of it: the time is the whole load's, a conservative
        # measure of the link)
        speeds.observe_load(ld.tally.bytes if "host" in states.sources else ld.nbytes, time.perf_counter() - t0)
    if ld.took.labelled:  # a source that delivered what it had said was cold is believed again
        for label in states.sources:
            cold_fills_of(client).served(label.split("/", 1)[0])
    return builder, None


async def _cut_short(model: Any, client: Any, ld: _Loading, fetch: asyncio.Future, stop: Exception, took_s: float,
                     report: Report, speeds: Any) -> tuple[CacheBuilder | None, int | None]:
    """A load given up (past its deadline, or its progress said it would be) or refused memory by a full
    arena: what arrived is used and the rest computed; a given-up load teaches what it showed."""
    # What arrived is counted before the fetch is cancelled: a chunk still being added when it is (its receive
    # buffer handed back under it) is not used, and its slots are recomputed.
    arrived = ld.builder.added_prefix()
    fetch.cancel()
    await asyncio.gather(fetch, return_exceptions=True)
    report.bytes_moved = ld.tally.bytes
    if isinstance(stop, ArenaFull):  # the arena's contract: a load that does not fit is a recompute
        report.arena_full += 1
        why = f"was refused memory, the host arena is full ({stop})"
    elif isinstance(stop, SourceError | DigestMismatch):  # no source could deliver a chunk: nothing to learn
        why = f"failed ({type(stop).__name__}: {str(stop)[:160]})"
    else:
        assert ld.decision is not None  # (no deadline without a plan)
        why = str(stop) or f"ran past its {ld.decision.deadline_s * 1e3:.0f} ms deadline"
        if ld.took.warm:  # what did land by then is the link's speed: the next plan knows it turned slow
            speeds.observe_load(ld.tally.bytes, took_s, abandoned=True)
        else:  # a cold one measured the source it waited on, whose "cold" now counts for less
            why += f" (cold, from {cold_given_up(client, ld.hit, ld.chunks, arrived, ld.tally.bytes, took_s)})"
    layout = await asyncio.get_running_loop().run_in_executor(None, layer_layout, model)
    upto = arrived if kind_of(layout) == "kv" else 0
    _say(report, f"the load {why}: {upto} of {ld.hit.chunks} chunks used, the rest computed")
    return (ld.builder if upto else None), upto


def _say(report: Report, what: str) -> None:
    report.plan = f"{report.plan}; {what}" if report.plan else what


def _steer_plan(model, emphasis, steer, alpha, heads, n_ids):
    """The steering plan of a request, or None (off by default; on per request or per manifest)."""
    return resolve(model, emphasis, steer=steer, alpha=alpha, heads=heads, n_ids=n_ids)


def _run(model, tokenizer, ids, builder: CacheBuilder | None, report, max_new_tokens, do_sample, temperature,
         eos_token_id, t_start, st: Steer | QuestionSteer | None = None, upto=None):
    with torch.inference_mode():
        t0 = time.perf_counter()
        n = 0
        cache = None
        if builder is not None:
            cache, n = builder.finish(upto=upto)
            if n >= len(ids):  # attention KV only (agenerate dropped a hybrid's last chunk before fetching)
                cache.crop(len(ids) - 1)
                n = len(ids) - 1
            report.chunks_reused = len(builder.counts) if upto is None else upto
        report.tokens_reused = n
        report.decode_ms += (time.perf_counter() - t0) * 1e3
        if cache is None:
            cache = new_cache(model)
        t0 = time.perf_counter()
        done = None  # the prompt's last logits, when the question map ran the prompt (unsure: plain)
        if isinstance(st, QuestionSteer):  # the map from the question: the document's cache first, unsteered
            n, st, qm = st.prepare(model, tokenizer, cache, n, ids)
            _say(report, qm.summary())
            done = qm.logits
        with steering(model, st):
            # [1, vocab]: what the request uses
            logits = continue_from_cache(model, cache, n, ids[n:], last=1) if done is None else done
            report.prefill_ms = (time.perf_counter() - t0) * 1e3
            first_logits = logits[-1].float()
            nxt = _pick(first_logits, do_sample, temperature)
            report.ttft_ms = (time.perf_counter() - t_start) * 1e3
            eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
            out = decode_loop(model, cache, nxt, len(ids), max_new_tokens, eos, do_sample, temperature)
        report.new_tokens = len(out)
    text = tokenizer.decode(out, skip_special_tokens=True) if hasattr(tokenizer, "decode") else ""
    return Generation(ids=out, text=text, report=report, first_logits=first_logits)


def decode_loop(model: Any, cache: Any, first: int, pos: int, max_new_tokens: int, eos: int | None,
                do_sample: bool = False, temperature: float = 1.0) -> list[int]:
    """Generate from ``first`` (already chosen) at position ``pos`` on, one token per forward."""
    out: list[int] = []
    nxt = first
    while True:
        out.append(nxt)
        if len(out) >= max_new_tokens or (eos is not None and nxt == eos):
            return out
        step = _forward(model, cache, torch.tensor([nxt], device=model.device), pos, logits=True)
        pos += 1
        nxt = _pick(step.logits[0, -1].float(), do_sample, temperature)


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float) -> int:
    if not do_sample:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
    return int(torch.multinomial(probs, 1))


def generate(model: Any, tokenizer: Any, prompt: str | list[int], client, **kwargs) -> Generation:
    """Blocking ``agenerate`` for scripts: ``client`` is a ``kdn.client.SyncKDNClient``."""
    from kdn.client.sync import SyncKDNClient

    if not isinstance(client, SyncKDNClient):
        raise InvalidInput("generate() takes a SyncKDNClient; use agenerate() with a KDNClient")
    return client.run(agenerate(model, tokenizer, prompt, client.aclient, **kwargs))
