"""Attention steering from a manifest's emphasis map (PASTA-style), on loaded KV, without recomputing it.

    from kdn.adapters.hf.steer import plan, steering

    st = plan(model, manifest.emphasis_map)          # None when there is nothing to do (alpha 1, no spans)
    with steering(model, st):                         # forwards in this block (this thread / task) are steered
        logits = continue_from_cache(model, cache, n, question_ids)

For the selected ``(layer, head)`` pairs, queries at positions ``>= query_from`` (by default the end of the
published knowledge: the question and the generated tokens) get an additive bias of ``log(alpha)`` on
their attention scores to the tokens of the map's ``region`` that are not emphasized -- PASTA's "scale the
other tokens' attention by alpha, renormalize", written as a mask. Keys outside the region (the chat
template, the question, generated tokens) and all other heads are untouched. Since only the new queries
change, the cached K/V of the knowledge -- loaded from the KDN, or computed by a plain prefill -- stay
exactly what they are: steering works on reused prefixes and blended contexts alike (``rag.blend_prefill``
takes the same plan).

How: the model's attention implementation is wrapped once (``install``: ``sdpa`` becomes
``kdn_steer_sdpa``, which calls the original with the same arguments when no plan is active, so an
unsteered forward stays bit-identical); ``steering`` sets the plan in a context variable for the
forwards inside it. ``alpha = 1`` (or no heads, or no spans) gives no plan at all.

``attention_to`` measures, per layer and head, how much attention the last query rows pay to given key
positions: how ``bench/steer.py`` picks the heads to steer (on a tuning split) and how an origin derives
a map from probe questions (``derive_emphasis``).
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kdn.emphasis import EmphasisMap, merge_spans
from kdn.errors import InvalidInput, ModelMismatch

from kdn.adapters import steering as steering_plan

PREFIX = "kdn_steer_"
_ACTIVE: contextvars.ContextVar[Steer | None] = contextvars.ContextVar("kdn_steer", default=None)
_RECORD: contextvars.ContextVar[tuple[int, Callable[[int, torch.Tensor], None]] | None] = contextvars.ContextVar(
    "kdn_steer_record", default=None)


@dataclass(frozen=True)
class Steer:
    """A steering plan: ``heads`` per layer, the key bias, and where the steered queries start."""

    heads: dict[int, tuple[int, ...]]  # layer -> query-head indices
    key_bias: torch.Tensor  # [region_end] float32: log(alpha) on region tokens not emphasized, else 0
    query_from: int  # queries at absolute positions >= this are steered
    alpha: float

    def shifted(self, offset: int) -> Steer:
        """The same plan for a context where the steered text sits ``offset`` positions later (``offset >= 0``)."""
        if offset < 0:
            raise InvalidInput("a steering plan moves only forward")
        bias = torch.cat((torch.zeros(offset), self.key_bias))
        return Steer(self.heads, bias, self.query_from + offset, self.alpha)

    def bias(self, layer: int, q_pos: torch.Tensor, k_len: int, n_heads: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | None:
        """The additive bias ``[1, n_heads, len(q_pos), k_len]`` of ``layer`` (None if it is not steered)."""
        heads = self.heads.get(layer)
        if not heads:
            return None
        kb = torch.zeros(k_len, dtype=torch.float32)
        n = min(k_len, self.key_bias.numel())
        kb[:n] = self.key_bias[:n]
        rows = (q_pos >= self.query_from).to(torch.float32).cpu()  # [q]
        head_on = torch.zeros(n_heads, dtype=torch.float32)
        head_on[list(heads)] = 1.0
        b = head_on[:, None, None] * rows[None, :, None] * kb[None, None, :]  # [H, q, k]
        return b[None].to(device=device, dtype=dtype)


def default_heads(model: Any) -> list[tuple[int, int]]:
    """Every query head of the middle third of the layers: what a map without ``heads`` steers."""
    return steering_plan.default_heads(*_dims(model))


def _dims(model: Any) -> tuple[int, int]:
    cfg = model.config
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


def of_spec(s: steering_plan.SteerSpec | None) -> Steer | None:
    """The wrapper's form of an engine-neutral plan (``kdn.adapters.steering``)."""
    if s is None:
        return None
    return Steer(dict(s.heads), s.key_bias(), s.query_from, s.alpha)


def plan(model: Any, emphasis: EmphasisMap | dict | None, *, alpha: float | None = None,
         heads: Sequence[tuple[int, int]] | None = None, query_from: int | None = None) -> Steer | None:
    """The plan for ``emphasis`` on ``model`` (request overrides: ``alpha``, ``heads``, ``query_from``), or None.

    None when there is nothing to steer: no map, no spans, no heads, or ``alpha == 1`` (exactly the
    unsteered model). Heads must exist in this model (``ModelMismatch`` otherwise).
    """
    n_layers, n_heads = _dims(model)
    return of_spec(steering_plan.spec(emphasis, n_layers=n_layers, n_heads=n_heads, alpha=alpha, heads=heads,
                                      query_from=query_from))


def resolve(model: Any, emphasis: EmphasisMap | dict | None, *, steer: bool | None, alpha: float | None = None,
            heads: Sequence[tuple[int, int]] | None = None, n_ids: int | None = None) -> Steer | None:
    """A request's plan (off by default; on per request or per map: ``kdn.adapters.steering.resolve``)."""
    n_layers, n_heads = _dims(model)
    return of_spec(steering_plan.resolve(emphasis, n_layers=n_layers, n_heads=n_heads, steer=steer, alpha=alpha,
                                         heads=heads, n_ids=n_ids))


# --- the attention wrapper -------------------------------------------------------------------


def _inner_attention(name: str, module: Any) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ModelMismatch(f"{type(module).__name__} has no eager attention function to steer")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def _wrapper(inner: str) -> Callable[..., Any]:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        st, rec = _ACTIVE.get(), _RECORD.get()
        layer = getattr(module, "layer_idx", None)
        fn = _inner_attention(inner, module)
        if st is not None and layer is not None and layer in st.heads:
            q_len, k_len = query.shape[2], key.shape[2]
            first = k_len - q_len  # batch 1, keys at positions 0..k_len-1 (a KDN cache): query i is at first + i
            r0 = min(max(st.query_from - first, 0), q_len)  # the first steered query row
            if r0 == q_len:
                pass  # no steered row in this forward (the document's own prefill)
            elif r0 > 0 and rec is None:
                # A prefill that runs past query_from: the rows before it attend as usual (the plain, fast
                # path, causal over the keys up to each row), the rest with the bias; outputs [B, q, H, D].
                k0 = first + r0
                m0 = None if attention_mask is None else attention_mask[..., :r0, :k0]
                a, _ = fn(module, query[:, :, :r0], key[:, :, :k0], value[:, :, :k0], m0, **kwargs)
                m1 = None if attention_mask is None else attention_mask[..., r0:, :]
                b_out, _ = _steered(fn, st, layer, module, query[:, :, r0:], key, value, m1, **kwargs)
                return torch.cat((a, b_out), dim=1), None
            else:
                return _steered(fn, st, layer, module, query, key, value, attention_mask, rec=rec, **kwargs)
        if rec is not None and layer is not None:  # what this layer attends to
            rec[1](layer, _probs(module, query, key, attention_mask, rec[0]))
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def _steered(fn: Callable[..., Any], st: Steer, layer: int, module: Any, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: torch.Tensor | None,
             rec: tuple[int, Callable[[int, torch.Tensor], None]] | None = None, **kwargs: Any) -> Any:
    """Attention of the last ``query`` rows over all keys with the plan's bias added to the mask."""
    q_len, k_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(k_len - q_len, k_len)
    mask = _float_mask(attention_mask, q_len, k_len, query.dtype, query.device)
    b = st.bias(layer, q_pos, k_len, query.shape[1], query.dtype, query.device)
    if b is not None:
        mask = mask + b
    if rec is not None:  # what this layer attends to, steering included
        rec[1](layer, _probs(module, query, key, mask, rec[0]))
    return fn(module, query, key, value, mask, **kwargs)


def _float_mask(mask: torch.Tensor | None, q_len: int, k_len: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The attention mask as additive floats ``[B, 1|H, q, k]`` (``None``: causal)."""
    if mask is None:
        qp = torch.arange(k_len - q_len, k_len, device=device)
        mask = torch.arange(k_len, device=device)[None, :] <= qp[:, None]
        mask = mask[None, None]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask[..., :k_len].to(dtype)


def _probs(module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
           rows: int) -> torch.Tensor:
    """Attention probabilities of the last ``rows`` query rows, per query head: ``[H, rows, k]`` float32."""
    q_len = query.shape[2]
    q = query[0, :, -rows:].float()  # [H, r, D]
    k = key[0].float()  # [Hkv, k, D]
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    scale = float(getattr(module, "scaling", q.shape[-1] ** -0.5))
    s = torch.einsum("hqd,hkd->hqk", q, k) * scale
    m = _float_mask(mask, q_len, k.shape[1], torch.float32, s.device)[0, :, -rows:]  # [1|H, r, k]
    return torch.softmax(s + m, dim=-1)


def install(model: Any) -> None:
    """Wrap ``model``'s attention implementation once (idempotent); inert until ``steering`` sets a plan."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = model.config
    cur = cfg._attn_implementation
    if cur.startswith(PREFIX):
        return
    if cur not in ("sdpa", "eager"):
        raise ModelMismatch(f"steering wraps sdpa or eager attention, this model uses {cur!r}")
    name = PREFIX + cur
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _wrapper(cur))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[cur])
    for sub in [cfg, *(getattr(m, "config", None) for m in model.modules())]:
        if sub is not None and getattr(sub, "_attn_implementation", None) == cur:
            sub._attn_implementation = name


@contextmanager
def steering(model: Any, st: Steer | None) -> Iterator[None]:
    """Forwards of ``model`` in this block (this thread or task) run with plan ``st`` (None: unsteered)."""
    if st is None:
        yield
        return
    install(model)
    token = _ACTIVE.set(st)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def attention_to(model: Any, last_rows: int = 1) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, record each layer's attention of the last ``last_rows`` query rows: ``{layer: [H, rows, k]}``
    (the latest forward's; float32, on the CPU)."""
    install(model)
    out: dict[int, torch.Tensor] = {}

    def rec(layer: int, probs: torch.Tensor) -> None:
        out[layer] = probs.cpu()

    token = _RECORD.set((last_rows, rec))
    try:
        yield out
    finally:
        _RECORD.reset(token)


def head_scores(probs: dict[int, torch.Tensor], positions: Sequence[int]) -> torch.Tensor:
    """``[layers, heads]``: the mean attention mass the recorded rows put on ``positions``."""
    idx = torch.as_tensor(list(positions), dtype=torch.long)
    layers = sorted(probs)
    return torch.stack([probs[la][:, :, idx].sum(-1).mean(-1) for la in layers])


def derive_emphasis(model: Any, tokens: Sequence[int], region: tuple[int, int], probes: Sequence[Sequence[int]], *,
                    heads: Sequence[tuple[int, int]] | None = None, top: int = 8, width: int = 4,
                    alpha: float = 0.05) -> EmphasisMap:
    """A map from the model's own attention: for each probe (token ids appended after ``tokens``), the
    ``top`` region positions its last token attends to most (summed over ``heads``, default
    ``default_heads``), widened by ``width`` tokens on each side. One forward per probe."""
    from kdn.adapters.hf.extract import _forward, new_cache

    chosen = list(heads) if heads is not None else default_heads(model)
    rs, re_ = region
    if not (0 <= rs < re_ <= len(tokens)):
        raise InvalidInput(f"region [{rs}, {re_}) is not inside the {len(tokens)} tokens")
    dev = next(model.parameters()).device
    spans: list[tuple[int, int]] = []
    for probe in probes:
        ids = torch.as_tensor(list(tokens) + list(probe), dtype=torch.long, device=dev)
        with torch.inference_mode(), attention_to(model) as att:
            _forward(model, new_cache(model), ids, 0, logits=False)
        mass = torch.zeros(re_ - rs)
        for la, h in chosen:
            mass += att[la][h, -1, rs:re_]
        for p in torch.topk(mass, min(top, mass.numel())).indices.tolist():
            spans.append((rs + p - width, rs + p + width + 1))
    return EmphasisMap(spans=merge_spans(spans, rs, re_), region=(rs, re_), alpha=alpha,
                       heads=tuple((int(a), int(b)) for a, b in (heads or ())), source="probe")
