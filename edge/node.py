"""One edge node's parts wired together, and its one read path: ``Edge.load``.

Every read goes through ``Edge.load``: memory -> disk -> (one flight per key)
owner peer -> other regions -> origin (the source plan is ``fill.py``),
verify, keep in memory, persist on disk off the response path. Prefetch,
warm and push call the same function. The HTTP side (``app.py``) sends what
it returns; the registry views (``views.py``) keep its chain index, origins
and policies current.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from kdn.edge.config import EdgeConfig
from kdn.edge.disk import DiskTier
from kdn.edge.eviction import POLICIES
from kdn.edge.fill import Filler
from kdn.edge.flight import SingleFlight
from kdn.edge.membership import Membership
from kdn.edge.memory import MemoryTier
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.policies import PolicyEngine
from kdn.edge.prefetch import ChainIndex, Prefetcher
from kdn.edge.records import OriginRecords, OwnerRecords, RecordCache
from kdn.edge.tiers import EntryMeta, Handle, Key, Tier, steady_wall
from kdn.edge.upper import AutoUpper

from kdn.format.address import Address
from kdn.auth import TokenScope
from kdn.wire.bodyget import BodyGetter
from kdn.format.encodings import LOSSLESS_PREFERENCE
from kdn.errors import RegistryUnavailable, SourceError
from kdn.format.objects import blob_namespace
from kdn.registry import NodeRecord, ObjectRecord

log = logging.getLogger("kdn.edge.app")

PUSH_FILLS = 8  # fills a push keeps going at an edge (a warm: one at a time)


def token_scope(cfg: EdgeConfig) -> TokenScope:
    """Where the upstream token may go: ``--token-hosts`` (loopback by default),
    plus the host of a configured ``--origin`` (the operator named it)."""
    patterns = list(TokenScope(cfg.token_hosts).patterns)
    if cfg.origin:
        host = urlsplit(cfg.origin).hostname
        if host:
            patterns.append(host)
    return TokenScope(patterns)


def upstream_headers(path: str | None) -> dict[str, str]:
    """The edge's own token for its upstream (``--upstream-token-file``, else ``KDN_UPSTREAM_TOKEN``)."""
    if path is None:
        token = os.environ.get("KDN_UPSTREAM_TOKEN")
    else:
        from kdn.auth import read_token

        token = read_token(path)
    return {"Authorization": f"Bearer {token}"} if token else {}


def key_of(rec: ObjectRecord, encoding: str) -> Key:
    """The tier key of ``rec``'s object in ``encoding`` (its address was checked when the record was parsed)."""
    return rec.address, encoding


@dataclass
class Loaded:
    """What one read got: bytes in memory to write, or a file to sendfile. ``release()`` once sent."""

    source: str  # "memory", "disk", or where a fill came from: "peer:ID", "region:R", "upper:R", "origin"
    size: int
    data: memoryview | None = None
    path: Path | None = None
    handle: Handle | None = None  # pins a tier entry against eviction while it is sent

    def release(self) -> None:
        if self.handle is not None:
            self.handle.release()
            self.handle = None


class Edge:
    """One edge node's parts, wired together (the app holds one). ``await Edge.open(...)`` makes it whole:
    every part exists from then on (none is None waiting for a start); the app's cleanup contexts start
    and stop them in order (``app.py``)."""

    policies: PolicyEngine  # (made last in __init__; the filler reads its upper tiers when it plans)

    @classmethod
    async def open(cls, config: EdgeConfig, registry, metrics: EdgeMetrics) -> Edge:
        """An edge of ``config``: its disk tier scanned first (in a thread), then every other part made."""
        disk = None
        if config.disk:  # (what the scan evicts, over a smaller budget, is counted; nothing else can be yet)
            disk = await DiskTier.open(config.disk, config.disk_budget, policy=POLICIES[config.eviction],
                                       fsync=config.fsync,
                                       on_evict=lambda key, meta, reason: metrics.evictions.labels(reason).inc())
        return cls(config, registry, metrics, disk=disk)

    def __init__(self, config: EdgeConfig, registry, metrics: EdgeMetrics, *, disk: DiskTier | None = None) -> None:
        """Made inside a running event loop (its HTTP session is): use ``Edge.open``, which opens the disk tier."""
        self.config = config
        self.registry = registry
        self.m = metrics
        self.me = NodeRecord(role="edge", region=config.region, node_id=config.node_id, url=config.advertised_url,
                             extra=config.record_extra("edge", config.region))
        self.admitters = config.admitters()
        self.left_out: set[tuple[str, str, str]] = set()  # origins left out, logged once each
        verifier = None
        if config.trusted_keys:
            from kdn.registry.signing import Verifier

            verifier = Verifier.from_file(config.trusted_keys)
        self.records = RecordCache(registry, config.records_cache, verifier, metrics.refused_records.inc,
                                   floor_s=config.deny_floor_ms / 1000)
        self.memory = MemoryTier(config.mem_budget, POLICIES[config.eviction], on_evict=self._on_evict)
        self.disk = disk
        if disk is not None:
            disk.on_evict = self._on_evict
        self.chains = ChainIndex(config.chain_index)
        self.prefetcher = Prefetcher(self.chains, config.prefetch, self._prefetch_one)
        self._origins: list[str] = [config.origin.rstrip("/")] if config.origin else []
        self.origins_listed = bool(self._origins)  # an origin was known once (edge.views.watch_origins)
        self._connect_upstream(config, registry, metrics)
        operators = None
        if config.operator_keys:
            from kdn.registry.signing import Verifier

            operators = Verifier.from_file(config.operator_keys)
        self.policies = PolicyEngine(registry, config.region, self.tiers, warm=self.warm, manifest_feed=True,
                                     verifier=operators, bodies=self.bodies, link=self._fill_seconds)
        self.prefetched: set[Key] = set()  # filled by a prefetch and not read yet
        self.flight: SingleFlight[tuple[bytes | bytearray, str]] = SingleFlight()  # one fill per key at a time
        self._background: set[asyncio.Task] = set()
        self._disk_error_logged = float("-inf")
        self._promoting: set[Key] = set()  # disk hits being copied to memory: one copy per key at a time

    def _fill_seconds(self, nbytes: int) -> float:
        """How long this edge expects ``nbytes`` of fills to take, from the sources its fills measured (a scheduled
        push starts that long before its window); unmeasured: at the assumed link speed (edge/policy_warms.py)."""
        from kdn.edge.policy_warms import ASSUMED_BPS

        measured = self.filler.estimates.least_measured(nbytes)
        return measured if measured is not None else nbytes / ASSUMED_BPS

    def _connect_upstream(self, config: EdgeConfig, registry, metrics: EdgeMetrics) -> None:
        """The upstream: the body reader every fill goes through (kdn.wire.bodyget, as the fetch client's), an HTTP
        session for the other requests, the region's membership (a lease and a watch on nodes/edge/, started
        by the app) and the filler that plans sources from it."""
        from kdn.tls import client_context

        ssl = client_context(config.ca)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, limit_per_host=64, ssl=ssl),
                                             auto_decompress=False)
        self.getter = BodyGetter(ssl=ssl, per_host=64)
        self.membership = Membership(registry, self.me, ttl=config.lease_ttl, admitters=self.admitters,
                                     on_unadmitted=metrics.unadmitted_nodes.inc)
        self.filler = Filler(session=self.session, membership=self.membership, origin_urls=self.origin_urls,
                             me=self.me, upstream_headers=upstream_headers(config.upstream_token_file), metrics=metrics,
                             token_scope=token_scope(config), getter=self.getter,
                             always_probe_regions=config.region_probes == "always",
                             upper_regions=self.upper_regions)
        # Without an upper policy, the upper tier the edges choose by their measured round trips to the
        # origins (edge/upper.py); started by the app once the membership is (it rewrites this edge's record).
        self.auto_upper = (AutoUpper(origin_urls=self.origin_urls, probe=self._probe_origin,
                                     advertise=self.membership.advertise, regions=self.membership.regions,
                                     revision=lambda: self.membership.generation)
                           if config.upper_tier == "auto" else None)
        # Manifest bodies a registry pointer names (origins with --records store), whatever --records says.
        self.bodies = OriginRecords(self.session, self.origin_urls, self.filler.headers)
        if config.records != "registry":  # records beside the blobs: asked of the owner edge, then the origins
            origins = self.bodies if config.records == "origin" else OriginRecords(
                self.session, self.origin_urls, self.filler.headers, fallback=registry,
                on_fallback=metrics.record_reads.labels("registry").inc,  # auto: the registry for what none has
                ever_listed=lambda: self.origins_listed)
            self.records.source = OwnerRecords(origins, self.membership.owner, config.node_id,
                                               lambda where, n: metrics.record_reads.labels(where).inc(n),
                                               on_fallback=metrics.owner_fallback)

    def background(self, coro) -> bool:
        """Run ``coro`` off the response path, holding a reference until it ends. Bounded: when 256 are
        running, ``coro`` is closed unstarted and this returns False."""
        if len(self._background) >= 256:
            coro.close()
            return False
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def idle(self) -> None:
        """Until the background work started so far (disk copies) is done: for tests and shutdown."""
        while self._background:
            await asyncio.wait(list(self._background))

    async def drain(self, timeout: float = 5.0) -> None:
        """Stop prefetching; let the background work end (durable disk copies, promotions: each is
        quick), then cancel what is left: a cancelled disk put leaves only a temp file, which the next
        start deletes."""
        await self.prefetcher.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    @property
    def tiers(self) -> list[Tier]:
        """Fastest first: where ``load`` looks, and what policies govern."""
        return [self.memory] + ([self.disk] if self.disk is not None else [])

    def origin_urls(self) -> list[str]:
        return self._origins

    def upper_regions(self) -> frozenset[str]:
        """The upper tier every region fills through: the regions ``upper`` policies name, else (with
        ``--upper-tier auto``) the region the edges' measured round trips to the origins choose, else none."""
        named = self.policies.upper_regions
        if named or self.auto_upper is None:
            return named
        chosen = self.auto_upper.region
        return frozenset((chosen,)) if chosen is not None else frozenset()

    @property
    def upper_chosen_by(self) -> str | None:
        """Why ``upper_regions`` holds what it does: "policy", "latency", or None (no upper tier)."""
        if self.policies.upper_regions:
            return "policy"
        return "latency" if self.upper_regions() else None

    async def _probe_origin(self, url: str) -> float:
        """Seconds for one ``GET /healthz`` of the origin at ``url`` (raises when it does not answer 200)."""
        t0 = time.monotonic()  # (the filler's session: a probe leaves the way a fill does)
        async with self.filler.session.get(f"{url}/healthz", headers=self.filler.headers(url),
                                    allow_redirects=False) as r:
            await r.read()
            if r.status != 200:
                raise SourceError(f"origin {url[:80]} /healthz answered {r.status}")
        return time.monotonic() - t0

    # --- eviction accounting -------------------------------------------------

    def _on_evict(self, key: Key, meta: EntryMeta, reason: str) -> None:
        self.m.evictions.labels(reason).inc()
        if key in self.prefetched and not any(t.contains(key) for t in self.tiers):
            self.prefetched.discard(key)
            self.m.prefetch_wasted.inc()

    def _note_read(self, key: Key) -> None:
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.m.prefetch_used.inc()

    # --- the read path -------------------------------------------------------

    def choose_encoding(self, rec: ObjectRecord, want: str | None) -> str | None:
        if want is not None:
            return want if want in rec.encodings else None
        return next((e for e in LOSSLESS_PREFERENCE if e in rec.encodings), None)

    def meta_for(self, rec: ObjectRecord, encoding: str) -> EntryMeta:
        enc = rec.encodings[encoding]
        return EntryMeta(size=enc.size, digest=enc.digest, namespace=rec.namespace, inserted_at=steady_wall())

    def holds(self, key: Key) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def reads(self, key: Key) -> dict[str, int]:
        """Per tier holding ``key``: the whole reads it answered from its copy since it arrived there."""
        return {t.name: n for t in self.tiers if (n := t.reads(key)) is not None}

    def owns(self, address: Address) -> bool:
        owner = self.membership.owner(address)
        return owner is None or owner.node_id == self.me.node_id

    async def load(self, key: Key, rec: ObjectRecord, *, hop: bool = False, tier: bool = False,
                   fill: bool = True) -> Loaded | None:
        """Every read, top to bottom (groupcache's ``Group.load``).

        1. The tiers, memory then disk: a hit needs no coordination (a disk hit is
           promoted into memory off the response path).
        2. A miss joins the key's one flight (``_fill``), which re-checks the tiers,
           walks the source plan, verifies, keeps the blob, and hands every caller
           waiting on it the same bytes.

        With ``fill=False`` a miss is None (HEAD and cached-only probes never fill). ``tier``: a lower
        region's fill through this edge, the upper tier: a miss fills from the origin alone.
        Raises ``SourceError`` when no source delivers an intact blob.
        """
        hit = await self._from_tiers(key, rec)
        if hit is not None or not fill:
            return hit
        self.m.in_flight.inc()
        try:
            # A tier request has a flight of its own, which asks only the origin: joined to a fill that itself
            # goes through an upper tier (views of a moved upper policy disagree for a moment), two upper
            # tiers could each wait on the other until the timeout.
            flight_key = (key, "tier") if tier else key
            blob, source = await self.flight.do(flight_key, lambda: self._fill(key, rec, hop=hop, tier=tier))
        finally:
            self.m.in_flight.dec()
        return Loaded(source, len(blob), data=memoryview(blob))

    async def _from_tiers(self, key: Key, rec: ObjectRecord, *, count: bool = True) -> Loaded | None:
        for tier in self.tiers:
            handle = await tier.acquire(key)
            if handle is None:
                if count:
                    self.m.misses.labels(tier.name).inc()
                continue
            if handle.meta.namespace != rec.namespace:
                # Kept when the blob's own header agreed with its record; a record that now says otherwise was
                # relabelled (see _fill), and is not trusted with these bytes.
                handle.release()
                self.records.forget(key[0])
                log.error("object %s: cached for namespace %r, its record now says %r: not served",
                          key[0], handle.meta.namespace[:64], rec.namespace[:64])
                raise SourceError(f"object {key[0]}: its record's namespace changed")
            if count:
                self.m.hits.labels(tier.name).inc()
            if handle.data is not None:  # in memory: written as it is
                return Loaded(tier.name, handle.size, data=handle.data, handle=handle)
            assert handle.path is not None  # a file: sent with sendfile, and promoted to memory
            if (count and key not in self._promoting and not self.memory.contains(key)
                    and handle.size <= self.memory.budget):
                self._promoting.add(key)
                if not self.background(_promote(self, key, handle.path, rec, handle.meta.inserted_at)):
                    self._promoting.discard(key)
            return Loaded(tier.name, handle.size, path=handle.path, handle=handle)
        return None

    async def _fill(self, key: Key, rec: ObjectRecord, *, hop: bool,
                    tier: bool = False) -> tuple[bytes | bytearray, str]:
        """Inside the key's single flight: re-check, fetch from the plan, verify, keep.

        Event order that makes the re-check necessary: caller A misses the tiers,
        caller B's flight for the same key completes and puts the blob in memory,
        then A starts a new flight; without the re-check A would fetch it again.
        """
        again = await self._from_tiers(key, rec, count=False)
        if again is not None:
            try:
                if again.data is not None:
                    blob = again.data.obj
                elif again.path is not None:
                    blob = await asyncio.to_thread(again.path.read_bytes)
                else:
                    raise RuntimeError(f"a {again.source} handle with neither bytes nor a file")
                return bytes(blob), again.source
            finally:
                again.release()
        filled = await self.filler.fetch(key, rec, hop=hop, tier=tier)  # verified against the record's digest
        made_for = blob_namespace(filled.blob)
        if made_for is not None and made_for != rec.namespace:
            # The origin wrote whose object it is into the blob; a record that says otherwise was relabelled by
            # a registry writer (a signed record cannot be: its signature covers the namespace).
            self.records.forget(key[0])
            log.error("object %s: its record says namespace %r, the blob its origin made says %r: not served",
                      key[0], rec.namespace[:64], made_for)
            raise SourceError(f"object {key[0]}: record and blob disagree on its namespace")
        meta = self.meta_for(rec, key[1])
        await self.memory.put(key, filled.blob, meta)
        # The owner keeps a durable copy (fsynced: not on the response path); other edges a hot one.
        if self.disk is not None and self.owns(key[0]) and not self.disk.contains(key):
            self.background(self._persist(key, filled.blob, meta))
        return filled.blob, filled.source

    async def _persist(self, key: Key, blob: bytes | bytearray | memoryview, meta: EntryMeta) -> None:
        """The owner's disk copy. A disk that fails (full, read-only, gone) costs that copy only: the
        memory tier and the response are not affected; counted, and logged at most once a minute."""
        if self.disk is None:
            return
        try:
            await self.disk.put(key, blob, meta)
        except OSError as e:
            self.m.disk_write_errors.inc()
            now = time.monotonic()
            if now - self._disk_error_logged > 60:
                self._disk_error_logged = now
                log.warning("disk tier write failed (%s); serving from memory and upstream", e)

    def where(self, key: Key, rec: ObjectRecord) -> str:
        """Where a read of ``key`` would come from now: a tier, else the first source the plan would fill from."""
        if self.memory.contains(key):
            return "memory"
        if self.disk is not None and self.disk.contains(key):
            return "disk"
        return next((r.label for r in self.filler.routes(key, rec, hop=False) if not r.cached_only), "origin")

    async def _prefetch_one(self, address: Address, encoding: str | None = None) -> None:
        rec = await self.records.get(address)
        enc = self.choose_encoding(rec, encoding) if rec is not None else None
        if rec is None or enc is None or self.holds(key := key_of(rec, enc)):
            return
        owner = self.membership.owner(address)
        if owner is not None and owner.node_id != self.me.node_id:
            # The owner fills it; this edge only passes the hint on.
            fills = self.filler
            async with fills.session.post(f"{owner.url}/v1/prefetch", json={"addresses": [address], "encoding": enc},
                                          headers=fills.headers(owner.url), allow_redirects=False) as r:
                await r.read()
            return
        self.m.prefetch_started.inc()
        loaded = await self.load(key, rec, hop=True)
        if loaded is not None:
            loaded.release()
        self.prefetched.add(key)

    async def warm(self, addresses: list[Address], namespace: str, *, rate: int | None = None,
                   policy: str | None = None) -> None:
        """Operator 'warm' and 'push' policies: every edge fills the addresses it owns, ahead of demand; a push
        (``policy`` named) at most ``rate`` bytes a second, its progress in ``kdn_edge_push*``. A fill goes
        through the same single flight as a reader's, so a reader asking meanwhile joins it."""
        mine = [a for a in addresses if self.owns(a)]
        pending = self.m.push_pending.labels(policy) if policy is not None else None
        if pending is not None:
            pending.set(len(mine))
        t0, started = time.monotonic(), 0
        todo = iter(mine)

        async def worker() -> None:  # a push keeps PUSH_FILLS fills going: one at a time is a round trip each
            nonlocal started
            for address in todo:
                outcome = "failed"
                try:
                    rec = await self.records.get(address)
                    enc = self.choose_encoding(rec, None) if rec is not None else None
                    if rec is None or enc is None:
                        log.warning("%s of %s: no record with an encoding to fill", policy or "warm", address[:16])
                    elif self.holds(key_of(rec, enc)):
                        outcome = "held"
                    else:
                        size = rec.encodings[enc].size
                        if rate:  # paced: a fill starts once the bytes started before it fit the rate
                            wait, started = started / rate - (time.monotonic() - t0), started + size
                            if wait > 0:
                                await asyncio.sleep(wait)
                        loaded = await self.load(key_of(rec, enc), rec, hop=True)
                        if loaded is not None:
                            loaded.release()
                        self.m.warmed.inc()
                        outcome = "filled"
                        if policy is not None:
                            self.m.pushed_bytes.labels(policy).inc(size)
                except (SourceError, RegistryUnavailable) as e:
                    log.warning("%s of %s failed: %s", policy or "warm", address[:16], e)
                if pending is not None:
                    self.m.pushed.labels(policy, outcome).inc()
                    pending.dec()
        try:
            async with asyncio.TaskGroup() as group:  # (a worker's bug, or a cancel, stops them all)
                for _ in range(PUSH_FILLS if policy is not None else 1):
                    group.create_task(worker())
        finally:
            if pending is not None:
                pending.set(0)


async def _promote(edge: Edge, key: Key, path: Path, rec: ObjectRecord, inserted_at: float) -> None:
    """A disk hit's copy in memory. It keeps the disk entry's arrival time: with a fresh one, a TTL
    policy's clock restarted at every promotion and an object outlived its TTL by up to twice over
    (bench/faults.py ``clock_jump`` saw hits 7 s after their fill under a 3 s TTL)."""
    try:
        blob = await asyncio.to_thread(path.read_bytes)
        if len(blob) == rec.encodings[key[1]].size:
            await edge.memory.put(key, blob, replace(edge.meta_for(rec, key[1]), inserted_at=inserted_at))
    except OSError:
        pass  # evicted meanwhile: the next read fills again
    finally:
        edge._promoting.discard(key)
