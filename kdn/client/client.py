"""The fetch client an inference server uses: find the longest cached prefix of a prompt and fetch it.

Its sources (``kdn.client.sources``: the owner edge of its region first, then the
region's other edges, other regions' edges, the origin) each keep a moving
estimate of round-trip time and bandwidth; a fetch goes to the source with the
least expected time for the object's size, is hedged to the next source when
it runs past twice its expected time, fails over on error, and is verified
against the digest its record promised before anything is decoded. Records
and manifests are believed as far as ``kdn.client.trust`` allows. Object bodies are read by
``kdn.wire.bodyget`` (keep-alive connections of its own, straight into arena
buffers); lookups, records and manifests go through one aiohttp session. How a lookup finds the
longest published prefix is ``kdn.client.find``; how a prefix's objects are fetched and decoded or placed into an
engine's cache is ``kdn.client.prefix``.

    async with KDNClient(edges=["http://127.0.0.1:8100"], token=...) as c:
        hit = await c.lookup(tokens, model_id, namespace="public")
        states = await c.fetch_prefix(hit)

What it returns (``Lookup``, ``Fetched``, ``PrefixStates``, ...) is defined in
``kdn.client.lookup``; ``SyncKDNClient`` (``kdn.client.sync``) wraps it for scripts. The package
(``kdn.client``) exports all of them.
"""

from __future__ import annotations

__all__ = ["KDNClient"]

import asyncio
import logging
import os
import ssl as _ssl
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from kdn.format import address as A
from kdn.format.address import Address, Digest, ModelId, validate_digest
from kdn.client.bases import Bases
from kdn.wire.bodyget import BodyGetter, Tally
from kdn.client.connections import DECODE_THREADS, Connections
from kdn.format.encodings import affordable, parse_budget
from kdn.errors import InvalidInput, KDNError, SourceError
from kdn.wire.estimate import DECODE, DecodeSpeeds
from kdn.wire.fetch import Fetcher, Fresh, Observer, Route, Want
from kdn.client.find import find_prefix
from kdn.client.hosted import Behind, Held, HostStats, held
from kdn.client.lookup import Fetched, Lookup, PrefixStates, Probe, Tensors
from kdn.client.parts import fetch_tensors
from kdn.format.layout import DEFAULT_MAX_OBJECT_BYTES
from kdn.format.pieces import Pieces
from kdn.client.prefix import fetch_prefix
from kdn.client.sources import Sources, from_nodes
from kdn.client.trust import Trust

if TYPE_CHECKING:  # pragma: no cover - imported where used, so `import kdn.client` stays light
    from kdn.wire.arena import Arena
    from kdn.format.objects import Layout, ObjectView
    from kdn.wire.scatter import Placer
    from kdn.registry import Membership
    from kdn.registry.records import Encoding, Manifest, ObjectRecord
    from kdn.client.trust import TrustedKeys
    from kdn.client.versions import ManifestState
    from kdn.client.host import HostClient

log = logging.getLogger(__name__)

RECENT_FETCHES = 1 << 16  # addresses a client remembers having fetched (KDNClient.warm) ...
RECENT_S = 600.0  # ... and for how long (an edge's memory tier turns over; after this, not known warm)


class KDNClient:
    """Async fetch client. Give it edge URLs (first = the region's entry point), and/or an origin URL."""

    def __init__(
        self,
        *,
        edges: Sequence[str | tuple[str, str]] = (),
        remote_edges: Sequence[str] = (),
        origin: str | None = None,
        token: str | None = None,
        max_hedges: int = 1,
        concurrency: int = 8,
        timeout: float = 30.0,
        ca: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        quality: str | float = "lossless",
        local_addr: str | None = None,
        trusted_keys: TrustedKeys | None = None,
        arena: Arena | None = None,
        decode_speeds: DecodeSpeeds | None = None,
        manifest_state: ManifestState = None,
        decode_threads: int = DECODE_THREADS,
        host: HostClient | None = None,
    ) -> None:
        # Where to fetch from and in what order (kdn.client.sources): its routes (``all``), their estimates (of
        # transfers, ``estimates``; of lookups and registry reads, ``control``) and the region's ring.
        self.routing = Sources(edges, remote_edges, origin)
        # How it reaches them: sessions, the body reader, the verified fetcher, the decode threads, the bearer
        # token (``headers``) (kdn.client.connections).
        self.net = Connections(self.routing.estimates, token=token, timeout=timeout, ca=ca, ssl=ssl,
                               local_addr=local_addr, concurrency=concurrency, decode_threads=decode_threads)
        if max_hedges < 0:
            raise InvalidInput(f"max_hedges must be >= 0, not {max_hedges}")
        self.max_hedges = max_hedges  # extra requests a slow fetch may start (0: never hedged)
        # What it may fetch: "lossless" (the default) or a maximum NLL increase in % picks the encodings, beside
        # what decoding each costs on this machine (measured by every decode; the process's own by default).
        parse_budget(quality)
        self.quality = quality
        self.decode_speeds = decode_speeds if decode_speeds is not None else DECODE
        # What it believes: publisher keys (a kdn.registry.signing.Verifier, key strings, or a file of them): with them, a
        # record whose signature does not verify is a miss -- its digest is never believed (kdn.client.trust).
        self.trust = Trust(trusted_keys, manifest_state)
        self._fetched: OrderedDict[Address, float] = OrderedDict()  # address -> when fetched (warm), bounded
        # kvtc bases by address: each fetched once (then shared by every object that names it)
        self.bases = Bases(self.record, self.fetch)
        # What to count of each attempt of a fetch (``kdn.wire.fetch.Observer``: traces, metrics); None: nothing.
        self.fetch_observer: Observer | None = None
        # Receive buffers reused across loads (``kdn.wire.arena``): a prefix loaded into an engine's cache
        # (``fetch_prefix(into=...)``) lands in them and hands them back once decoded into place.
        self.arena = arena
        # The machine's host tier (kdn.client.host.HostClient, the caller's to open and close): the first source
        # of a load into an engine's cache; what it lacks comes from the edges, then is asked of it behind.
        self.host = host
        self.host_stats = HostStats()
        self.behind = Behind()

    # --- lifecycle -------------------------------------------------------------

    @property
    def getter(self) -> BodyGetter:
        """The object-body path (``kdn.client.connections``)."""
        return self.net.getter

    @property
    def fetcher(self) -> Fetcher:
        return self.net.fetcher

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.net.session

    @property
    def decoders(self) -> ThreadPoolExecutor:
        return self.net.decoders

    @property
    def decode_threads(self) -> int:
        return self.net.decode_threads

    async def close(self) -> None:
        await self.behind.close()
        await self.net.close()

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
                        self.routing.control[s.url].fail()
                        errors.append(f"{s.label}: HTTP {r.status}")
                        continue
                    data = await r.json(content_type=None)
                    if not isinstance(data, dict):
                        raise ValueError("not a JSON object")
                    self.routing.control[s.url].observe(0, time.perf_counter() - t0)  # small: an RTT sample
                    return data
            except ValueError:
                self.routing.control[s.url].fail()
                errors.append(f"{s.label}: not a JSON object")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.routing.control[s.url].fail()
                self.routing.estimates[s.url].fail()  # unreachable: its transfers would fail too
                errors.append(f"{s.label}: {type(e).__name__}")
        raise SourceError("no source answered " + path.split("?")[0] + ": " + "; ".join(errors))

    async def record(self, address: Address) -> ObjectRecord | None:
        """The record of ``address`` (None if absent, unreadable or refused: ``kdn.client.trust``)."""
        address = A.validate_address(address)
        d = await self._json("GET", f"/v1/registry/objects/{address}")
        return self.trust.record(d, address)

    async def manifest(self, namespace: str, name: str, *, pin: str | None = None) -> Manifest | None:
        """The manifest of ``namespace/name`` (a ``kdn.registry.Manifest``; None if absent, unreadable or refused).
        Never an older one than this client took before: a superseded manifest, validly signed and replayed by a
        registry writer or a lying edge, is refused (counted in ``rejected_records``; with ``trusted_keys``, which
        make the version the origin's word); the highest version seen per name is kept in ``manifest_versions``:
        by default in a per-user file (``kdn.client.versions.state_file``;
        ``manifest_state=PATH`` names another, ``False`` keeps them in memory), so that it holds across restarts
        and processes.
        ``pin`` (``kdn.registry.signing.manifest_pin``, printed by ``kdn publish``) takes exactly that manifest: any
        other one served under the name is refused (None, counted), with keys or without."""
        ref = f"{A.validate_namespace(namespace)}/{A.validate_name(name)}"
        return self.trust.manifest(await self._json("GET", f"/v1/registry/manifests/{ref}"), ref, pin)

    @property
    def rejected_records(self) -> int:
        """Records and manifests refused so far (``kdn.client.trust``)."""
        return self.trust.rejected

    @property
    def manifest_versions(self) -> MutableMapping[str, int]:
        """``namespace/name`` -> the highest manifest version this client has taken (``kdn.client.trust``)."""
        return self.trust.manifest_versions

    # --- lookup ----------------------------------------------------------------

    async def lookup(self, tokens: Iterable[int], model_id: ModelId, namespace: str = "public", *,
                     chunk_tokens: int = A.DEFAULT_CHUNK_TOKENS, host: bool = True) -> Lookup:
        """How many leading tokens of ``tokens`` are published: whole chunks, then a partial tail
        (``kdn.client.find``: one ``/v1/lookup``, the chain's records riding with it, believed as ``kdn.client.trust`` allows;
        a prompt that continues past a published text reuses all of the text). With a host tier (and ``host``),
        it is asked first: a chain it holds whole is found with no edge asked."""
        ask_host = None
        if host and self.host is not None:
            tier, stats = self.host, self.host_stats

            async def ask_host(addresses: list[Address]) -> Held:
                return await held(tier, addresses, stats, records=True)

        return await find_prefix(self._json, self.record, self.trust, list(tokens), model_id, namespace,
                                 chunk_tokens, ask_host)

    # --- fetch -----------------------------------------------------------------

    @classmethod
    async def from_registry(cls, registry: Membership, region: str, *, token_hosts: str | list[str] | None = None,
                            admitted_by: TrustedKeys | None = None,
                            revoked_admissions: str | os.PathLike[str] | Iterable[str] | None = None,
                            **kwargs: Any) -> KDNClient:
        """Sources from the registry's live nodes (``kdn.client.sources.from_nodes``): this region's edges, other
        regions' edges, the origins; with a ``token``, only nodes it may reach (``token_hosts``); with
        ``admitted_by`` (operator keys), only nodes one of them admitted and did not revoke."""
        found = await from_nodes(registry, region, token=kwargs.get("token"), token_hosts=token_hosts,
                                 admitted_by=admitted_by, revoked_admissions=revoked_admissions)
        return cls(**found, **kwargs)

    def _ranked(self, size: int, address: Address | None = None, *, control: bool = False) -> list[Route]:
        """The sources for one request, least expected time first (``kdn.client.sources.Sources.ranked``)."""
        return self.routing.ranked(size, address, control=control)

    def expected_seconds(self, size: int) -> float:
        """The least expected time to fetch ``size`` bytes from any source, as a load moves them (many objects
        at once, ``SourceEstimate.expected_load``): the load planner's link."""
        return min(self.routing.estimates[s.url].expected_load(size) for s in self._ranked(size))

    def choose_encoding(self, encodings: Mapping[str, Encoding], quality: str | float | None = None) -> str | None:
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
            size = enc.size
            t = self.routing.least_expected(size) + self.decode_speeds.seconds(name, size)
            if t < best_t:
                best, best_t = name, t
        return best

    async def fetch(self, address: Address, *, encoding: str | None = None, digest: Digest | None = None,
                    size: int | None = None, quality: str | float | None = None, cold: bool = False,
                    pooled: bool = False, arena: Arena | None = None, pieces: Pieces | None = None,
                    tally: Tally | None = None, part: tuple[int, int] | None = None) -> Fetched:
        """One object, verified. Without ``digest`` the registry record supplies it (and, without
        ``encoding``, the record's encodings are chosen from by ``quality``). ``pooled``: the body lands
        in a buffer of ``arena`` (default: the client's, when it has one), which the caller hands back with
        ``Fetched.release()`` once the bytes are used (ArenaFull when the arena's budget is spent). ``pieces``
        (the record's piece digests, ``kdn.format.pieces``) verify the body piece by piece as it lands. ``tally``
        (``kdn.wire.bodyget.Tally``) counts the body bytes as they land, also of an attempt that fails or is cut
        short: a load given up at its deadline measures its own link by them (``kdn.planner``). ``part``: only
        pieces ``[first, end)`` (``fetch_part``, with the record the caller holds: ``kdn.client.parts``)."""
        address = A.validate_address(address)
        if digest is None or encoding is None or size is None:
            rec = await self.record(address)
            if rec is None:
                raise SourceError(f"{address} is not in the registry")
            encs = rec.encodings
            encoding = encoding or self.choose_encoding(encs, quality)
            if encoding is None or encoding not in encs:
                raise SourceError(f"{address} has no encoding {encoding!r} within quality {quality or self.quality!r}"
                                  f" (it has {sorted(encs)})")
            digest, size = encs[encoding].digest, encs[encoding].size
            pieces = encs[encoding].piece_list
        if size > DEFAULT_MAX_OBJECT_BYTES:
            raise InvalidInput(f"{address} is {size} bytes, over the client's limit")
        async with self.net.limit:
            return await self._fetch_hedged(address, encoding, digest, size, hedge=self.max_hedges > 0 and not cold,
                                            pooled=(arena or self.arena) if pooled else None, pieces=pieces,
                                            part=part, tally=tally)

    async def probe(self, address: Address, *, encoding: str, digest: Digest, size: int, pieces: Pieces | None = None,
                    deadline_s: float) -> Probe | None:
        """Time this client's link by fetching one object, verifying it and dropping it: the load planner's
        probe (``Decision.probe_s``), run beside a request that computes instead of inside it. Not hedged (a
        second source would time another link). Never raises for the source: a probe cut at ``deadline_s``
        or failed reports the body bytes that did land by then (``abandoned``), as a load given up does.
        None: it measured nothing (the arena had no room for the body)."""
        from kdn.wire.arena import ArenaFull

        tally, t0 = Tally(), time.perf_counter()
        try:
            async with self.net.limit:
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

    async def _fetch_hedged(self, address: Address, encoding: str, digest: Digest, size: int, *, hedge: bool = True,
                            pooled: Arena | None = None, pieces: Pieces | None = None,
                            part: tuple[int, int] | None = None, tally: Tally | None = None) -> Fetched:
        """Through ``kdn.wire.fetch`` (one verified fetch for edges and clients): the best source first, hedged to
        the next past twice its expected time (at most ``max_hedges`` extra; others only when a source
        fails); the first verified body wins.

        Not for an object the edge reported it would have to fill (``hedge=False``): its answer is
        slow by design, and a hedge to another edge starts a second fill from the same upstream (the
        geo bench saw one cold object fan out to all seven sources, 100 ms apart, each filling it).
        """
        want = Want(A.validate_address(address), encoding, size, validate_digest(digest), pieces, part)
        routes = self._ranked(want.nbytes, address)
        alloc = pooled.take if pooled is not None else None  # the arena the body lands in, if any
        body = await self.fetcher.fetch(want,
                                        routes, hedge=hedge, max_hedges=self.max_hedges, alloc=alloc,
                                        observer=self.fetch_observer, tally=tally)
        blob = body.buffer.data if isinstance(body.buffer, Fresh) else body.blob
        self.note_read(address)
        return Fetched(address, encoding, blob, f"{body.route.label}/{body.served_by}", body.seconds, body.buffer)

    def note_read(self, address: Address) -> None:
        """Remember that this client read ``address`` (or had it read for it: a vLLM scheduler hands its loads
        to a worker with a client of its own): the edge held or filled it, so it is warm there now."""
        self._fetched[address] = time.monotonic()
        self._fetched.move_to_end(address)
        while len(self._fetched) > RECENT_FETCHES:
            self._fetched.popitem(last=False)

    def warm(self, address: Address, tier: str) -> bool:
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

    async def fetch_part(self, address: Address, encoding: str, first: int, end: int) -> Fetched:
        """Pieces ``[first, end)`` of an object (``kdn.format.pieces``: 1 MiB each by default) by a range request, each
        verified against the piece digests of its (signed) record: ``blob`` holds the blob's bytes
        ``[first * piece_bytes, ...)``. InvalidInput if the record has no pieces (a blob of one piece, or
        from before pieces): fetch it whole."""
        rec = await self.record(address)
        if rec is None or encoding not in rec.encodings:
            raise SourceError(f"{address} has no {encoding!r} record here")
        e = rec.encodings[encoding]
        pieces = e.piece_list
        if pieces is None:
            raise InvalidInput(f"{address}.{encoding} records no piece digests: fetch it whole")
        async with self.net.limit:
            return await self._fetch_hedged(address, encoding, e.digest, e.size, hedge=self.max_hedges > 0,
                                            pieces=pieces, part=(first, end))

    async def fetch_tensors(self, address: Address, names: Iterable[str], *, encoding: str = "raw") -> Tensors:
        """Only the named tensors of an object (one layer's ``L3.k`` and ``L3.v``, say), verified, by range
        requests where its record has piece digests (``kdn.client.parts``)."""
        return await fetch_tensors(self, address, names, encoding=encoding)

    async def basis(self, address: Address) -> Any:
        """The kvtc basis (``kdn.kernels.transform.Basis``) at ``address``: fetched once, verified, registered
        for decoding (``kdn.client.bases``)."""
        return await self.bases.get(A.validate_address(address))

    async def prepare(self, f: Fetched, tokens: int | None = None) -> int | None:
        """Load the kvtc bases a fetched object names; the ``max_decoded`` its decode may use (``kdn.client.bases``)."""
        return await self.bases.prepare(f, tokens)

    @property
    def bases_fetched(self) -> int:
        return self.bases.fetched

    async def fetch_prefix(self, hit: Lookup, *, encoding: str | None = None,
                           quality: str | float | None = None,
                           into: Callable[[int, ObjectView], None] | None = None,
                           arena: Arena | None = None, scatter: Placer | None = None,
                           tally: Tally | None = None,
                           needs: Callable[[int], Collection[str] | None] | None = None) -> PrefixStates:
        """Fetch, verify and decode every object of a lookup; objects stay in chain order (``kdn.client.prefix``).

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

        With ``scatter`` (``kdn.wire.scatter.Placer``, e.g. the same ``CacheBuilder``), a chunk fetched ``raw`` that
        the engine can place is received straight into its memory (``kdn.wire.scatter``: no receive buffer of the
        object's size; its 32 KB runs are read through the connection's 1 MiB bounce buffer and copied out
        while in cache, ``kdn.wire.bodyget``); its ``fetched[i].blob`` is empty. ``tally``: every body byte of the
        prefix counted as it lands (``fetch``). ``needs(i)``: the tensors chunk ``i``'s ``into`` reads, where not
        all (a hybrid's K/V of every chunk but the last): only those are fetched, by verified ranges.
        """
        return await fetch_prefix(self, hit, encoding=encoding, quality=quality, into=into, arena=arena,
                                  scatter=scatter, tally=tally, needs=needs)

    async def fetch_placed(self, address: Address, *, digest: Digest, size: int, pieces: Pieces | None,
                           place: Callable[[Layout], Mapping[str, Sequence[memoryview]]],
                           tally: Tally | None = None) -> tuple[Fetched, Layout]:
        """A raw object received straight into the caller's memory (``kdn.wire.scatter``): ``place`` checks the
        header (raise to refuse it: nothing is placed) and names the runs each tensor's bytes go to. Verified
        against ``digest`` (and ``pieces``) as the bytes land; the caller uses its memory only once this
        returns. Never hedged, since two bodies would race for the same memory; a failed attempt's bytes are
        rewritten by the next source's."""
        from kdn.wire.scatter import Scatter

        address = A.validate_address(address)
        if size > DEFAULT_MAX_OBJECT_BYTES:
            raise InvalidInput(f"{address} is {size} bytes, over the client's limit")
        routes = self._ranked(size, address)
        async with self.net.limit:
            body = await self.fetcher.fetch(Want(address, "raw", size, validate_digest(digest), pieces),
                                            routes, hedge=False, alloc=lambda n: Scatter(n, place),
                                            observer=self.fetch_observer, tally=tally)
        assert isinstance(body.buffer, Scatter) and body.buffer.layout is not None
        f = Fetched(address, "raw", memoryview(b""), f"{body.route.label}/{body.served_by}", body.seconds)
        self.note_read(address)
        return f, body.buffer.layout

