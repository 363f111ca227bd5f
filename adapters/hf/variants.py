"""Reuse across fine-tunes of one base model (opt-in, approximate): a variant reads its base's published states.

    async with KDNClient(edges=["http://127.0.0.1:8100"], trusted_keys="keys.txt") as client:
        async with open_registry(url) as reg:                  # the publisher put it: kdn relation put
            rel = await find_relation(reg, model_id(variant, tokenizer), client)  # None unless trusted-signed
        # (or from a file the publisher ships: rel = verifier.check(BaseRelation.unpack(blob)))
        out = await agenerate_variant(variant, tokenizer, ids, client, accept_base=rel)  # opting in: your call
        print(out.text, out.report.line())

A state is bound to exact weights by its model id, so each fine-tune of a base recomputes the knowledge the
base already published. After DroidSpeak (Liu et al., arXiv 2411.02820), a variant can take the base's K/V
for most layers and recompute the few where the two diverge most. What this module does, and what it costs:

- **the layer plan** (``measure_pair``, once per pair): on sample texts, the continuation NLL and the KL from
  the variant's own next-token distributions when the variant reads its context from a cache that holds its
  own K/V for layers ``[0, k)`` and the base's for ``[k, L)``, for every depth k; beside it, the KV divergence
  per layer and the effect of the base's K/V in one layer alone (where the critical layers are). ``pick_depth``
  takes the least k within a budget (at every deeper k too); ``relation_for`` writes the ``BaseRelation`` the
  publisher signs (``kdn.registry.signing.Signer.sign``).
- **recompute from the embeddings.** A layer's K/V for the prefix need the hidden states entering it; the
  consumer has only token ids and the base's K/V, so the plan is always the first k layers, run by the variant
  from the embeddings (``recompute_layers``: the forward stops before layer k). No extra object; its cost is
  k/L of a prefill's layer work, and it needs no loaded byte, so it runs while the base's chunks arrive.
  DroidSpeak recomputes any contiguous group [a, b) from the sender's hidden states entering layer a (its
  "E cache"), which the origin does not publish: a plan that is not a first-k set is refused here.
- **DroidSpeak's groups, measured only** (``measure_groups``): a group [a, b) recomputed from the base's hidden
  states entering layer a (``hidden_entering``, ``recompute_group``), the base's K/V elsewhere: what publishing
  those hidden states would buy, for the benchmark; nothing loads such a plan.
- **the load path** (``agenerate_variant``): only with ``accept_base=relation``, signed by a key the caller
  (or the client) trusts and naming this very model as the variant; then the base's chunks are looked up and
  loaded through the client as ``agenerate`` loads its own (``fetch_prefix`` into a ``CacheBuilder``), layers
  ``[0, k)`` replaced by the variant's own, the rest of the prompt prefilled, and greedy decoding. Without it,
  ``agenerate`` runs: the variant's own states or none, never the base's.

A plan of all L layers uses no base state: bit for bit the variant prefilling the reused prefix in one forward,
then the rest. Only for families whose decoder layers are ``model.model.layers`` and hold attention K/V alone.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.format.address import ModelId
from kdn.errors import InvalidInput, ModelMismatch
from kdn.registry.records import BaseRelation
from kdn.registry.relations import take_relation
from kdn.template import encode_text

from kdn.adapters.hf.cache import CacheBuilder, continue_from_cache
from kdn.adapters.hf.extract import _forward, kind_of, layer_layout, new_cache
from kdn.adapters.hf.generate import Generation, _pick, agenerate, decode_loop, default_arena, model_id

METRICS = ("nll%", "kl")


class _Stop(Exception):
    """Raised before layer k: the forward has written layers [0, k) into the cache."""


def decoder_layers(model: Any) -> Any:
    """The model's decoder layers (``model.model.layers``); ``ModelMismatch`` for a family without them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ModelMismatch(f"{type(model).__name__}: no model.model.layers, so no layer plan")
    return layers


def recompute_layers(model: Any, ids: Sequence[int], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K/V ``[1, kv_heads, n, head_dim]`` of layers ``[0, k)`` of ``model`` over ``ids`` at positions 0..n-1,
    one forward from the embeddings that stops before layer k (k/L of a prefill's layer work)."""
    layers = decoder_layers(model)
    if not 0 <= k <= len(layers):
        raise InvalidInput(f"depth {k} is outside 0..{len(layers)}")
    if k == 0 or not ids:
        return []

    def stop(*_: Any) -> None:
        raise _Stop

    cache = _run_hooked(model, ids, {k: stop} if k < len(layers) else {})
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(k)]


def _run_hooked(model: Any, ids: Sequence[int], hooks: dict[int, Any]) -> Any:
    """One forward over ``ids`` from position 0 with forward pre-hooks on decoder layers (index -> hook; one may
    raise ``_Stop``); the cache it filled."""
    layers = decoder_layers(model)
    cache = new_cache(model)
    handles = [layers[i].register_forward_pre_hook(h) for i, h in hooks.items()]
    try:
        with torch.inference_mode():
            _forward(model, cache, torch.as_tensor(list(ids), device=next(model.parameters()).device), 0, logits=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return cache


def hidden_entering(model: Any, ids: Sequence[int], layer: int) -> torch.Tensor:
    """The hidden states ``[1, n, hidden]`` entering decoder layer ``layer`` over ``ids`` (what DroidSpeak sends
    as its "E cache"); the forward stops there."""
    if not 0 <= layer < len(decoder_layers(model)):
        raise InvalidInput(f"layer {layer} is outside 0..{len(decoder_layers(model)) - 1}")
    got: list[torch.Tensor] = []

    def grab(_: Any, args: tuple) -> None:
        got.append(args[0])
        raise _Stop

    _run_hooked(model, ids, {layer: grab})
    return got[0]


def recompute_group(model: Any, ids: Sequence[int], a: int, b: int,
                    entering: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K/V of layers ``[a, b)`` of ``model`` over ``ids`` run from ``entering`` (the hidden states entering
    layer a, another model's: ``hidden_entering``) instead of its own. A measurement: layers [0, a) still run
    here and are thrown away; a consumer given those hidden states would start at layer a."""
    L = len(decoder_layers(model))
    if not 0 <= a < b <= L:
        raise InvalidInput(f"group [{a}, {b}) is not within 0..{L}")

    def swap(_: Any, args: tuple) -> tuple:
        return (entering, *args[1:])

    def stop(*_: Any) -> None:
        raise _Stop

    cache = _run_hooked(model, ids, {a: swap, **({b: stop} if b < L else {})})
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(a, b)]


def cache_of(model: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` for ``model`` holding ``kv`` (one ``[1, H, n, D]`` pair per layer, every layer)."""
    cache = new_cache(model)
    if len(kv) != len(cache.layers):
        raise ModelMismatch(f"{len(kv)} layers of K/V for a model of {len(cache.layers)}")
    for layer, (k, v) in zip(cache.layers, kv):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v  # (a forward on top concatenates: these tensors are never written)
    return cache


def _overlay(cache: Any, own: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace the first ``len(own)`` layers of ``cache`` with ``own`` (same token count)."""
    for i, (k, v) in enumerate(own):
        layer = cache.layers[i]
        if tuple(layer.keys.shape) != tuple(k.shape):
            raise ModelMismatch(f"layer {i}: the base's K/V are {tuple(layer.keys.shape)}, the variant's "
                                f"{tuple(k.shape)}: not the same architecture")
        layer.keys, layer.values = k.to(layer.keys.dtype), v.to(layer.values.dtype)


# --- the layer plan, measured once per pair ----------------------------------------------------------------------


@dataclass
class PairMeasurement:
    """What reading the base's K/V does to the variant, averaged over the samples (``measure_pair``)."""

    layers: int
    samples: int
    tokens: int  # context tokens, over all samples
    nll_own: float  # the variant on its own K/V: mean continuation NLL a token
    nll: list[float]  # [k] for k = 0..L: the variant's own K/V in layers [0, k), the base's in [k, L)
    dnll: list[float]  # [k]: mean over samples of the NLL increase over nll_own, in %
    dnll_worst: list[float]  # [k]: the worst sample's
    kl: list[float]  # [k]: mean KL(own || mixed) of the next-token distributions, nats a token
    swap_dnll: list[float]  # [i]: the base's K/V in layer i alone (the variant's elsewhere), NLL increase in %
    swap_kl: list[float]  # [i]: likewise, KL
    div_k: list[float]  # [i]: ||K_variant - K_base|| / ||K_variant|| of layer i over the contexts
    div_v: list[float]

    def value(self, metric: str, k: int) -> float:
        if metric not in METRICS:
            raise InvalidInput(f"metric must be one of {METRICS}, got {metric!r}")
        return self.dnll[k] if metric == "nll%" else self.kl[k]


def _scores(model: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], n: int, cont: Sequence[int],
            own_lp: torch.Tensor | None) -> tuple[float, float, torch.Tensor]:
    """(NLL of ``cont[1:]``, KL from ``own_lp``, log-probs) of ``model`` reading ``cont`` after a cache of ``kv``."""
    logits = continue_from_cache(model, cache_of(model, kv), n, list(cont))
    lp = torch.log_softmax(logits.double(), dim=-1)
    nll = -lp[torch.arange(len(cont) - 1), torch.as_tensor(list(cont[1:]))].mean().item()
    kl = 0.0 if own_lp is None else (own_lp.exp() * (own_lp - lp)).sum(-1).mean().item()
    return nll, kl, lp


def _measure_one(base: Any, variant: Any, ctx: Sequence[int], cont: Sequence[int]) -> dict[str, Any]:
    L = len(decoder_layers(variant))
    own, other = recompute_layers(variant, ctx, L), recompute_layers(base, ctx, L)
    nll_own, _, own_lp = _scores(variant, own, len(ctx), cont, None)
    out: dict[str, Any] = {"nll_own": nll_own, "nll": [], "kl": [], "swap_nll": [], "swap_kl": []}
    for k in range(L + 1):
        nll, kl, _ = _scores(variant, list(own[:k]) + list(other[k:]), len(ctx), cont, own_lp)
        out["nll"].append(nll)
        out["kl"].append(kl)
    for i in range(L):
        nll, kl, _ = _scores(variant, list(own[:i]) + [other[i]] + list(own[i + 1:]), len(ctx), cont, own_lp)
        out["swap_nll"].append(nll)
        out["swap_kl"].append(kl)
    out["dk"] = [(((a - b).double().norm() ** 2).item(), (a.double().norm() ** 2).item())
                 for (a, _), (b, _) in zip(own, other)]
    out["dv"] = [(((a - b).double().norm() ** 2).item(), (a.double().norm() ** 2).item())
                 for (_, a), (_, b) in zip(own, other)]
    return out


def measure_pair(base: Any, variant: Any, samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> PairMeasurement:
    """Measure a (base, variant) pair on ``samples``: (context ids, continuation ids of at least 2 tokens).

    Per sample: both models' K/V over the context (one forward each), then the variant reads the continuation
    from a cache that mixes them, for every depth k (L + 1 reads) and every single layer swapped (L reads):
    about 2 prefills of the context and 2L + 2 forwards of the continuation."""
    if not samples or any(len(c) < 1 or len(x) < 2 for c, x in samples):
        raise InvalidInput("samples are (context of >= 1 token, continuation of >= 2 tokens), at least one")
    L = len(decoder_layers(variant))
    if len(decoder_layers(base)) != L or layer_layout(base) != layer_layout(variant):
        raise ModelMismatch("the base and the variant do not share one layer layout")
    if kind_of(layer_layout(variant)) != "kv":
        raise ModelMismatch("only attention-only models: a recurrent state cannot be split by layer here")
    runs = [_measure_one(base, variant, c, x) for c, x in samples]

    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs)

    def pct(r: dict, key: str, j: int) -> float:
        return (r[key][j] - r["nll_own"]) / r["nll_own"] * 100

    def div(key: str, i: int) -> float:
        return (sum(r[key][i][0] for r in runs) / max(sum(r[key][i][1] for r in runs), 1e-30)) ** 0.5

    return PairMeasurement(
        layers=L, samples=len(runs), tokens=sum(len(c) for c, _ in samples),
        nll_own=mean([r["nll_own"] for r in runs]),
        nll=[mean([r["nll"][k] for r in runs]) for k in range(L + 1)],
        dnll=[mean([pct(r, "nll", k) for r in runs]) for k in range(L + 1)],
        dnll_worst=[max(pct(r, "nll", k) for r in runs) for k in range(L + 1)],
        kl=[mean([r["kl"][k] for r in runs]) for k in range(L + 1)],
        swap_dnll=[mean([pct(r, "swap_nll", i) for r in runs]) for i in range(L)],
        swap_kl=[mean([r["swap_kl"][i] for r in runs]) for i in range(L)],
        div_k=[div("dk", i) for i in range(L)], div_v=[div("dv", i) for i in range(L)])


def measure_groups(base: Any, variant: Any, samples: Sequence[tuple[Sequence[int], Sequence[int]]],
                   groups: Sequence[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, float]]:
    """DroidSpeak's plans, for comparison (nothing here can load them): per group ``(a, b)``, the mean NLL
    increase in % and KL (as ``measure_pair``'s) when the variant recomputes layers [a, b) from the base's hidden
    states entering layer a and takes the base's K/V in every other layer."""
    L = len(decoder_layers(variant))
    got: dict[tuple[int, int], list[tuple[float, float]]] = {g: [] for g in groups}
    for ctx, cont in samples:
        own, other = recompute_layers(variant, ctx, L), recompute_layers(base, ctx, L)
        nll_own, _, own_lp = _scores(variant, own, len(ctx), cont, None)
        entering: dict[int, torch.Tensor] = {}
        for a, b in groups:
            if a not in entering:
                entering[a] = hidden_entering(base, ctx, a)
            kv = list(other[:a]) + recompute_group(variant, ctx, a, b, entering[a]) + list(other[b:])
            nll, kl, _ = _scores(variant, kv, len(ctx), cont, own_lp)
            got[(a, b)].append(((nll - nll_own) / nll_own * 100, kl))
    return {g: (sum(d for d, _ in r) / len(r), sum(k for _, k in r) / len(r)) for g, r in got.items()}


def pick_depth(m: PairMeasurement, budget: float, metric: str = "nll%") -> int:
    """The least k such that reading layers [k, L) from the base stays within ``budget`` of ``metric`` at k and
    at every deeper k (the measured curve need not fall monotonically): L if nothing shallower does."""
    if not budget >= 0:
        raise InvalidInput(f"budget must be >= 0, got {budget}")
    k = m.layers
    while k > 0 and m.value(metric, k - 1) <= budget:
        k -= 1
    return k


def relation_for(m: PairMeasurement, variant_id: ModelId, base_id: ModelId, budget: float, metric: str = "nll%", *,
                 name: str = "", depth: int | None = None) -> BaseRelation:
    """The (unsigned) relation a publisher signs: recompute layers [0, k) for the least k within ``budget``
    (``depth``: this k instead, what was measured at it recorded all the same)."""
    k = pick_depth(m, budget, metric) if depth is None else depth
    if not 0 <= k <= m.layers:
        raise InvalidInput(f"depth {k} is outside 0..{m.layers}")
    measured = {"samples": m.samples, "tokens": m.tokens, "nll_own": round(m.nll_own, 6),
                "dnll": round(m.dnll[k], 4), "dnll_worst": round(m.dnll_worst[k], 4), "kl": round(m.kl[k], 6),
                "dnll_all_base": round(m.dnll[0], 4)}
    return BaseRelation(variant=variant_id, base=base_id, layers=m.layers, recompute=list(range(k)), metric=metric,
                        budget=float(budget), measured=measured, name=name)


# --- the load path ------------------------------------------------------------------------------------------------


def check_relation(rel: Any, model: Any, tokenizer: Any, verifier: Any) -> int:
    """The plan's depth k, once ``rel`` is a ``BaseRelation`` signed by a key of ``verifier`` that names this
    model as its variant and is not withdrawn; raises otherwise (``SignatureError``, ``ModelMismatch``,
    ``InvalidInput``). ``verifier`` (required): a ``kdn.client.Trust`` (a client's ``.trust``), which also
    refuses a relation older than one of its variant taken before (``RefusedRelation``), or a bare
    ``kdn.registry.signing.Verifier``, which checks the signature alone."""
    if not isinstance(rel, BaseRelation):
        raise InvalidInput(f"accept_base takes a BaseRelation, not a {type(rel).__name__}")
    take = getattr(verifier, "relation", None)
    if callable(take):
        take(rel)  # SignatureError (counted by the Trust); InvalidInput without keys
    elif verifier is None:
        raise InvalidInput("a base relation is taken only signed by a trusted publisher key: pass trusted= or a "
                           "client with trusted_keys")
    else:
        take_relation(rel, verifier)  # SignatureError: unsigned, an unknown key, or a field changed after signing
    if rel.deleted:
        raise InvalidInput(f"the relation for {rel.variant[:16]}... is withdrawn (a signed tombstone, version "
                           f"{rel.version})")
    mid = model_id(model, tokenizer)
    if rel.variant != mid:
        raise ModelMismatch(f"the relation is for variant {rel.variant[:16]}..., not this model ({mid[:16]}...)")
    L = len(decoder_layers(model))
    if rel.layers != L:
        raise ModelMismatch(f"the relation's plan is for {rel.layers} layers; this model has {L}")
    if rel.depth is None:
        raise InvalidInput(f"layer plan {rel.recompute[:8]}... is not the first k layers: recomputing a group "
                           f"further in needs the base's hidden states entering it, which are not published")
    if kind_of(layer_layout(model)) != "kv":
        raise ModelMismatch("only attention-only models take a base's states")
    return rel.depth


@dataclass
class VariantReport:
    tokens_total: int = 0
    tokens_from_base: int = 0  # the prefix whose layers [k, L) are the base's K/V
    layers: int = 0
    layers_recomputed: int = 0  # k: the variant's own layers [0, k) over that prefix
    chunks_loaded: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    lookup_ms: float = 0.0
    fetch_ms: float = 0.0  # to the last byte of the base's chunks
    recompute_ms: float = 0.0  # layers [0, k) over the prefix (beside the fetch)
    prefill_ms: float = 0.0  # the rest of the prompt, every layer
    ttft_ms: float = 0.0
    new_tokens: int = 0

    def line(self) -> str:
        src = ", ".join(f"{k} x{v}" for k, v in sorted(self.sources.items())) or "none"
        return (f"{self.tokens_from_base}/{self.tokens_total} tokens from the base's states ({self.chunks_loaded} "
                f"chunks from {src}), layers 0..{self.layers_recomputed - 1} of {self.layers} recomputed; lookup "
                f"{self.lookup_ms:.1f} ms, fetch {self.fetch_ms:.1f} ms, recompute {self.recompute_ms:.1f} ms, "
                f"prefill {self.prefill_ms:.1f} ms; first token after {self.ttft_ms:.1f} ms")


@dataclass
class VariantGeneration:
    ids: list[int]
    text: str
    report: VariantReport
    first_logits: torch.Tensor  # [vocab]


async def _load_base(model: Any, client: Any, hit: Any, rel: BaseRelation, report: VariantReport) -> Any:
    """The base's chunks of ``hit``, fetched and decoded into a cache (as ``agenerate`` loads its own)."""
    loop = asyncio.get_running_loop()
    pool = getattr(client, "arena", None) or default_arena()
    builder = await loop.run_in_executor(None, functools.partial(CacheBuilder, model, hit.token_counts(), arena=pool))
    states = await client.fetch_prefix(hit, into=builder.add, arena=pool, scatter=builder)
    for obj in states.objects:
        if obj.header.model_id != rel.base:
            raise ModelMismatch(f"object {obj.header.address[:16]}... is of model {obj.header.model_id[:16]}..., "
                                f"not the relation's base ({rel.base[:16]}...)")
    report.fetch_ms, report.sources, report.chunks_loaded = states.fetch_s * 1e3, states.sources, hit.chunks
    cache, _ = builder.finish()
    return cache


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) * 1e3


async def _prefix_cache(model: Any, ids: list[int], client: Any, rel: BaseRelation, k: int, namespace: str,
                        chunk_tokens: int, report: VariantReport) -> tuple[Any, int]:
    """The cache of the prompt's longest prefix the base published: layers [0, k) the variant's own (computed
    while the base's chunks arrive), [k, L) the base's; and its token count (at most all but the last token)."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    hit = await client.lookup(ids, rel.base, namespace, chunk_tokens=chunk_tokens)
    report.lookup_ms = (time.perf_counter() - t0) * 1e3
    n = min(hit.tokens, len(ids) - 1)  # the last token runs with every layer: its logits are the answer
    if n <= 0:
        return new_cache(model), 0
    own_f = loop.run_in_executor(None, _timed, recompute_layers, model, ids[:n], k)
    if k == report.layers:  # every layer the variant's own: nothing of the base is needed
        own, report.recompute_ms = await own_f
        return cache_of(model, own), n
    try:
        cache = await _load_base(model, client, hit, rel, report)
    finally:
        own, report.recompute_ms = await own_f
    if hit.tokens > n:
        cache.crop(n)
    _overlay(cache, own)
    report.tokens_from_base = n
    return cache, n


async def agenerate_variant(model: Any, tokenizer: Any, prompt: str | list[int], client: Any, *,
                            accept_base: BaseRelation | None = None, trusted: Any = None, namespace: str = "public",
                            chunk_tokens: int = 256, max_new_tokens: int = 32,
                            eos_token_id: int | None = None) -> Generation | VariantGeneration:
    """Generate greedily from ``prompt`` with ``model``, a variant, reading the prefix its base published.

    Opt-in: without ``accept_base`` this is ``agenerate`` (the model's own states, exact). With it, ``accept_base``
    must verify against ``trusted`` (a ``kdn.registry.signing.Verifier`` or a ``kdn.client.Trust``; default: the
    client's ``Trust``: its publisher keys and its relation marks) and name
    this model as its variant (``check_relation``); the base's chunks are loaded, layers ``[0, k)`` of the
    relation's plan recomputed by this model, and the rest of the prompt computed."""
    if accept_base is None:
        return await agenerate(model, tokenizer, prompt, client, namespace=namespace, chunk_tokens=chunk_tokens,
                               max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    t_start = time.perf_counter()
    ids = encode_text(tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise InvalidInput("empty prompt")
    loop = asyncio.get_running_loop()
    judge = trusted if trusted is not None else getattr(client, "trust", None) or getattr(client, "verifier", None)
    k = await loop.run_in_executor(None, check_relation, accept_base, model, tokenizer, judge)
    report = VariantReport(tokens_total=len(ids), layers=accept_base.layers, layers_recomputed=k)
    cache, n = await _prefix_cache(model, ids, client, accept_base, k, namespace, chunk_tokens, report)
    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)

    def run() -> VariantGeneration:
        t0 = time.perf_counter()
        first = continue_from_cache(model, cache, n, ids[n:], last=1)[-1].float()
        report.prefill_ms = (time.perf_counter() - t0) * 1e3
        nxt = _pick(first, False, 1.0)
        report.ttft_ms = (time.perf_counter() - t_start) * 1e3
        with torch.inference_mode():
            out = decode_loop(model, cache, nxt, len(ids), max_new_tokens, eos)
        report.new_tokens = len(out)
        text = tokenizer.decode(out, skip_special_tokens=True) if hasattr(tokenizer, "decode") else ""
        return VariantGeneration(ids=out, text=text, report=report, first_logits=first)

    return await loop.run_in_executor(None, run)
