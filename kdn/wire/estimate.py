"""Moving estimates of a source's round-trip time and bandwidth, and the expected time of a fetch.

Each transfer of ``size`` bytes taking ``seconds`` updates two exponentially
weighted moving averages: small transfers mostly measure latency, large ones
bandwidth. ``expected(size) = rtt + size / bandwidth`` ranks sources; a source
with no samples gets an optimistic prior so it is tried (and measured) once.
Failures inflate the estimate so a failing source falls behind until it
recovers.

A transfer that shared its source with others (a load fetches up to eight
objects at once) saw a share of the source's bandwidth, which is what ranking
and hedging a single object want; a load of many objects goes at the sum. So
each sample also feeds an ``aggregate`` bandwidth, weighted by the transfers'
average company while it ran (``Company``), and ``expected_load(size)`` is what
the load planner asks: the time to move ``size`` bytes as a load does. Without
it a load over a 1 Gbit/s link with 20 ms of delay was expected to take 3x its
time, and the planner computed a prompt it could have loaded (bench/ttft.py).

Estimates go stale: a source not sampled for ``stale_after`` seconds is
ranked by its prior again, so it gets re-measured. Without that, one slow
early sample (a cold cache filling from far away) would exile a near source
for good: it would never be chosen, so never re-measured (seen in
bench/geo.py, where clients stuck to a region 30 ms away).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SMALL = 64 << 10  # transfers below this size update the RTT estimate only


@dataclass
class SourceEstimate:
    rtt: float = 0.001  # seconds; optimistic prior: unmeasured sources get tried
    bandwidth: float = 1e9  # bytes/second
    alpha: float = 0.3
    samples: int = 0
    failures: int = 0
    last_failure: float = 0.0
    stale_after: float = 10.0
    prior_rtt: float | None = None
    prior_bandwidth: float | None = None
    last_sample: float = 0.0
    aggregate: float | None = None  # bytes/second of the source's transfers together (a load's speed) ...
    aggregate_at: float = 0.0  # ... and when it was last sampled
    _penalty: float = field(default=0.0, repr=False)

    def set_prior(self, rtt: float, bandwidth: float | None = None) -> None:
        self.prior_rtt = self.rtt = rtt
        if bandwidth is not None:
            self.bandwidth = bandwidth
        self.prior_bandwidth = self.bandwidth

    def observe(self, size: int, seconds: float, company: float | None = None) -> None:
        """A transfer of ``size`` bytes in ``seconds``; ``company``: the transfers from this source in flight
        beside it, on average over its time, itself included (``Company``); None (unknown: a lower bound
        taken from a hedge still running) leaves the aggregate as it is."""
        self.last_sample = time.monotonic()
        seconds = max(seconds, 1e-6)
        a = self.alpha if self.samples else 1.0
        if size < SMALL:
            self.rtt += a * (seconds - self.rtt)
        else:
            # Attribute the RTT to latency and the rest to bandwidth.
            transfer = max(seconds - self.rtt, seconds * 0.1)
            self.bandwidth += a * (size / transfer - self.bandwidth)
            if company is not None:
                together = size * max(company, 1.0) / transfer
                self.aggregate = together if self.aggregate is None else (
                    self.aggregate + self.alpha * (together - self.aggregate))
                self.aggregate_at = self.last_sample
        self.samples += 1
        self._penalty = 0.0

    def fail(self) -> None:
        self.failures += 1
        self.last_failure = time.monotonic()
        self._penalty = min(max(self._penalty * 2, 0.05), 5.0)

    def expected(self, size: int) -> float:
        now = time.monotonic()
        rtt, bandwidth = self.rtt, self.bandwidth
        if self.samples and self.prior_rtt is not None and now - self.last_sample > self.stale_after:
            rtt, bandwidth = self.prior_rtt, self.prior_bandwidth or bandwidth  # stale: explore again
        # Failures go stale too: a source that failed during an outage and was not asked since would
        # otherwise carry the penalty until someone happened to ask it (the restored phase of
        # bench/faults.py slow_region_link kept reading from the origin, 3x slower, for that reason).
        penalty = self._penalty if now - self.last_failure <= self.stale_after else 0.0
        return rtt + size / max(bandwidth, 1.0) + penalty

    def expected_load(self, size: int) -> float:
        """Expected seconds to move ``size`` bytes as a load does, many transfers at once: at the aggregate
        bandwidth measured (never below one transfer's); stale or unmeasured, as ``expected``."""
        single = self.expected(size)
        if self.aggregate is None or time.monotonic() - self.aggregate_at > self.stale_after:
            return single
        return min(single, self.expected(0) + size / max(self.aggregate, self.bandwidth, 1.0))


class Company:
    """Transfers in flight per source, integrated over time: the average number in flight while one ran
    (itself included), which scales its sample from its share of the source to the source's speed."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}
        self._area: dict[str, float] = {}  # transfer-seconds so far, per source
        self._at: dict[str, float] = {}

    def _advance(self, source: str, now: float) -> None:
        self._area[source] = self._area.get(source, 0.0) + self._n.get(source, 0) * (now - self._at.get(source, now))
        self._at[source] = now

    def start(self, source: str) -> Mark:
        """A transfer from ``source`` begins; what ``end`` takes back."""
        now = time.perf_counter()
        self._advance(source, now)
        self._n[source] = self._n.get(source, 0) + 1
        return Mark(source, now, self._area[source])

    def end(self, mark: Mark) -> float:
        """The transfer of ``mark`` ended: its average company (counted once; later calls read it back)."""
        if mark.company is None:
            now = time.perf_counter()
            self._advance(mark.source, now)
            self._n[mark.source] -= 1
            duration = now - mark.t0
            mark.company = (self._area[mark.source] - mark.area0) / duration if duration > 0 else 1.0
        return mark.company


@dataclass
class Mark:
    """One transfer's start, for ``Company.end``."""

    source: str
    t0: float
    area0: float
    company: float | None = None


class Estimates:
    """Estimates by source id (a URL or a node id)."""

    def __init__(self) -> None:
        self._by: dict[str, SourceEstimate] = {}

    def __getitem__(self, source: str) -> SourceEstimate:
        est = self._by.get(source)
        if est is None:
            est = self._by[source] = SourceEstimate()
        return est

    def least_measured(self, size: int) -> float | None:
        """The least expected time to load ``size`` bytes from a source this has measured at least once; None
        before any sample (an unmeasured estimate is a guess, not a speed)."""
        return min((e.expected_load(size) for e in self._by.values() if e.samples), default=None)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {s: {"rtt_ms": e.rtt * 1e3, "mbps": e.bandwidth * 8 / 1e6, "samples": e.samples, "failures": e.failures}
                for s, e in self._by.items()}


# Decodes shorter than this are dominated by fixed costs (a header parse, a thread hop): not a speed sample.
MIN_DECODE_SAMPLE = 256 << 10


class DecodeSpeeds:
    """This machine's measured decode speed per encoding (decoded bytes/s), with ``kdn.format.encodings.TABLE`` as
    the prior until an encoding has been timed here.

    Which encoding is cheapest to load depends on the receiver as much as on the link: ``raw`` is a copy,
    ``zstd`` a decode that runs at 0.4 GB/s on a loaded 2-core VM and several times that on a server core.
    A constant would pick ``zstd`` on a fast link for a slow receiver (and ``raw`` over a WAN for a fast
    one), so every decode a client times refines the figure (an exponentially weighted average of
    decoded bytes over seconds, ``alpha`` the weight of a new sample). One instance per process by
    default (:data:`DECODE`): the speed is the machine's, and a vLLM scheduler that chooses and a worker
    that decodes share it when they share a process.
    """

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._rate: dict[str, float] = {}
        self._samples: dict[str, int] = {}

    def observe(self, encoding: str, decoded_bytes: int, seconds: float) -> None:
        if decoded_bytes < MIN_DECODE_SAMPLE or not seconds > 0:
            return
        rate = decoded_bytes / seconds
        n = self._samples.get(encoding, 0)
        old = self._rate.get(encoding, rate)
        self._rate[encoding] = rate if n == 0 else old + self.alpha * (rate - old)
        self._samples[encoding] = n + 1

    def rate(self, encoding: str) -> float:
        """Decoded bytes per second: measured here when sampled, else the table's one-thread figure."""
        from kdn.format.encodings import TABLE

        measured = self._rate.get(encoding)
        return measured if measured is not None else TABLE[encoding].decode_mbps * 1e6

    def seconds(self, encoding: str, encoded_size: int) -> float:
        """Expected time to decode an object of ``encoded_size`` bytes (its decoded size from the table's ratio)."""
        from kdn.format.encodings import TABLE

        return encoded_size * TABLE[encoding].ratio / max(self.rate(encoding), 1.0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {e: {"mbps": r / 1e6, "samples": self._samples[e]} for e, r in self._rate.items()}


DECODE = DecodeSpeeds()
