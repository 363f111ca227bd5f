"""The edge server: caches objects next to regional inference servers.

Every read goes through one function, ``Edge.load``: memory -> disk -> (one
flight per key) owner peer -> other regions -> origin (the source plan is
``fill.py``), verify, keep in memory, persist on disk off the response path.
The handler sends what it returns with ``X-KDN-Source`` saying where the
bytes came from; prefetch and warm call the same function, lookup the same
planner. ``create_app(config)``
builds the aiohttp app; the registry, the edge and its tiers, the upstream
(HTTP session, membership), background work, policies and the registry views
are each a ``cleanup_ctx`` resource, started in order and stopped in reverse.

Routes:
    GET|HEAD /v1/objects/{address}[?encoding=]   the blob (HEAD: is it here, no fill)
    POST /v1/lookup                              ordered addresses -> longest available prefix, where each is
    POST /v1/prefetch                            (edge to edge) fill these in the background
    GET  /v1/registry/objects/{address}          GET /v1/registry/manifests/{ns}/{name}
    GET  /healthz                                GET /metrics
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from kdn import service
from kdn.service import connections
from kdn.address import validate_address, validate_name
from kdn.auth import Grant, Grants, TokenScope, covers, may_read
from kdn.bodyget import BodyGetter
from kdn.encodings import LOSSLESS_PREFERENCE
from kdn.errors import InvalidInput, KDNError, RegistryUnavailable, SourceError
from kdn.fetch import CACHED_ONLY, HOP, TIER
from kdn.objects import blob_namespace
from kdn.registry import Manifest, NodeRecord, ObjectRecord, follow
from kdn.registry.follow import stop_tasks
from kdn.service import GRANTS, METRICS, REGISTRY, bearer, object_headers, read_json
from kdn.store import validate_encoding

from kdn.edge.disk import DiskTier
from kdn.edge.eviction import DEFAULT_POLICY, POLICIES
from kdn.edge.fill import Filler
from kdn.edge.flight import SingleFlight
from kdn.edge.membership import Membership
from kdn.edge.memory import MemoryTier
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.policies import PolicyEngine
from kdn.edge.prefetch import ChainIndex, Prefetcher
from kdn.edge.records import OriginRecords, OwnerRecords, RecordCache
from kdn.edge.tiers import EntryMeta, Handle, Key, Tier, steady_wall

log = logging.getLogger(__name__)



PUSH_FILLS = 8  # fills a push keeps going at an edge (a warm: one at a time)


@dataclass
class EdgeConfig(service.NodeConfig):
    """An edge (``kdn edge serve``): the shared node settings plus its tiers, upstreams and trust."""

    port: int = 8100
    node_id: str = field(default_factory=lambda: validate_name(f"edge-{socket.gethostname().split('.')[0][:40]}"))
    region: str = "local"
    origin: str | None = None  # default: the origins registered in the registry
    mem_budget: int = 1 << 30
    disk: str | None = None
    disk_budget: int = 10 << 30
    upstream_token_file: str | None = None  # the token this edge shows peers and the origin
    # hosts that token may reach, http or https; None = loopback (kdn.auth.TokenScope)
    token_hosts: str | None = None
    prefetch: int = 2
    records_cache: int = 100_000
    # A "no" (absent, or not yours) takes at least this long, or a recent record read's p99 if longer
    # (edge/records.py): its timing then does not tell another tenant's recently read object from an absent one.
    deny_floor_ms: float = 2.0
    ca: str | None = None  # CA bundle to verify peers and the origin over HTTPS (default: system CAs)
    trusted_keys: str | None = None  # publisher keys file: records not signed by one are misses
    operator_keys: str | None = None  # operator keys file: policies not signed by one are skipped
    region_probes: str = "worth"  # "worth": ask a region first only when it pays (edge/fill.py); "always"
    eviction: str = DEFAULT_POLICY  # both tiers' policy: "arc" (chosen on the traces) or "s3-fifo"
    records: str = "registry"  # where object records are read: the registry, or the origins' stores (edge/records.py)
    require_admission: bool = False  # leave out peers and origins no --operator-keys key admitted (kdn node admit)
    revoked_admissions: str | None = None  # the operator's revocation list (kdn node revoke), read again on change

    def __post_init__(self) -> None:
        if self.region_probes not in ("worth", "always"):
            raise InvalidInput(f"region_probes must be 'worth' or 'always', not {self.region_probes!r}")
        if self.records not in ("registry", "origin"):
            raise InvalidInput(f"records must be 'registry' or 'origin', not {self.records!r}")
        if self.eviction not in POLICIES:
            raise InvalidInput(f"eviction must be one of {', '.join(POLICIES)}, not {self.eviction!r}")


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
    """One edge node's parts, wired together (the app holds one)."""

    def __init__(self, config: EdgeConfig, registry, metrics: EdgeMetrics) -> None:
        self.config = config
        self.registry = registry
        self.m = metrics
        self.me = NodeRecord(role="edge", region=config.region, node_id=config.node_id, url=config.advertised_url,
                             extra=config.record_extra("edge", config.region))
        # With --require-admission: peers and origins from the registry count only if an operator admitted
        # them (kdn.signing.unadmitted); a registry writer cannot point this edge at a server of its choice.
        self.admitters = None
        self.left_out: set[tuple[str, str, str]] = set()  # origins left out, logged once each
        if config.revoked_admissions and not config.require_admission:
            raise InvalidInput("--revoked-admissions is for --require-admission: give both")
        if config.require_admission:
            from kdn.signing import Admitters

            if not config.operator_keys:
                raise InvalidInput("--require-admission checks admissions with --operator-keys: give both")
            self.admitters = Admitters.from_files(config.operator_keys, config.revoked_admissions)
        verifier = None
        if config.trusted_keys:
            from kdn.signing import Verifier

            verifier = Verifier.from_file(config.trusted_keys)
        self.records = RecordCache(registry, config.records_cache, verifier, metrics.refused_records.inc,
                                   floor_s=config.deny_floor_ms / 1000)
        self.memory = MemoryTier(config.mem_budget, POLICIES[config.eviction], on_evict=self._on_evict)
        self.disk: DiskTier | None = None
        self.membership: Membership | None = None
        self.filler: Filler | None = None
        self.chains = ChainIndex()
        self.prefetcher = Prefetcher(self.chains, config.prefetch, self._prefetch_one)
        self.bodies: OriginRecords | None = None  # where manifest bodies are read (set with the upstream)
        self.policies: PolicyEngine | None = None
        self.prefetched: set[Key] = set()  # filled by a prefetch and not read yet
        self.flight: SingleFlight[tuple[bytes, str]] = SingleFlight()  # one fill per key at a time
        self._background: set[asyncio.Task] = set()
        self._disk_error_logged = float("-inf")
        self._promoting: set[Key] = set()  # disk hits being copied to memory: one copy per key at a time
        self._origins: list[str] = [config.origin.rstrip("/")] if config.origin else []

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

    def _ring(self) -> Membership:
        if self.membership is None:
            raise RuntimeError("the edge is not started: no membership yet (its app's cleanup contexts start it)")
        return self.membership

    def _fills(self) -> Filler:
        if self.filler is None:
            raise RuntimeError("the edge is not started: no upstream session yet")
        return self.filler

    def owns(self, address: str) -> bool:
        owner = self._ring().owner(address)
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

    async def _fill(self, key: Key, rec: ObjectRecord, *, hop: bool, tier: bool = False) -> tuple[bytes, str]:
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
        filled = await self._fills().fetch(key, rec, hop=hop, tier=tier)  # verified against the record's digest
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

    async def _persist(self, key: Key, blob: bytes, meta: EntryMeta) -> None:
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
        plan = self._fills().plan(key, rec, hop=False)
        return next((label for label, _, extra in plan if CACHED_ONLY not in extra), "origin")

    async def _prefetch_one(self, address: str, encoding: str | None = None) -> None:
        rec = await self.records.get(address)
        enc = self.choose_encoding(rec, encoding) if rec is not None else None
        if rec is None or enc is None or self.holds((address, enc)):
            return
        owner = self._ring().owner(address)
        if owner is not None and owner.node_id != self.me.node_id:
            # The owner fills it; this edge only passes the hint on.
            fills = self._fills()
            async with fills.session.post(f"{owner.url}/v1/prefetch", json={"addresses": [address], "encoding": enc},
                                          headers=fills.headers(owner.url)) as r:
                await r.read()
            return
        self.m.prefetch_started.inc()
        loaded = await self.load((address, enc), rec, hop=True)
        if loaded is not None:
            loaded.release()
        self.prefetched.add((address, enc))

    async def warm(self, addresses: list[str], namespace: str, *, rate: int | None = None,
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
                    elif self.holds((address, enc)):
                        outcome = "held"
                    else:
                        size = rec.encodings[enc].size
                        if rate:  # paced: a fill starts once the bytes started before it fit the rate
                            wait, started = started / rate - (time.monotonic() - t0), started + size
                            if wait > 0:
                                await asyncio.sleep(wait)
                        loaded = await self.load((address, enc), rec, hop=True)
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


EDGE = web.AppKey("edge", Edge)


# --- resources -------------------------------------------------------------


# Each long-lived resource is its own cleanup_ctx (create_app lists them): started in that order,
# stopped in reverse, so what produces work (watches, policies) stops before what does it (background
# fills and disk copies), and that before what it uses (membership, the HTTP session, the tiers).


async def _edge_ctx(app: web.Application):
    """The edge itself: its tiers (the disk tier opened here) and its one-flight-per-key table."""
    cfg = app[EDGE_CONFIG]
    edge = Edge(cfg, app[REGISTRY], app[EDGE_METRICS])
    app[EDGE] = edge
    app[service.RECORDS] = edge.records  # the edge serves records from its cache (and where it reads them)
    if cfg.disk:
        edge.disk = await DiskTier.open(cfg.disk, cfg.disk_budget, policy=POLICIES[cfg.eviction], fsync=cfg.fsync,
                                        on_evict=edge._on_evict)
    try:
        yield
    finally:
        await edge.flight.close()


async def _upstream_ctx(app: web.Application):
    """The upstream: the body reader every fill goes through (``kdn.bodyget``, as the fetch client's),
    an HTTP session for the other requests, the region's membership (a lease and a watch on
    ``nodes/edge/``) and the filler that plans sources from it."""
    cfg, edge = app[EDGE_CONFIG], app[EDGE]
    from kdn.tls import client_context

    ssl = client_context(cfg.ca)
    connector = aiohttp.TCPConnector(limit=256, limit_per_host=64, ssl=ssl)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    getter = BodyGetter(ssl=ssl, per_host=64)
    try:
        edge.membership = Membership(app[REGISTRY], edge.me, ttl=cfg.lease_ttl, admitters=edge.admitters,
                                     on_unadmitted=edge.m.unadmitted_nodes.inc)
        edge.filler = Filler(session=session, membership=edge.membership, origin_urls=edge.origin_urls, me=edge.me,
                             upstream_headers=_upstream_headers(cfg.upstream_token_file), metrics=edge.m,
                             token_scope=token_scope(cfg), getter=getter,
                             always_probe_regions=cfg.region_probes == "always",
                             upper_regions=lambda: edge.policies.upper_regions if edge.policies else frozenset())
        # Manifest bodies a registry pointer names (origins with --records store), whatever --records says.
        edge.bodies = OriginRecords(session, edge.origin_urls, edge.filler.headers)
        app[service.MANIFEST_BODIES] = edge.bodies
        if cfg.records == "origin":  # records beside the blobs: asked of the owner edge, then the origins
            membership = edge.membership
            edge.records.source = OwnerRecords(edge.bodies, membership.owner, cfg.node_id,
                                               lambda where, n: edge.m.record_reads.labels(where).inc(n))
        await edge.membership.start()
        try:
            yield
        finally:
            await edge.membership.close()
    finally:
        getter.close()
        await session.close()


async def _background_ctx(app: web.Application):
    """Work off the response path (prefetch, durable disk copies, promotions): drained at shutdown;
    and the TTL expiry pass."""
    expiry = asyncio.create_task(_expire_loop(app[EDGE]), name="kdn-edge-expiry")
    try:
        yield
    finally:
        expiry.cancel()
        await asyncio.gather(expiry, return_exceptions=True)
        await app[EDGE].drain()


POLICY_WAIT_S = 5.0  # at start, how long the edge waits for its policies before it serves anyway


async def _policies_ctx(app: web.Application):
    cfg, edge = app[EDGE_CONFIG], app[EDGE]
    operators = None
    if cfg.operator_keys:
        from kdn.signing import Verifier

        operators = Verifier.from_file(cfg.operator_keys)
    edge.policies = PolicyEngine(app[REGISTRY], cfg.region, edge.tiers, warm=edge.warm, manifest_feed=True,
                                 verifier=operators, bodies=edge.bodies)
    await edge.policies.start()
    try:
        yield
    finally:
        await edge.policies.close()


async def _views_ctx(app: web.Application):
    """The edge's registry views: one of ``manifests/`` (the prefetch chain index and the policy engine
    both read it) and, without ``--origin``, one of the live origins."""
    cfg, edge = app[EDGE_CONFIG], app[EDGE]
    watchers = [asyncio.create_task(_watch_manifests(edge), name="kdn-edge-manifests")]
    if not cfg.origin:
        watchers.append(asyncio.create_task(_watch_origins(edge), name="kdn-edge-origins"))
    try:
        # Serve once the policies are applied, so a restarted edge's warm disk tier is not read before its
        # TTLs and pins are known (an entry a TTL expired while the edge was down would be served once more).
        # A registry that does not answer in time does not keep the edge down: it serves, applies them later.
        policies = edge.policies
        if policies is not None:
            try:
                await policies.wait_applied(lambda p: p.ready, timeout=POLICY_WAIT_S)
            except TimeoutError:
                log.warning("serving before the policies are known: the registry did not answer in %.0f s; "
                            "they apply when it does", POLICY_WAIT_S)
        log.info("edge %s in region %s serving at %s", cfg.node_id, cfg.region, cfg.advertised_url)
        yield
    finally:
        await stop_tasks(watchers, what="registry view")


def token_scope(cfg: EdgeConfig) -> TokenScope:
    """Where the upstream token may go: ``--token-hosts`` (loopback by default),
    plus the host of a configured ``--origin`` (the operator named it)."""
    patterns = list(TokenScope(cfg.token_hosts).patterns)
    if cfg.origin:
        host = urlsplit(cfg.origin).hostname
        if host:
            patterns.append(host)
    return TokenScope(patterns)


def _upstream_headers(path: str | None) -> dict[str, str]:
    if path is None:
        token = os.environ.get("KDN_UPSTREAM_TOKEN")
    else:
        from kdn.auth import read_token

        token = read_token(path)
    return {"Authorization": f"Bearer {token}"} if token else {}


async def _watch_manifests(edge: Edge) -> None:
    """The edge's one view of ``manifests/``: keeps the chain index (for prefetch) current and hands
    each event on to the policy engine (pins and warms name manifests)."""

    warned: set[str] = set()

    def put(key: str, value: bytes) -> None:
        # One unreadable manifest (a newer writer, a bad hand edit) hides itself only: once it failed
        # the whole snapshot, which left prefetch off and re-listed every manifest in a retry loop.
        try:
            edge.chains.put(Manifest.unpack(value))
        except KDNError as e:
            edge.m.bad_records.labels("manifest").inc()
            if key not in warned and len(warned) < 1024:
                warned.add(key)
                log.warning("skipping unreadable manifest record %s: %s", key, str(e).splitlines()[0][:200])

    async def whole(key: str, value: bytes) -> bytes:
        """A pointer's whole manifest (``Manifest.body``, read from the origins), packed; anything else, or
        a pointer whose body cannot be read now (no chain for prefetch; policies read it again), as it is."""
        try:
            m = Manifest.unpack(value)
        except KDNError:
            return value  # (put() counts and logs it)
        if m.body is None or edge.bodies is None:
            return value
        async with fetching:
            full = await edge.bodies.get_manifest_body(m.namespace, m.name, m.body)
        if full is None or not m.points_at(full):
            log.warning("manifest %s v%d: its body %s could not be read from the origins", key, m.version,
                        m.body[:16])
            return value
        return full.pack()

    fetching = asyncio.Semaphore(16)

    async def on_event(ev) -> None:
        if ev.kind == "snapshot":
            keys = list(ev.items)
            ev = dataclasses.replace(ev, items=dict(zip(keys, await asyncio.gather(
                *(whole(k, ev.items[k]) for k in keys)))))
        elif ev.kind == "put" and ev.value is not None:
            ev = dataclasses.replace(ev, value=await whole(ev.key, ev.value))
        if ev.kind == "snapshot":
            edge.chains = ChainIndex()
            edge.prefetcher.index = edge.chains
            for key, value in ev.items.items():
                put(key, value)
        elif ev.kind == "put":
            put(ev.key, ev.value)
        elif ev.kind == "delete":
            edge.chains.remove(ev.key.split("/", 1)[1])
        if edge.policies is not None:
            await edge.policies.feed_manifests(ev)

    await follow(edge.registry, "manifests/", on_event, what="manifest")


EXPIRY_PASS_S = 1.0


async def _expire_loop(edge: Edge) -> None:
    """The expiry pass: every EXPIRY_PASS_S, drop the TTL-expired entries of every tier. Without it an expired
    entry went only under pressure, so with room to spare it was served for ever past its TTL."""
    while True:
        await asyncio.sleep(EXPIRY_PASS_S)
        for tier in edge.tiers:
            await tier.expire()


def _left_out(edge: Edge, node: NodeRecord, why: str | None) -> bool:
    """Whether an origin is left out (not admitted); counted and logged once per node and reason."""
    if why is None:
        return False
    key = (node.node_id, node.url, why)
    if key not in edge.left_out and len(edge.left_out) < 1024:
        edge.left_out.add(key)
        edge.m.unadmitted_nodes.inc()
        log.warning("leaving out %s %s at %s: %s", node.role, node.node_id, node.url[:80], why)
    return True


async def _watch_origins(edge: Edge) -> None:
    """Without --origin, the origins are whatever the registry lists as live."""

    async def on_event(ev) -> None:
        nodes = await edge.registry.list_nodes(role="origin")
        if edge.admitters is not None:
            from kdn.signing import unadmitted

            nodes = [n for n in nodes if not _left_out(edge, n, unadmitted(n, edge.admitters))]
        edge._origins = [n.url.rstrip("/") for n in sorted(nodes, key=lambda n: n.node_id)]

    async def recheck() -> None:  # admissions expire while their origins stay up: read the list again
        from kdn.edge.membership import ADMISSION_RECHECK_S

        while True:
            await asyncio.sleep(ADMISSION_RECHECK_S)
            if edge.admitters is not None:
                edge.admitters.refresh()  # a revocation takes effect here, as an expiry does
            with contextlib.suppress(KDNError):
                await on_event(None)

    task = asyncio.create_task(recheck()) if edge.admitters is not None else None
    try:
        await follow(edge.registry, "nodes/origin/", on_event, what="origin")
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


# --- handlers --------------------------------------------------------------


async def _readable_record(request: web.Request, address: str) -> ObjectRecord:
    edge = request.app[EDGE]
    t0 = time.monotonic()
    rec = await edge.records.get(address)
    allowed = request.app[GRANTS].namespaces(bearer(request), "read")
    if rec is None or not may_read(allowed, rec.namespace, rec.kind):
        await edge.records.hold(t0)  # the same answer whether absent or not yours, and at the same time
        raise web.HTTPNotFound(text=f"no object {address}")
    return rec


async def get_object(request: web.Request) -> web.StreamResponse:
    edge = request.app[EDGE]
    address = validate_address(request.match_info["address"])
    rec = await _readable_record(request, address)
    want = request.query.get("encoding")
    encoding = edge.choose_encoding(rec, want)
    if encoding is None:
        edge.records.forget(address)
        raise web.HTTPNotFound(text=f"object {address} has no encoding {want!r}; it has {sorted(rec.encodings)}")
    key: Key = (address, encoding)
    digest = rec.encodings[encoding].digest
    size = rec.encodings[encoding].size
    if service.not_modified(request, digest):
        return web.Response(status=304, headers=object_headers(digest, "edge", encoding, rec.namespace))
    head = request.method == "HEAD"
    rng = service.byte_range(request, size, digest)  # one range of the blob (a 416 before any fill)
    # Hop, tier and cached-only requests are how edges ask each other; from anyone else they would be a way
    # to probe what is cached (or to skip the owner), so only a read-everything (edge) grant sets them.
    peer = "*" in request.app[GRANTS].namespaces(bearer(request), "read")
    cached_only = peer and bool(request.headers.get(CACHED_ONLY))
    try:
        loaded = await edge.load(key, rec, hop=peer and HOP in request.headers, tier=peer and TIER in request.headers,
                                 fill=not (head or cached_only))
    except SourceError as e:
        raise web.HTTPServiceUnavailable(text=str(e)) from None
    if loaded is None:
        if head:  # HEAD never fills: it answers "can you serve it", with where it would come from
            return web.Response(headers={**object_headers(digest, "miss" if peer or bearer(request) else "edge",
                                                          encoding, rec.namespace), "Content-Length": str(size)})
        raise web.HTTPNotFound(text=f"{address} is not cached here")
    try:
        if loaded.handle is not None:
            edge._note_read(key)
        if not head:
            edge.prefetcher.after_read(address, encoding)
        # An anonymous HEAD learns whether it can read the object, not which tier holds it.
        source = loaded.source if (peer or bearer(request) or not head) else "edge"
        headers = object_headers(digest, source, encoding, rec.namespace)
        if loaded.path is not None:
            return await _send_file(request, loaded.path, loaded.size, headers, head=head, metrics=edge.m, rng=rng)
        if loaded.data is None:
            raise RuntimeError(f"a {loaded.source} handle with neither bytes nor a file")
        return await _send_bytes(request, loaded.data, headers, head=head, metrics=edge.m,
                                 source=loaded.source.split(":", 1)[0], rng=rng)
    finally:
        loaded.release()


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


async def _send_bytes(request, data: memoryview, headers: dict, *, head: bool, metrics, source: str,
                      rng: tuple[int, int] | None = None):
    """Write ``data`` (or its range ``rng``) inside the handler, while the caller still holds the tier handle:
    the bytes cannot be evicted under this write (a stalled reader is cut off, so the handle it pins is
    released)."""
    resp, how = await service.send_body(request, data, headers, head=head, rng=rng)
    if how == "gone":
        metrics.aborted.inc()
    elif how == "sent" and not head:
        metrics.bytes_served.labels(source).inc(len(data) if rng is None else rng[1] - rng[0])
    return resp


async def _send_file(request, path: Path, size: int, headers: dict, *, head: bool, metrics,
                     rng: tuple[int, int] | None = None):
    """sendfile(2) the blob (or its range ``rng``); like aiohttp's FileResponse, but with the digest as ETag."""
    resp = web.StreamResponse(headers=headers)
    service.ranged(resp, rng, size)
    offset, count = (0, size) if rng is None else (rng[0], rng[1] - rng[0])
    try:
        await service.send_within(request, count, _sendfile_body(request, resp, path, offset, count, head=head,
                                                                 metrics=metrics))
        return resp
    except ConnectionError:
        metrics.aborted.inc()
        return resp


async def _sendfile_body(request, resp, path: Path, offset: int, count: int, *, head: bool, metrics):
    await resp.prepare(request)  # StreamResponse sends its headers now, before the body
    if not head:
        with open(path, "rb") as f:
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("connection lost")
            try:
                await asyncio.get_running_loop().sendfile(transport, f, offset, count)
            except NotImplementedError:  # e.g. TLS: fall back to plain writes
                f.seek(offset)
                await resp.write(f.read(count))
        metrics.bytes_served.labels("disk").inc(count)
    await resp.write_eof()
    return resp


async def lookup(request: web.Request) -> web.Response:
    """Ordered addresses in; how many leading ones can be served, and from where each would come."""
    edge = request.app[EDGE]
    body, addrs = await service.read_addresses(request)
    t0 = time.monotonic()
    allowed = request.app[GRANTS].namespaces(bearer(request), "read")
    recs = await edge.records.get_many(addrs)
    where = []
    for a, rec in zip(addrs, recs):
        if rec is None or not covers(allowed, rec.namespace):
            break
        want = body.get("encoding")
        enc = edge.choose_encoding(rec, want)
        if enc is None:
            break
        # Without a named encoding, a held lossless copy is a hit: a client picks among them by its link.
        held = [e for e in LOSSLESS_PREFERENCE if e in rec.encodings] if want is None else [enc]
        enc = next((e for e in held if edge.holds((a, e))), enc)
        where.append(edge.where((a, enc), rec))
    if not bearer(request):
        # Which tier holds each object is cache state, which an anonymous HEAD does not see either: it would
        # tell anyone what others read lately (a lookup fills nothing, so it repeats at will).
        where = ["edge"] * len(where)
    if len(where) < len(addrs):  # it stopped at a "no": held like one (an absent record, or another tenant's)
        await edge.records.hold(t0)
    return web.json_response({"length": len(where), "sources": where})


async def prefetch(request: web.Request) -> web.Response:
    """Edge-to-edge hint: fill these addresses (that I own) in the background."""
    body = await read_json(request)
    addrs = body.get("addresses")
    if not isinstance(addrs, list) or len(addrs) > 64:
        raise web.HTTPBadRequest(text="'addresses' must be a list of at most 64 addresses")
    grants = request.app[GRANTS].namespaces(bearer(request), "read")
    if "*" not in grants:
        raise web.HTTPForbidden(text="prefetch is for edges (a read-* token)")
    encoding = body.get("encoding")
    try:
        encoding = None if encoding is None else validate_encoding(encoding)
    except InvalidInput as e:
        raise web.HTTPBadRequest(text=f"'encoding': {e}") from None
    edge = request.app[EDGE]
    for a in addrs:
        edge.prefetcher.schedule(validate_address(a), encoding)
    return web.json_response({"scheduled": len(addrs)}, status=202)


async def healthz(request: web.Request) -> web.Response:
    edge = request.app[EDGE]
    return web.json_response({
        "status": "ok", "role": "edge", "node_id": edge.me.node_id, "region": edge.me.region,
        "ring": edge.membership.ring.nodes if edge.membership else [],
        "memory": {"used": edge.memory.used, "budget": edge.memory.budget},
        "disk": {"used": edge.disk.used, "budget": edge.disk.budget} if edge.disk else None,
        "origins": edge.origin_urls(),
        "upper_tiers": sorted(edge.policies.upper_regions) if edge.policies else [],
    })


EDGE_CONFIG = web.AppKey("edge_config", EdgeConfig)
EDGE_METRICS = web.AppKey("edge_metrics", EdgeMetrics)


def create_app(config: EdgeConfig) -> web.Application:
    metrics = CollectorRegistry()
    app = web.Application(middlewares=[service.metrics_middleware_factory(metrics, "edge"), service.error_middleware])
    app[EDGE_CONFIG] = config
    app[METRICS] = metrics
    app[EDGE_METRICS] = EdgeMetrics(metrics, lambda: app.get(EDGE))
    service.install_deadlines(app, config.deadlines, metrics, "edge")
    app[GRANTS] = Grants.from_file(config.token_file, anonymous=Grant(frozenset({"read"}), frozenset({"public"})))
    app.cleanup_ctx.extend([service.registry_ctx(config.registry), _edge_ctx, _upstream_ctx, _background_ctx,
                            _policies_ctx, _views_ctx])
    app.router.add_get("/v1/objects/{address}", get_object)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_post("/v1/prefetch", prefetch)
    app.router.add_get("/healthz", healthz)
    service.add_common_routes(app)
    return app


def run(config: EdgeConfig) -> None:
    logging.basicConfig(level=os.environ.get("KDN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kdn.tls import server_context

    app = create_app(config)
    connections.run(app, config.host, config.port, caps=config.connection_caps(), service="edge",
                    ssl_context=server_context(config.tls_cert, config.tls_key), metrics=app[METRICS],
                    **service.server_options(app))
