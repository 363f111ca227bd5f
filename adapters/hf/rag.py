"""Non-prefix reuse for HF Llama-family models: compose standalone chunks in any order, blend, generate.

    async with KDNClient(edges=["http://127.0.0.1:8100"]) as client:
        out = await generate_rag(model, tokenizer, "What is the hotel limit?", [doc_a, doc_b], client)
        print(out.text, out.report.line())

The context is ``[head][chunk 1]..[chunk k][query]``. Each document chunk's KV
was computed on its own at positions ``0..n-1`` (the origin publishes them with
``"standalone": true``); ``head`` (system prompt / chat-template opening) and
``query`` are computed fresh. ``blend_prefill`` follows CacheBlend:

1. compose: shift each chunk's keys to its offset (``kdn.kernels.rope``), concatenate;
2. layers ``0..check_layer``: recompute every token (cheap: 2 of 30 layers for
   SmolLM2), which gives the true K/V of the check layer;
3. select the ``recompute_ratio`` of reused tokens whose check-layer K/V deviate
   most from the composed ones (``kdn.kernels.blend.select_tokens``);
4. deeper layers: only the selected tokens and the fresh ones run; their
   queries attend to the composed K/V of all tokens, with their own rows
   replaced by the recomputed ones, layer by layer.

``selection`` picks the tokens of step 3 and says what the check costs:

- ``"deviation-kv"``: CacheBlend's selection with a cheaper check:
  layers ``0..check_layer-1`` run for every token, then only the check layer's
  K/V projections (what the deviation compares); the selected tokens run from
  the check layer on. It selects the same tokens and leaves the same cache as
  ``"deviation"`` (the check layer's output for unselected tokens was never
  used) and skips that layer's attention and MLP for them (on SmolLM2-135M a
  recomputed share of 18.0% instead of 20.7% at 15%, the same NLL);
- ``"deviation-query"`` (default): the same check, and the tokens ranked by deviation
  times the square root of the attention the query (the fresh tokens after
  the last reused one) pays them at the check layer
  (``kdn.kernels.blend.query_weighted``): a wrong state the question reads is
  worth more than one it does not. Costs the query's own q projection and one
  attention row per query token at the check layer, no reused-token work;
  lower answer NLL than ``"deviation-kv"`` at the same ratio on SmolLM2-135M,
  on each of three draws of the bench's contexts (docs/whitebox.md);
- ``"deviation"``: CacheBlend as listed above, the check layer run in full.
  ``check_layer=0`` selects nothing useful: layer 0's K/V of a token depend on
  the token alone, so composed and true ones differ by rounding only;
- ``"chunk-start"``: the first ``round(recompute_ratio * n)`` tokens of each
  reused chunk of ``n`` tokens (each standalone chunk was computed at positions
  0.., so its first tokens are the ones it used as an attention sink; EPIC-style
  position-independent caching). No check layer: the selected tokens and the
  fresh ones run in every layer, nothing else does.

``Blend.layer_tokens`` counts the (reused token, layer) pairs actually
recomputed, check layers included: ``R * (check_layer + 1) + r * (L - check_layer - 1)``
for ``"deviation"`` (R reused tokens, r selected, L layers);
``R * check_layer + R * f + r * (L - check_layer)`` for ``"deviation-kv"`` and ``"deviation-query"``, with
``f = kv_share(layer)`` the K/V projections' share of a layer's matmul weights
(6.2% for SmolLM2-135M); ``r * L`` for ``"chunk-start"``.
``Blend.recompute_share`` divides it by ``R * L``.

``recompute_ratio=0`` is pure composition (no check layer: fresh tokens on top
of the shifted chunks). ``recompute_ratio=1`` runs every token in every layer (no check layer),
the same operations as ``full_prefill``, and gives bit-identical results.
Decoder layers are driven here (embed_tokens, layers, norm, rotary_emb), with
explicit positions, for ``llama`` and ``qwen2`` (full attention) models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kdn import address as A
from kdn.emphasis import EmphasisMap, merge_spans
from kdn.errors import DigestMismatch, InvalidInput, ModelMismatch, SourceError
from kdn.kernels.blend import compose, kv_deviation, n_select, query_attention, query_weighted, select_tokens
from kdn.kernels.rope import rope_of
from kdn.template import chat_frame, encode_frame, encode_text

from kdn.adapters.hf.cache import build_cache
from kdn.adapters.hf.extract import standalone_chunk
from kdn.adapters.hf.generate import _pick, decode_loop, model_id
from kdn.adapters.hf.steer import Steer, plan, steering

BLEND_FAMILIES = frozenset({"llama", "qwen2"})
SELECTIONS = ("deviation", "deviation-kv", "deviation-query", "chunk-start")


@dataclass
class Segment:
    """A run of tokens in the composed context: ``kv`` holds its standalone states, or ``None`` (compute fresh).

    ``at``: the position ``kv``'s first token was computed at (0 for a standalone chunk; a slice of a
    prefix chain keeps its own, ``kdn.adapters.hf.edits``): its keys turn by (place - ``at``).
    ``exact``: ``kv`` holds the true states of these tokens at this place (the unchanged prefix of an
    edited document): never checked nor recomputed, except by ``recompute_ratio=1``, which runs everything.
    """

    ids: Sequence[int]
    kv: Mapping[str, torch.Tensor] | None = None
    at: int = 0
    exact: bool = False


@dataclass
class Blend:
    logits: torch.Tensor  # [n_logits, vocab] of the context's last positions
    keys: list[torch.Tensor]  # per layer [1, kv_heads, S, head_dim], as the cache should hold them
    values: list[torch.Tensor]
    n_tokens: int
    n_reused: int  # tokens whose KV came from standalone chunks (or shifted slices), ``exact`` ones not counted
    recomputed: torch.Tensor  # indices of reused tokens recomputed in the deep layers (ascending)
    layer_tokens: float = 0.0  # (reused token, layer) pairs recomputed, check layers included
    n_layers: int = 1
    n_exact: int = 0  # tokens of ``exact`` segments: loaded as they are, not checked (all run at ratio 1)

    @property
    def recompute_share(self) -> float:
        """The share of the reused tokens' layer work that was recomputed: ``layer_tokens / (n_reused * n_layers)``."""
        return self.layer_tokens / (self.n_reused * self.n_layers) if self.n_reused else 0.0


def _check_model(model: Any) -> None:
    cfg = model.config
    if cfg.model_type not in BLEND_FAMILIES:
        raise ModelMismatch(f"blending drives {sorted(BLEND_FAMILIES)} decoder layers, not {cfg.model_type!r}")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        raise ModelMismatch(f"blending needs full attention in every layer, this model has {sorted(kinds)}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, sn = cos[:, None], sin[:, None]  # [1, 1, s, D]
    return x * c + _rotate_half(x) * sn


def _kv(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K (rotated) and V of ``x`` [1, s, hidden], its input after ``input_layernorm``: each [1, Hkv, s, D]."""
    attn = layer.self_attn
    s, D = x.shape[1], attn.head_dim
    k = attn.k_proj(x).view(1, s, -1, D).transpose(1, 2)
    v = attn.v_proj(x).view(1, s, -1, D).transpose(1, 2)
    return _rope(k, cos, sin), v


def _q(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A layer's queries (rotated) of ``x`` [1, s, hidden], its input after ``input_layernorm``: [1, Hq, s, D]."""
    attn = layer.self_attn
    s, D = x.shape[1], attn.head_dim
    return _rope(attn.q_proj(x).view(1, s, -1, D).transpose(1, 2), cos, sin)


# Queries of a partial recompute are cut by position into at most this many bands of the context; each
# band's queries attend to the keys up to its last position only (one masked call over every key does
# twice the causal work: masked keys cost as much). Bands with no query cost nothing, so queries bunched
# together (the question at the end, a compose-only blend) are one call, not eight.
_QUERY_GROUPS = 8


def _groups(idx: torch.Tensor, S: int) -> list[tuple[int, int]]:
    """``[a, b)`` runs of the ascending positions ``idx`` [s] that fall in the same band of ``S / 8`` positions."""
    band = -(-S // _QUERY_GROUPS)
    _, counts = torch.unique_consecutive(torch.div(idx, band, rounding_mode="floor"), return_counts=True)
    out, a = [], 0
    for c in counts.tolist():
        out.append((a, a + c))
        a += c
    return out


def _attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, idx: torch.Tensor, scale: float,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries at positions ``idx`` [s] (ascending) over K/V [1, Hkv, S, D]: [1, Hq, s, D].

    ``bias``: an additive ``[1, Hq, s, S]`` term on the scores (steering, ``kdn.adapters.hf.steer``)."""
    s, S = q.shape[2], K.shape[2]
    if s == S and bias is None:  # every position: plain causal attention
        return F.scaled_dot_product_attention(q, K, V, is_causal=True, scale=scale, enable_gqa=True)
    outs = []
    for a, b in _groups(idx, S):
        m = int(idx[b - 1]) + 1  # keys past the group's last position are masked for all of it
        mask = torch.arange(m, device=idx.device)[None, :] <= idx[a:b, None]  # [b-a, m]
        am: torch.Tensor = mask[None, None]
        if bias is not None:  # steered heads: an additive mask
            am = torch.zeros(am.shape, dtype=q.dtype, device=q.device).masked_fill(~am, torch.finfo(q.dtype).min)
            am = am + bias[:, :, a:b, :m]
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], K[:, :, :m], V[:, :, :m], attn_mask=am,
                                                   scale=scale, enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _layer(layer: Any, h: torch.Tensor, idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           K: torch.Tensor, V: torch.Tensor, steer: Steer | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for the tokens ``idx`` (positions = indices, ascending) over the context's K/V.

    h: [1, s, hidden] of tokens idx [s]; K, V: [1, Hkv, S, D] of the whole context,
    rows ``idx`` replaced, in place, by the ones computed here. Returns (h', K, V).
    """
    attn = layer.self_attn
    s = h.shape[1]
    x = layer.input_layernorm(h)  # [1, s, hidden]
    q = _q(layer, x, cos, sin)  # [1, Hq, s, D]
    k, v = _kv(layer, x, cos, sin)  # [1, Hkv, s, D] each
    K.index_copy_(2, idx, k)  # [1, Hkv, S, D]
    V.index_copy_(2, idx, v)
    bias = steer.bias(attn.layer_idx, idx, K.shape[2], q.shape[1], q.dtype, q.device) if steer is not None else None
    o = _attend(q, K, V, idx, attn.scaling, bias)  # [1, Hq, s, D]
    h = h + attn.o_proj(o.transpose(1, 2).reshape(1, s, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, K, V


def kv_share(layer: Any) -> float:
    """A K/V projection's share of one layer's per-token matmul work: (k_proj + v_proj) / all linear weights."""
    kv = layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()
    total = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    return kv / total


def chunk_start_tokens(segments: Sequence[Segment], ratio: float) -> list[int]:
    """Context indices of the first ``n_select(n, ratio)`` tokens of each reused segment (ascending);
    ``exact`` segments only at ratio 1 (every token)."""
    out: list[int] = []
    off = 0
    for s in segments:
        n = len(s.ids)
        if s.kv is not None and (not s.exact or ratio == 1.0):
            out += range(off, off + n_select(n, ratio))
        off += n
    return out


def blend_prefill(model: Any, segments: Sequence[Segment], *, recompute_ratio: float = 0.15, check_layer: int = 1,
                  n_logits: int = 1, selection: str = "deviation-query", steer: Steer | None = None) -> Blend:
    """Prefill a context of reused and fresh segments, CacheBlend style (see the module doc).

    The last ``n_logits`` tokens must be fresh (their logits are returned). ``steer``: a steering plan
    (``kdn.adapters.hf.steer``) in the composed context's positions; it biases the queries it covers.
    """
    _check_model(model)
    if not 0.0 <= recompute_ratio <= 1.0:
        raise InvalidInput(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
    if selection not in SELECTIONS:
        raise InvalidInput(f"selection must be one of {list(SELECTIONS)}, got {selection!r}")
    inner = model.model
    layers = list(inner.layers)
    if not 0 <= check_layer < len(layers):
        raise InvalidInput(f"check_layer {check_layer} is not a layer of this {len(layers)}-layer model")
    if selection in ("deviation-kv", "deviation-query") and check_layer == 0:
        raise InvalidInput(f"{selection} needs check_layer >= 1 (layer 0's K/V do not depend on the context)")
    p = next(model.parameters())
    dev, dtype = p.device, p.dtype
    lengths = [len(s.ids) for s in segments]
    if not lengths or min(lengths) == 0:
        raise InvalidInput("every segment needs at least one token")
    ids = torch.tensor([t for s in segments for t in s.ids], dtype=torch.long, device=dev)  # [S]
    S = ids.numel()
    fresh = torch.cat([torch.full((n,), s.kv is None, dtype=torch.bool) for s, n in zip(segments, lengths)]).to(dev)
    exact = torch.cat([torch.full((n,), s.kv is not None and s.exact, dtype=torch.bool)
                       for s, n in zip(segments, lengths)]).to(dev)
    if not bool(fresh[S - n_logits:].all()):
        raise InvalidInput(f"the last {n_logits} tokens must be fresh (a query) to have logits")
    reused_idx = (~fresh & ~exact).nonzero().flatten()  # [R]
    fresh_idx = fresh.nonzero().flatten()
    # The tokens the check layers run: all but the exact ones; ``row`` maps a position to its row among them.
    live = (~exact).nonzero().flatten()
    row = torch.full((S,), -1, dtype=torch.long, device=dev)
    row[live] = torch.arange(live.numel(), device=dev)
    attn0 = layers[0].self_attn
    H = model.config.num_key_value_heads
    Ks, Vs = compose([s.kv for s in segments], lengths, rope_of(model), range(len(layers)),
                     kv_shape=(H, attn0.head_dim), dtype=dtype, device=dev, starts=[s.at for s in segments])
    embed = inner.embed_tokens

    def cos_sin(idx: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inner.rotary_emb(like, position_ids=idx[None])  # each [1, s, D]

    L = len(layers)
    with torch.inference_mode():
        if recompute_ratio in (0.0, 1.0) or selection == "chunk-start":  # no check layer: nothing to select by
            chosen = torch.tensor(chunk_start_tokens(segments, recompute_ratio) if recompute_ratio else [],
                                  dtype=torch.long, device=dev)
            start, idx = 0, torch.sort(torch.cat((chosen, fresh_idx))).values
            h = embed(ids[idx])[None]  # [1, s, hidden]
            layer_tokens: float = int((~exact[chosen]).sum()) * L  # exact tokens (ratio 1) are not reused ones
        else:
            # "deviation": layers 0..check_layer in full; "deviation-kv": layers 0..check_layer-1 in full and
            # only the K/V projections of the check layer (what the deviation needs).
            full_layers = check_layer + 1 if selection == "deviation" else check_layer
            idx = live
            h = embed(ids[idx])[None]  # [1, s, hidden]
            cos, sin = cos_sin(idx, h)
            # The composed K/V of the reused tokens at the check layer, kept before the layers below rewrite it.
            comp_k, comp_v = Ks[check_layer][:, :, reused_idx], Vs[check_layer][:, :, reused_idx]
            for i in range(full_layers):
                h, Ks[i], Vs[i] = _layer(layers[i], h, idx, cos, sin, Ks[i], Vs[i], steer)
            if selection != "deviation":
                x = layers[check_layer].input_layernorm(h)
                k, v = _kv(layers[check_layer], x, cos, sin)
                if live.numel() == S:
                    Ks[check_layer], Vs[check_layer] = k, v
                else:  # the exact tokens' rows stay as loaded
                    Ks[check_layer].index_copy_(2, live, k)
                    Vs[check_layer].index_copy_(2, live, v)
            # Deviation of the reused tokens at the check layer: true (just computed) vs composed.
            d = kv_deviation(Ks[check_layer][:, :, reused_idx], Vs[check_layer][:, :, reused_idx],
                             comp_k, comp_v)  # [R]
            if selection == "deviation-query" and reused_idx.numel():
                # The query: the fresh tokens after the last reused one; how much it reads each token.
                qpos = torch.arange(int(reused_idx[-1]) + 1, S, device=dev)
                qpos = qpos[~exact[qpos]]
                qr = row[qpos]
                q = _q(layers[check_layer], x[:, qr], cos[:, qr], sin[:, qr])
                attn = layers[check_layer].self_attn
                # Steered, the question reads the emphasised tokens more: weigh them as the steered model will.
                bias = steer.bias(attn.layer_idx, qpos, S, q.shape[1], q.dtype, dev) if steer is not None else None
                a = query_attention(q, Ks[check_layer], qpos, attn.scaling, bias)
                d = query_weighted(d, a[reused_idx])
            chosen = reused_idx[select_tokens(d, recompute_ratio)]
            idx = torch.sort(torch.cat((chosen, fresh_idx))).values  # [s]
            h = h.index_select(1, row[idx])
            start = full_layers
            R = int(reused_idx.numel())
            layer_tokens = R * start + int(chosen.numel()) * (L - start)
            if selection != "deviation":
                layer_tokens += R * kv_share(layers[check_layer])
        recomputed = idx[~fresh[idx]]
        cos, sin = cos_sin(idx, h)
        for i in range(start, len(layers)):
            h, Ks[i], Vs[i] = _layer(layers[i], h, idx, cos, sin, Ks[i], Vs[i], steer)
        assert bool((idx[-n_logits:] == torch.arange(S - n_logits, S, device=dev)).all())
        logits = model.lm_head(inner.norm(h[:, -n_logits:]))[0]  # [n_logits, vocab]
    return Blend(logits=logits, keys=Ks, values=Vs, n_tokens=S, n_reused=int(reused_idx.numel()),
                 recomputed=recomputed, layer_tokens=layer_tokens, n_layers=L, n_exact=int(exact.sum()))


def full_prefill(model: Any, ids: Sequence[int], *, n_logits: int = 1) -> Blend:
    """Every token in every layer, by ``blend_prefill``'s own routine (the reference for ratio 1)."""
    return blend_prefill(model, [Segment(list(ids))], recompute_ratio=1.0, n_logits=n_logits)


def blend_cache(model: Any, b: Blend) -> Any:
    """A ``DynamicCache`` holding a blend's K/V, to continue generating from position ``b.n_tokens``."""
    chunk = {}
    for i, (k, v) in enumerate(zip(b.keys, b.values)):
        chunk[f"L{i}.k"], chunk[f"L{i}.v"] = k[0], v[0]
    cache, n = build_cache(model, [chunk])
    assert n == b.n_tokens
    return cache


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


async def _fetch_chunks(client: Any, mid: A.ModelId, namespace: str, addrs: Sequence[A.Address], device: Any,
                        report: RagReport) -> list[dict | None]:
    """Each address's tensors, or ``None`` where the KDN cannot serve it (a miss is a recompute).

    A pipeline per chunk: each is decoded off the event loop as soon as it has arrived and been
    verified, while the others are still on the wire. ``report.fetch_ms`` runs to the last decode.
    """
    from kdn.objects import decode_object, to_torch

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
    _check_model(model)
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
    states = await _fetch_chunks(client, mid, namespace, addrs, device, report)
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
