"""A host tier put together from its config: segment, store, fills from the edges, the engines' socket, its
metrics and, with a region, its region's policies; started, and stopped in the reverse order (``kdn host
serve`` runs one until a signal).

Nothing of it outlives the process, on purpose: it is a cache. A restarted host makes a new segment and
fills again from its edges; an engine that had it mapped reads the old pages until it reconnects.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

from kdn.auth import Grant, Grants, read_token
from kdn.edge.eviction import policy_named
from kdn.host.config import HostConfig
from kdn.host.fill import EdgeUpstream, Filler, Upstream
from kdn.host.metrics import serve_metrics, snapshot
from kdn.host.ops import Ops
from kdn.host.policies import HostPolicies
from kdn.host.segment import Segment
from kdn.host.server import HostServer, check_socket_free
from kdn.host.store import HostStore
from kdn.service.records import DenyFloor

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp import web

    from kdn.client.client import KDNClient


class HostTier:
    """A running host tier; ``await HostTier.start(config)``, then ``await tier.close()``."""

    def __init__(self, config: HostConfig, segment: Segment, store: HostStore, filler: Filler,
                 server: HostServer, client: KDNClient | None) -> None:
        self.config, self.segment, self.store, self.filler = config, segment, store, filler
        self.server, self.client = server, client
        self.metrics: web.AppRunner | None = None
        self.metrics_port: int | None = None
        self.policies: HostPolicies | None = None  # the region's (config.region), followed

    @classmethod
    async def start(cls, config: HostConfig, *, upstream: Upstream | None = None) -> HostTier:
        """Start one. ``upstream`` replaces the fills from ``config``'s edges (tests of the host alone)."""
        await check_socket_free(config.socket)  # before the segment: a live host's would be replaced
        grants = Grants.from_file(config.token_file, anonymous=Grant(frozenset({"read"}), frozenset({"public"})))
        client = None
        if upstream is None:
            from kdn.client.client import KDNClient

            # Not hedged: a fill's body lands in one block of the segment, one attempt at a time.
            client = KDNClient(edges=list(config.edges), origin=config.origin, max_hedges=0, ca=config.ca,
                               token=read_token(config.upstream_token_file) if config.upstream_token_file else None,
                               trusted_keys=config.trusted_keys, timeout=config.timeout)
            upstream = EdgeUpstream(client)
        segment = Segment.create(config.segment, config.segment_bytes, group=config.group)
        try:
            store = HostStore(segment.size, config.held_budget, policy_named(config.eviction), stamps=segment.view)
            filler = Filler(store, segment.view, upstream)
            ops = Ops(store, filler, grants, segment, lambda: tier.stats(),
                      floor=DenyFloor(config.deny_floor_ms / 1000))
            server = HostServer(ops, store, config.socket, group=config.group)
            tier = cls(config, segment, store, filler, server, client)
        except BaseException:
            segment.close()
            if client is not None:
                await client.close()
            raise
        try:
            await server.start()
            if config.region is not None:
                tier.policies = await HostPolicies.start(config, store, filler, client)
            if config.metrics_port is not None:
                tier.metrics, tier.metrics_port = await serve_metrics(tier.stats, config.metrics_host,
                                                                      config.metrics_port)
        except BaseException:
            await tier.close()  # (what started stops; the rest is closed as never started)
            raise
        return tier

    def stats(self) -> dict[str, int]:
        return snapshot(self.store, self.filler, self.server, self.policies)

    async def close(self) -> None:
        """The policies first (their runs' fills stop), then the engines (their leases end), the fills, the
        edges' client, the metrics, the segment."""
        if self.policies is not None:
            await self.policies.close()
        await self.server.close()
        await self.filler.close()
        if self.client is not None:
            await self.client.close()
        if self.metrics is not None:
            await self.metrics.cleanup()
        self.segment.close()


async def serve(config: HostConfig) -> None:
    """Run a host tier until SIGINT or SIGTERM."""
    tier = await HostTier.start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    follows = f"; policies of region {config.region}" if config.region is not None else ""
    print(f"kdn host: {config.socket} (segment {config.segment}, {config.segment_bytes} bytes{follows})", flush=True)
    try:
        await stop.wait()
    finally:
        await tier.close()
