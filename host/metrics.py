"""The host tier's numbers: one snapshot (the ``stats`` op's answer) and the same as Prometheus metrics,
``kdn_host_*``, on a loopback ``/metrics`` (``--metrics-port``).

The snapshot is read off the store, the fills and the socket when asked, so the op and the scrape cannot
disagree, and nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kdn.host.fill import Filler
from kdn.host.server import HostServer
from kdn.host.store import HostStore

if TYPE_CHECKING:  # pragma: no cover
    from kdn.host.policies import HostPolicies

GAUGES = {
    "objects": "Objects held in the segment",
    "used_bytes": "Segment bytes in blocks: held objects and fills in flight",
    "budget_bytes": "Bytes the host tier holds at most",
    "segment_bytes": "Size of the shared-memory segment",
    "leased_bytes": "Bytes of objects an engine holds a lease on (never evicted)",
    "leases": "Leases held by engines now",
    "connections": "Engine connections open now",
    "fills_in_flight": "Fills from the edges in progress",
    "holes": "Free blocks of the segment (1: not fragmented)",
    "pinned": "Objects held that a pin policy keeps (never evicted)",
    "pinned_bytes": "Bytes of the objects pin policies keep",
    "policies": "Policies in force for this host's region (--region)",
}
COUNTERS = {
    "hits": "Leases of an object already held",
    "misses": "Leases that had to fill first",
    "fills": "Objects filled from the edges, verified and held",
    "fill_bytes": "Bytes filled from the edges",
    "fill_failures": "Fills no source delivered intact",
    "evictions": "Objects evicted for room",
    "evicted_bytes": "Bytes evicted for room",
    "refused": "Objects refused for want of room (leases, pins and fills keep the rest)",
    "pins_refused": "Objects of a pin policy refused for want of room (the pins fill the budget)",
    "policy_applies": "Changes to the pins the region's policies handed the host",
    "warm_runs": "Warm and push runs of the region's policies started",
    "warm_failures": "Warm and push runs that failed",
    "warmed": "Objects warm and push runs filled",
}
NO_POLICIES = {"policies": 0, "policy_applies": 0, "warm_runs": 0, "warm_failures": 0, "warmed": 0}


def snapshot(store: HostStore, filler: Filler, server: HostServer, policies: HostPolicies | None = None
             ) -> dict[str, int]:
    s = store.stats
    return {
        **(policies.stats() if policies is not None else NO_POLICIES),
        "objects": len(store), "used_bytes": store.used, "budget_bytes": store.budget,
        "segment_bytes": store.segment_bytes, "leased_bytes": store.leased_bytes, "leases": store.leases,
        "connections": server.connections, "fills_in_flight": len(filler.flight), "holes": store.holes,
        "hits": s.hits, "misses": s.misses, "fills": s.fills, "fill_bytes": s.fill_bytes,
        "fill_failures": filler.failed, "evictions": s.evictions, "evicted_bytes": s.evicted_bytes,
        "refused": s.refused, "pinned": store.pinned, "pinned_bytes": store.pinned_bytes,
        "pins_refused": s.pins_refused,
    }


class Collector:
    """``kdn_host_*`` read off a snapshot at each scrape."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        now = self.read()
        for name, text in GAUGES.items():
            yield GaugeMetricFamily(f"kdn_host_{name}", text, value=now[name])
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(f"kdn_host_{name}", text, value=now[name])


async def serve_metrics(read: Callable[[], dict[str, int]], host: str, port: int) -> tuple[web.AppRunner, int]:
    """``GET /metrics`` on ``host:port`` (0: any free port); the runner to clean up, and the port."""
    registry = CollectorRegistry()
    registry.register(Collector(read))

    async def metrics(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])
