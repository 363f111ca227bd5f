"""The upper tier chosen by measured latency, when no ``upper`` policy names one.

An upper tier (origin shield, ``edge/fill.py``) is the region whose edges every other region fills
through, so the origin serves about one fill per object whatever the number of regions. An operator
names it with ``kdn policy set NAME --upper --region R``. When none does, the edges choose it the way
a tiered CDN does (Cloudflare's smart tiered cache: the tier nearest the origin): each edge measures
its round trip to the origins and advertises it in its node record; every edge reads the others'
from the membership it already watches and takes the same region, the one whose edges sit nearest
the origin, when it is clearly nearer than the rest:

    rtt(R) = median of R's edges' advertised round trips (each the minimum of PROBE_SAMPLES probes)
    best   = the region of least rtt (ties: the first name)
    upper  = best  if rtt(best) <= AUTO_RATIO x median(rtt of the other regions)
                   and median(others) - rtt(best) >= AUTO_MIN_GAP_MS;  else none

Where every region is about as far from the origin (one machine's loopback, one data centre), no region
is chosen: a tier there would add a hop and save little. Every edge computes the same function of the
same records, so they agree as soon as their views do; while two views differ for a moment, a fill
through the "wrong" region is still correct (a tier's fill goes to the origin alone: no loop). A probe
is ``GET /healthz`` on each origin, in series, every PROBE_EVERY_S; the record is rewritten only when
the advertised figure moves by more than ADVERTISE_CHANGE (and 1 ms), so the watch every edge keeps on
``nodes/edge/`` carries one event per real change, not one per probe.

A registry writer that can write node records could advertise a false round trip and draw other
regions' fills: they stay verified bytes (every body is checked against its signed record), a failing
upper tier rests behind the filler's breaker, and ``--require-admission`` leaves out nodes an operator
did not admit. ``kdn edge serve --upper-tier policy`` turns the choice off (only policies name tiers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from kdn.registry import NodeRecord

log = logging.getLogger(__name__)

EXTRA_KEY = "origin_rtt_ms"  # a node record's advertised round trip to its nearest origin, in ms
PROBE_EVERY_S = 30.0
PROBE_SAMPLES = 3  # per origin and round: the least of them (queueing on either side only adds)
PROBE_TIMEOUT_S = 2.0
ADVERTISE_CHANGE = 0.2  # rewrite the record when the figure moves by more than this share (and 1 ms)
AUTO_RATIO = 0.5
AUTO_MIN_GAP_MS = 20.0
MAX_RTT_MS = 60_000.0  # an advertised figure outside [0, this] is ignored


def advertised(rec: NodeRecord) -> float | None:
    """The round trip ``rec`` advertises, if it is a number in range (it comes from the registry)."""
    v = rec.extra.get(EXTRA_KEY)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and 0.0 <= v <= MAX_RTT_MS else None


def choose(regions: Mapping[str, Iterable[NodeRecord]]) -> str | None:
    """The region every edge should fill through, from the round trips its live edges advertise; None
    when fewer than two regions advertise one, or none is clearly nearer the origin than the rest."""
    rtts: dict[str, float] = {}
    for region, nodes in regions.items():
        figures = [v for v in (advertised(n) for n in nodes) if v is not None]
        if figures:
            rtts[region] = statistics.median(figures)
    if len(rtts) < 2:
        return None
    best = min(sorted(rtts), key=lambda r: rtts[r])
    others = statistics.median(v for r, v in rtts.items() if r != best)
    if rtts[best] <= AUTO_RATIO * others and others - rtts[best] >= AUTO_MIN_GAP_MS:
        return best
    return None


class AutoUpper:
    """This edge's side of the choice: measure the origins, advertise the figure, read everyone's.

    ``probe`` times one request to an origin (seconds; raises when it fails); ``advertise`` rewrites
    this edge's node record with the figure (``Membership.advertise``); ``regions`` and ``revision``
    are the membership's view and its registry revision (the choice is recomputed only when it moves).
    """

    def __init__(self, *, origin_urls: Callable[[], list[str]], probe: Callable[[str], Awaitable[float]],
                 advertise: Callable[[dict[str, object]], Awaitable[None]],
                 regions: Callable[[], Mapping[str, Iterable[NodeRecord]]], revision: Callable[[], int],
                 every_s: float = PROBE_EVERY_S) -> None:
        self._origin_urls = origin_urls
        self._probe = probe
        self._advertise = advertise
        self._regions = regions
        self._revision = revision
        self.every_s = every_s
        self.rtt_ms: float | None = None  # the last round's figure (None: no origin answered yet)
        self.advertised_ms: float | None = None  # what this edge's record says
        self.rounds = 0
        self._cached: tuple[int, str | None] = (-1, None)
        self._task: asyncio.Task[None] | None = None

    @property
    def region(self) -> str | None:
        """The region chosen now, from the membership's view (None: no upper tier by latency)."""
        rev = self._revision()
        if self._cached[0] != rev:
            self._cached = (rev, choose(self._regions()))
        return self._cached[1]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kdn-edge-upper-probe")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def measure(self) -> float | None:
        """One round: the least round trip to any origin over PROBE_SAMPLES probes each, in ms."""
        best: float | None = None
        for url in self._origin_urls()[:8]:
            for _ in range(PROBE_SAMPLES):
                try:
                    async with asyncio.timeout(PROBE_TIMEOUT_S):
                        s = await self._probe(url)
                except Exception as e:  # noqa: BLE001 -- any failure: no figure from this origin this round
                    log.debug("upper-tier probe of %s failed: %s", url[:80], e)
                    break  # this origin does not answer now: the others may
                ms = s * 1e3
                best = ms if best is None else min(best, ms)
        return best

    async def round(self) -> None:
        """Measure, and rewrite the record when the figure moved enough (or was never advertised)."""
        self.rounds += 1
        ms = await self.measure()
        if ms is None:
            return
        self.rtt_ms = ms
        old = self.advertised_ms
        if old is not None and abs(ms - old) <= max(ADVERTISE_CHANGE * old, 1.0):
            return
        figure = round(ms, 2)
        try:
            await self._advertise({EXTRA_KEY: figure})
        except Exception as e:  # noqa: BLE001 -- a registry error: try again next round
            log.warning("could not advertise this edge's origin round trip (%s); retrying in %.0f s", e, self.every_s)
            return
        self.advertised_ms = figure

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await self.round()
            await asyncio.sleep(max(self.every_s - (time.monotonic() - t0), 1.0))
