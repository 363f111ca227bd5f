"""The load planner: per request, load what is faster to load than to compute, and compute the rest.

A KDN hit must never make a prompt slower than computing it. On a CPU a
prefill costs seconds and a load milliseconds; on a GPU a prefill of a few
thousand tokens takes tens of milliseconds, and a slow link or decoder can
lose to it. So each request is planned from measured speeds, not assumed ones:

- **the link**: the chosen source's expected time for ``n`` bytes
  (``kdn.estimate``: round trip + n / bandwidth), supplied by the caller;
- **the loader**: bytes/s from the wire into the engine's cache (fetch,
  verify, decode, write), a moving estimate of this engine's own loads
  (``Speeds.observe_load``); its prior is the link's;
- **the engine's prefill**: ``PrefillModel``, seconds for ``n`` tokens after
  ``s`` cached ones, from the model's shape (weights' FLOPs per token plus
  attention's, which grows with ``s``) scaled by this engine's own timings
  (``Speeds.observe_prefill``). Until it has timed a prefill, the planner
  loads everything (the reason says so): loading is what the KDN exists for,
  and the first computed suffix calibrates it.

For ``k`` leading chunks loaded (``t_k`` tokens), the time to the first token is

    T(k) = load(chunks 0..k) + prefill(L - t_k tokens after t_k)

and, for an engine that can compute its head while the tail loads (the
transformers adapter; vLLM loads only a prefix past what it holds),

    T(h, k) = max(prefill(t_h), load(chunks h..k)) + prefill(L - t_k after t_k).

The plan is the least of these, ``T(0)`` (compute everything) included. Its
``deadline_s`` bounds the load: past it, the loader uses what arrived and
computes the rest, so a stalled source costs a bounded delay, not a hang.

Worked example (numbers from docs/design.md): an 8k-token prompt, 32 chunks
of 32 MiB (a Llama-3-8B shape), a prefill model that says 246 ms for the whole
prompt. Over a 50 GB/s pinned host copy, load(32) ~ 21 ms: load all, 11x. Over
a 1 GB/s WAN link, load(32) ~ 1 s: compute all (``reason`` "compute: load
1074 ms > prefill 246 ms"). Over 10 GB/s, the whole load (107 ms) wins, and
with head overlap a few head chunks computed during the tail's transfer win a
little more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

EWMA = 0.3
LEARN_TOKENS = 256  # a forward of at least this many tokens teaches the prefill model's per-FLOP cost
DEADLINE_SLACK = 2.0  # a load may take this many times its expected time, plus DEADLINE_FLOOR_S, ...
DEADLINE_FLOOR_S = 0.05
DEADLINE_OF_PREFILL = 0.25  # ... or this share of the full prefill if longer, before it is abandoned


@dataclass(frozen=True)
class Chunk:
    """One object of a prefix: the tokens it covers and the bytes on the wire."""

    tokens: int
    nbytes: int

    def __post_init__(self) -> None:
        assert self.tokens > 0 and self.nbytes >= 0, (self.tokens, self.nbytes)


@dataclass
class PrefillModel:
    """Seconds of a prefill of ``n`` tokens after ``after`` cached ones: ``fixed + k * flops(n, after)``.

    ``flops`` counts the weights' multiply-adds (2 x parameters per token) and attention's (QK and AV:
    4 x layers x attention width per token pair); ``k`` (seconds per FLOP, this engine on this device) and
    ``fixed`` (a forward's launch and Python cost) are learnt from the engine's timed forwards.
    """

    params: int
    layers: int
    attn_width: int  # query heads x head dim
    k: float | None = None  # seconds per FLOP; None until a forward was timed
    fixed: float = 0.0
    samples: int = 0
    fixed_samples: int = 0

    def flops(self, n: int, after: int = 0) -> float:
        return 2.0 * self.params * n + 4.0 * self.layers * self.attn_width * n * (after + n / 2)

    def seconds(self, n: int, after: int = 0) -> float:
        """Expected seconds; ``inf`` when unmeasured (callers treat that as "loading wins")."""
        if n <= 0:
            return 0.0
        if self.k is None:
            return math.inf
        return self.fixed + self.k * self.flops(n, after)

    def observe(self, n: int, after: int, seconds: float) -> None:
        """A timed forward of ``n`` tokens after ``after``. Small ones (a suffix, a decode step) are mostly
        a forward's fixed cost and teach ``fixed``; only forwards of at least ``LEARN_TOKENS`` teach ``k``:
        learnt from a 16-token suffix on a GPU (all launch overhead), ``k`` would make an 8k prefill look
        ten times dearer than it is, and the planner would load over a link slower than computing."""
        if n <= 0 or seconds <= 0:
            return
        if n < LEARN_TOKENS:
            self.fixed = seconds if not self.fixed_samples else self.fixed + EWMA * (seconds - self.fixed)
            self.fixed_samples += 1
            return
        k = max(seconds - self.fixed, seconds * 0.5) / self.flops(n, after)
        self.k = k if self.k is None else self.k + EWMA * (k - self.k)
        self.samples += 1


@dataclass
class Speeds:
    """What one engine has measured of itself: its prefill, and its loads' bytes/s into its cache."""

    prefill: PrefillModel
    load_bps: float | None = None  # wire bytes / second, fetch to cache, of this engine's own loads
    loads: int = 0

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        bps = nbytes / seconds
        self.load_bps = bps if self.load_bps is None else self.load_bps + EWMA * (bps - self.load_bps)
        self.loads += 1

    def observe_prefill(self, n: int, after: int, seconds: float) -> None:
        self.prefill.observe(n, after, seconds)


@dataclass(frozen=True)
class Plan:
    """Compute chunks ``[0, head)`` while loading ``[head, load)``; compute everything after ``load``."""

    head: int
    load: int
    tokens_loaded: int
    tokens_total: int
    expected_s: float
    compute_all_s: float
    deadline_s: float  # of the load; past it the loader gives up (inf: no bound)
    reason: str
    expected_load_s: float = 0.0

    def __post_init__(self) -> None:
        assert 0 <= self.head <= self.load, (self.head, self.load)
        assert 0 <= self.tokens_loaded <= self.tokens_total

    @property
    def loads_anything(self) -> bool:
        return self.load > self.head

    @property
    def speedup(self) -> float:
        """Expected speed against computing everything (1.0 when nothing is loaded)."""
        return self.compute_all_s / self.expected_s if self.expected_s > 0 and math.isfinite(self.compute_all_s) else 1.0


def plan(chunks: Sequence[Chunk], total_tokens: int, *, link: Callable[[int], float], speeds: Speeds,
         overlap: bool = False, max_deadline_s: float = math.inf) -> Plan:
    """The fastest split of a request of ``total_tokens`` whose first ``len(chunks)`` chunks are published.

    ``link(nbytes)``: the expected seconds to fetch that many bytes (round trip included). ``overlap``:
    the engine can compute a head of chunks while the rest loads.
    """
    n = len(chunks)
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.tokens)
    assert starts[-1] <= total_tokens, (starts[-1], total_tokens)
    pre = speeds.prefill
    compute_all = pre.seconds(total_tokens)
    if not n:
        return Plan(0, 0, 0, total_tokens, compute_all, compute_all, math.inf, "nothing published")
    nbytes = [0]
    for c in chunks:
        nbytes.append(nbytes[-1] + c.nbytes)

    def load_s(h: int, k: int) -> float:
        b = nbytes[k] - nbytes[h]
        if b <= 0:
            return 0.0
        t = link(b)
        if speeds.load_bps:
            t = max(t, b / speeds.load_bps)
        return t

    if not math.isfinite(compute_all):  # never timed a prefill: load everything (and learn from the suffix)
        t = load_s(0, n)  # with nothing to weigh it against, only the caller's cap bounds the load
        return Plan(0, n, starts[n], total_tokens, t, compute_all, max_deadline_s, "load: prefill not measured yet", t)
    best = (compute_all, 0, 0)
    for k in range(1, n + 1):
        rest = pre.seconds(total_tokens - starts[k], starts[k])
        for h in (range(0, k) if overlap else (0,)):
            t = max(pre.seconds(starts[h]), load_s(h, k)) + rest
            if t < best[0]:
                best = (t, h, k)
    t, h, k = best
    if k == 0:
        t_all = load_s(0, n)
        return Plan(0, 0, 0, total_tokens, compute_all, compute_all, math.inf,
                    f"compute: load {t_all * 1e3:.0f} ms + suffix > prefill {compute_all * 1e3:.0f} ms", t_all)
    tl = load_s(h, k)
    what = (f"load {k - h} of {n} chunks" + (f", computing the first {h} meanwhile" if h else "")
            + f": {t * 1e3:.1f} ms vs prefill {compute_all * 1e3:.1f} ms")
    return Plan(h, k, starts[k] - starts[h], total_tokens, t, compute_all,
                _deadline(tl, max_deadline_s, compute_all), what, tl)


def _deadline(expected_s: float, cap: float, compute_all_s: float = 0.0) -> float:
    """How long a load may run before what arrived is used and the rest computed. Twice its expected time
    (+ 50 ms) bounds a stalled source; where a prefill is far dearer (a CPU: seconds against a load's
    milliseconds), a quarter of it, so that a noisy moment on the link does not throw away a load that was
    still by far the faster way."""
    slack = DEADLINE_SLACK * expected_s + DEADLINE_FLOOR_S
    if math.isfinite(compute_all_s):
        slack = max(slack, DEADLINE_OF_PREFILL * compute_all_s)
    return min(cap, slack)


@dataclass
class Reasons:
    """Counts of plans by outcome (metrics): loaded all, loaded part, computed all, load abandoned."""

    counts: dict[str, int] = field(default_factory=dict)
    tokens_loaded: int = 0
    tokens_computed: int = 0

    def count(self, outcome: str, loaded: int, computed: int) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.tokens_loaded += loaded
        self.tokens_computed += computed
