"""The load planner: per request, load what is faster to load than to compute, and compute the rest.

A KDN hit must never make a prompt slower than computing it. On a CPU a
prefill costs seconds and a load milliseconds; on a GPU a prefill of a few
thousand tokens takes tens of milliseconds, and a slow link or decoder can
lose to it. So each request is planned from measured speeds, not assumed ones:

- **the link**: the chosen source's expected time for ``n`` bytes
  (``kdn.wire.estimate``: round trip + n / bandwidth), supplied by the caller;
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
computes the rest, so a stalled source costs a bounded delay, not a hang; and
the loader reports the bytes that did land by then
(``Speeds.observe_load(abandoned=True)``), so a link that turned slow is learnt
from the one load it spoils. That one load need not run to its deadline:
once an eighth of it has passed, a load whose own progress (the bytes its
fetches landed, over the time it has run) says it would end past 1.5x its
deadline is given up at once (``overruns``; one that has landed nothing, at
half its deadline): the link's speed is measured as well from that eighth,
and the request computes ~7/8 of a deadline sooner. A plan that computes everything measures nothing:
once the last load is ``PROBE_AFTER_S`` old, a plan that would compute all
still computes all, and asks its caller to fetch the first chunk *off the
request path* (reason "probe", ``Decision.probe_s``: the probe's own deadline, the
prompt's prefill time, at least ``PROBE_FLOOR_S``): the
engine does not wait for it, so a link still slow costs no request anything,
and one that recovered is seen again; the probe's measurement replaces the
stale one (no moving average drags the old speed along). The probe times the
fetch and its verification, not a decode into the engine's cache: it may
overstate a slow decoder's load speed until the next real load measures it.

A chunk the machine's host tier holds (``kdn.chunk.Chunk.host``: shared memory on the engine's own machine, no socket)
is a source of its own: its bytes cost ``n / Speeds.host_bps`` (this engine's loads that came wholly from
the host; before the first, ``HOST_PRIOR_BPS``), never the link's round trip and bandwidth, and a load
from the host teaches the host's speed only, so a slow edge does not make the host look slow nor the other
way round. A load that mixes them takes the sum of both (they share the engine's cores).

A load the entry edge said it must fill first ("cold": a peer's, another region's or the origin's bytes)
waits on the edge's upstream, which is not the client's link to estimate: its deadline is
``cold_deadline``, ``COLD_OF_PREFILL`` full prefills plus a fill allowance (``COLD_FILL_S``), never the
caller's whole cap (a lying entry edge that labelled every hit cold and stalled cost each request the 30 s
cap, 21-25x its prefill); its progress is judged once its first byte has landed (``overruns(cold=True)``:
the wait for that byte is the fill's). ``ColdFills`` remembers, per source, the cold loads that were given
up: for ``PROBE_AFTER_S`` the next cold load from that source is expected to move as that one did (so the
next plan computes instead of waiting again), and after ``COLD_DOUBTED_AFTER`` of them running, with none it
served in between, that source's "cold" is no longer believed: its hits are planned, bounded and
measured as warm ones.

An engine that already holds ``cached`` leading tokens (vLLM's own prefix
cache) plans only past them: the chunks follow those tokens, and every
prefill is costed after them.

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
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kdn.chunk import Chunk

EWMA = 0.3
LEARN_TOKENS = 256  # a forward of at least this many tokens teaches the prefill model's per-FLOP cost
K_WINDOW = 8  # the per-FLOP cost is the least of the last this many forwards that teach it
DEADLINE_SLACK = 2.0  # a load may take this many times its expected time, plus DEADLINE_FLOOR_S, ...
DEADLINE_FLOOR_S = 0.05
DEADLINE_OF_PREFILL = 0.25  # ... or this share of the full prefill if longer, before it is abandoned
PROBE_AFTER_S = 30.0  # a plan that computes everything probes one chunk if no load was measured for this long
PROBE_FLOOR_S = 1.0  # a probe runs at least this long (or to its last byte) before what landed is its measure
OVERRUN_AFTER = 0.125  # a load is judged by its own progress once this share of its deadline has passed ...
OVERRUN_MARGIN = 1.5  # ... and given up at once if, at the speed it has moved, it would end past this x its deadline
STALL_AFTER = 0.5  # a load that has landed nothing yet is given up once this share of its deadline has passed
OVERRUN_MIN_SHARE = 0.125  # ... by its speed before half its deadline only once it has landed this share of its bytes
COLD_OF_PREFILL = 2.0  # a cold load (the entry edge fills it first) may run this many full prefills ...
COLD_FILL_S = 1.0  # ... plus this allowance for the fill's own trip upstream, before it is given up
HOST_PRIOR_BPS = 1e9  # the host tier's bytes/s into the cache before this engine measured one (a memcpy is ~5-10)
COLD_DOUBTED_AFTER = 2  # a source whose cold loads were given up this many times running is not believed cold


@dataclass
class PrefillModel:
    """Seconds of a prefill of ``n`` tokens after ``after`` cached ones: ``fixed + k * flops(n, after)``.

    ``flops`` counts the weights' multiply-adds (2 x parameters per token) and attention's (QK and AV:
    4 x layers x attention width per token pair); ``k`` (seconds per FLOP, this engine on this device) and
    ``fixed`` (a forward's launch and Python cost) are learnt from the engine's timed forwards.

    ``k`` is the least of the last ``K_WINDOW`` forwards' costs, not a moving average: a fresh engine's first
    forwards pay one-time costs (kernels built per shape, caches and pages touched first), and an average
    starting from them made every prefill look several times dearer than it is, so the planner loaded over a
    link slower than computing until enough samples had diluted them (a fresh vLLM engine: six loads over a
    256 KiB/s edge, each slower than the prefill it replaced). The engine's demonstrated speed is what a
    prefill now costs; an error this way only makes the planner compute where loading would have tied.
    """

    params: int
    layers: int
    attn_width: int  # query heads x head dim
    k: float | None = None  # seconds per FLOP; None until a forward was timed
    fixed: float = 0.0
    samples: int = 0
    fixed_samples: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=K_WINDOW), repr=False)

    def flops(self, n: int, after: int = 0) -> float:
        return 2.0 * self.params * n + 4.0 * self.layers * self.attn_width * n * (after + n / 2)

    def seconds(self, n: int, after: int = 0) -> float:
        """Expected seconds; ``inf`` when unmeasured (callers treat that as "loading wins")."""
        if n <= 0:
            return 0.0
        if self.k is None:
            return math.inf
        return self.fixed + self.k * self.flops(n, after)

    def forget(self) -> None:
        """Unmeasured again (what was learnt of ``k`` no longer holds: another device, a recalibration)."""
        self.k = None
        self.recent.clear()

    def observe(self, n: int, after: int, seconds: float) -> None:
        """A timed forward of ``n`` tokens after ``after``. Small ones (a suffix, a decode step) are mostly
        a forward's fixed cost and teach ``fixed``; only forwards of at least ``LEARN_TOKENS`` teach ``k``:
        learnt from a 16-token suffix on a GPU (all launch overhead), ``k`` would make an 8k prefill look
        ten times dearer than it is, and the planner would load over a link slower than computing."""
        self._learn(n, self.flops(n, after), seconds)

    def observe_step(self, work: Sequence[tuple[int, int]], seconds: float) -> None:
        """A timed engine step that ran ``(n, after)`` for each request in its batch (vLLM: ``n`` scheduled
        tokens of a request that already had ``after``): its tokens and FLOPs add up."""
        self._learn(sum(n for n, _ in work), sum(self.flops(n, a) for n, a in work if n > 0), seconds)

    def _learn(self, n: int, flops: float, seconds: float) -> None:
        if n <= 0 or seconds <= 0 or flops <= 0:
            return
        if n < LEARN_TOKENS:
            self.fixed = seconds if not self.fixed_samples else self.fixed + EWMA * (seconds - self.fixed)
            self.fixed_samples += 1
            return
        self.recent.append(max(seconds - self.fixed, seconds * 0.5) / flops)
        self.k = min(self.recent)
        self.samples += 1


@dataclass
class Speeds:
    """What one engine has measured of itself: its prefill, and its loads' bytes/s into its cache."""

    prefill: PrefillModel
    load_bps: float | None = None  # wire bytes / second, fetch to cache, of this engine's own loads
    loads: int = 0
    host_bps: float | None = None  # the same, of its loads that came wholly from the machine's host tier
    host_loads: int = 0
    last_load: float | None = None  # time.monotonic() of the last load measured
    last_probe: float | None = None  # ... and of the last probe planned (one per PROBE_AFTER_S at most)

    def observe_load(self, nbytes: int, seconds: float, now: float | None = None, *, abandoned: bool = False,
                     probe: bool = False, host: bool = False) -> None:
        """A load of ``nbytes`` that took ``seconds`` (``host``: every byte from the machine's host tier: it
        teaches ``host_bps`` only). One ``abandoned`` at its deadline is reported with the
        bytes that did land in the time it was given (the load's own ``kdn.wire.bodyget.Tally``): the link's
        own speed while it ran, taken at once rather than by a moving average's step, so that the next
        plan computes if that speed loses to the prefill: a link that turned slow costs one load, not one
        per doubling of the deadline (bench/vllm_plan.py: three, before). No byte at all (a stalled
        source) counts as one, a speed that makes every load lose until the probe. A ``probe``'s measurement
        replaces the estimate too: the probe was planned because the last load's speed went stale, and
        planning it marked the link as just probed, so without this it would be blended into the stale speed
        (an engine whose prefill is fast then kept computing over a link that had recovered:
        bench/vllm_plan.py at af77008 on AMX, 14 -> 45 MB/s from a 116 MB/s probe)."""
        if seconds <= 0 or (nbytes <= 0 and not abandoned):
            return
        bps = max(nbytes, 1) / seconds
        if host:  # the host tier's own speed: not the link's (nor is it stale: no probe measures it)
            self.host_bps = bps if self.host_bps is None else self.host_bps + EWMA * (bps - self.host_bps)
            self.host_loads += 1
            return
        if self.load_bps is None or probe or self.stale(now):  # a stale estimate is not blended with
            self.load_bps = bps
        elif abandoned:
            self.load_bps = min(self.load_bps, bps)
        else:
            self.load_bps = self.load_bps + EWMA * (bps - self.load_bps)
        self.loads += 1
        self.last_load = time.monotonic() if now is None else now

    def stale(self, now: float | None = None) -> bool:
        """The last load measured is over ``PROBE_AFTER_S`` old (never measured: not stale, the link's own
        estimate stands)."""
        t = time.monotonic() if now is None else now
        last = max(self.last_load or 0.0, self.last_probe or 0.0)
        return self.last_load is not None and t - last > PROBE_AFTER_S

    def observe_prefill(self, n: int, after: int, seconds: float) -> None:
        self.prefill.observe(n, after, seconds)

    def observe_prefill_step(self, work: Sequence[tuple[int, int]], seconds: float) -> None:
        self.prefill.observe_step(work, seconds)


@dataclass(frozen=True)
class Decision:
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
    probe_s: float = 0.0  # > 0: fetch chunk 0 off the request path, for at most this long, and observe its speed

    def __post_init__(self) -> None:
        assert 0 <= self.head <= self.load, (self.head, self.load)
        assert 0 <= self.tokens_loaded <= self.tokens_total

    @property
    def loads_anything(self) -> bool:
        return self.load > self.head

    @property
    def outcome(self) -> str:
        """What it chose, for metrics: ``load``, ``compute``, ``probe`` (computes, and re-measures the link off
        the request path; the reason's first word)."""
        return self.reason.split(":", 1)[0].split(" ", 1)[0]

    @property
    def speedup(self) -> float:
        """Expected speed against computing everything (1.0 when nothing is loaded)."""
        return self.compute_all_s / self.expected_s if self.expected_s > 0 and math.isfinite(self.compute_all_s) else 1.0


def decide(chunks: Sequence[Chunk], total_tokens: int, *, link: Callable[[int], float], speeds: Speeds,
           overlap: bool = False, max_deadline_s: float = math.inf, cached: int = 0, probe: bool = True,
           now: float | None = None) -> Decision:
    """The fastest split of a request of ``total_tokens`` (past the ``cached`` ones the engine holds) whose
    first ``len(chunks)`` chunks are published.

    ``link(nbytes)``: the expected seconds to fetch that many bytes (round trip included). ``overlap``:
    the engine can compute a head of chunks while the rest loads. ``probe``: where the plan computes
    everything and the measured load speed is stale, ask for chunk 0 to be fetched off the request path
    (``Decision.probe_s``; see the module docstring); callers pass False where the fetch would not measure
    this link (the edge must fill it first).
    """
    n = len(chunks)
    # A stale measured speed is re-measured by a probe off the request path where one can be made; where
    # not (the hit is cold: the edge must fill it first, and a probe would time the edge's upstream), it is
    # not used: the plan goes by the link's estimate, and the load measures the speed again. Otherwise one
    # load given up on a slow link made this engine compute every new document from then on.
    measured = speeds.load_bps if (probe or not speeds.stale(now)) else None
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.tokens)
    assert starts[-1] <= total_tokens, (starts[-1], total_tokens)
    pre = speeds.prefill
    compute_all = pre.seconds(total_tokens, cached)
    if not n:
        return Decision(0, 0, 0, total_tokens, compute_all, compute_all, math.inf, "nothing published")
    load_s = _load_time(chunks, link, measured, speeds.host_bps or HOST_PRIOR_BPS)
    if not math.isfinite(compute_all):  # never timed a prefill: load everything (and learn from the suffix)
        t = load_s(0, n)  # with nothing to weigh it against, only the caller's cap bounds the load
        return Decision(0, n, starts[n], total_tokens, t, compute_all, max_deadline_s,
                        "load: prefill not measured yet", t)
    best = (compute_all, 0, 0)
    for k in range(1, n + 1):
        rest = pre.seconds(total_tokens - starts[k], cached + starts[k])
        for h in (range(0, k) if overlap else (0,)):
            t = max(pre.seconds(starts[h], cached), load_s(h, k)) + rest
            if t < best[0]:
                best = (t, h, k)
    t, h, k = best
    if k == 0:
        return _compute_all(total_tokens, compute_all, load_s(0, n), speeds, probe=probe, now=now,
                            max_deadline_s=max_deadline_s)
    tl = load_s(h, k)
    what = (f"load {k - h} of {n} chunks" + (f", computing the first {h} meanwhile" if h else "")
            + f": {t * 1e3:.1f} ms vs prefill {compute_all * 1e3:.1f} ms")
    return Decision(h, k, starts[k] - starts[h], total_tokens, t, compute_all,
                _deadline(tl, max_deadline_s, compute_all), what, tl)


def _load_time(chunks: Sequence[Chunk], link: Callable[[int], float], measured: float | None,
               host_bps: float) -> Callable[[int, int], float]:
    """Seconds to load chunks ``[h, k)``: the host tier's bytes at ``host_bps``, the rest over the link (its
    estimate, or the engine's ``measured`` loads where slower), the two summed (they share the engine's cores)."""
    nbytes, hosted = [0], [0]  # running sums: all bytes, and those the host tier holds
    for c in chunks:
        nbytes.append(nbytes[-1] + c.size)
        hosted.append(hosted[-1] + (c.size if c.host else 0))

    def load_s(h: int, k: int) -> float:
        hb = hosted[k] - hosted[h]
        b = nbytes[k] - nbytes[h] - hb  # over the link
        t = hb / host_bps
        if b <= 0:
            return t
        t_link = link(b)
        if measured:
            t_link = max(t_link, b / measured)
        return t + t_link

    return load_s


def _compute_all(total_tokens: int, compute_all: float, t_all: float, speeds: Speeds, *, probe: bool,
                 now: float | None, max_deadline_s: float) -> Decision:
    """The plan that computes everything (loading all would take ``t_all``), with a probe of the link where
    the last load measured is stale."""
    why = f"load {t_all * 1e3:.0f} ms + suffix > prefill {compute_all * 1e3:.0f} ms"
    if probe and speeds.stale(now):
        # Computing everything measures nothing: fetch one chunk beside the request, so that a link that
        # recovered is seen. One probe per PROBE_AFTER_S, whether or not it measures (requests before its
        # answer compute). Off the request path, since inside it a probe over a link still slow cost that
        # request the chunk's transfer: 1.33x a prefill in vLLM, bench/vllm_plan.py at ec527af.
        # The probe is cut once it took as long as computing the whole prompt (a link that slow loses
        # anyway, and what landed by then is its measure), but never before PROBE_FLOOR_S: off the request
        # path a longer probe costs nothing, and one cut at a GPU's 20 ms prefill would time mostly its
        # connection's setup, and keep a recovered link looking slow.
        speeds.last_probe = time.monotonic() if now is None else now
        return Decision(0, 0, 0, total_tokens, compute_all, compute_all, math.inf,
                    f"probe: compute, and fetch one chunk off the request path to re-measure the link, "
                    f"the last load measured is stale ({why})", t_all,
                    probe_s=min(max_deadline_s, max(PROBE_FLOOR_S, compute_all)))
    return Decision(0, 0, 0, total_tokens, compute_all, compute_all, math.inf, "compute: " + why, t_all)


def overruns(elapsed_s: float, landed: int, total: int, deadline_s: float, first_s: float | None = None, *,
             cold: bool = False) -> bool:
    """Whether a load that has run ``elapsed_s`` of its ``deadline_s`` and landed ``landed`` of its ``total``
    bytes should be given up now: at the speed it has moved so far it would end past ``OVERRUN_MARGIN`` x its
    deadline, judged only once ``OVERRUN_AFTER`` of the deadline has passed; or it has landed nothing at all
    by ``STALL_AFTER`` of it (a first byte can wait on a connection or a busy machine: an eighth of a
    deadline with nothing in it was seen in CI, on a load whose bytes then came).

    Why: such a load is given up at its deadline anyway, so every moment spent on it past the point that
    showed it is lost to the request; the first load after a link turned slow paid its whole deadline
    (1.34x a prefill in bench/vllm_plan.py). The average since the start, first byte's wait included, can
    only understate the speed; the margin and the eighth are there so a slow start alone gives nothing up.
    With ``first_s`` (seconds from the start to the first byte) the speed is taken from that byte on: the
    wait for it is a round trip, paid once. Nor is a speed judged, before half the deadline, on less than
    ``OVERRUN_MIN_SHARE`` of the load's bytes:
    its first moments are a connection's setup and TCP's slow start, not its speed (bench/ttft.py: a 7.8 MB
    load over a 1 Gbit/s link with a 20 ms delay had landed 256 KiB 65 ms in and was given up, where the
    whole load takes ~90 ms; bench/vllm_plan.py: a 47 MB load over a fast loopback link, 3 MB 30 ms into
    its 208 ms deadline).

    A ``cold`` load (the entry edge fills it first) is judged only once its first byte has landed: the wait
    for that byte is the edge's fill, bounded by the (cold) deadline alone, not by ``STALL_AFTER``."""
    if not math.isfinite(deadline_s) or deadline_s <= 0 or elapsed_s < OVERRUN_AFTER * deadline_s or landed >= total:
        return False
    if landed <= 0:
        return not cold and elapsed_s >= STALL_AFTER * deadline_s
    if landed < OVERRUN_MIN_SHARE * total and elapsed_s < STALL_AFTER * deadline_s:
        return False  # (from half its deadline on, a load is judged by whatever it has landed)
    # ``first_s``: when its first byte landed. The wait for it (a round trip, a connection) is paid once,
    # not once per byte: the speed is what landed since.
    wait = first_s if first_s is not None and 0 <= first_s < elapsed_s else 0.0
    return wait + (elapsed_s - wait) * total / landed > OVERRUN_MARGIN * deadline_s


def _deadline(expected_s: float, cap: float, compute_all_s: float = 0.0) -> float:
    """How long a load may run before what arrived is used and the rest computed. Twice its expected time
    (+ 50 ms) bounds a stalled source; where a prefill is far dearer (a CPU: seconds against a load's
    milliseconds), a quarter of it, so that a noisy moment on the link does not throw away a load that was
    still by far the faster way."""
    slack = DEADLINE_SLACK * expected_s + DEADLINE_FLOOR_S
    if math.isfinite(compute_all_s):
        slack = max(slack, DEADLINE_OF_PREFILL * compute_all_s)
    return min(cap, slack)


def cold_deadline(expected_s: float, cap: float, compute_all_s: float) -> float:
    """How long a cold load (the entry edge fills it first) may run before what arrived is used and the rest
    computed: ``COLD_OF_PREFILL`` x the full prefill + ``COLD_FILL_S``, never less than a warm load of its
    bytes would get, at most ``cap``; ``cap`` where the prefill is not measured yet (nothing to weigh it by).

    Why a multiple of the prefill: the fill's time is the edge's upstream's, which the client cannot estimate,
    so the bound is what the request can afford. Past one prefill a cold load has already lost to computing;
    the rest is a fill's benefit of the doubt (its first byte may wait on an origin a WAN away; once it lands,
    ``overruns`` judges the speed). Giving up costs the edge nothing: its fill runs on for whoever asks next
    (``edge/flight.py``)."""
    if not math.isfinite(compute_all_s):
        return cap
    return min(cap, max(_deadline(expected_s, math.inf, compute_all_s), COLD_OF_PREFILL * compute_all_s + COLD_FILL_S))


@dataclass
class ColdFill:
    """What one source's cold loads showed: how many were given up since one it served completed, and the
    last of those (the bytes it landed in the seconds it was given, and when)."""

    given_up: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    at: float = 0.0  # time.monotonic()


@dataclass
class ColdFills:
    """Per source (its label), the cold loads it was waited on for and that were given up.

    A source's "cold" buys its loads a longer deadline and no judgement before their first byte, so a source
    that says "cold" and then stalls (a lying entry edge) must not be believed for ever: one given-up cold load
    makes that source's cold loads expected to move as that one did for ``PROBE_AFTER_S`` (``expected``: the
    planner then computes them instead of waiting again); ``COLD_DOUBTED_AFTER`` of them running, with no
    load it served in between, and its "cold" is no longer believed (``believed``): its hits are planned as
    warm ones, with the planner's own deadline, judged from their start, and their time measures the link.
    A load it serves to the end clears it (``served``)."""

    by: dict[str, ColdFill] = field(default_factory=dict)

    def gave_up(self, source: str, nbytes: int, seconds: float, now: float | None = None) -> None:
        f = self.by.setdefault(source, ColdFill())
        f.given_up += 1
        f.nbytes, f.seconds, f.at = max(nbytes, 0), max(seconds, 0.0), time.monotonic() if now is None else now

    def served(self, source: str) -> None:
        self.by.pop(source, None)

    def believed(self, source: str) -> bool:
        """Whether ``source`` saying "cold" still earns a load the cold deadline."""
        f = self.by.get(source)
        return f is None or f.given_up < COLD_DOUBTED_AFTER

    def expected(self, source: str, nbytes: int, now: float | None = None) -> float:
        """Seconds a cold load of ``nbytes`` from ``source`` is expected to take by its last given-up one, if
        that was within ``PROBE_AFTER_S``; else 0 (nothing known against it). None landed: ``inf``."""
        f = self.by.get(source)
        t = time.monotonic() if now is None else now
        if f is None or not f.given_up or t - f.at > PROBE_AFTER_S or nbytes <= 0:
            return 0.0
        return nbytes * f.seconds / f.nbytes if f.nbytes > 0 else math.inf


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
