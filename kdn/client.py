"""The fetch client an inference server uses: find the longest cached prefix of a prompt and fetch it.

Sources of an object, in the order of preference when nothing is measured
yet: the owner edge of the client's region (by the same consistent-hash ring
the edges use), the other edges of the region, other regions' edges, the
origin. Each source keeps a moving estimate of round-trip time and bandwidth
(``kdn.estimate``); a fetch goes to the source with the least expected time
for the object's size, is hedged to the next source when it runs past twice
its expected time, fails over on error, and is verified against the digest
the registry promised before anything is decoded. Object bodies are read by
``kdn.bodyget`` (keep-alive connections of its own, straight into arena
buffers); lookups, records and manifests go through one aiohttp session.

    async with KDNClient(edges=["http://127.0.0.1:8100"], token=...) as c:
        hit = await c.lookup(tokens, model_id, namespace="public")
        states = await c.fetch_prefix(hit)

What it returns (``Lookup``, ``Fetched``, ``PrefixStates``, ...) is defined in
``kdn.lookup``; ``SyncKDNClient`` (``kdn.sync``) wraps it for scripts. Both are
importable from here.
"""

from __future__ import annotations

__all__ = ["FILL_TIERS", "Fetched", "KDNClient", "Lookup", "PrefixStates", "Probe", "Source",
           "Tensors", "fills"]

import asyncio
import logging
import os
import random
import ssl as _ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from kdn import address as A
from kdn.address import validate_digest
from kdn.bodyget import BodyGetter, Tally
from kdn.encodings import affordable, parse_budget
from kdn.errors import DigestMismatch, InvalidInput, KDNError, SourceError
from kdn.estimate import DECODE, DecodeSpeeds, Estimates
from kdn.fetch import Fetcher, Fresh, Observer, Route, Want
from kdn.lookup import FILL_TIERS, Fetched, Lookup, PrefixStates, Probe, Source, Tensors, fills
from kdn.pieces import Pieces

if TYPE_CHECKING:  # pragma: no cover - imported where used, so `import kdn.client` stays light
    from kdn.arena import Arena
    from kdn.objects import DecodedObject, Layout, ObjectHeader, ObjectView
    from kdn.scatter import Placer
    from kdn.registry import Membership, NodeRecord
    from kdn.ring import Ring
    from kdn.signing import Verifier

    # Publisher keys: a Verifier, key strings (ed25519:<hex>), or a file of them.
    TrustedKeys = Verifier | str | os.PathLike[str] | Iterable[str]

log = logging.getLogger(__name__)
T = TypeVar("T")

STRATEGIES = ("latency", "random", "origin-only")  # source selection; "latency" is KDN's own
MAX_OBJECT_BYTES = 1 << 30
BASIS_ENCODING = "basis"  # how a model's kvtc basis is stored and served (kind "basis" records)


RECENT_FETCHES = 1 << 16  # addresses a client remembers having fetched (KDNClient.warm) ...
RECENT_S = 600.0  # ... and for how long (an edge's memory tier turns over; after this, not known warm)


def _admitters(keys: TrustedKeys | None, revoked: str | os.PathLike[str] | Iterable[str] | None) -> Verifier | None:
    """The operator keys a reader checks admissions with, and their revocation list (kdn.signing.Admitters)."""
    if keys is None:
        if revoked is not None:
            raise InvalidInput("revoked_admissions is for admitted_by: give both")
        return None
    from kdn.signing import KEY_PREFIX, Admitters, Verifier

    if isinstance(keys, Admitters) and revoked is None:
        return keys
    if isinstance(keys, Admitters) and (keys.revoked_path is not None or keys.revoked):
        raise InvalidInput("admitted_by already carries a revocation list: give revoked_admissions there, or "
                           "plain keys here (one list, not two that could disagree)")
    if isinstance(keys, Verifier):
        return Admitters([f"{KEY_PREFIX}{k.public_bytes_raw().hex()}" for k in keys.keys.values()], revoked)
    if isinstance(keys, str) and keys.startswith(KEY_PREFIX):
        return Admitters([keys], revoked)
    if isinstance(keys, (str, os.PathLike)):
        return Admitters.from_files(keys, revoked)
    return Admitters(keys, revoked)


def _verifier(keys: TrustedKeys | None) -> Verifier | None:
    if keys is None:
        return None
    from kdn.signing import KEY_PREFIX, Verifier

    if isinstance(keys, Verifier):
        return keys
    if isinstance(keys, str):
        return Verifier([keys]) if keys.startswith(KEY_PREFIX) else Verifier.from_file(keys)
    if isinstance(keys, os.PathLike):
        return Verifier.from_file(keys)
    return Verifier(keys)


class KDNClient:
    """Async fetch client. Give it edge URLs (first = the region's entry point), and/or an origin URL."""

    def __init__(
        self,
        *,
        edges: Sequence[str | tuple[str, str]] = (),
        remote_edges: Sequence[str] = (),
        origin: str | None = None,
        token: str | None = None,
        hedge: bool = True,
        max_hedges: int = 1,
        concurrency: int = 8,
        timeout: float = 30.0,
        ca: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        strategy: str = "latency",
        quality: str | float = "lossless",
        local_addr: str | None = None,
        trusted_keys: TrustedKeys | None = None,
        arena: Arena | None = None,
        decode_speeds: DecodeSpeeds | None = None,
        manifest_state: str | os.PathLike[str] | None = None,
    ) -> None:
        if not edges and not origin and not remote_edges:
            raise InvalidInput("KDNClient needs at least one edge or an origin")
        # Benchmarks compare source selection: "random" shuffles every ranking (seed ``self.rng``),
        # "origin-only" never asks an edge. The default, "latency", is the ranking below.
        if strategy not in STRATEGIES:
            raise InvalidInput(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        if strategy == "origin-only" and not origin:
            raise InvalidInput("strategy 'origin-only' needs an origin")
        self.strategy = strategy
        self.rng = random.Random()
        # ``edges`` may be URLs or (node_id, URL) pairs; with ids, the client routes each
        # address to its owner edge first, by the same ring the edges use.
        pairs = [(e, e) if isinstance(e, str) else (e[0], e[1]) for e in edges]
        self.sources: list[Source] = (
            [Source(u.rstrip("/"), "edge", f"edge:{nid if nid != u else i}", 0.001, nid if nid != u else None)
             for i, (nid, u) in enumerate(pairs)]
            + [Source(u.rstrip("/"), "region", f"region:{i}", 0.05) for i, u in enumerate(remote_edges)]
            + ([Source(origin.rstrip("/"), "origin", "origin", 0.1)] if origin else [])
        )
        ids = [s.node_id for s in self.sources if s.node_id]
        self._ring: Ring | None = None
        if ids:
            from kdn.ring import Ring

            self._ring = Ring(ids)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.hedge = hedge
        if max_hedges < 0:
            raise InvalidInput(f"max_hedges must be >= 0, not {max_hedges}")
        self.max_hedges = max_hedges
        # Two views of each source: object transfers (what ranks fetches) and control requests (lookup,
        # registry reads: what ranks those). A lookup's time is mostly the edge's own work (registry
        # reads, queueing behind fills); fed into the transfer estimate it made a near edge look 50 ms
        # away and sent the geo bench's clients to another region (docs/benchmarks.md, Geo).
        self.estimates = Estimates()
        self.control = Estimates()
        # What decoding each encoding costs on this machine (measured by every decode; the process's own
        # by default), the other half of choosing an encoding beside the link's estimate.
        self.decode_speeds = decode_speeds if decode_speeds is not None else DECODE
        for s in self.sources:
            self.estimates[s.url].set_prior(s.prior_rtt)
            self.control[s.url].set_prior(s.prior_rtt)
        self._sem = asyncio.Semaphore(concurrency)
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 5.0))
        self._ssl = ssl
        self._ca = ca
        # "lossless" (the default) or a maximum NLL increase in %: which encodings a fetch may pick.
        self.quality = quality
        parse_budget(quality)
        self._session: aiohttp.ClientSession | None = None
        self._getter: BodyGetter | None = None
        self._fetcher: Fetcher | None = None
        self._local_addr = local_addr  # bind outgoing connections to this IP (multi-homed hosts, link emulation)
        # Publisher keys (a kdn.signing.Verifier, key strings, or a file of them): with them, a record
        # whose signature does not verify is a miss -- its digest is never believed.
        self.verifier = _verifier(trusted_keys)
        self.rejected_records = 0
        self._fetched: OrderedDict[str, float] = OrderedDict()  # address -> when fetched (warm), bounded
        # namespace/name -> the highest version this client has taken; with ``manifest_state``, kept in that file
        # (kdn.versions) so that a new process still refuses what an earlier one saw superseded.
        self.manifest_versions: dict[str, int] = {}
        if manifest_state is not None:
            from kdn.versions import VersionFile

            self.manifest_versions = VersionFile(manifest_state)
        # kvtc bases by address: each fetched once (then shared by every object that names it)
        self._bases: dict[str, asyncio.Task[Any]] = {}
        self.bases_fetched = 0
        # What to count of each attempt of a fetch (``kdn.fetch.Observer``: traces, metrics); None: nothing.
        self.fetch_observer: Observer | None = None
        # Receive buffers reused across loads (``kdn.arena``): a prefix loaded into an engine's cache
        # (``fetch_prefix(into=...)``) lands in them and hands them back once decoded into place.
        self.arena = arena

    # --- lifecycle -------------------------------------------------------------

    @property
    def getter(self) -> BodyGetter:
        """The object-body path: keep-alive connections that read into preallocated buffers."""
        if self._getter is None:
            from kdn.tls import client_context

            self._getter = BodyGetter(ssl=self._ssl if self._ssl is not None else client_context(self._ca),
                                      local_addr=self._local_addr)
        return self._getter

    @property
    def fetcher(self) -> Fetcher:
        """Verified fetches (``kdn.fetch``) over ``getter``, measured into ``estimates``."""
        if self._fetcher is None:
            self._fetcher = Fetcher(self.getter, self.estimates, timeout=self._timeout.total or 30.0)
        return self._fetcher

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            from kdn.tls import client_context

            # HTTPS sources are always verified: against ``ca`` / $KDN_CA, else the system CAs.
            connector = aiohttp.TCPConnector(limit=64, ssl=self._ssl if self._ssl is not None else client_context(self._ca),
                                             local_addr=(self._local_addr, 0) if self._local_addr else None)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers,
                                                  timeout=self._timeout, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._getter is not None:
            self._getter.close()
            self._getter = None
            self._fetcher = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KDNClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- registry reads through the first source that answers -----------------

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The JSON object the first source to answer sends (None: 404). Any other answer, a JSON
        array or string included, fails that source and the next is asked."""
        errors = []
        for s in self._ranked(0, control=True):
            t0 = time.perf_counter()
            try:
                async with self.session.request(method, f"{s.url}{path}", json=body, allow_redirects=False) as r:
                    if r.status == 404:
                        return None
                    if r.status != 200:
                        self.control[s.url].fail()
                        errors.append(f"{s.label}: HTTP {r.status}")
                        continue
                    data = await r.json(content_type=None)
                    if not isinstance(data, dict):
                        raise ValueError("not a JSON object")
                    self.control[s.url].observe(0, time.perf_counter() - t0)  # small: an RTT sample
                    return data
            except ValueError:
                self.control[s.url].fail()
                errors.append(f"{s.label}: not a JSON object")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.control[s.url].fail()
                self.estimates[s.url].fail()  # unreachable: its transfers would fail too
                errors.append(f"{s.label}: {type(e).__name__}")
        raise SourceError("no source answered " + path.split("?")[0] + ": " + "; ".join(errors))

    async def record(self, address: str) -> dict[str, Any] | None:
        d = await self._json("GET", f"/v1/registry/objects/{A.validate_address(address)}")
        return self._trusted(d, "object", address)

    async def manifest(self, namespace: str, name: str, *, pin: str | None = None) -> dict[str, Any] | None:
        """The manifest of ``namespace/name`` (None if absent or refused). Never an older one than this client
        took before: a superseded manifest, validly signed and replayed by a registry writer or a lying edge, is
        refused (counted in ``rejected_records``; with ``trusted_keys``, which make the version the origin's word);
        the highest version seen per name is kept in
        ``manifest_versions``: in memory, or with ``manifest_state=PATH`` in that file, so that it holds across
        restarts and processes (kdn.versions).
        ``pin`` (``kdn.signing.manifest_pin``, printed by ``kdn publish``) takes exactly that manifest: any
        other one served under the name is refused (None, counted), with keys or without."""
        ref = f"{A.validate_namespace(namespace)}/{A.validate_name(name)}"
        d = self._trusted(await self._json("GET", f"/v1/registry/manifests/{ref}"), "manifest", ref)
        if pin is not None and d is not None:
            from kdn.registry import Manifest
            from kdn.signing import manifest_pin

            try:
                got = manifest_pin(Manifest.from_dict(d))
            except InvalidInput as e:
                got = f"unreadable ({e})"
            if got != A.validate_digest(pin):
                self.rejected_records += 1
                log.warning("KDN manifest %s refused: it is not the pinned one (%s, pinned %s)", ref, got[:16],
                            pin[:16])
                return None
        if d is None or self.verifier is None:  # without keys a version is the sender's word: nothing to hold to
            return None if d is not None and d.get("deleted") else d
        version = d.get("version", 0)
        if not (isinstance(version, int) and not isinstance(version, bool) and version >= 0):
            self.rejected_records += 1
            log.warning("KDN manifest %s refused: version %r", ref, str(version)[:20])
            return None
        seen = self.manifest_versions.get(ref, 0)
        if version < seen:
            self.rejected_records += 1
            log.warning("KDN manifest %s refused: version %d is older than version %d taken before (a replay)",
                        ref, version, seen)
            return None
        self.manifest_versions[ref] = version
        return None if d.get("deleted") else d  # a signed tombstone: deleted, and older ones refused from now

    def _trusted(self, d: dict[str, Any] | None, kind: str, what: str) -> dict[str, Any] | None:
        """``d`` if no keys are configured or a trusted key signed it (and it says what it was asked for)."""
        if d is None or self.verifier is None:
            return d
        from kdn.registry import Manifest, ObjectRecord
        from kdn.signing import SignatureError

        try:
            rec: ObjectRecord | Manifest
            if kind == "object":
                rec = ObjectRecord.from_dict(d)
                got = rec.address
            else:
                rec = Manifest.from_dict(d)
                got = rec.ref
            self.verifier.check(rec)
            if got != what:
                raise SignatureError(f"asked for {what}, got a record of {got}")
        except (SignatureError, InvalidInput) as e:
            self.rejected_records += 1
            log.warning("KDN record refused: %s", e)
            return None
        return d

    # --- lookup ----------------------------------------------------------------

    async def lookup(self, tokens: Iterable[int], model_id: str, namespace: str = "public", *,
                     chunk_tokens: int = A.DEFAULT_CHUNK_TOKENS) -> Lookup:
        """How many leading tokens of ``tokens`` are published: whole chunks, then a partial tail.

        Whole chunks are found with one ``/v1/lookup``; past them, the last
        matched chunk's record lists its partial tails (length -> address), so a
        prompt that continues past a published text (text + question) reuses
        all of the text.
        """
        toks = list(tokens)
        full = A.prefix_addresses(A.validate_model_id(model_id), namespace, toks, chunk_tokens, full_chunks_only=True)
        n = 0
        where: list[object] = []
        if full:
            body = await self._json("POST", "/v1/lookup", {"addresses": full})
            try:  # an edge's answer is a claim: a number within the chain, or nothing
                n = max(0, min(int(body["length"]), len(full))) if body else 0
            except (KeyError, TypeError, ValueError):
                n = 0
            sources = body.get("sources") if body else None
            where = sources if isinstance(sources, list) else []
            # Not in the answering edge's tiers: a read fills it (through the owner, or from the origin).
            cold = {a for a, w in zip(full, where) if w not in ("memory", "disk")}
        addrs = full[:n]
        records: list[dict[str, Any]] = []
        if n and self.verifier is not None:
            # The edge's "I have n" is a claim; a chunk counts only once its signed record verifies.
            recs = await asyncio.gather(*(self.record(a) for a in addrs))
            n = next((i for i, r in enumerate(recs) if r is None), n)
            addrs, records = addrs[:n], [r for r in recs[:n] if r is not None]  # (none is, below n)
        covered = n * chunk_tokens
        if n:
            parent = records[-1] if records else await self.record(addrs[-1])
            tails = {int(k): v for k, v in (parent or {}).get("tails", {}).items()}
            for length in sorted(tails, reverse=True):
                if covered + length <= len(toks):
                    cand = A.next_address(addrs[-1], toks[covered:covered + length])
                    tail = await self.record(cand) if cand == tails[length] else None
                    if tail is not None:
                        addrs.append(cand)
                        records += [tail] if records else []
                        covered += length
                        break
        return Lookup(model_id=model_id, namespace=namespace, addresses=addrs, tokens=covered,
                      chunk_tokens=chunk_tokens, records=records, cold=cold if n else set(),
                      sources=[str(w) for w in where[:n]])

    # --- fetch -----------------------------------------------------------------

    @classmethod
    async def from_registry(cls, registry: Membership, region: str, *, token_hosts: str | list[str] | None = None,
                            admitted_by: TrustedKeys | None = None,
                            revoked_admissions: str | os.PathLike[str] | Iterable[str] | None = None,
                            **kwargs: Any) -> KDNClient:
        """Sources from the registry's live nodes: this region's edges, other regions' edges, the origins.

        With a ``token``, nodes it may not reach are left out: a registry writer names these URLs,
        and the token goes only to ``token_hosts`` (loopback by default; https too: kdn.auth.TokenScope).
        With ``admitted_by`` (operator keys), so is every node without an admission one of them signed
        (``kdn node admit``): the writer cannot name a server of its choice at all; and every node whose
        admission is in ``revoked_admissions`` (a file or a list of ids: ``kdn node revoke``).
        """
        edges = await registry.list_nodes(role="edge")
        origins = await registry.list_nodes(role="origin")
        operators = _admitters(admitted_by, revoked_admissions)
        if operators is not None:
            from kdn.signing import unadmitted

            why = {(n.role, n.region, n.node_id): unadmitted(n, operators) for n in edges + origins}

            def out(n: NodeRecord) -> str | None:
                return why[(n.role, n.region, n.node_id)]

            left = [f"{n.role} {n.node_id} ({out(n)})" for n in edges + origins if out(n)]
            if left:
                log.warning("leaving out %d unadmitted node(s): %s", len(left), "; ".join(left[:5]))
            edges = [n for n in edges if not out(n)]
            origins = [n for n in origins if not out(n)]
        if kwargs.get("token"):
            from kdn.auth import TokenScope

            scope = TokenScope(token_hosts)
            dropped = [n.url for n in edges + origins if not scope.allows(n.url)]
            if dropped:
                log.warning("leaving out %d node(s) the token may not reach (token_hosts %s): %s",
                            len(dropped), ",".join(scope.patterns), ", ".join(dropped[:5]))
            edges = [n for n in edges if scope.allows(n.url)]
            origins = [n for n in origins if scope.allows(n.url)]
        mine = [(n.node_id, n.url) for n in edges if n.region == region]
        remote = [n.url for n in edges if n.region != region]
        return cls(edges=mine, remote_edges=remote, origin=origins[0].url if origins else None, **kwargs)

    def _ranked(self, size: int, address: str | None = None, *, control: bool = False) -> list[Source]:
        """Least expected time first. A non-owner edge of the region fills through the owner, so it
        costs its own transfer plus the owner's: the owner ranks first while it answers. ``control``:
        for a lookup or registry read, ranked by those requests' own times."""
        if self.strategy == "origin-only":
            return [s for s in self.sources if s.kind == "origin"]
        if self.strategy == "random":
            order = list(self.sources)
            self.rng.shuffle(order)
            return order
        est = self.control if control else self.estimates
        owner = self._ring.owner(address) if (self._ring is not None and address) else None
        owner_url = next((s.url for s in self.sources if s.node_id == owner), None) if owner else None

        def cost(s: Source) -> float:
            own = est[s.url].expected(size)
            if owner_url is not None and s.node_id is not None and s.url != owner_url:
                own += est[owner_url].expected(size)
            return own

        return sorted(self.sources, key=cost)

    def expected_seconds(self, size: int) -> float:
        """The least expected time to fetch ``size`` bytes from any source (the load planner's link)."""
        return min(self.estimates[s.url].expected(size) for s in self._ranked(size))

    def choose_encoding(self, encodings: dict[str, dict[str, Any]], quality: str | float | None = None) -> str | None:
        """The encoding with the least expected fetch + decode time within the quality budget.

        Lossless requests (the default) never pick a lossy encoding; a lossy
        one is picked only when the measured link makes its smaller size worth
        its slower decode.
        """
        budget = parse_budget(self.quality if quality is None else quality)
        best, best_t = None, float("inf")
        for name, enc in encodings.items():
            if not affordable(name, budget):
                continue
            size = int(enc["size"])
            t = min(self.estimates[s.url].expected(size) for s in self.sources) + self.decode_speeds.seconds(name, size)
            if t < best_t:
                best, best_t = name, t
        return best

    async def fetch(self, address: str, *, encoding: str | None = None, digest: str | None = None,
                    size: int | None = None, quality: str | float | None = None, cold: bool = False,
                    pooled: bool = False, arena: Arena | None = None, pieces: Pieces | None = None,
                    tally: Tally | None = None) -> Fetched:
        """One object, verified. Without ``digest`` the registry record supplies it (and, without
        ``encoding``, the record's encodings are chosen from by ``quality``). ``pooled``: the body lands
        in a buffer of ``arena`` (default: the client's, when it has one), which the caller hands back with
        ``Fetched.release()`` once the bytes are used (ArenaFull when the arena's budget is spent). ``pieces``
        (the record's piece digests, ``kdn.pieces``) verify the body piece by piece as it lands. ``tally``
        (``kdn.bodyget.Tally``) counts the body bytes as they land, also of an attempt that fails or is cut
        short: a load given up at its deadline measures its own link by them (``kdn.planner``)."""
        A.validate_address(address)
        if digest is None or encoding is None or size is None:
            rec = await self.record(address)
            if rec is None:
                raise SourceError(f"{address} is not in the registry")
            encs = rec["encodings"]
            encoding = encoding or self.choose_encoding(encs, quality)
            if encoding is None or encoding not in encs:
                raise SourceError(f"{address} has no encoding {encoding!r} within quality {quality or self.quality!r}"
                                  f" (it has {sorted(encs)})")
            digest, size = encs[encoding]["digest"], encs[encoding]["size"]
            pieces = Pieces.of(encs[encoding])
        if size > MAX_OBJECT_BYTES:
            raise InvalidInput(f"{address} is {size} bytes, over the client's limit")
        async with self._sem:
            return await self._fetch_hedged(address, encoding, digest, size, hedge=self.hedge and not cold,
                                            pooled=(arena or self.arena) if pooled else None, pieces=pieces,
                                            tally=tally)

    async def probe(self, address: str, *, encoding: str, digest: str, size: int, pieces: Pieces | None = None,
                    deadline_s: float) -> Probe | None:
        """Time this client's link by fetching one object, verifying it and dropping it: the load planner's
        probe (``Plan.probe_s``), run beside a request that computes instead of inside it. Not hedged (a
        second source would time another link). Never raises for the source: a probe cut at ``deadline_s``
        or failed reports the body bytes that did land by then (``abandoned``), as a load given up does.
        None: it measured nothing (the arena had no room for the body)."""
        from kdn.arena import ArenaFull

        tally, t0 = Tally(), time.perf_counter()
        try:
            async with self._sem:
                f = await asyncio.wait_for(
                    self._fetch_hedged(address, encoding, digest, size, hedge=False, pieces=pieces, tally=tally,
                                       pooled=self.arena), deadline_s)
        except ArenaFull:
            return None
        except (TimeoutError, KDNError, aiohttp.ClientError, OSError) as e:
            log.info("KDN probe of %s ended early after %.0f ms: %s", address[:16],
                     (time.perf_counter() - t0) * 1e3, str(e) or type(e).__name__)
            return Probe(tally.bytes, time.perf_counter() - t0, True)
        f.release()
        return Probe(len(f.blob), time.perf_counter() - t0, False)

    async def _fetch_hedged(self, address: str, encoding: str, digest: str, size: int, *, hedge: bool = True,
                            pooled: Arena | None = None, pieces: Pieces | None = None,
                            part: tuple[int, int] | None = None, tally: Tally | None = None) -> Fetched:
        """Through ``kdn.fetch`` (one verified fetch for edges and clients): the best source first, hedged to
        the next past twice its expected time (at most ``max_hedges`` extra; others only when a source
        fails); the first verified body wins.

        Not for an object the edge reported it would have to fill (``hedge=False``): its answer is
        slow by design, and a hedge to another edge starts a second fill from the same upstream (the
        geo bench saw one cold object fan out to all seven sources, 100 ms apart, each filling it).
        """
        want = Want(A.validate_address(address), encoding, size, validate_digest(digest), pieces, part)
        routes = [Route(s.label, s.url, s.kind, self.headers, timeout=self._timeout.total)
                  for s in self._ranked(want.nbytes, address)]
        alloc = pooled.take if pooled is not None else None  # the arena the body lands in, if any
        body = await self.fetcher.fetch(want,
                                        routes, hedge=hedge, max_hedges=self.max_hedges, alloc=alloc,
                                        observer=self.fetch_observer, tally=tally)
        blob = body.buffer.data if isinstance(body.buffer, Fresh) else body.blob
        self.note_read(address)
        return Fetched(address, encoding, blob, f"{body.route.label}/{body.served_by}", body.seconds, body.buffer)

    def note_read(self, address: str) -> None:
        """Remember that this client read ``address`` (or had it read for it: a vLLM scheduler hands its loads
        to a worker with a client of its own): the edge held or filled it, so it is warm there now."""
        self._fetched[address] = time.monotonic()
        self._fetched.move_to_end(address)
        while len(self._fetched) > RECENT_FETCHES:
            self._fetched.popitem(last=False)

    def warm(self, address: str, tier: str) -> bool:
        """Whether reading ``address``, which the entry edge's lookup placed in ``tier``, costs only this
        client's link (what the load planners time): the edge said ``memory`` or ``disk``; or it gave the
        coarse answer an anonymous caller gets (``edge``, which hides cache state) and this client fetched
        that very object lately, so the edge held it then. A fill (``fills``), or an object this client has
        not read, may cost the edge's upstream too."""
        t = tier.split(":", 1)[0]
        if t in ("memory", "disk"):
            return True
        when = self._fetched.get(address)
        return t in ("edge", "") and when is not None and time.monotonic() - when < RECENT_S

    def warm_hit(self, hit: Lookup) -> bool:
        """``warm`` for every object of a lookup."""
        tiers = list(hit.sources) + [""] * (len(hit.addresses) - len(hit.sources))
        return all(self.warm(a, t) for a, t in zip(hit.addresses, tiers))

    @property
    def hedges(self) -> int:
        return self.fetcher.hedges

    @property
    def failovers(self) -> int:
        return self.fetcher.failovers

    async def fetch_part(self, address: str, encoding: str, first: int, end: int) -> Fetched:
        """Pieces ``[first, end)`` of an object (``kdn.pieces``: 1 MiB each by default) by a range request, each
        verified against the piece digests of its (signed) record: ``blob`` holds the blob's bytes
        ``[first * piece_bytes, ...)``. InvalidInput if the record has no pieces (a blob of one piece, or
        from before pieces): fetch it whole."""
        rec = await self.record(address)
        if rec is None or encoding not in rec["encodings"]:
            raise SourceError(f"{address} has no {encoding!r} record here")
        e = rec["encodings"][encoding]
        pieces = Pieces.of(e)
        if pieces is None:
            raise InvalidInput(f"{address}.{encoding} records no piece digests: fetch it whole")
        async with self._sem:
            return await self._fetch_hedged(address, encoding, e["digest"], int(e["size"]), hedge=self.hedge,
                                            pieces=pieces, part=(first, end))

    async def fetch_tensors(self, address: str, names: Iterable[str], *, encoding: str = "raw") -> Tensors:
        """Only the named tensors of an object (one layer's ``L3.k`` and ``L3.v``, say), verified: the pieces
        holding its header, then the pieces that hold those tensors, by range requests. Where the record has
        no pieces, the whole object is fetched and verified, then cut."""
        from kdn.objects import head_length, read_layout

        rec = await self.record(address)
        if rec is None or encoding not in rec["encodings"]:
            raise SourceError(f"{address} has no {encoding!r} record here")
        e = rec["encodings"][encoding]
        size, pieces, want = int(e["size"]), Pieces.of(e), list(names)
        if pieces is None:
            f = await self.fetch(address, encoding=encoding)
            layout = read_layout(f.blob[:head_length(f.blob[:8])], size)
            return Tensors(layout, {n: memoryview(f.blob)[slice(*_span(layout, n))] for n in want}, size)
        pb = pieces.piece_bytes
        head = await self.fetch_part(address, encoding, 0, 1)
        moved = len(head.blob)
        hl = head_length(head.blob[:8])
        if hl > len(head.blob):  # a header longer than a piece: the pieces it spans
            more = await self.fetch_part(address, encoding, 1, -(-hl // pb))
            head, moved = replace(head, blob=bytearray(head.blob) + more.blob), moved + len(more.blob)
        layout = read_layout(head.blob[:hl], size)
        spans = {n: _span(layout, n) for n in want}
        if not spans:
            return Tensors(layout, {}, moved)
        first, end = min(b for b, _ in spans.values()) // pb, -(-max(e for _, e in spans.values()) // pb)
        held = -(-len(head.blob) // pb)  # pieces already here with the header
        data: bytes | bytearray | memoryview = head.blob
        base = 0
        if end > held:
            body = await self.fetch_part(address, encoding, max(first, held), end)
            moved += len(body.blob)
            data, base = ((bytearray(head.blob[first * pb:]) + body.blob, first * pb) if first < held
                          else (body.blob, first * pb))
        return Tensors(layout, {n: memoryview(data)[b - base:e - base] for n, (b, e) in spans.items()}, moved)

    async def basis(self, address: str) -> Any:
        """The kvtc basis (``kdn.kernels.transform.Basis``) at ``address``: fetched once, verified,
        registered for decoding. Its address is the BLAKE3 of its bytes, and objects name it from inside
        their verified bytes, so a basis that is not exactly those bytes is refused whatever its record says."""
        A.validate_address(address)
        task = self._bases.get(address)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._bases[address] = asyncio.ensure_future(self._load_basis(address))
        return await asyncio.shield(task)

    async def _load_basis(self, address: str) -> Any:
        rec = await self.record(address)
        if rec is None:
            raise SourceError(f"kvtc basis {address[:16]}... is not in the registry")
        enc = rec.get("encodings", {}).get(BASIS_ENCODING)
        if rec.get("kind") != "basis" or not isinstance(enc, dict) or enc.get("digest") != address:
            raise DigestMismatch(f"the record of {address[:16]}... is not a kvtc basis stored under its own digest")
        f = await self.fetch(address, encoding=BASIS_ENCODING, digest=address, size=int(enc["size"]))
        self.bases_fetched += 1

        def load() -> Any:
            import kdn.kernels  # noqa: F401  (registers the kvtc codec)
            from kdn.kernels.transform import Basis, register_basis

            basis = Basis.from_bytes(f.blob)
            register_basis(basis)
            return basis

        return await asyncio.to_thread(load)

    async def prepare(self, f: Fetched, tokens: int | None = None) -> int | None:
        """Load the kvtc bases a fetched object names; the ``max_decoded`` its decode may use (None: default),
        for ``tokens`` tokens (default: the span its header claims; a caller that knows the span passes it)."""
        from kdn.objects import read_header

        h = read_header(f.blob)
        addrs = {str(t.params.get("basis")) for t in h.tensors.values() if t.codec == "kvtc"}
        if not addrs:
            return None
        bases = [await self.basis(a) for a in sorted(addrs)]
        from kdn.kernels.transform import decoded_cap

        n = h.end - h.start if tokens is None else tokens
        return int(max(decoded_cap(b, n) for b in bases))

    async def fetch_prefix(self, hit: Lookup, *, encoding: str | None = None,
                           quality: str | float | None = None,
                           into: Callable[[int, ObjectView], None] | None = None,
                           arena: Arena | None = None, scatter: Placer | None = None,
                           tally: Tally | None = None) -> PrefixStates:
        """Fetch, verify and decode every object of a lookup; objects stay in chain order.

        A pipeline per object: each is decoded (off the event loop) as soon as it
        has arrived and been verified, while the others are still on the wire.
        ``fetch_s`` is the time to the last byte, ``decode_s`` what decoding added
        after it.

        With ``into``, each verified, parsed and checked object is handed to
        ``into(index, view)`` in a worker thread instead of being decoded here: an
        engine's loader that decodes each tensor straight into its cache
        (``kdn.adapters.hf.CacheBuilder``). The returned ``objects`` then carry
        headers and no tensors. Their receive buffers then come from ``arena`` (or the client's own): each
        goes back once ``into`` has used it, so ``fetched[i].blob`` must not be read after.

        With ``scatter`` (``kdn.scatter.Placer``, e.g. the same ``CacheBuilder``), a chunk fetched ``raw`` that
        the engine can place is received straight into its memory (``kdn.scatter``: no receive buffer of the
        object's size; its 32 KB runs are read through the connection's 1 MiB bounce buffer and copied out
        while in cache, ``kdn.bodyget``); its ``fetched[i].blob`` is empty. ``tally``: every body byte of the
        prefix counted as it lands (``fetch``).
        """
        from kdn.objects import DecodedObject

        budget = parse_budget(self.quality if quality is None else quality)
        pool = arena if arena is not None else self.arena
        t0 = time.perf_counter()
        arrived: list[float] = []

        known = dict(zip(hit.addresses, hit.records))  # verified by the lookup: no second record read

        async def one(index: int, address: A.Address) -> tuple[Fetched, DecodedObject]:
            rec = known.get(address) or await self.record(address)
            if rec is None:
                raise SourceError(f"{address} is not in the registry")
            enc = encoding or self.choose_encoding(rec["encodings"], quality)
            if enc is None or enc not in rec["encodings"]:
                raise SourceError(f"{address} has no encoding {enc!r} within quality {quality or self.quality!r}"
                                  f" (it has {sorted(rec['encodings'])})")
            e = rec["encodings"][enc]
            if scatter is not None and enc == "raw" and scatter.placeable(index):
                f, layout = await self._fetch_placed(address, e, index, hit, scatter, tally)
                arrived.append(time.perf_counter())
                scatter.placed(index, layout)
                return f, DecodedObject(layout.header, {})
            f = await self.fetch(address, encoding=enc, digest=e["digest"], size=int(e["size"]),
                                 cold=address in hit.cold, pooled=into is not None, arena=pool, pieces=Pieces.of(e),
                                 tally=tally)
            arrived.append(time.perf_counter())
            try:
                # A kvtc object: its basis first (fetched once); its decode bounded by the span the lookup
                # asked for, never by what the object's own header claims.
                cap = await self.prepare(f, hit.token_counts()[index])
                return f, await asyncio.to_thread(_decode_checked, f, hit, budget, cap, index, into,
                                                  self.decode_speeds)
            finally:
                if into is not None:  # decoded into the engine's cache: the receive buffer is free again
                    f.release()

        done = await asyncio.gather(*(one(i, a) for i, a in enumerate(hit.addresses)))
        t_last = max(arrived, default=t0)
        return PrefixStates(hit, [o for _, o in done], [f for f, _ in done], t_last - t0, time.perf_counter() - t_last)

    async def _fetch_placed(self, address: A.Address, e: dict[str, Any], index: int, hit: Lookup,
                            scatter: Placer, tally: Tally | None = None) -> tuple[Fetched, Layout]:
        """A raw object received straight into the engine's memory (``kdn.scatter``): never hedged, since two
        bodies would race for the same memory; a failed attempt's bytes are rewritten by the next source's."""
        from kdn.scatter import Scatter

        def place(layout: Layout) -> Mapping[str, Sequence[memoryview]]:
            _check_identity(layout.header, hit, address)
            return scatter.place(index, layout)

        size = int(e["size"])
        if size > MAX_OBJECT_BYTES:
            raise InvalidInput(f"{address} is {size} bytes, over the client's limit")
        routes = [Route(s.label, s.url, s.kind, self.headers, timeout=self._timeout.total)
                  for s in self._ranked(size, address)]
        async with self._sem:
            body = await self.fetcher.fetch(Want(address, "raw", size, validate_digest(e["digest"]), Pieces.of(e)),
                                            routes, hedge=False, alloc=lambda n: Scatter(n, place),
                                            observer=self.fetch_observer, tally=tally)
        assert isinstance(body.buffer, Scatter) and body.buffer.layout is not None
        f = Fetched(address, "raw", memoryview(b""), f"{body.route.label}/{body.served_by}", body.seconds)
        self.note_read(address)
        return f, body.buffer.layout


def _span(layout: Layout, name: str) -> tuple[int, int]:
    try:
        return layout.span(name)
    except KeyError:
        raise InvalidInput(f"object {layout.header.address[:16]} has no tensor {name[:64]!r}") from None


def _check_identity(h: ObjectHeader, hit: Lookup, address: str) -> None:
    """A verified object is the one the lookup asked for: its address, model and namespace."""
    if h.model_id != hit.model_id or h.namespace != hit.namespace or h.address != address:
        raise DigestMismatch(f"object {address} claims model {h.model_id[:12]}/{h.namespace}, "
                             f"expected {hit.model_id[:12]}/{hit.namespace}")


def _decode_checked(f: Fetched, hit: Lookup, budget: float | None, max_decoded: int | None = None,
                    index: int = 0, into: Callable[[int, ObjectView], None] | None = None,
                    speeds: DecodeSpeeds | None = None) -> DecodedObject:
    """Check a verified object is the one the lookup asked for, then decode it (or hand it to ``into``)."""
    from kdn.codecs import codec_names, get_codec
    from kdn.objects import DecodedObject, ObjectView, decoded_nbytes

    view = ObjectView(f.blob, max_decoded=max_decoded)
    h = view.header
    _check_identity(h, hit, f.address)
    counts = hit.token_counts()
    start = sum(counts[:index])
    if (h.start, h.end) != (start, start + counts[index]):
        raise DigestMismatch(f"object {f.address} claims tokens [{h.start}, {h.end}), the lookup asked for "
                             f"[{start}, {start + counts[index]})")
    if not {t.codec for t in h.tensors.values()} <= set(codec_names()):
        import kdn.kernels  # noqa: F401  (lossy codecs need torch: registered only when used)
    if budget is None and not all(get_codec(t.codec).lossless for t in h.tensors.values()):
        # Belt and braces: the digest already pins the bytes to a lossless encoding.
        raise DigestMismatch(f"object {f.address} holds lossy tensors but lossless was asked for")
    t0 = time.perf_counter()
    if into is not None:
        into(index, view)
        out = DecodedObject(h, {})
    else:
        out = DecodedObject(h, view.decode())
    if speeds is not None:  # what the decode (into the engine's cache, with ``into``) cost on this machine
        speeds.observe(h.encoding, decoded_nbytes(h), time.perf_counter() - t0)
    return out


def __getattr__(name: str) -> Any:
    """``SyncKDNClient`` is importable from here too (it lives in ``kdn.sync``, which imports this module)."""
    if name == "SyncKDNClient":
        from kdn.sync import SyncKDNClient

        return SyncKDNClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
