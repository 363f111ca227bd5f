"""A request's steering plan, engine-neutral: which heads, which keys, from which query on.

Both adapters steer the same way (PASTA-style: in the chosen ``(layer, head)`` pairs, queries at positions
``>= query_from`` get ``log(alpha)`` added to their scores for the keys of the map's ``region`` that are not
emphasized); they differ only in where the bias enters the engine's attention (``kdn.adapters.hf.steer``
wraps transformers' attention function, ``kdn.adapters.vllm.steer`` recomputes the steered rows after
vLLM's kernel). This module turns an emphasis map and a request's overrides into that plan, with the same
defaults and the same refusals for both.

    spec = resolve(emphasis, n_layers=30, n_heads=9, steer=None, n_ids=len(prompt))  # None: do not steer
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput, ModelMismatch


@dataclass(frozen=True)
class SteerSpec:
    """A resolved plan: small, hashable and picklable (it travels in vLLM's per-step connector metadata)."""

    heads: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, query heads), layers ascending
    region: tuple[int, int]
    spans: tuple[tuple[int, int], ...]  # emphasized, inside region
    alpha: float
    query_from: int  # queries at absolute positions >= this are steered

    def layer_heads(self, layer: int) -> tuple[int, ...]:
        return self._by_layer.get(layer, ())

    @functools.cached_property
    def _by_layer(self) -> dict[int, tuple[int, ...]]:  # asked per job, layer and step by vLLM's wrapper
        return dict(self.heads)

    def key_bias(self, n: int | None = None) -> torch.Tensor:
        """``[n]`` float32 (default ``region[1]``): ``log(alpha)`` on region keys not emphasized, 0 elsewhere."""
        full = _key_bias(self.region, self.spans, self.alpha)
        if n is None or n == full.numel():
            return full.clone()
        out = torch.zeros(n, dtype=torch.float32)
        m = min(n, full.numel())
        out[:m] = full[:m]
        return out


@functools.lru_cache(maxsize=64)
def _key_bias(region: tuple[int, int], spans: tuple[tuple[int, int], ...], alpha: float) -> torch.Tensor:
    rs, re_ = region
    kb = torch.zeros(re_, dtype=torch.float32)
    kb[rs:re_] = math.log(alpha)
    for s, e in spans:
        kb[s:e] = 0.0
    return kb


def default_heads(n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """Every query head of the middle third of the layers: what a map without ``heads`` steers."""
    return [(la, h) for la in range(n_layers // 3, (2 * n_layers) // 3) for h in range(n_heads)]


def spec(emphasis: EmphasisMap | dict | None, *, n_layers: int, n_heads: int, alpha: float | None = None,
         heads: Sequence[Sequence[int]] | None = None, query_from: int | None = None) -> SteerSpec | None:
    """The plan for ``emphasis`` on a model of ``n_layers`` x ``n_heads`` (request overrides: ``alpha``,
    ``heads``, ``query_from``), or None when there is nothing to steer: no map, no spans, no heads, or
    ``alpha == 1`` (exactly the unsteered model). ``ModelMismatch`` for heads the model does not have."""
    if emphasis is None:
        return None
    emap = emphasis if isinstance(emphasis, EmphasisMap) else EmphasisMap.from_dict(emphasis)
    a = emap.alpha if alpha is None else alpha
    if isinstance(a, bool) or not isinstance(a, numbers.Real) or not (math.isfinite(a) and 0.0 < a <= 1.0):
        raise InvalidInput(f"steering alpha must be in (0, 1], got {str(a)[:20]}")
    a = float(a)
    chosen = list(heads) if heads is not None else (list(emap.heads) or default_heads(n_layers, n_heads))
    if a == 1.0 or not emap.spans or not chosen:
        return None
    qf = emap.region[1] if query_from is None else _index(query_from, "steering query_from")
    if qf < 0:
        raise InvalidInput(f"steering query_from must be a position, got {qf}")
    return SteerSpec(by_layer(chosen, n_layers, n_heads), (int(emap.region[0]), int(emap.region[1])),
                     tuple((int(s), int(e)) for s, e in emap.spans), a, qf)


def by_layer(pairs: Sequence[object], n_layers: int, n_heads: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``[layer, head]`` pairs grouped as ``((layer, heads), ...)``, layers ascending; ``InvalidInput`` for what is
    not a pair of ints, ``ModelMismatch`` for a head the model does not have."""
    per: dict[int, set[int]] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidInput(f"a head is a [layer, head] pair of ints, got {str(pair)[:30]}")
        la, h = _index(pair[0], "a head's layer"), _index(pair[1], "a head's index")
        if not (0 <= la < n_layers and 0 <= h < n_heads):
            raise ModelMismatch(f"head ({la}, {h}) is not in this model ({n_layers} layers x {n_heads} heads)")
        per.setdefault(la, set()).add(h)
    return tuple((la, tuple(sorted(hs))) for la, hs in sorted(per.items()))


def _index(v: object, what: str) -> int:
    """An integer (numpy's too), not a bool or a float."""
    if isinstance(v, bool):
        raise InvalidInput(f"{what} must be an int, got {v}")
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInput(f"{what} must be an int, got {str(v)[:20]}") from None


def resolve(emphasis: EmphasisMap | dict | None, *, n_layers: int, n_heads: int, steer: bool | None = None,
            alpha: float | None = None, heads: Sequence[Sequence[int]] | None = None,
            query_from: int | None = None, n_ids: int | None = None) -> SteerSpec | None:
    """A request's plan, or None: off by default, on per request (``steer=True``) or per manifest
    (``steer=None`` and the map's ``default_on``); ``steer=False`` wins over the map. ``n_ids``: the
    prompt's length, which the map's region must fit in."""
    if emphasis is None:
        if steer:
            raise InvalidInput("steer=True needs the manifest's emphasis map (emphasis=manifest['emphasis'])")
        return None
    emap = emphasis if isinstance(emphasis, EmphasisMap) else EmphasisMap.from_dict(emphasis)
    if not (steer if steer is not None else emap.default_on):
        return None
    if n_ids is not None and emap.region[1] > n_ids:
        raise InvalidInput(f"the emphasis map covers {emap.region[1]} tokens, the prompt has {n_ids}")
    return spec(emap, n_layers=n_layers, n_heads=n_heads, alpha=alpha, heads=heads, query_from=query_from)


def salt(emphasis: EmphasisMap | dict, *, alpha: float | None = None, heads: Sequence[Sequence[int]] | None = None,
         query_from: int | None = None) -> str:
    """A name for a steering request's inputs (``kdn-steer-`` and 16 hex digits): engines that cache K/V by
    tokens alone (vLLM's prefix cache) keep steered blocks apart under it, since a steered layer changes
    the K/V of every later layer at the steered positions."""
    emap = emphasis if isinstance(emphasis, EmphasisMap) else EmphasisMap.from_dict(emphasis)
    body = {"map": emap.to_dict(), "alpha": alpha, "heads": None if heads is None else [list(p) for p in heads],
            "query_from": query_from}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return "kdn-steer-" + digest[:16]
