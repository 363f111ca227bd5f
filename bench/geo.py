"""Geo-distributed simulation: source selection across three regions, over emulated links, on loopback.

    python -P bench/geo.py [--requests 200] [--docs 10] [--doc-tokens 2200] [--seed 7 | --seeds 1,2,3] [--zipf 1.0]
                           [--remote-share 0.2] [--object-mb 3.9] [--mem-mb 1.5] [--budget-s 540]
                           [--plot docs/img/geo_cdf.png] [--json bench/work/geo.json]

Everything runs on 127.0.0.1 in this process, except a real etcd (``/usr/bin/etcd``, a free port, a temp
data dir, stopped by PID). Topology (round-trip times; each one-way delay is half):

    region  edges                      from near            from mid            from far
    near    near-1, near-2             1 ms / 10 Gbit/s     30 ms / 1 Gbit/s    120 ms / 200 Mbit/s
    mid     mid-1, mid-2               30 ms / 1 Gbit/s     1 ms / 10 Gbit/s    100 ms / 200 Mbit/s
    far     far-1, far-2               120 ms / 200 Mbit/s  100 ms / 200 Mbit/s 1 ms / 10 Gbit/s
    origin  origin-1                   120 ms / 200 Mbit/s from every region

Every server (6 edges, the origin) sits behind one ``LinkEmulator`` (bench/lib/linkemu.py) whose profile is
chosen by the connecting socket's source address: region ``i`` binds its outgoing sockets to 127.0.i.1
(edges: their upstream HTTP session) and 127.0.i.2 (its clients). The edges and the origin advertise the
emulated URLs (``EdgeConfig.url``, ``OriginConfig.url``, the edges' ``origin``), so every hop pays its
link: client -> edge, edge -> owner peer, edge -> other regions' edges (cached-only), edge -> origin.
A connection from any other address gets no delay and is counted as "unemulated" (must stay 0).

Objects are tiny-llama chunks (~90 KB zstd), far smaller than real KV. Rather than run a model big
enough to make multi-MB objects (its prefill alone would eat the time budget on 2 cores), bandwidths
are scaled by ``mean object size / --object-mb`` (default 3.9 MiB, a SmolLM2-135M 256-token zstd chunk),
so each transfer takes as long as a real SmolLM2-135M chunk would on the stated link; delays are not
scaled. Bandwidth is per connection (per TCP flow), not a shared bottleneck.

Workload (seeded): ``--docs`` manifests of ``--doc-tokens`` random token ids each, published through the
origin (not emulated, not timed); ``--requests`` prompts, doc chosen by Zipf(``--zipf``) popularity; half
the prompts are the whole doc + a question (every chunk and the tail), half the first k chunks + a
question; ``--remote-share`` of them come from clients in mid and far, the rest from near. Requests run
one at a time (closed loop), the same sequence for every strategy, each strategy on fresh, empty edges.

Strategies (the fetch client's ``strategy=`` hook, or a ranking the bench puts in its place):
    latency      KDN's client: all seven sources (the region's two edges, the other regions' four, the
                 origin), least expected time from measured RTT/bandwidth, hedged at 2x expected
    static-nearest  what an operator would configure by hand: the client knows one edge, the first of its
                 own region (``<region>-1``: 1 ms away, the nearest by the topology above), and the origin;
                 every lookup and fetch goes to that edge, no hedging, no measuring; the origin only when
                 the edge fails (an error, not a slow answer)
    random       the sources a client of the region is configured with -- the region's two edges -- in a
                 random order per request (seeded), the origin last; hedged the way the client hedges
    origin-only  every lookup and fetch goes to the origin
    oracle       per object, the ONE source with the least modeled time given the true cache state (read
                 from the edges' tiers) and the true links, following each source's real fill plan
                 (``Filler.routes``), known before the fetch; no hedging. The choice is modeled, the fetch is
                 measured. It is a bound for single-source selection under that model only: a hedging client
                 can beat it (a hedge takes the faster of two measured transfers), and a measured transfer can
                 take longer than the model says (2 shared cores). Objects it took from elsewhere are then
                 passed through the client's region owner, untimed, so the cache state evolves as on the
                 default path (a per-fetch oracle would otherwise take every cold object straight from the
                 origin -- faster than an edge that probes the other regions first -- and leave the edges
                 cold for good).
    oracle-hedged  the oracle's ranking (all seven sources, least modeled time first) with the client's
                 hedging (past 2x the leading source's expected time, the next source too; not for objects
                 the lookup reported cold): the oracle a hedging client is measured against. Same untimed
                 owner warming as the oracle.
    oracle-probe (optional) every fetch goes to all seven sources at once, the first verified answer wins:
                 the measured minimum, but seven transfers per object load the 2 cores.
Plus the latency strategy on edges with prefetch 0 (the others run with prefetch 2, the default).

Seeds: ``--seeds 1,2,3`` runs the whole thing once per seed -- a fresh etcd, origin and documents (their
tokens from the seed), the workload (from the seed), the clients' random generators -- and reports, per
strategy, each percentile as the median over seeds with the min-max across seeds, and each ratio per seed
and as the median (min-max) of the per-seed ratios. ``--budget-s`` is per seed.

Measured per request: fetch (``fetch_prefix``'s concurrent fetch of every object, verified) and TTFT at
the engine (``agenerate`` with tiny-llama, ``max_new_tokens=1``: lookup + fetch + decode + cache build +
prefill of the question + first token). Origin egress from the origin's /metrics (delta per run); hit
ratios per tier from each edge's /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))  # etcd_proc: the one throwaway-etcd helper

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from etcd_proc import EtcdProcess  # noqa: E402
from jobs import publish_and_wait  # noqa: E402
from ports import free_port  # noqa: E402
from linkemu import LinkEmulator  # noqa: E402
import results as R  # noqa: E402

from kdn.wire.bodyget import BodyGetter  # noqa: E402
from kdn.client import Fetched, KDNClient  # noqa: E402

REGIONS = ("near", "mid", "far")
REGION_NET = {"near": 1, "mid": 2, "far": 3}
RTT_MS = {("near", "near"): 1, ("mid", "mid"): 1, ("far", "far"): 1,
          ("near", "mid"): 30, ("near", "far"): 120, ("mid", "far"): 100}
MBIT = {("near", "near"): 10_000, ("mid", "mid"): 10_000, ("far", "far"): 10_000,
        ("near", "mid"): 1_000, ("near", "far"): 200, ("mid", "far"): 200}
ORIGIN_RTT_MS, ORIGIN_MBIT = 120, 200
PUBLISH_TOKEN = "geo-publisher-" + "p" * 20
EDGE_TOKEN = "geo-edge-" + "e" * 23
# ("latency-hit-only", an experiment of earlier runs, is what kdn.wire.fetch does for every caller now: a body a
# source had to fill never updates that source's estimate.)
STRATEGIES = ("oracle", "oracle-hedged", "latency", "static-nearest", "random", "origin-only", "oracle-probe")
DEFAULT_STRATEGIES = ("oracle", "oracle-hedged", "latency", "static-nearest", "random", "origin-only")
ORACLES = ("oracle", "oracle-hedged")  # their objects are passed through the region owner, untimed


def pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if (a, b) in RTT_MS else (b, a)


def edge_ip(region: str) -> str:
    return f"127.0.{REGION_NET[region]}.1"


def client_ip(region: str) -> str:
    return f"127.0.{REGION_NET[region]}.2"


# --- the topology -----------------------------------------------------------------------------------


class Links:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def rtt(self, a: str, b: str) -> float:
        if "origin" in (a, b):
            return ORIGIN_RTT_MS / 1e3
        return RTT_MS[pair(a, b)] / 1e3

    def rate(self, a: str, b: str) -> float:
        """Emulated bytes/s (scaled)."""
        mbit = ORIGIN_MBIT if "origin" in (a, b) else MBIT[pair(a, b)]
        return mbit * self.scale * 1e6 / 8

    def xfer(self, a: str, b: str, size: int) -> float:
        return self.rtt(a, b) + size / self.rate(a, b)

    def profiles_to(self, dst_region: str) -> dict[str, tuple[float, float]]:
        """by_source for the proxy in front of a node of ``dst_region``: (one-way ms, scaled Mbit/s)."""
        out = {}
        for r in REGIONS:
            prof = (self.rtt(r, dst_region) * 1e3 / 2, self.rate(r, dst_region) * 8 / 1e6)
            out[edge_ip(r)] = prof
            out[client_ip(r)] = prof
        return out


def bound_session(ip: str, **kw) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=256, limit_per_host=64, local_addr=(ip, 0))
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, **kw)


@dataclass
class EdgeNode:
    node_id: str
    region: str
    port: int
    link: LinkEmulator
    runner: web.AppRunner
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.link.url

    @property
    def edge(self):
        from kdn.edge.app import EDGE

        return self.runner.app[EDGE]


class World:
    """etcd, the origin and its link; per run, six fresh edges with their links."""

    def __init__(self, tmp: Path, args) -> None:
        self.tmp, self.args = tmp, args
        self.etcd = EtcdProcess()  # bench/lib/etcd_proc.py: the one throwaway-etcd helper
        self.registry = ""
        self.links = Links(1.0)
        self.origin_runner: web.AppRunner | None = None
        self.origin_port = 0
        self.origin_link: LinkEmulator | None = None
        self.edges: dict[str, EdgeNode] = {}
        self.tokens = tmp / "tokens"
        self.tokens.write_text(f"{PUBLISH_TOKEN} admin *\n{EDGE_TOKEN} read *\n")
        (tmp / "edge-token").write_text(EDGE_TOKEN + "\n")
        for f in (self.tokens, tmp / "edge-token"):
            f.chmod(0o600)  # the servers warn about a token file every user can read
        self.run_no = 0

    async def start(self) -> None:
        from kdn.origin.app import OriginConfig, create_app

        await asyncio.to_thread(self.etcd.start)
        self.registry = self.etcd.registry_url("/kdn-geo/")
        self.origin_port = free_port()
        self.origin_link = await LinkEmulator(0, "127.0.0.1", self.origin_port, delay_ms=0, mbit=0).start()
        cfg = OriginConfig(model="tiny-llama", registry=self.registry, store=str(self.tmp / "origin-store"),
                           port=self.origin_port, token_file=str(self.tokens), node_id="origin-1", fsync=False,
                           url=self.origin_link.url,
                           # As the published figures were measured: with records beside the blobs, the edges'
                           # manifest-body reads leave on a session this bench does not bind to a region yet.
                           records="registry")
        self.origin_runner = web.AppRunner(create_app(cfg))
        await self.origin_runner.setup()
        await web.TCPSite(self.origin_runner, "127.0.0.1", self.origin_port).start()

    def set_scale(self, scale: float) -> None:
        """Bandwidths known only after publishing (they scale with the objects' size)."""
        self.links = Links(scale)
        self.origin_link.by_source = {ip: _prof(p) for ip, p in self.links.profiles_to("origin").items()}

    @property
    def origin_direct(self) -> str:
        return f"http://127.0.0.1:{self.origin_port}"

    async def start_edges(self, prefetch: int) -> None:
        from kdn.edge.app import EdgeConfig, create_app

        self.run_no += 1
        for region in REGIONS:
            for i in (1, 2):
                nid = f"{region}-{i}"
                port = free_port()
                link = await LinkEmulator(0, "127.0.0.1", port, delay_ms=0, mbit=0,
                                          by_source=self.links.profiles_to(region)).start()
                cfg = EdgeConfig(region=region, registry=self.registry, origin=self.origin_link.url,
                                 mem_budget=int(self.args.mem_mb * (1 << 20)),
                                 disk=str(self.tmp / f"run{self.run_no}" / nid), disk_budget=256 << 20,
                                 port=port, node_id=nid, url=link.url, token_file=str(self.tokens),
                                 upstream_token_file=str(self.tmp / "edge-token"), prefetch=prefetch,
                                 lease_ttl=5.0, fsync=False,
                                 # Every region is as far from the origin (120 ms): no upper tier would be
                                 # chosen by latency; without its probes every connection stays emulated
                                 # (they start before the bound session below replaces the edge's).
                                 upper_tier="policy")
                runner = web.AppRunner(create_app(cfg))
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                node = EdgeNode(nid, region, port, link, runner, bound_session(edge_ip(region)))
                # The edge's upstream session and body reader (peers, other regions, origin) leave from its
                # region's address.
                node.edge.filler.session = node.session
                # ... and so do its record and manifest-body reads (--records auto asks the origin first).
                node.edge.bodies.session = node.session
                if (origins := getattr(node.edge.records.source, "origins", None)) is not None:
                    origins.session = node.session
                node.edge.filler.getter.close()
                node.edge.filler.getter = BodyGetter(ssl=None, per_host=64, local_addr=edge_ip(region))
                self.edges[nid] = node
        want = {r: sorted(f"{r}-{i}" for i in (1, 2)) for r in REGIONS}

        def complete(m) -> bool:
            return {r: sorted(n.node_id for n in ns) for r, ns in m.regions().items()} == want

        await asyncio.gather(*(n.edge.membership.wait_for(complete, timeout=20) for n in self.edges.values()))

    async def stop_edges(self) -> None:
        for node in self.edges.values():
            await node.runner.cleanup()
            await node.session.close()
            await node.link.stop()
        self.edges.clear()

    def unemulated(self) -> int:
        links = [n.link for n in self.edges.values()] + [self.origin_link]
        return sum(lk.stats.by_profile.get(lk.default, 0) for lk in links)

    async def stop(self) -> None:
        await self.stop_edges()
        if self.origin_runner is not None:
            await self.origin_runner.cleanup()
        if self.origin_link is not None:
            await self.origin_link.stop()
        await asyncio.to_thread(self.etcd.stop)


def _prof(p):
    from linkemu import Profile

    return Profile(float(p[0]), float(p[1]))


# --- publishing and the workload ------------------------------------------------------------------------


async def publish_docs(world: World, n: int, tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    async with aiohttp.ClientSession(world.origin_direct, headers={"Authorization": f"Bearer {PUBLISH_TOKEN}"}) as s:
        for d in range(n):
            ids = [rng.randrange(3, 512) for _ in range(tokens)]
            out.append(await publish_and_wait(s, {"name": f"geo-doc-{d}", "namespace": "public", "tokens": ids}))
    return out


@dataclass
class Request:
    region: str
    doc: int
    prompt: list[int]
    whole: bool


def workload(manifests: list[dict], n: int, seed: int, zipf: float, remote_share: float) -> list[Request]:
    rng = random.Random(seed + 1)
    weights = [1 / (i + 1) ** zipf for i in range(len(manifests))]
    out = []
    for _ in range(n):
        u = rng.random()
        region = "near" if u >= remote_share else ("mid" if u < remote_share / 2 else "far")
        d = rng.choices(range(len(manifests)), weights)[0]
        toks = list(manifests[d]["prefix_tokens"])
        full = len(toks) // manifests[d]["chunk_tokens"]
        whole = rng.random() < 0.5 or full < 2
        head = toks if whole else toks[: rng.randint(1, full - 1) * manifests[d]["chunk_tokens"]]
        question = [rng.randrange(3, 512) for _ in range(rng.randint(8, 40))]
        out.append(Request(region, d, head + question, whole))
    return out


# --- clients ------------------------------------------------------------------------------------------


class BenchClient(KDNClient):
    """KDNClient that keeps the last prefix's per-object fetches; ``oracle`` (a callable: client, size,
    address -> sources in order) replaces the ranking, lookups' included."""

    def __init__(self, *, oracle=None, probe_all: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.rng = random.Random()  # random: the seeded shuffle
        self.oracle = oracle
        self.probe_all = probe_all
        self.last: dict = {}  # task -> its last PrefixStates (requests in flight share a client)
        self.trace: list | None = None  # --trace: every ranking and transfer, with the estimates behind it

    def _trace_fetches(self) -> None:
        """--trace: every transfer (through kdn.wire.fetch's observer), beside the rankings below."""
        trace = self.trace
        assert trace is not None

        class Tracer:
            def failed(self, route, error):
                trace.append({"t": round(time.monotonic(), 4), "ev": "get", "src": route.label, "error": type(error).__name__})

            def missed(self, route, seconds):
                trace.append({"t": round(time.monotonic(), 4), "ev": "get", "src": route.label, "ms": round(seconds * 1e3, 1),
                              "served": "miss"})

            def delivered(self, route, body):
                trace.append({"t": round(time.monotonic(), 4), "ev": "get", "src": route.label,
                              "ms": round(body.seconds * 1e3, 1), "served": body.served_by})

        self.fetch_observer = Tracer()

    async def _fetch_hedged(self, address, encoding, digest, size, *, hedge=True, pooled=None, pieces=None, part=None,
                            tally=None):
        """probe_all: ask every source at once, keep the first verified answer (the measured minimum). (``tally``,
        the load planner's byte count, is passed on; the probe_all strategy runs without a planner.)"""
        if not self.probe_all:
            return await super()._fetch_hedged(address, encoding, digest, size, hedge=hedge, pooled=pooled,
                                               pieces=pieces, part=part, tally=tally)
        from kdn.errors import DigestMismatch, SourceError
        from kdn.wire.fetch import Want

        want = Want(address, encoding, size, digest, pieces, part)
        tasks = [asyncio.create_task(self.fetcher.fetch(want, [s])) for s in self.routing.all]
        errors = []
        try:
            for fut in asyncio.as_completed(tasks):
                try:
                    body = await fut
                except (SourceError, DigestMismatch) as e:
                    errors.append(str(e))
                    continue
                return Fetched(address, encoding, body.buffer.data, f"{body.route.label}/{body.served_by}",
                               body.seconds)
            raise SourceError(f"no source delivered {address}: " + "; ".join(errors))
        finally:
            for t in tasks:
                t.cancel()

    def _ranked(self, size, address=None, *, control=False):
        order = (self.oracle(self, size, address) if self.oracle is not None
                 else super()._ranked(size, address, control=control))
        if self.trace is not None:
            est = self.routing.control if control else self.routing.estimates
            self.trace.append({"t": round(time.monotonic(), 4), "ev": "rank", "size": size,
                               "order": [(s.label, round(est[s.url].expected(size) * 1e3, 2))
                                         for s in order[:4]]})
        return order

    async def _json(self, method, path, body=None):
        t0 = time.monotonic()
        try:
            return await super()._json(method, path, body)
        finally:
            if self.trace is not None:
                self.trace.append({"t": round(t0, 4), "ev": "json", "path": path.split("/")[2],
                                   "ms": round((time.monotonic() - t0) * 1e3, 1)})

    async def fetch_prefix(self, hit, **kw):
        st = self.last[asyncio.current_task()] = await super().fetch_prefix(hit, **kw)
        return st


class Oracle:
    """The least modeled time per object, from the true cache state and the true links."""

    def __init__(self, world: World, region: str, records: dict) -> None:
        self.world, self.region, self.records = world, region, records
        self.by_url = {n.url: n for n in world.edges.values()}

    def holds(self, node: EdgeNode, key) -> bool:
        e = node.edge
        return e.memory.contains(key) or (e.disk is not None and e.disk.contains(key))

    def fill(self, node: EdgeNode, key, size: int, hop: bool, depth: int = 0, tier: bool = False) -> float:
        """Time for ``node`` to obtain ``key`` it does not hold, following its real fill plan."""
        L, r, t = self.world.links, node.region, 0.0
        for route in node.edge.filler.routes(key, self.records[key[0]], hop=hop, tier=tier):
            label, url = route.label, route.url
            kind = label.split(":", 1)[0]
            if kind == "origin":
                return t + L.xfer(r, "origin", size)
            peer = self.by_url.get(url)
            if peer is None:
                continue
            if kind == "peer":
                inner = 0.0 if self.holds(peer, key) else self.fill(peer, key, size, True, depth + 1)
                return t + inner + L.xfer(r, r, size)
            if kind == "upper":  # a full fill there (an upper policy; the geo runs set none)
                inner = 0.0 if self.holds(peer, key) else self.fill(peer, key, size, True, depth + 1, tier=True)
                return t + inner + L.xfer(r, peer.region, size)
            if self.holds(peer, key):  # another region's owner, cached-only
                return t + L.xfer(r, peer.region, size)
            t += L.rtt(r, peer.region)  # its 404
        return float("inf")

    def cost(self, src, size: int, address: str | None) -> float:
        L = self.world.links
        if src.kind == "origin":
            return L.xfer(self.region, "origin", size)
        node = self.by_url[src.url]
        base = L.xfer(self.region, node.region, size)
        if address is None:
            return base
        rec = self.records[address]
        key = (address, node.edge.choose_encoding(rec, None))
        return base + (0.0 if self.holds(node, key) else self.fill(node, key, size, False))

    def __call__(self, client: KDNClient, size: int, address: str | None):
        return sorted(client.routing.all, key=lambda s: self.cost(s, size, address))


def static_ranking(client: KDNClient, size: int, address: str | None) -> list:
    """static-nearest: the configured order, always (the one edge, then the origin for errors)."""
    return list(client.routing.all)


def origin_only_ranking(client: KDNClient, size: int, address: str | None) -> list:
    """origin-only: every lookup and fetch goes to the origin (never an edge)."""
    return [s for s in client.routing.all if s.kind == "origin"]


def region_random_ranking(client: BenchClient, size: int, address: str | None) -> list:
    """random: the region's edges shuffled (the client's seeded generator), the origin last."""
    edges = [s for s in client.routing.all if s.kind != "origin"]
    client.rng.shuffle(edges)
    return edges + [s for s in client.routing.all if s.kind == "origin"]


def client_sources(world: World, region: str, strategy: str) -> dict:
    """The sources a client of ``region`` is configured with under ``strategy`` (KDNClient keyword args)."""
    mine = [(n.node_id, n.url) for n in world.edges.values() if n.region == region]
    remote = [n.url for n in world.edges.values() if n.region != region]
    if strategy == "static-nearest":  # by hand: the nearest edge (1 ms; both of the region's are, take -1)
        nearest = world.edges[f"{region}-1"]
        return dict(edges=[(nearest.node_id, nearest.url)], origin=world.origin_link.url)
    if strategy == "random":  # the region's set, not all seven
        return dict(edges=mine, origin=world.origin_link.url)
    return dict(edges=mine, remote_edges=remote, origin=world.origin_link.url)


def make_client(world: World, region: str, strategy: str, seed: int, records: dict) -> BenchClient:
    kw = client_sources(world, region, strategy)
    if strategy in ("oracle", "oracle-probe", "oracle-hedged"):
        # oracle: one fetch, to the source with the least modeled time given the true cache state.
        # oracle-hedged: that ranking, hedged the way the client hedges.
        # oracle-probe: every fetch goes to all sources at once, the first verified answer wins.
        # Lookups of all three: the source with the least RTT.
        c = BenchClient(**kw, max_hedges=1 if strategy == "oracle-hedged" else 0, probe_all=strategy == "oracle-probe")
        c.oracle = Oracle(world, region, records)
    elif strategy == "static-nearest":
        c = BenchClient(**kw, max_hedges=0, oracle=static_ranking)
    elif strategy == "random":
        c = BenchClient(**kw, oracle=region_random_ranking)
    elif strategy == "origin-only":
        c = BenchClient(**kw, max_hedges=0, oracle=origin_only_ranking)
    else:  # latency: KDN's own ranking
        c = BenchClient(**kw)
    c.rng.seed(seed)
    net = c.net  # (kdn.client.connections: made on first use, so rebinding them here is before any request)
    net._local_addr = client_ip(region)  # leave from my region: the link emulator picks the link by source address
    net._session = bound_session(client_ip(region), headers=net.headers,
                                 timeout=aiohttp.ClientTimeout(total=net.timeout, sock_connect=min(net.timeout, 5.0)))
    c.label_region = {s.label: (world.origin_link.url == s.url and "origin")
                      or next(n.region for n in world.edges.values() if n.url == s.url) for s in c.routing.all}
    return c


# --- one run ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    region: str
    fetch_ms: float
    ttft_ms: float
    lookup_ms: float
    objects: int
    object_ms: list[float]
    served_from: list[str]  # region of the source the client used, per object
    x_source: list[str]  # where that source got the bytes (X-KDN-Source)
    addresses: list[str] = field(default_factory=list, repr=False)
    labels: list[str] = field(default_factory=list, repr=False)  # the client's source label, per object


@dataclass
class RunResult:
    name: str
    strategy: str
    prefetch: int
    seed: int = 0
    samples: list[Sample] = field(default_factory=list)
    origin_bytes: float = 0.0
    edge_metrics: dict = field(default_factory=dict)  # region -> {metric: value}
    hedges: int = 0
    failovers: int = 0
    wall_s: float = 0.0
    truncated: bool = False
    unemulated: int = 0
    wrong_hits: int = 0


async def scrape(url: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def msum(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))


async def origin_bytes(world: World) -> float:
    return msum(await scrape(world.origin_direct), "kdn_origin_bytes_served_total")


async def one_run(world: World, name: str, strategy: str, prefetch: int, requests: list[Request], engine,
                  records: dict, model_id: str, seed: int, deadline: float) -> RunResult:
    res = RunResult(name, strategy, prefetch, seed)
    await world.start_edges(prefetch)
    clients = {r: make_client(world, r, strategy, seed, records) for r in REGIONS}
    if world.args.trace:
        for c in clients.values():
            c.trace = []
            c._trace_fetches()
    before = await origin_bytes(world)
    t_run = time.perf_counter()
    try:
        queue = list(enumerate(requests))
        slots: list[Sample | None] = [None] * len(requests)

        async def worker() -> None:
            while queue:
                if time.monotonic() > deadline:
                    res.truncated = True
                    return
                i, req = queue.pop(0)
                slots[i] = await one_request(clients[req.region], req, engine, model_id, res)
                if strategy in ORACLES:
                    await warm_owners(world, clients[req.region], slots[i].addresses, slots[i].labels)

        await asyncio.gather(*(worker() for _ in range(max(1, world.args.concurrency))))
        res.samples = [x for x in slots if x is not None]
        res.wall_s = time.perf_counter() - t_run
        for node in world.edges.values():  # let background prefetches finish before counting
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(node.edge.prefetcher.idle(), 10)
        res.origin_bytes = await origin_bytes(world) - before
        for node in world.edges.values():
            m = await scrape(f"http://127.0.0.1:{node.port}")
            agg = res.edge_metrics.setdefault(node.region, {})
            for key, val in (
                ("mem_hits", msum(m, "kdn_edge_hits_total", tier="memory")),
                ("mem_misses", msum(m, "kdn_edge_misses_total", tier="memory")),
                ("disk_hits", msum(m, "kdn_edge_hits_total", tier="disk")),
                ("disk_misses", msum(m, "kdn_edge_misses_total", tier="disk")),
                ("fill_peer", msum(m, "kdn_edge_fill_seconds_count", source="peer")),
                ("fill_region", msum(m, "kdn_edge_fill_seconds_count", source="region")),
                ("fill_origin", msum(m, "kdn_edge_fill_seconds_count", source="origin")),
                ("prefetch_started", msum(m, "kdn_edge_prefetch_started_total")),
                ("prefetch_used", msum(m, "kdn_edge_prefetch_used_total")),
                ("prefetch_wasted", msum(m, "kdn_edge_prefetch_wasted_total")),
            ):
                agg[key] = agg.get(key, 0.0) + val
        if world.args.trace:  # one JSON line per run: every client's rankings and transfers
            with open(world.args.trace, "a") as fh:
                fh.write(json.dumps({"run": name, "strategy": strategy, "prefetch": prefetch, "seed": seed,
                                     "trace": {r: c.trace for r, c in clients.items()}}) + "\n")
        res.hedges = sum(c.hedges for c in clients.values())
        res.failovers = sum(c.failovers for c in clients.values())
        res.unemulated = world.unemulated()
    finally:
        for c in clients.values():
            await c.close()
        await world.stop_edges()
    return res


_DOC_TOKENS: dict[int, list[int]] = {}


async def one_request(c: BenchClient, req: Request, engine, model_id: str, res: RunResult) -> Sample:
    from kdn.adapters.hf import agenerate

    gen = await agenerate(engine.model, engine.tokenizer, req.prompt, c, model_id_=model_id, max_new_tokens=1)
    rep = gen.report
    st = c.last.pop(asyncio.current_task(), None)
    fetched = st.fetched if st is not None else []
    want = len(_DOC_TOKENS[req.doc]) if req.whole else len(req.prompt) - len(req.prompt) % 256
    if rep.tokens_reused != want:
        res.wrong_hits += 1
    return Sample(req.region, rep.fetch_ms, rep.ttft_ms, rep.lookup_ms, len(fetched), [f.seconds * 1e3 for f in fetched],
                  [c.label_region.get(f.source.split("/", 1)[0], "?") for f in fetched],
                  [f.source.split("/", 1)[1].split(":", 1)[0] for f in fetched],
                  [f.address for f in fetched], [f.source.split("/", 1)[0] for f in fetched])


async def warm_owners(world: World, c: BenchClient, addresses: list[str], labels: list[str]) -> None:
    """Untimed: objects the oracle took from elsewhere pass through the client's region owner anyway.

    A per-fetch oracle that skips the edges on a miss (the origin is faster than an edge that fills through
    sequential cross-region probes) would leave the edges cold forever. So the oracle chooses per fetch on
    the cache state the default path would have built: every object reaches the owner edge of the
    client's region, as it does when the client asks that owner (prefetch included).
    """
    todo = []
    for a, label in zip(addresses, labels):
        owner = c.routing.ring.owner(a)
        if label != f"edge:{owner}":
            todo.append((world.edges[owner].port, a))
    if not todo:
        return
    async with aiohttp.ClientSession() as s:
        async def get(port: int, a: str) -> None:
            async with s.get(f"http://127.0.0.1:{port}/v1/objects/{a}") as r:
                await r.read()

        await asyncio.gather(*(get(p, a) for p, a in todo), return_exceptions=True)


# --- report ------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


def near(res: RunResult) -> list[Sample]:
    return [s for s in res.samples if s.region == "near"]


def fetch_ms(res: RunResult) -> list[float]:
    return [s.fetch_ms for s in near(res)]


Key = tuple[str, int]  # (strategy, prefetch)


def grouped(results: list[RunResult]) -> dict[Key, list[RunResult]]:
    """Runs by (strategy, prefetch), in the order they ran, each list in seed order."""
    out: dict[Key, list[RunResult]] = {}
    for r in results:
        out.setdefault((r.strategy, r.prefetch), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r.seed)
    return out


def spread(vals: list[float], digits: int = 1) -> str:
    """``median (min-max)`` over seeds; a single value alone."""
    vals = [v for v in vals if v == v]
    if not vals:
        return "n/a"
    med = f"{statistics.median(vals):.{digits}f}"
    return med if len(vals) == 1 else f"{med} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def mix(runs: list[RunResult]) -> str:
    src = [x for r in runs for s in near(r) for x in s.served_from]
    return " / ".join(f"{100 * src.count(k) / max(1, len(src)):.0f}%" for k in ("near", "mid", "far", "origin"))


def strategy_table(results: list[RunResult]) -> str:
    """Every run: one row per strategy and seed."""
    rows = ["| strategy | prefetch | seed | requests (near) | fetch p50 ms | fetch p90 ms | fetch p99 ms | "
            "per-object p50 ms | TTFT p50 ms | TTFT p99 ms | lookup p50 ms | objects from near / mid / far / origin | "
            "origin egress MB (all clients) | hedges | wall s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for (strategy, prefetch), runs in grouped(results).items():
        for r in runs:
            ss = near(r)
            f = fetch_ms(r)
            t = [s.ttft_ms for s in ss]
            obj = [x for s in ss for x in s.object_ms]
            rows.append(f"| {strategy} | {prefetch} | {r.seed} | {len(ss)}{' (cut)' if r.truncated else ''} | "
                        f"{pct(f, 50):.1f} | {pct(f, 90):.1f} | {pct(f, 99):.1f} | {pct(obj, 50):.1f} | "
                        f"{pct(t, 50):.1f} | {pct(t, 99):.1f} | {pct([s.lookup_ms for s in ss], 50):.1f} | "
                        f"{mix([r])} | {r.origin_bytes / 1e6:.2f} | {r.hedges} | {r.wall_s:.0f} |")
    return "\n".join(rows)


def summary_table(results: list[RunResult]) -> str:
    """Per strategy: each figure's median over seeds, (min-max) across them."""
    rows = ["| strategy | prefetch | seeds | fetch p50 ms | fetch p90 ms | fetch p99 ms | TTFT p50 ms | TTFT p99 ms | "
            "objects from near / mid / far / origin (all seeds) | origin egress MB (all clients) | hedges |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for (strategy, prefetch), runs in grouped(results).items():
        def per(q: float, ttft: bool = False) -> str:
            return spread([pct([s.ttft_ms if ttft else s.fetch_ms for s in near(r)], q) for r in runs])

        cut = " (cut)" if any(r.truncated for r in runs) else ""
        rows.append(f"| {strategy} | {prefetch} | {len(runs)}{cut} | {per(50)} | {per(90)} | {per(99)} | "
                    f"{per(50, True)} | {per(99, True)} | {mix(runs)} | "
                    f"{spread([r.origin_bytes / 1e6 for r in runs], 2)} | {spread([r.hedges for r in runs], 0)} |")
    return "\n".join(rows)


# a / b, fetch latency of near clients, prefetch 2: what each ratio compares
RATIOS = [("latency", "static-nearest"), ("latency", "oracle"), ("latency", "oracle-hedged"),
          ("static-nearest", "oracle"), ("oracle-hedged", "oracle"), ("random", "static-nearest"),
          ("origin-only", "static-nearest")]


def ratios(results: list[RunResult], a: str, b: str, q: float) -> list[float]:
    """Per seed (both ran): pct_q(a) / pct_q(b)."""
    g = grouped(results)
    ra = {r.seed: r for r in g.get((a, 2), [])}
    rb = {r.seed: r for r in g.get((b, 2), [])}
    return [pct(fetch_ms(ra[s]), q) / pct(fetch_ms(rb[s]), q) for s in sorted(set(ra) & set(rb))]


def ratio_table(results: list[RunResult]) -> str:
    seeds = sorted({r.seed for r in results})
    per = " / ".join(str(s) for s in seeds)
    rows = [f"| a / b (fetch, near clients, prefetch 2; below 1: a is faster) | p50: median (min-max) | "
            f"p50 per seed ({per}) | p90: median (min-max) | p99: median (min-max) | p99 per seed ({per}) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for a, b in RATIOS:
        r50, r90, r99 = (ratios(results, a, b, q) for q in (50, 90, 99))
        if not r50:
            continue
        rows.append(f"| {a} / {b} | {spread(r50, 2)} | {' / '.join(f'{x:.2f}' for x in r50)} | {spread(r90, 2)} | "
                    f"{spread(r99, 2)} | {' / '.join(f'{x:.2f}' for x in r99)} |")
    return "\n".join(rows)


def tier_table(results: list[RunResult]) -> str:
    rows = ["| strategy | prefetch | region | edge reads | memory hit | disk hit (of memory misses) | edge hit | "
            "fills from peer / other region / origin | prefetch started / used / wasted |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for (strategy, prefetch), runs in grouped(results).items():
        for region in REGIONS:
            m: dict[str, float] = {}
            for r in runs:  # counts summed over seeds
                for k, v in r.edge_metrics.get(region, {}).items():
                    m[k] = m.get(k, 0.0) + v
            reads = m.get("mem_hits", 0) + m.get("mem_misses", 0)
            mem = m.get("mem_hits", 0) / reads if reads else float("nan")
            dreads = m.get("disk_hits", 0) + m.get("disk_misses", 0)
            disk = m.get("disk_hits", 0) / dreads if dreads else float("nan")
            edge_hit = (m.get("mem_hits", 0) + m.get("disk_hits", 0)) / reads if reads else float("nan")
            rows.append(f"| {strategy} | {prefetch} | {region} | {reads:.0f} | {_p(mem)} | {_p(disk)} | "
                        f"{_p(edge_hit)} | {m.get('fill_peer', 0):.0f} / {m.get('fill_region', 0):.0f} / "
                        f"{m.get('fill_origin', 0):.0f} | {m.get('prefetch_started', 0):.0f} / "
                        f"{m.get('prefetch_used', 0):.0f} / {m.get('prefetch_wasted', 0):.0f} |")
    return "\n".join(rows)


def _p(x: float) -> str:
    return "n/a" if x != x else f"{x:.0%}"


def plot(results: list[RunResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (strategy, prefetch), runs in grouped(results).items():
        xs = sorted(x for r in runs for x in fetch_ms(r))  # every seed's requests together
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{strategy} (prefetch {prefetch})")
    ax.set_xscale("log")
    ax.set_xlabel("fetch latency per request, ms (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main --------------------------------------------------------------------------------------------


@dataclass
class SeedSetup:
    seed: int
    objects: int
    mean_object_bytes: float
    scale: float
    requests: int
    near_requests: int
    setup_s: float


async def run_seed(args, seed: int, engine) -> tuple[list[RunResult], SeedSetup]:
    """One seed: a fresh etcd, origin and documents; every strategy of the plan on fresh edges."""
    deadline = time.monotonic() + args.budget_s
    tmp = Path(tempfile.mkdtemp(prefix="kdn-geo-"))
    world = World(tmp, args)
    results: list[RunResult] = []
    try:
        t0 = time.monotonic()
        await world.start()
        manifests = await publish_docs(world, args.docs, args.doc_tokens, seed)
        _DOC_TOKENS.clear()
        for i, m in enumerate(manifests):
            _DOC_TOKENS[i] = list(m["prefix_tokens"])
        from kdn.service import REGISTRY

        assert world.origin_runner is not None
        reg = world.origin_runner.app[REGISTRY]  # the origin's records, where it keeps them (beside its blobs)
        addrs = [a for m in manifests for a in m["addresses"]]
        recs = await reg.get_objects(addrs)
        records = {a: r for a, r in zip(addrs, recs)}
        for a in list(records):  # tails are listed on their parent's record, not always in the manifest
            for tail in records[a].tails.values() if hasattr(records[a], "tails") else []:
                if tail not in records:
                    records[tail] = await reg.get_object(tail)
        sizes = [min(e.size for e in r.encodings.values()) for r in records.values()]
        mean = statistics.mean(sizes)
        scale = mean / (args.object_mb * (1 << 20))
        world.set_scale(scale)
        model_id = manifests[0]["model_id"]
        setup_s = time.monotonic() - t0
        reqs = workload(manifests, args.requests, seed, args.zipf, args.remote_share)
        info = SeedSetup(seed, len(records), mean, scale, len(reqs), sum(r.region == "near" for r in reqs), setup_s)
        print(f"seed {seed}: setup {setup_s:.1f} s: {len(manifests)} docs, {len(records)} objects, mean "
              f"{mean / 1e3:.0f} kB; bandwidth scale {scale:.4f} (= {mean / 1e3:.0f} kB / {args.object_mb} MiB); "
              f"{len(reqs)} requests, {info.near_requests} from near", flush=True)
        plan = [(s, 2) for s in args.strategies] + ([("latency", 0)] if args.prefetch0 else [])
        for strategy, prefetch in plan:
            r = await one_run(world, f"{strategy}/p{prefetch}/s{seed}", strategy, prefetch, reqs, engine, records,
                              model_id, seed, deadline)
            results.append(r)
            f = fetch_ms(r)
            print(f"  seed {seed} {strategy:14s} prefetch {prefetch}: {len(r.samples)} requests in {r.wall_s:.1f} s, "
                  f"near fetch p50 {pct(f, 50):.1f} / p90 {pct(f, 90):.1f} / p99 {pct(f, 99):.1f} ms, "
                  f"wrong hits {r.wrong_hits}, unemulated connections {r.unemulated}"
                  f"{' (CUT BY BUDGET)' if r.truncated else ''}", flush=True)
    finally:
        await world.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return results, info


async def main(args) -> int:
    res = R.Results("geo", args)
    t_all = time.monotonic()
    from kdn.adapters.hf import load_model

    engine = await asyncio.to_thread(load_model, "tiny-llama")
    results: list[RunResult] = []
    setups: list[SeedSetup] = []
    for seed in args.seeds:
        rs, info = await run_seed(args, seed, engine)
        results += rs
        setups.append(info)

    by = grouped(results)
    seeds = f"seed {args.seeds[0]}" if len(args.seeds) == 1 else f"seeds {', '.join(map(str, args.seeds))}"
    titles = {
        "summary": f"Source selection, near clients: median over {seeds} (min-max across seeds)",
        "ratios": f"Ratios of fetch latency, per seed, and their median (min-max) over {seeds}",
        "strategies": "Every run (near clients; prefetch 2 unless noted)",
        "tiers": f"Edge tiers (each edge's /metrics, summed per region and over {seeds}; all clients)",
    }
    for tid, build in (("summary", summary_table), ("ratios", ratio_table), ("strategies", strategy_table),
                       ("tiers", tier_table)):
        print(f"\n### {titles[tid]}\n")
        res.table(tid, build(results), titles[tid])

    lines = []
    for a, b, target, better in (("latency", "static-nearest", None, None), ("latency", "oracle", 1.1, "le"),
                                 ("random", "latency", 2.0, "ge")):
        rr = ratios(results, a, b, 50)
        if not rr:
            continue
        line = f"- {a} p50 / {b} p50 = {spread(rr, 2)}"
        if target is not None:
            met = sum((x <= target) if better == "le" else (x >= target) for x in rr)
            line += f" (target {'<=' if better == 'le' else '>='} {target}): met in {met} of {len(rr)} seeds"
        lines.append(line)
    if ("latency", 0) in by and ("latency", 2) in by:
        def q(k: Key, p: float) -> str:
            return spread([pct(fetch_ms(r), p) for r in by[k]])

        lines.append(f"- prefetch 2 vs 0 (latency-aware): fetch p50 {q(('latency', 2), 50)} vs "
                     f"{q(('latency', 0), 50)} ms, p99 {q(('latency', 2), 99)} vs {q(('latency', 0), 99)} ms")
    total = time.monotonic() - t_all
    lines.append(f"- total wall time {total:.0f} s (setup per seed: "
                 f"{', '.join(f'{s.setup_s:.0f}' for s in setups)} s); near requests per seed: "
                 f"{', '.join(str(s.near_requests) for s in setups)} of {args.requests}; unemulated connections: "
                 f"{sum(r.unemulated for r in results)}; wrong prefix hits: {sum(r.wrong_hits for r in results)}")
    print("\n### Targets\n")
    res.table("targets", "\n".join(lines), "Targets")
    res.extra["seeds"] = [s.__dict__ for s in setups]
    headline(res, results)
    res.write()
    if args.plot:
        plot(results, Path(args.plot), f"{args.requests} requests per seed ({seeds}), {args.docs} docs, "
             f"Zipf {args.zipf}; near clients; bandwidth x{statistics.mean(s.scale for s in setups):.4f}")
        print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "seeds": [s.__dict__ for s in setups], "total_s": total,
            "machine": f"{os.cpu_count()} cores, {platform.python_version()}",
            "runs": [{"strategy": r.strategy, "prefetch": r.prefetch, "seed": r.seed, "origin_bytes": r.origin_bytes,
                      "edge_metrics": r.edge_metrics, "hedges": r.hedges, "failovers": r.failovers,
                      "wall_s": r.wall_s, "truncated": r.truncated, "unemulated": r.unemulated,
                      "samples": [s.__dict__ for s in r.samples]} for r in results]}, indent=1))
    return 0


def headline(res: R.Results, results: list[RunResult]) -> None:
    """The README row: KDN's client against static-nearest (what a user would configure by hand), at p50 and
    p99, median over seeds (min-max); beside it the oracle bound and the hedging oracle, and origin egress."""
    by = grouped(results)
    if not all(k in by for k in (("latency", 2), ("static-nearest", 2))):
        return
    n = len(by[("latency", 2)])
    med = statistics.median

    def cell(a: str, b: str, q: float) -> tuple[float, str]:
        rr = ratios(results, a, b, q)
        return med(rr), spread(rr, 2)

    s50, c50 = cell("latency", "static-nearest", 50)
    s99, c99 = cell("latency", "static-nearest", 99)
    lat = {q: spread([pct(fetch_ms(r), q) for r in by[("latency", 2)]]) for q in (50, 99)}
    st = {q: spread([pct(fetch_ms(r), q) for r in by[("static-nearest", 2)]]) for q in (50, 99)}
    ms = {k: {q: med([pct(fetch_ms(r), q) for r in by[k]]) for q in (50, 99)}
          for k in (("latency", 2), ("static-nearest", 2))}
    ms50 = f"{ms[('latency', 2)][50]:.0f} vs {ms[('static-nearest', 2)][50]:.0f} ms"
    ms99 = f"{ms[('latency', 2)][99]:.0f} vs {ms[('static-nearest', 2)][99]:.0f} ms"
    text = f"fetch p50 **{s50:.2f}x** static-nearest's, p99 **{s99:.2f}x**; above 1x the client is slower"
    note = (f"each a median over seeds of the per-seed ratio, which need not match the ratio of each strategy's "
            f"own median: p50 {ms50}, p99 {ms99}")
    figs = [{"shown": f"p50 **{s50:.2f}x**", "cells": [c50], "table": "ratios"},
            {"shown": f"p99 **{s99:.2f}x**", "cells": [c99], "table": "ratios"},
            {"shown": ms50, "cells": [lat[50], st[50]], "table": "summary"},
            {"shown": ms99, "cells": [lat[99], st[99]], "table": "summary"}]
    if n > 1:  # the spread: per-seed ratios, and in how many seeds the client was the slower
        per = []
        for q, c in ((50, c50), (99, c99)):
            rr = ratios(results, "latency", "static-nearest", q)
            seeds_cell = " / ".join(f"{x:.2f}" for x in rr)
            shown = f"p{q} {min(rr):.2f}-{max(rr):.2f}x (slower in {sum(x > 1 for x in rr)} of {len(rr)})"
            per.append(shown)
            figs.append({"shown": shown, "cells": [c, seeds_cell], "table": "ratios"})
        note += f"; {n} seeds, per seed {per[0]}, {per[1]}"
    text += f" ({note})"
    for o, what in (("oracle", "the single-source oracle (a bound for picking one source, not for a hedging "
                     "client)"), ("oracle-hedged", "the hedging oracle")):
        if (o, 2) in by:
            o50, oc50 = cell("latency", o, 50)
            o99, oc99 = cell("latency", o, 99)
            text += f"; vs {what} p50 {o50:.2f}x, p99 {o99:.2f}x"
            figs += [{"shown": f"{what} p50 {o50:.2f}x", "cells": [oc50], "table": "ratios"},
                     {"shown": f"{what} p50 {o50:.2f}x, p99 {o99:.2f}x", "cells": [oc99], "table": "ratios"}]
    if ("origin-only", 2) in by:
        def egress(k: Key) -> tuple[float, str]:
            mb = [r.origin_bytes / 1e6 for r in by[k]]
            return med(mb), spread(mb, 2)

        (oo_mb, oo_c), (lat_mb, lat_c), (st_mb, st_c) = (egress(k) for k in (
            ("origin-only", 2), ("latency", 2), ("static-nearest", 2)))
        text += (f"; origin egress {oo_mb / lat_mb:.0f}x below origin-only's (static-nearest's: "
                 f"{oo_mb / st_mb:.0f}x below)")
        figs += [{"shown": f"{oo_mb / lat_mb:.0f}x below origin-only's", "table": "summary", "cells": [oo_c, lat_c]},
                 {"shown": f"static-nearest's: {oo_mb / st_mb:.0f}x below", "table": "summary",
                  "cells": [oo_c, st_c]}]
    res.set_headline(
        f"geo simulation, 3 regions, KDN's latency-aware client vs static-nearest (the nearest edge, configured by "
        f"hand), {n} seed{'s' if n > 1 else ''}", text,
        "static-nearest: the client's nearest edge configured by hand (what a user would do), no hedging, the origin "
        "only on errors; the oracle (per object the one source with the least modeled time, known "
        "in advance, no hedging) and the same oracle hedged; origin-only", figs)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--doc-tokens", type=int, default=2200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--seeds", default="", help="comma-separated seeds, each a full run (overrides --seed)")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--remote-share", type=float, default=0.2)
    ap.add_argument("--object-mb", type=float, default=3.9, help="real object size the bandwidths are scaled to")
    ap.add_argument("--mem-mb", type=float, default=1.5, help="each edge's memory tier")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help=f"comma-separated, of {', '.join(STRATEGIES)}")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (closed loop)")
    ap.add_argument("--no-prefetch0", dest="prefetch0", action="store_false", help="skip the prefetch-0 run")
    ap.add_argument("--budget-s", type=float, default=540, help="stop issuing requests after this long")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "geo_cdf.png"))
    ap.add_argument("--json", default=str(ROOT / "bench" / "work" / "geo.json"))
    ap.add_argument("--trace", default="", help="append every client's rankings (with the estimates behind "
                    "them) and transfers here, one JSON line per run")
    R.add_arg(ap)
    args = ap.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [args.seed]
    except ValueError:
        ap.error(f"--seeds takes integers, comma-separated, not {args.seeds!r}")
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad:
        ap.error(f"unknown strategies {bad}")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
