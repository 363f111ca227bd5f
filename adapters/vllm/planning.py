"""The load planner for vLLM: this engine's measured speeds, and how much of a request's hit to load.

``kdn.planner`` decides; this module gives it what it needs inside vLLM's
scheduler, which never sees a forward itself:

- **the prefill**: a ``PrefillModel`` from the model's config (weights per
  token, layers, attention width), scaled by this engine's own steps. Each
  step is timed from the moment the scheduler built its connector metadata to
  the moment its output came back (``Steps``), less any overlap with the step
  before it (vLLM's async scheduling plans step ``t + 1`` while ``t`` runs);
  steps that loaded from the KDN teach nothing (their time is not compute).
- **the loader**: the wire bytes of each of this engine's loads and the time
  from its start to its last chunk staged, reported by the worker side in its
  stats; a load abandoned at its deadline reports the bytes that landed by
  then (the link's speed while it ran).
- **the link**: the client's least expected time for the bytes;
- **the host tier**: chunks the machine's host tier held at lookup (``Chunk.host``) cost their bytes at the
  host's own measured speed (loads that came wholly from it report it apart: ``Speeds.host_bps``).

``decide`` cuts a ``LoadPlan`` to the number of chunks the planner chose,
still on a block boundary (a hybrid model: still a chunk end), and gives the
load the planner's deadline; a load the entry edge must fill first (a chunk
not in its memory or disk) gets ``kdn.planner.cold_deadline`` (a multiple of
the prefill plus a fill allowance, at most ``load_timeout``: with
``load_timeout`` a lying edge that called every hit cold and stalled cost each
request the whole timeout), and its time teaches the load speed nothing (it
measured the edge's upstream) unless it is given up: then, as for a warm
load, what landed by then is the speed, so the next plan computes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kdn.chunk import Chunk
from kdn.planner import Decision, PrefillModel, Reasons, Speeds, cold_deadline, decide

from kdn.adapters.vllm.plan import LoadPlan, plan_load

MAX_PENDING = 64  # steps timed at once (vLLM has at most a couple in flight); older ones are dropped


def prefill_model(hf_config: Any) -> PrefillModel:
    """The prefill's shape from a model config: the weights one token multiplies (attention projections
    and the MLP, per layer; experts counted as many as a token is routed to), layers, attention width.
    The embedding is a lookup and vLLM computes logits only for the tokens it samples: neither counts."""
    cfg = getattr(hf_config, "get_text_config", lambda: hf_config)()
    h = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(cfg, "head_dim", None) or (h // heads if heads else 0))
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * h)
    experts = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    if experts:
        inter = experts * int(getattr(cfg, "moe_intermediate_size", None) or inter)
    attn = h * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    per_layer = attn + 3 * h * inter  # gated MLP: gate, up, down
    return PrefillModel(params=max(layers * per_layer, 1), layers=layers, attn_width=heads * head_dim)


@dataclass
class _Step:
    scheduled: float  # time.monotonic() when its metadata was built
    work: tuple[tuple[int, int], ...]  # (tokens this step computes, tokens before) per request
    loaded: bool  # it carried KDN loads: its time is not the engine's compute


@dataclass
class Steps:
    """Times vLLM's steps from metadata to output and teaches the prefill model from those that computed."""

    speeds: Speeds
    _pending: deque = field(default_factory=deque)
    _last_end: float = 0.0

    def scheduled(self, work: Sequence[tuple[int, int]], loaded: bool, now: float | None = None) -> None:
        self._pending.append(_Step(time.monotonic() if now is None else now, tuple(work), loaded))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()

    def finished(self, now: float | None = None) -> None:
        """The oldest step's output came back (vLLM returns outputs in step order)."""
        if not self._pending:
            return
        end = time.monotonic() if now is None else now
        st = self._pending.popleft()
        began = max(st.scheduled, self._last_end)  # with async scheduling it waited for the step before it
        self._last_end = end
        if not st.loaded and st.work:
            self.speeds.observe_prefill_step(st.work, end - began)


@dataclass
class Planner:
    """Per request, how much of the published hit this engine should load (``decide``), and what it chose."""

    speeds: Speeds
    link: Callable[[int], float]
    max_deadline_s: float = math.inf
    reasons: Reasons = field(default_factory=Reasons)
    steps: Steps = field(init=False)

    def __post_init__(self) -> None:
        self.steps = Steps(self.speeds)

    def decide(self, lp: LoadPlan, chain: Sequence[Chunk], *, num_tokens: int, block_size: int,
               needs_state: bool) -> tuple[LoadPlan | None, Decision, str]:
        """``lp`` (``plan_load``'s offer from the lookup's ``chain``) cut to what is faster to load than to compute.

        vLLM loads only a prefix past what it holds (no head computed meanwhile), so the planner weighs
        ``k`` leading chunks of ``lp`` loaded then the rest computed, against computing it all. Returns
        the cut plan (None: compute it all), the planner's decision, and its outcome for the metrics
        (``load``, ``load_part``, ``compute``, ``probe``).
        """
        chunks = [replace(p, start=lo, end=hi) for p, lo, hi in lp.spans()]  # (the tokens the load writes)
        decision = decide(chunks, num_tokens - lp.first, link=self.link, speeds=self.speeds,
                          max_deadline_s=self.max_deadline_s, cached=lp.first, probe=not lp.cold)
        if decision.load == len(chunks):
            out: LoadPlan | None = replace(lp, deadline_s=decision.deadline_s)
        elif decision.load == 0:
            out = None
        else:
            last = lp.chunks[decision.load - 1]
            upto = next(i for i, p in enumerate(chain) if p is last) + 1
            out = plan_load(chain[:upto], computed=lp.first, num_tokens=num_tokens, block_size=block_size,
                            needs_state=needs_state)
            if out is not None:
                out = replace(out, deadline_s=decision.deadline_s)
        if out is not None and out.cold:
            # The entry edge fills these first: its upstream's time is not the client's link to estimate, so the
            # bound is what the request can afford, a multiple of its prefill (kdn.planner.cold_deadline).
            out = replace(out, deadline_s=cold_deadline(decision.expected_load_s, self.max_deadline_s,
                                                        decision.compute_all_s))
        outcome = decision.outcome
        if out is not None and out.end < lp.end and outcome == "load":
            outcome = "load_part"
        loaded = out.tokens if out is not None else 0
        self.reasons.count(outcome, loaded, num_tokens - lp.first - loaded)
        return out, decision, outcome

    def snapshot(self) -> dict[str, Any]:
        """What the planner knows and chose (tests, the driver's ``stats``)."""
        pre = self.speeds.prefill
        return {"counts": dict(self.reasons.counts), "tokens_loaded": self.reasons.tokens_loaded,
                "tokens_computed": self.reasons.tokens_computed, "seconds_per_flop": pre.k,
                "fixed_s": pre.fixed, "prefill_samples": pre.samples, "load_bps": self.speeds.load_bps,
                "loads": self.speeds.loads}
