"""Blending for HF Llama-family models: a context of reused (standalone) and fresh segments prefilled
CacheBlend style; ``kdn.adapters.hf.rag`` drives it from the KDN, ``kdn.adapters.hf.edits`` across an edit.

``blend_prefill`` follows CacheBlend:

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
Decoder layers are driven here, with explicit positions, for ``llama`` and ``qwen2`` (full attention)
models, through the steps of ``HFOps`` (embed_tokens, each layer's norms, projections and MLP,
rotary_emb); an engine that owns its modules gives the same steps (vLLM: ``kdn.adapters.vllm.blend_run``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kdn.errors import InvalidInput, ModelMismatch
from kdn.kernels.blend import compose, kv_deviation, n_select, query_attention, query_weighted, select_tokens
from kdn.kernels.rope import rope_of

from kdn.adapters.hf.cache import build_cache
from kdn.adapters.hf.steer import Steer

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


def check_model(model: Any) -> None:
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


class HFOps:
    """The steps ``blend_prefill`` takes through a transformers Llama-family model, layer by layer.

    Another engine drives the same blend by giving these methods for its own modules (vLLM's:
    ``kdn.adapters.vllm.blend.VllmOps``). Hidden states are ``[1, s, hidden]``; q/k/v ``[1, heads, s, D]``,
    q and k rotated; ``rot`` is whatever ``rotary`` returns for the positions ``idx`` (here: cos, sin).
    """

    def __init__(self, model: Any) -> None:
        check_model(model)
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.config = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_heads, self.head_dim = model.config.num_key_value_heads, self.layers[0].self_attn.head_dim
        self.rope = rope_of(model)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)[None]  # [1, s, hidden]

    def rotary(self, idx: torch.Tensor, like: torch.Tensor) -> Any:
        return self.inner.rotary_emb(like, position_ids=idx[None])  # (cos, sin), each [1, s, D]

    @staticmethod
    def rot_rows(rot: Any, rows: torch.Tensor) -> Any:
        return rot[0][:, rows], rot[1][:, rows]

    def norm_in(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[i].input_layernorm(h)

    def kv(self, i: int, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K (rotated) and V of ``x`` [1, s, hidden], its input after ``input_layernorm``."""
        attn = self.layers[i].self_attn
        s, D = x.shape[1], attn.head_dim
        k = attn.k_proj(x).view(1, s, -1, D).transpose(1, 2)
        v = attn.v_proj(x).view(1, s, -1, D).transpose(1, 2)
        return _rope(k, *rot), v

    def q(self, i: int, x: torch.Tensor, rot: Any) -> torch.Tensor:
        attn = self.layers[i].self_attn
        s, D = x.shape[1], attn.head_dim
        return _rope(attn.q_proj(x).view(1, s, -1, D).transpose(1, 2), *rot)

    def qkv(self, i: int, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q(i, x, rot)
        k, v = self.kv(i, x, rot)
        return q, k, v

    def scaling(self, i: int) -> float:
        return self.layers[i].self_attn.scaling

    def finish(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``i`` after attention: ``o`` [1, Hq, s, D] through o_proj, the residual, the MLP."""
        layer = self.layers[i]
        s = h.shape[1]
        h = h + layer.self_attn.o_proj(o.transpose(1, 2).reshape(1, s, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(h))[0]  # [n, vocab]

    def kv_share(self, i: int) -> float:
        return kv_share(self.layers[i])


def ops_of(model: Any) -> Any:
    """``model``'s blend steps: an engine's own ops object as it is (it has ``qkv``), else a transformers model's."""
    return model if hasattr(model, "qkv") and hasattr(model, "finish") else HFOps(model)


# Queries of a partial recompute are cut by position into at most this many bands of the context; each
# band's queries attend to the keys up to its last position only (one masked call over every key does
# twice the causal work: masked keys cost as much). Bands with no query cost nothing, so queries bunched
# together (the question at the end, a compose-only blend) are one call, not eight. Few queries take fewer
# bands (one per ``_BAND_QUERIES``): a call's fixed cost outweighs the masked keys' work there.
_QUERY_GROUPS = 8
_BAND_QUERIES = 64


def _groups(idx: torch.Tensor, S: int, bands: int = _QUERY_GROUPS) -> list[tuple[int, int]]:
    """``[a, b)`` runs of the ascending positions ``idx`` [s] that fall in the same band of ``S / bands`` positions."""
    band = -(-S // bands)
    _, counts = torch.unique_consecutive(torch.div(idx, band, rounding_mode="floor"), return_counts=True)
    out, a = [], 0
    for c in counts.tolist():
        out.append((a, a + c))
        a += c
    return out


@dataclass
class _Bands:
    """How the queries at positions ``idx`` attend, made once for every layer they run: per band of queries
    ``[a, b)``, the keys it sees (``m``) and its causal mask ``[b-a, m]``; ``whole``: every position (plain
    causal attention, unless steered)."""

    idx: torch.Tensor
    calls: list[tuple[int, int, int, torch.Tensor]]
    whole: bool

    @staticmethod
    def of(idx: torch.Tensor, S: int) -> _Bands:
        s = idx.numel()
        calls = []
        for a, b in _groups(idx, S, min(_QUERY_GROUPS, max(1, s // _BAND_QUERIES))):
            m = int(idx[b - 1]) + 1  # keys past the group's last position are masked for all of it
            calls.append((a, b, m, torch.arange(m, device=idx.device)[None, :] <= idx[a:b, None]))
        return _Bands(idx, calls, s == S)


def _attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, bands: _Bands, scale: float,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries at positions ``bands.idx`` [s] (ascending) over K/V [1, Hkv, S, D]:
    [1, Hq, s, D]. ``bias``: an additive ``[1, Hq, s, S]`` term on the scores (steering, ``kdn.adapters.hf.steer``)."""
    if bands.whole and bias is None:  # every position: plain causal attention
        return F.scaled_dot_product_attention(q, K, V, is_causal=True, scale=scale, enable_gqa=True)
    outs = []
    for a, b, m, mask in bands.calls:
        am: torch.Tensor = mask[None, None]
        if bias is not None:  # steered heads: an additive mask
            am = torch.zeros(am.shape, dtype=q.dtype, device=q.device).masked_fill(~am, torch.finfo(q.dtype).min)
            am = am + bias[:, :, a:b, :m]
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], K[:, :, :m], V[:, :, :m], attn_mask=am,
                                                   scale=scale, enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _layer(ops: Any, i: int, h: torch.Tensor, bands: _Bands, rot: Any, K: torch.Tensor, V: torch.Tensor,
           steer: Steer | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder layer ``i`` for the tokens ``bands.idx`` (positions = indices, ascending) over the context's K/V.

    h: [1, s, hidden] of tokens idx [s]; K, V: [1, Hkv, S, D] of the whole context,
    rows ``idx`` replaced, in place, by the ones computed here. Returns (h', K, V).
    """
    idx = bands.idx
    x = ops.norm_in(i, h)  # [1, s, hidden]
    q, k, v = ops.qkv(i, x, rot)  # [1, Hq, s, D]; [1, Hkv, s, D] each
    K.index_copy_(2, idx, k)  # [1, Hkv, S, D]
    V.index_copy_(2, idx, v)
    bias = steer.bias(i, idx, K.shape[2], q.shape[1], q.dtype, q.device) if steer is not None else None
    o = _attend(q, K, V, bands, ops.scaling(i), bias)  # [1, Hq, s, D]
    return ops.finish(i, h, o), K, V


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
                  n_logits: int = 1, selection: str = "deviation-query", steer: Steer | None = None,
                  upto: int | None = None) -> Blend:
    """Prefill a context of reused and fresh segments, CacheBlend style (see the module doc).

    ``model``: a transformers model, or an engine's blend steps (``HFOps``' methods: vLLM's ``VllmOps``).
    The last ``n_logits`` tokens must be fresh (their logits are returned; 0: none, an engine that computes
    the last token itself). ``steer``: a steering plan (``kdn.adapters.hf.steer``) in the composed context's
    positions; it biases the queries it covers. ``upto`` (with ``n_logits=0``): only the K/V of positions
    below it are wanted (an engine computes the rest itself): later tokens serve the check as the question
    and run no further (their K/V past the check layer are left as composed).
    """
    ops = ops_of(model)
    if upto is not None and n_logits:
        raise InvalidInput("upto is for a blend without logits (n_logits=0)")
    _check_args(ops, recompute_ratio, check_layer, selection)
    c = _context(ops, segments, n_logits)
    L = len(ops.layers)
    with torch.inference_mode():
        if recompute_ratio in (0.0, 1.0) or selection == "chunk-start":  # no check layer: nothing to select by
            chosen = torch.tensor(chunk_start_tokens(segments, recompute_ratio) if recompute_ratio else [],
                                  dtype=torch.long, device=c.dev)
            start, idx = 0, torch.sort(torch.cat((chosen, c.fresh_idx))).values
            idx = idx[idx < upto] if upto is not None else idx
            h = ops.embed(c.ids[idx])  # [1, s, hidden]
            layer_tokens: float = int((~c.exact[chosen]).sum()) * L  # exact tokens (ratio 1) are not reused ones
        else:
            start, idx, h, layer_tokens = _check_and_select(ops, c, recompute_ratio, check_layer, selection, steer)
            if upto is not None:  # past the check, nothing at or after ``upto`` is wanted
                keep = idx < upto
                idx, h = idx[keep], h[:, keep]
        recomputed = idx[~c.fresh[idx]]
        rot = ops.rotary(idx, h)
        bands = _Bands.of(idx, c.S)
        for i in range(start, L):
            h, c.Ks[i], c.Vs[i] = _layer(ops, i, h, bands, rot, c.Ks[i], c.Vs[i], steer)
        S = c.S
        assert bool((idx[len(idx) - n_logits:] == torch.arange(S - n_logits, S, device=c.dev)).all())
        logits = ops.logits(h[:, -n_logits:]) if n_logits else h.new_empty((0,))  # [n_logits, vocab]
    return Blend(logits=logits, keys=c.Ks, values=c.Vs, n_tokens=S, n_reused=int(c.reused_idx.numel()),
                 recomputed=recomputed, layer_tokens=layer_tokens, n_layers=L, n_exact=int(c.exact.sum()))


def _check_args(ops: Any, recompute_ratio: float, check_layer: int, selection: str) -> None:
    if not 0.0 <= recompute_ratio <= 1.0:
        raise InvalidInput(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
    if selection not in SELECTIONS:
        raise InvalidInput(f"selection must be one of {list(SELECTIONS)}, got {selection!r}")
    n_layers = len(ops.layers)
    if not 0 <= check_layer < n_layers:
        raise InvalidInput(f"check_layer {check_layer} is not a layer of this {n_layers}-layer model")
    if selection in ("deviation-kv", "deviation-query") and check_layer == 0:
        raise InvalidInput(f"{selection} needs check_layer >= 1 (layer 0's K/V do not depend on the context)")


@dataclass
class _Context:
    """The composed context: its tokens, which are fresh, exact or reused, and the composed K/V per layer."""

    dev: torch.device
    ids: torch.Tensor  # [S]
    S: int
    fresh: torch.Tensor  # [S] bool: computed here
    exact: torch.Tensor  # [S] bool: loaded as they are, never checked
    reused_idx: torch.Tensor  # [R]: neither
    fresh_idx: torch.Tensor
    live: torch.Tensor  # the tokens the check layers run: all but the exact ones
    row: torch.Tensor  # [S]: a position's row among ``live`` (-1: not live)
    Ks: list[torch.Tensor]  # per layer [1, Hkv, S, D]
    Vs: list[torch.Tensor]


def _context(ops: Any, segments: Sequence[Segment], n_logits: int) -> _Context:
    dev, dtype = ops.device, ops.dtype
    lengths = [len(s.ids) for s in segments]
    if not lengths or min(lengths) == 0:
        raise InvalidInput("every segment needs at least one token")
    ids = torch.tensor([t for s in segments for t in s.ids], dtype=torch.long, device=dev)  # [S]
    S = ids.numel()
    fresh = torch.cat([torch.full((n,), s.kv is None, dtype=torch.bool) for s, n in zip(segments, lengths)]).to(dev)
    exact = torch.cat([torch.full((n,), s.kv is not None and s.exact, dtype=torch.bool)
                       for s, n in zip(segments, lengths)]).to(dev)
    if n_logits and not bool(fresh[S - n_logits:].all()):
        raise InvalidInput(f"the last {n_logits} tokens must be fresh (a query) to have logits")
    live = (~exact).nonzero().flatten()
    row = torch.full((S,), -1, dtype=torch.long, device=dev)
    row[live] = torch.arange(live.numel(), device=dev)
    Ks, Vs = compose([s.kv for s in segments], lengths, ops.rope, range(len(ops.layers)),
                     kv_shape=(ops.kv_heads, ops.head_dim), dtype=dtype, device=dev,
                     starts=[s.at for s in segments])
    return _Context(dev, ids, S, fresh, exact, (~fresh & ~exact).nonzero().flatten(), fresh.nonzero().flatten(),
                    live, row, Ks, Vs)


def _check_and_select(ops: Any, c: _Context, ratio: float, check_layer: int, selection: str,
                      steer: Steer | None) -> tuple[int, torch.Tensor, torch.Tensor, float]:
    """The check layers for every live token, then the selection: (the first layer left to run, the tokens
    that run it, their hidden states, the (reused token, layer) pairs the check cost and the rest will)."""
    Ks, Vs, reused_idx = c.Ks, c.Vs, c.reused_idx
    # "deviation": layers 0..check_layer in full; "deviation-kv": layers 0..check_layer-1 in full and
    # only the K/V projections of the check layer (what the deviation needs).
    full_layers = check_layer + 1 if selection == "deviation" else check_layer
    idx = c.live
    h = ops.embed(c.ids[idx])  # [1, s, hidden]
    rot = ops.rotary(idx, h)
    # The composed K/V of the reused tokens at the check layer, kept before the layers below rewrite it.
    comp_k, comp_v = Ks[check_layer][:, :, reused_idx], Vs[check_layer][:, :, reused_idx]
    bands = _Bands.of(idx, c.S)
    for i in range(full_layers):
        h, Ks[i], Vs[i] = _layer(ops, i, h, bands, rot, Ks[i], Vs[i], steer)
    if selection != "deviation":
        x = ops.norm_in(check_layer, h)
        k, v = ops.kv(check_layer, x, rot)
        if c.live.numel() == c.S:
            Ks[check_layer], Vs[check_layer] = k, v
        else:  # the exact tokens' rows stay as loaded
            Ks[check_layer].index_copy_(2, c.live, k)
            Vs[check_layer].index_copy_(2, c.live, v)
    # Deviation of the reused tokens at the check layer: true (just computed) vs composed.
    d = kv_deviation(Ks[check_layer][:, :, reused_idx], Vs[check_layer][:, :, reused_idx], comp_k, comp_v)  # [R]
    if selection == "deviation-query" and reused_idx.numel():
        # The query: the fresh tokens after the last reused one; how much it reads each token.
        qpos = torch.arange(int(reused_idx[-1]) + 1, c.S, device=c.dev)
        qpos = qpos[~c.exact[qpos]]
        qr = c.row[qpos]
        q = ops.q(check_layer, x[:, qr], ops.rot_rows(rot, qr))
        # Steered, the question reads the emphasised tokens more: weigh them as the steered model will.
        bias = steer.bias(check_layer, qpos, c.S, q.shape[1], q.dtype, c.dev) if steer is not None else None
        a = query_attention(q, Ks[check_layer], qpos, ops.scaling(check_layer), bias)
        d = query_weighted(d, a[reused_idx])
    chosen = reused_idx[select_tokens(d, ratio)]
    idx = torch.sort(torch.cat((chosen, c.fresh_idx))).values  # [s]
    h = h.index_select(1, c.row[idx])
    R = int(reused_idx.numel())
    layer_tokens: float = R * full_layers + int(chosen.numel()) * (len(ops.layers) - full_layers)
    if selection != "deviation":
        layer_tokens += R * ops.kv_share(check_layer)
    return full_layers, idx, h, layer_tokens


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
