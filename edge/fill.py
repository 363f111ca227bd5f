"""The edge's fill path: where a missing object comes from, read top to bottom.

    local tiers (memory, then disk)          -- served by the caller, not here
    -> the owner edge of this region          (one hop; skipped when I am the owner
                                               or the request is already a hop)
    -> other regions' edges holding it        (cached-only asks, fastest region first, each
                                               bounded: PROBE_MIN_S or 4x its expected time; a
                                               region only when its recent hit rate pays for a
                                               miss's round trip, see PROBE_HIT_PRIOR; at most
                                               PROBE_MAX_REGIONS of them)
    -> the upper tier's owner of the object   (a full fill there, which it shares with every
                                               region asking at once; when an ``upper`` policy
                                               names a region and this edge is not in it)
    -> the origin

An upper tier (origin shield, ``kdn policy set NAME --upper --region R``) makes the origin serve about
one fill per object whatever the number of regions: every other region's owner asks R's owner of the
object (``X-KDN-Tier``), whose single flight collapses their fills into one, and which fills from the
origin alone (its routes skip the cross-region asks the lower region already made). A failing upper tier
rests like a region (the breaker below) and the origin is asked instead.

Every body received is checked against the registry digest before it is
cached or served; a mismatch is counted, never served, and the next source is
tried. Bodies arrive through ``kdn.wire.bodyget``, the fetch client's reader: into
one preallocated buffer, hashed as they land (bench/fill_ab.py: 0.97-7.5x the
aiohttp reader the edge used before, median 1.06x; 2.3x with many 16 MiB
objects in flight over a 20 ms link). A source error is counted and falls back, never fatal (groupcache's
``Group.load``). ``Edge.load`` calls ``fetch`` inside the key's single
flight, so concurrent reads of one key share one upstream fetch; because
non-owners go through the owner, that holds across the whole region.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kdn.format.address import Address
from kdn.auth import TokenScope
from kdn.wire.bodyget import BodyGetter
from kdn.errors import DigestMismatch, SourceError
from kdn.wire.estimate import Estimates
from kdn.wire.fetch import CACHED_ONLY, HOP, TIER, Body, Fetcher, Fresh, Route, Want
from kdn.registry import NodeRecord, ObjectRecord
from kdn.ring import Ring

from kdn.edge.tiers import Key

log = logging.getLogger(__name__)

# A cross-region probe is an optimization (the origin always has the object): it may take this long, or 4x
# its region's expected time for the size if that is more, before the next source is tried. Without a bound
# a stalled inter-region link held every fill, and every plain client of the edge, for the whole fill
# timeout (30 s) before the origin was asked (bench/faults.py slow_region_link).
PROBE_MIN_S = 2.0
# A region whose probes keep failing is left out of routes for a while (a circuit breaker): after
# PROBE_TRIP failures in a row, for PROBE_REST_S; then one fill probes it again, and if that fails it rests
# twice as long (up to PROBE_REST_MAX_S); a healthy answer, a miss included, closes the breaker. Probes
# already in flight when a rest begins do not lengthen it. Without it every fill paid the probe bound
# during a stall: one plain read took 1.85 s (docs/reliability.md).
PROBE_TRIP = 2
PROBE_REST_S = 5.0
PROBE_REST_MAX_S = 60.0
# Whether a region is worth asking before the origin: with p the share of its recent probes that found the
# object, asking it first saves p x (origin's expected time - its expected time) and costs (1 - p) x its
# round trip on a miss. A region no faster than the origin is never worth its miss; a near one usually is.
# p is a moving average per region (PROBE_HIT_ALPHA), from PROBE_HIT_PRIOR, back to the prior when the
# region has not been asked for PROBE_HIT_STALE_S (so a region that filled up since is tried again).
PROBE_HIT_PRIOR = 0.5
PROBE_HIT_ALPHA = 0.1
PROBE_HIT_STALE_S = 30.0
# At most this many regions are asked cached-only in one fill (unless the operator asked for every region,
# --region-probes always), the fastest first: each miss costs a round trip in series, so asking every
# region made a cold fill over 10 regions wait for up to 9 of them (bench/upper_tier.py).
PROBE_MAX_REGIONS = 2
# A fill through the upper tier is two transfers in a row (upper <- origin, then me <- upper): it may take
# 4x its measured time (kdn.wire.fetch measures an upper tier's full fills), at least UPPER_MIN_S, at most the
# fill timeout; past it, or after a failure, the origin is asked, and an upper tier that keeps failing
# rests like a region (the breaker; an origin error the upper tier passes on counts against it too).
UPPER_MIN_S = 10.0


@dataclass(frozen=True)
class Filled:
    blob: bytearray  # verified; nobody else holds it (a memory tier keeps it as it is)
    source: str  # "peer:ID", "region:R", "upper:R", "origin"


class Filler:
    """Fetches a verified blob from the best source; the caller caches and serves it."""

    def __init__(self, *, session: aiohttp.ClientSession, membership, origin_urls, me: NodeRecord,
                 upstream_headers: dict[str, str], metrics, timeout: float = 30.0,
                 token_scope: TokenScope | None = None, getter: BodyGetter | None = None,
                 always_probe_regions: bool = False, upper_regions=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.session = session  # prefetch requests to owners
        self.clock = clock  # the breaker's rests and the hit rates' age (tests step a fake one)
        self.membership = membership
        self.origin_urls = origin_urls  # callable -> list[str] (config, else origins in the registry)
        self.me = me
        self._headers = upstream_headers
        self.scope = token_scope or TokenScope()
        self._withheld: set[str] = set()  # hosts already warned about
        self.m = metrics
        self.timeout = timeout  # seconds, per source
        self.estimates = Estimates()
        # Every body through the one verified fetch; the token is added per request, where it may go.
        # Object bodies come through its getter (TLS: pass one made with the CA).
        self.fetcher = Fetcher(getter or BodyGetter(ssl=None), self.estimates, timeout=timeout, authorize=self.headers)
        self._rings: dict[str, tuple[tuple[str, ...], Ring]] = {}
        self._probe_failures: dict[str, int] = {}  # region owner URL -> probe failures in a row
        self._rests: dict[str, int] = {}  # region owner URL -> rests in a row without a success between
        self._resting: dict[str, float] = {}  # region owner URL -> monotonic time its probes resume
        self._hit_rate: dict[str, tuple[float, float]] = {}  # region owner URL -> (share of probes that hit, when)
        self.always_probe_regions = always_probe_regions  # the operator prefers origin egress to latency
        # callable -> the regions ``upper`` policies name (the edge's PolicyEngine.upper_regions)
        self.upper_regions = upper_regions or frozenset

    @property
    def getter(self) -> BodyGetter:
        return self.fetcher.getter

    @getter.setter
    def getter(self, getter: BodyGetter) -> None:
        self.fetcher.getter = getter

    def headers(self, url: str) -> dict[str, str]:
        """The upstream token for ``url`` if it may go there (a host the operator named, any scheme)."""
        if not self._headers or self.scope.allows(url):
            return self._headers
        self.m.token_withheld.inc()
        host = url.split("/")[2] if url.count("/") >= 2 else url
        if host not in self._withheld and len(self._withheld) < 1024:
            self._withheld.add(host)
            log.warning("not sending the upstream token to %s (not in --token-hosts %s)",
                        host, ",".join(self.scope.patterns))
        return {}

    def routes(self, key: Key, rec: ObjectRecord, *, hop: bool, tier: bool = False,
               filling: bool = False) -> list[Route]:
        """A fill's routes, in the order to try (``kdn.wire.fetch.Route``: label, base URL, kind, headers,
        each one's bound). ``tier``: a lower region's fill through this edge, the upper tier (only the origins).
        ``filling``: for a fill (regions left out while they rest are counted), not a lookup's forecast."""
        address, encoding = key
        size = rec.encodings[encoding].size
        return [Route(label, base, label.split(":", 1)[0], extra, self._timeout_for(label.split(":", 1)[0], base, size))
                for label, base, extra in self._sources(address, size, hop=hop, tier=tier, filling=filling)]

    def _sources(self, address: Address, size: int, *, hop: bool, tier: bool,
                 filling: bool) -> list[tuple[str, str, dict[str, str]]]:
        origins = self.origin_urls()
        if tier:
            return [("origin", url, {}) for url in origins]
        out: list[tuple[str, str, dict[str, str]]] = []
        owner = self.membership.owner(address)
        if not hop and owner is not None and owner.node_id != self.me.node_id:
            out.append((f"peer:{owner.node_id}", owner.url, {HOP: "1"}))
        uppers: frozenset[str] = self.upper_regions()
        shielded = bool(uppers) and self.me.region not in uppers
        # Other regions: ask the owner there, cached-only; fastest region first. The upper tier is asked in
        # full below instead.
        remote: list[tuple[str, str]] = []
        upper: list[tuple[str, str]] = []
        for region, nodes in self.membership.regions().items():
            if region == self.me.region or not nodes:
                continue
            ring_owner = self._owner_in(region, nodes, address)
            if ring_owner is None:
                continue
            if self._is_resting(ring_owner.url):
                if filling:
                    self.m.region_skipped.inc()
                continue
            (upper if shielded and region in uppers else remote).append((region, ring_owner.url))
        # A probe saves the time of what is asked when it misses: the upper tier (below one), else the origin.
        # Unmeasured, they cannot be compared: then every region is asked (and so measured).
        nexts = [u for _, u in upper] or origins
        measured = bool(nexts) and all(self.estimates[u].samples for u in nexts)
        t_next = min((self.estimates[u].expected(size) for u in nexts), default=float("inf"))
        probes = 0
        for region, url in sorted(remote, key=lambda r: self.estimates[r[1]].expected(size)):
            if (measured and not self.always_probe_regions and self.estimates[url].samples
                    and not self._worth_probing(url, size, t_next)):
                if filling:
                    self.m.region_not_worth.inc()
                continue
            if probes == PROBE_MAX_REGIONS and not self.always_probe_regions:
                if filling:
                    self.m.region_capped.inc()
                continue
            probes += 1
            out.append((f"region:{region}", url, {HOP: "1", CACHED_ONLY: "1"}))
        for region, url in sorted(upper, key=lambda r: self.estimates[r[1]].expected(size)):
            out.append((f"upper:{region}", url, {HOP: "1", TIER: "1"}))
        for url in origins:
            out.append(("origin", url, {}))
        return out

    def _worth_probing(self, url: str, size: int, t_next: float) -> bool:
        """Is asking this region before the next source (the origin, or the upper tier) expected to save
        time? (See PROBE_HIT_PRIOR.)"""
        p = self.hit_rate(url)
        est = self.estimates[url]
        return p * (t_next - est.expected(size)) > (1.0 - p) * est.expected(0)

    def hit_rate(self, url: str) -> float:
        """The share of recent cached-only probes of this region edge that found the object."""
        rate, when = self._hit_rate.get(url, (PROBE_HIT_PRIOR, 0.0))
        return rate if self.clock() - when <= PROBE_HIT_STALE_S else PROBE_HIT_PRIOR

    def _probe_outcome(self, url: str, hit: bool) -> None:
        rate = self.hit_rate(url)
        self._hit_rate.pop(url, None)  # re-inserted last: the dict's order is the order of last update
        self._hit_rate[url] = (rate + PROBE_HIT_ALPHA * (float(hit) - rate), self.clock())
        if len(self._hit_rate) > 4096:  # bounded: forget the least recently updated
            for old in list(self._hit_rate)[:1024]:
                self._hit_rate.pop(old, None)

    def _is_resting(self, url: str) -> bool:
        until = self._resting.get(url)
        if until is None:
            return False
        if self.clock() < until:
            return True
        return False  # rested: the next fill probes it once more (a failure doubles the rest)

    def _probe_result(self, url: str, ok: bool) -> None:
        """Track a cross-region probe's outcome for the breaker."""
        if ok:
            self._probe_failures.pop(url, None)
            self._rests.pop(url, None)
            self._resting.pop(url, None)
            return
        now = self.clock()
        if self._resting.get(url, 0.0) > now:
            return  # a probe that started before the rest began
        n = self._probe_failures[url] = self._probe_failures.get(url, 0) + 1
        k = self._rests.get(url, 0)
        if n >= PROBE_TRIP or k:  # after a rest, one failed probe sends it back to rest, twice as long
            rest = min(PROBE_REST_S * 2 ** k, PROBE_REST_MAX_S)
            self._resting[url], self._rests[url], self._probe_failures[url] = now + rest, k + 1, 0
            if not k:
                log.warning("region edge %s failed %d probes in a row: skipped for %.0f s", url, n, rest)
        if len(self._probe_failures) > 4096:  # bounded: forget the oldest entries
            for old in list(self._probe_failures)[:1024]:
                self._probe_failures.pop(old, None)
                self._rests.pop(old, None)
                self._resting.pop(old, None)

    def _owner_in(self, region: str, nodes: list[NodeRecord], address: Address) -> NodeRecord | None:
        """The owner of ``address`` in another region's ring (rings cached per membership)."""
        ids = tuple(sorted(n.node_id for n in nodes))
        ring = self._rings.get(region)
        if ring is None or ring[0] != ids:
            ring = self._rings[region] = (ids, Ring(ids))
        owner = ring[1].owner(address)
        return next((n for n in nodes if n.node_id == owner), None)

    async def fetch(self, key: Key, rec: ObjectRecord, *, hop: bool, tier: bool = False) -> Filled:
        """The first of the fill's routes that delivers the blob intact (``kdn.wire.fetch``: length and digest
        checked as the bytes land; a lying or broken source is counted and the next one tried)."""
        address, encoding = key
        enc = rec.encodings[encoding]
        routes = self.routes(key, rec, hop=hop, tier=tier, filling=True)
        try:
            body = await self.fetcher.fetch(Want(address, encoding, enc.size, enc.digest, enc.piece_list), routes,
                                            observer=_Counts(self))
        except DigestMismatch as e:  # every source lied: for the edge that is a failed fill like any other
            raise SourceError(str(e)) from None
        assert isinstance(body.buffer, Fresh)
        return Filled(body.buffer.data, body.route.label)

    def _timeout_for(self, kind: str, base: str, size: int) -> float:
        if kind == "upper":  # its estimate is of its full fills (kdn.wire.fetch): both hops
            return min(self.timeout, max(UPPER_MIN_S, 4 * self.estimates[base].expected(size)))
        if kind != "region":
            return self.timeout
        return min(self.timeout, max(PROBE_MIN_S, 4 * self.estimates[base].expected(size)))

    def close(self) -> None:
        self.getter.close()


class _Counts:
    """What the edge counts of each attempt of a fill: metrics, and the regions' breaker and hit rates."""

    def __init__(self, filler: Filler) -> None:
        self.f = filler

    def failed(self, route: Route, error: Exception) -> None:
        m = self.f.m
        if isinstance(error, DigestMismatch):
            # A lying or broken source: never cached or served, counted; an answer all the same.
            m.digest_failures.labels(route.kind).inc()
            log.warning("digest mismatch for a fill from %s: %s", route.label, error)
            if route.kind in ("region", "upper"):
                self.f._probe_result(route.url, True)
                if route.kind == "region":
                    self.f._probe_outcome(route.url, True)
            return
        m.source_errors.labels(route.kind).inc()
        if route.kind in ("region", "upper"):
            self.f._probe_result(route.url, False)

    def missed(self, route: Route, seconds: float) -> None:
        self.f._probe_result(route.url, True)  # a healthy answer: the region just does not hold it
        self.f._probe_outcome(route.url, False)

    def delivered(self, route: Route, body: Body) -> None:
        if route.kind in ("region", "upper"):
            self.f._probe_result(route.url, True)
        if route.kind == "region":
            self.f._probe_outcome(route.url, True)
        self.f.m.fill_seconds.labels(route.kind).observe(body.seconds)
        self.f.m.fill_bytes.labels(route.kind).inc(body.want.size)
