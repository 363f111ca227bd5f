"""Moving estimates of a source's round-trip time and bandwidth, and the expected time of a fetch.

Each transfer of ``size`` bytes taking ``seconds`` updates two exponentially
weighted moving averages: small transfers mostly measure latency, large ones
bandwidth. ``expected(size) = rtt + size / bandwidth`` ranks sources; a source
with no samples gets an optimistic prior so it is tried (and measured) once.
Failures inflate the estimate so a failing source falls behind until it
recovers.

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
    _penalty: float = field(default=0.0, repr=False)

    def set_prior(self, rtt: float, bandwidth: float | None = None) -> None:
        self.prior_rtt = self.rtt = rtt
        if bandwidth is not None:
            self.bandwidth = bandwidth
        self.prior_bandwidth = self.bandwidth

    def observe(self, size: int, seconds: float) -> None:
        self.last_sample = time.monotonic()
        seconds = max(seconds, 1e-6)
        a = self.alpha if self.samples else 1.0
        if size < SMALL:
            self.rtt += a * (seconds - self.rtt)
        else:
            # Attribute the RTT to latency and the rest to bandwidth.
            transfer = max(seconds - self.rtt, seconds * 0.1)
            self.bandwidth += a * (size / transfer - self.bandwidth)
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


class Estimates:
    """Estimates by source id (a URL or a node id)."""

    def __init__(self) -> None:
        self._by: dict[str, SourceEstimate] = {}

    def __getitem__(self, source: str) -> SourceEstimate:
        est = self._by.get(source)
        if est is None:
            est = self._by[source] = SourceEstimate()
        return est

    def rank(self, sources: list[str], size: int) -> list[str]:
        """Sources by expected time for ``size`` bytes, fastest first (stable for ties)."""
        return sorted(sources, key=lambda s: self[s].expected(size))

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {s: {"rtt_ms": e.rtt * 1e3, "mbps": e.bandwidth * 8 / 1e6, "samples": e.samples, "failures": e.failures}
                for s, e in self._by.items()}
