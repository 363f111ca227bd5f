"""The load planner for transformers models: this engine's measured speeds, and a request's chunks.

``kdn.planner`` decides; this module gives it what it needs from a loaded
model and a ``KDNClient``: a ``Speeds`` per model (its prefill model built from
the config -- parameters, layers, attention width -- and scaled by this
process's own timed forwards), the chunks of a lookup with their wire sizes
(from the signed records when the lookup carries them, else the model's raw
K/V bytes per token: an overestimate of a compressed object, so the planner
errs towards computing, never towards a load it cannot afford), and the link
(the client's least expected time for the bytes). A plan that computes while
the load speed is stale asks for a probe: ``start_probe`` fetches the first
chunk beside the request and teaches its speed. ``await_load`` bounds a load
by its deadline, and gives it up sooner once its own progress shows it would
overrun it (``kdn.planner.overruns``). ``believe`` takes a lookup's "cold" labels (the entry edge must fill
those objects first) as far as this client still believes each source's (``kdn.planner.ColdFills``), and
``cold_given_up`` counts a cold load given up against the source it waited on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kdn.format.address import Digest
from kdn.wire.bodyget import Tally
from kdn.chunk import Chunk
from kdn.planner import OVERRUN_AFTER, ColdFills, PrefillModel, Speeds, overruns

log = logging.getLogger("kdn.adapters.hf")

_SPEEDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PROBES: set[asyncio.Task] = set()  # probes on the wire (a reference each, so none is collected mid-flight)
_FILLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def speeds_of(model: Any) -> Speeds:
    """This process's measured speeds of ``model`` (made at first use; refined by every load and prefill)."""
    sp = _SPEEDS.get(model)
    if sp is None:
        cfg = model.config
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        heads = int(getattr(text, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 64) // heads))
        layers = int(getattr(text, "num_hidden_layers", 1) or 1)
        params = sum(p.numel() for p in model.parameters())
        sp = _SPEEDS[model] = Speeds(PrefillModel(params=params, layers=layers, attn_width=heads * head_dim))
    return sp


async def await_load(fetch: asyncio.Future, *, tally: Tally, total: int, deadline_s: float | None,
                     cold: bool, started: float) -> Any:
    """``fetch``'s result, or ``TimeoutError`` once it ran past ``deadline_s`` (None: no bound) since
    ``started`` (``time.perf_counter``) or once the bytes ``tally`` counts (of ``total``) show it would overrun
    that deadline (``kdn.planner.overruns``; a ``cold`` load only once its first byte has landed). ``fetch``
    itself is left running (the caller cancels it and uses what arrived)."""
    if deadline_s is None or not math.isfinite(deadline_s):
        return await asyncio.wait_for(asyncio.shield(fetch), deadline_s)
    step = deadline_s * OVERRUN_AFTER / 2
    while True:
        left = started + deadline_s - time.perf_counter()
        if left <= 0:
            raise TimeoutError(f"ran past its {deadline_s * 1e3:.0f} ms deadline")
        done, _ = await asyncio.wait({fetch}, timeout=min(step, left))
        if done:
            return fetch.result()
        ran = time.perf_counter() - started
        first = tally.first - started if tally.first is not None else None
        if ran < deadline_s and overruns(ran, tally.bytes, total, deadline_s, first, cold=cold):
            raise TimeoutError(f"was given up after {ran * 1e3:.0f} ms, {tally.bytes:,} of {total:,} B landed: "
                               f"too slow to end within its {deadline_s * 1e3:.0f} ms deadline")


def cold_fills_of(client: Any) -> ColdFills:
    """What this process saw of ``client``'s sources' cold loads (made at first use; ``kdn.planner.ColdFills``)."""
    fills = _FILLS.get(client)
    if fills is None:
        fills = _FILLS[client] = ColdFills()
    return fills


def _lead(client: Any, address: str, nbytes: int) -> Any:
    """The source a fetch of ``address`` asks first, so the one a load of it waits on (a ``kdn.wire.fetch.Route``)."""
    return client.routing.ranked(nbytes, address)[0]


@dataclass(frozen=True)
class Believed:
    """A lookup as this client takes it, before it is planned."""

    hit: Any  # the lookup, its ``cold`` only the labels still believed (the rest are fetched as warm: hedged)
    warm: bool  # every object costs only this client's link: known warm, or its source's "cold" not believed
    labelled: bool  # some object was labelled cold, believed or not (a load of it that completes clears its source)
    link: Callable[[int], float]  # the planner's link: the client's, or slower where a source gave up lately
    doubted: tuple[str, ...] = ()  # sources whose last cold load was given up lately (the plan says so)


def believe(hit: Any, chunks: list[Chunk], client: Any) -> Believed:
    """``hit``'s cold labels judged by their sources' record (``ColdFills``): an object not known warm is
    cold while the source its fetch would wait on is still believed; one whose source is no longer believed
    is taken as warm (planned, bounded and measured as such, and its fetch hedged). A cold load's time is at
    least what its source's last given-up cold load showed, while that is recent."""
    fills = cold_fills_of(client)
    tiers = list(hit.sources) + [""] * (len(hit.addresses) - len(hit.sources))
    cold: set[str] = set()
    unbelieved: set[str] = set()
    for a, t, c in zip(hit.addresses, tiers, chunks):
        if client.warm(a, t) or c.host:  # (the host tier's copy is on this machine: nothing to fill)
            continue
        src = _lead(client, a, c.size).label
        if fills.believed(src):
            cold.add(src)
        else:
            unbelieved.add(a)
    if unbelieved:
        hit = replace(hit, cold=hit.cold - unbelieved)
    doubted = tuple(sorted(s for s in cold if fills.expected(s, 1) > 0))
    base = client.expected_seconds

    def link(n: int) -> float:
        return max([base(n)] + [fills.expected(s, n) for s in doubted])

    return Believed(hit, not cold, bool(cold or unbelieved), link if doubted else base, doubted)


def cold_given_up(client: Any, hit: Any, chunks: list[Chunk], arrived: int, nbytes: int, seconds: float) -> str:
    """A cold load given up after ``seconds`` with ``nbytes`` landed, counted against the source it waited on
    (the lead of its first chunk that had not arrived): in ``cold_fills_of(client)``, and in the client's
    estimate of that source, which ranks it lower for a while as a failed fetch does (the fetch it was
    waiting on is cancelled, not failed, so the client would not count it). The source's label."""
    i = min(arrived, hit.chunks - 1)
    src = _lead(client, hit.addresses[i], chunks[i].size)
    cold_fills_of(client).gave_up(src.label, nbytes, seconds)
    client.routing.estimates[src.url].fail()
    return src.label


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of raw K/V one token holds in this model (every attention layer, K and V, its cache dtype)."""
    from kdn.adapters.hf.extract import layer_layout

    import torch

    return sum(2 * s.kv[0] * s.kv[1] * torch.empty(0, dtype=s.kv_dtype).element_size()
               for s in layer_layout(model) if s.kv and s.kv_dtype is not None)


def chunks_of(hit: Any, client: Any, model: Any, encoding: str | None = None) -> list[Chunk]:
    """The lookup's objects as the planner sees them (``Lookup.chunk``): tokens, and bytes on the wire in the
    encoding the client would fetch; where the lookup brought no record of one, its raw K/V bytes (no encoding)."""
    per_token = kv_bytes_per_token(model)
    out = []
    for i, n in enumerate(hit.token_counts()):
        rec = hit.records[i] if i < len(hit.records) else None
        enc = (encoding or client.choose_encoding(rec.encodings)) if rec is not None else None
        if rec is not None and enc in rec.encodings:
            out.append(hit.chunk(i, rec, enc))
        else:
            start = i * hit.chunk_tokens
            out.append(Chunk(hit.addresses[i], start, start + n, "", Digest(""), n * per_token))
    return out


def start_probe(hit: Any, client: Any, speeds: Speeds, deadline_s: float,
                encoding: str | None = None) -> asyncio.Task:
    """Fetch the lookup's first object beside the request (the planner's probe, ``Decision.probe_s``) and teach
    ``speeds`` what it measured when it lands; the request does not wait for it. A record that names no
    encoding this client would fetch, bad piece digests, or a record that cannot be read (the edge or the
    registry failing: the next stale plan probes again) measure nothing; the task never ends in an error."""
    from kdn.errors import InvalidInput, KDNError

    async def run() -> None:
        address = hit.addresses[0]
        try:
            rec = hit.records[0] if hit.records else await client.record(address)
            enc = (encoding or client.choose_encoding(rec.encodings)) if rec is not None else None
            if rec is None or enc not in rec.encodings:
                return
            c = hit.chunk(0, rec, enc)
            got = await client.probe(address, encoding=enc, digest=c.digest, size=c.size, pieces=c.pieces,
                                     deadline_s=deadline_s)
        except InvalidInput:
            return
        except (KDNError, OSError) as err:
            log.debug("probe of %s measured nothing: %s", address[:16], err)
            return
        if got is not None:
            speeds.observe_load(got.nbytes, got.seconds, abandoned=got.abandoned, probe=True)

    task = asyncio.ensure_future(run())
    PROBES.add(task)
    task.add_done_callback(PROBES.discard)
    return task
