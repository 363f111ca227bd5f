"""One verified fetch: an object's body from the first source of a plan that delivers it intact.

The edge's fills (``kdn.edge.fill``) and the fetch client (``kdn.client``) both
fetch through ``Fetcher.fetch``; they differ only in the plan they hand it
(which sources, in which order, with which headers) and in what they count.
Written once here, for both:

- **the request**: ``GET {url}/v1/objects/{address}?encoding=...`` (quoted),
  the body read straight into a buffer the caller supplies (``alloc``: a
  reused arena lease on an engine's hot path, a fresh ``bytearray`` for an
  edge's tier), never more than the promised size (the buffer is the bound),
  no redirects followed, a deadline per request;
- **verification**: status 200, ``X-KDN-Encoding`` as asked, the exact
  ``Content-Length``, and the BLAKE3 digest fed as the bytes land (no second
  pass); with the record's piece digests, each piece is checked as its last
  byte lands (``kdn.format.pieces``): a wrong one drops the connection there, and a
  sink with ``verified(n)`` hears each proven prefix. A body that fails any of
  these is never returned, its source is counted and the next one is tried;
- **a cached-only ask** (another region's edge, ``X-KDN-Cached-Only``): a 404
  is a miss, measured as one round trip, not an error;
- **hedging** (the client's; an edge's fill does not hedge: its peer's answer
  is slow by design, a fill behind the owner): past twice the leading
  request's expected time (at least 20 ms) the next source is asked too, at
  most ``max_hedges`` extra; the first verified body wins, the others are
  cancelled and their buffers released;
- **what measures a link**: only a body the source served from its own tiers
  (``X-KDN-Source`` memory / disk), an origin's, or an upper tier's (its fills
  are what a miss costs the edges below it): a body the source first had
  to fill measures the upstream, and would make a near edge look far because
  its cache was cold. A failure inflates the source's estimate; a hedge that
  lost after running past its expected time is a lower bound on its time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote

from kdn.format.address import Address, Digest
from kdn.wire.bodyget import BodyError, BodyGetter, Sink, Tally
from kdn.errors import DigestMismatch, InvalidInput, SourceError
from kdn.wire.estimate import Company, Estimates, Mark
from kdn.format.pieces import BodyVerifier, Pieces, PieceVerifier, piece_span, verifier

CACHED_ONLY = "X-KDN-Cached-Only"  # "answer from your tiers or 404": cross-region probes never cause fills
HOP = "X-KDN-Hop"  # set on edge-to-edge requests: the receiver fills itself, never forwards in-region
TIER = "X-KDN-Tier"  # a lower region's fill through the upper tier: the receiver fills from the origin
MIN_HEDGE_S = 0.02


@dataclass(frozen=True)
class Want:
    """What a fetch must deliver: these bytes, and nothing else."""

    address: Address
    encoding: str
    size: int
    digest: Digest
    pieces: Pieces | None = None  # the record's piece digests: verified piece by piece (kdn/format/pieces.py)
    # Only pieces [first, end) of the blob (a range request, 206), each verified against its digest: the bytes
    # ``piece_span`` names. None: the whole blob.
    part: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.part is not None and self.pieces is None:
            raise InvalidInput(f"{self.address}.{self.encoding}: a range is verified by piece digests, and its "
                               "record has none")

    @property
    def nbytes(self) -> int:
        """The bytes this fetch moves (what its time measures)."""
        lo, hi = self.span
        return hi - lo

    @property
    def span(self) -> tuple[int, int]:
        """The bytes ``[lo, hi)`` of the blob this fetch delivers."""
        if self.part is None or self.pieces is None:
            return 0, self.size
        lo, hi, _ = piece_span(self.size, self.pieces, *self.part)
        return lo, hi


@dataclass(frozen=True)
class Route:
    """One source in a plan: where to ask, and how."""

    label: str  # what reports and metrics show: "edge:e1", "peer:e2", "region:us", "origin"
    url: str  # the node's base URL
    kind: str  # "edge" (the client's own region), "peer", "region", "upper", "origin"
    headers: Mapping[str, str] = field(default_factory=dict)  # the token where it may go, hop, cached-only
    timeout: float | None = None  # this request's bound (None: the fetcher's)

    @property
    def cached_only(self) -> bool:
        return CACHED_ONLY in self.headers


class Buffer(Protocol):
    """Where a body lands: ``view`` is exactly the body's size; ``release`` hands it back. (A buffer that is
    also a ``kdn.wire.bodyget.Sink``, such as ``kdn.wire.scatter.Scatter``, places the bytes itself.)"""

    @property
    def view(self) -> memoryview: ...

    def release(self) -> None: ...


class Fresh:
    """A buffer of its own (an edge's memory tier keeps it as it is): ``release`` does nothing."""

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.view = memoryview(self.data)

    def release(self) -> None:
        pass


@dataclass
class Body:
    """A verified body, and who sent it."""

    want: Want
    buffer: Buffer
    route: Route
    served_by: str  # the X-KDN-Source it was sent with (the route's label if none)
    seconds: float

    @property
    def blob(self) -> memoryview:
        return self.buffer.view


class Observer(Protocol):
    """What a caller counts of each attempt (metrics, a breaker); every method is optional to act on."""

    def failed(self, route: Route, error: Exception) -> None: ...
    def missed(self, route: Route, seconds: float) -> None: ...
    def delivered(self, route: Route, body: Body) -> None: ...


class _Quiet:
    def failed(self, route: Route, error: Exception) -> None:
        pass

    def missed(self, route: Route, seconds: float) -> None:
        pass

    def delivered(self, route: Route, body: Body) -> None:
        pass


class Fetcher:
    """Verified fetches over one ``BodyGetter``, ranked and measured by one ``Estimates``."""

    def __init__(self, getter: BodyGetter, estimates: Estimates, *, timeout: float = 30.0,
                 alloc: Callable[[int], Buffer] = Fresh,
                 authorize: Callable[[str], Mapping[str, str]] | None = None) -> None:
        self.getter = getter
        self.estimates = estimates
        self.company = Company()  # transfers in flight per source: a load's samples measure the source's speed
        self.timeout = timeout
        self.alloc = alloc
        # The caller's own credentials for a URL, decided when a request is actually sent (an edge
        # counts each time it withholds its token from a host outside --token-hosts).
        self.authorize = authorize
        self.hedges = 0  # extra requests started because the leading one ran late
        self.failovers = 0  # attempts that failed (an error or a lie), each followed by the next source

    async def fetch(self, want: Want, plan: Sequence[Route], *, hedge: bool = False, max_hedges: int = 1,
                    observer: Observer | None = None, alloc: Callable[[int], Buffer] | None = None,
                    tally: Tally | None = None) -> Body:
        """The first verified body from ``plan``'s sources, in order (hedged if asked); ``tally`` counts every
        body byte of every attempt as it lands."""
        race = _Race(self, want, plan, alloc or self.alloc, tally, observer or _Quiet())
        if not plan:
            raise SourceError(f"no source for {want.address}.{want.encoding}")
        race.launch()
        hedged = 0
        try:
            while race.pending:
                first = next(iter(race.pending.values()))
                budget = max(2 * self.estimates[first.url].expected(want.nbytes), MIN_HEDGE_S)
                can_hedge = hedge and hedged < max_hedges and race.launched < len(plan)
                done, _ = await asyncio.wait(race.pending, timeout=budget if can_hedge else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    self.hedges += 1
                    hedged += 1
                    race.launch()
                    continue
                for task in done:
                    if (body := race.settle(task)) is not None:
                        return body
                if not race.pending and race.launched < len(plan):
                    race.launch()
            raise race.failure()
        finally:
            await race.close()

    async def _attempt(self, want: Want, route: Route, make: Callable[[int], Buffer],
                       tally: Tally | None = None) -> Body | None:
        """One request: a verified body, None for a cached-only miss, or SourceError / DigestMismatch."""
        t0 = time.perf_counter()
        lo, hi = want.span
        buf = make(hi - lo)
        ok = False
        try:
            # Fed as the bytes land: verification overlaps the transfer, no second pass; piece by piece where
            # the record has pieces (a lie is found within a piece of where it starts).
            proven = getattr(buf, "verified", None)
            what = f"{want.address} from {route.label}"
            if want.part is not None and want.pieces is not None:
                hasher: BodyVerifier = PieceVerifier(hi - lo, piece_span(want.size, want.pieces, *want.part)[2], what,
                                                     proven)
            else:
                hasher = verifier(want.size, want.digest, want.pieces, what, proven)
            url = f"{route.url}/v1/objects/{want.address}?encoding={quote(want.encoding, safe='')}"
            try:
                # No redirects: a source that answers 3xx is a failed source, not a pointer to follow (it would
                # otherwise lead this node, and its token, to any host it names).
                headers = {**(self.authorize(url) if self.authorize else {}), **route.headers}
                if want.part is not None:  # If-Range: a source holding other bytes under the name sends all (a 200)
                    headers |= {"Range": f"bytes={lo}-{hi - 1}", "If-Range": f'"{want.digest}"'}
                target = buf if isinstance(buf, Sink) else buf.view  # kdn.wire.scatter places its bytes itself
                r = await self.getter.get(url, target, headers, route.timeout or self.timeout, hasher=hasher,
                                          tally=tally)
            except (BodyError, asyncio.TimeoutError, OSError) as e:
                raise SourceError(f"{type(e).__name__}: {str(e)[:120]}") from None
            if r.status == 404 and route.cached_only:
                return None
            if r.status != (200 if want.part is None else 206):
                raise SourceError(f"HTTP {r.status}")
            if want.part is not None and r.headers.get("content-range") != f"bytes {lo}-{hi - 1}/{want.size}":
                raise SourceError(f"asked for bytes {lo}-{hi - 1}/{want.size}, got {r.headers.get('content-range')}")
            if r.headers.get("x-kdn-encoding", want.encoding) != want.encoding:
                raise SourceError(f"asked for {want.encoding}, got {r.headers.get('x-kdn-encoding')}")
            if r.length != hi - lo:
                raise SourceError(f"Content-Length {r.length}, expected {hi - lo}")
            if not hasher.verified():
                raise DigestMismatch(f"{want.address} from {route.label} does not match its digest")
            if proven is not None and want.pieces is None:
                proven(hi - lo)  # verified whole: the sink hears it once, at the end
            ok = True
            return Body(want, buf, route, r.headers.get("x-kdn-source", route.label), time.perf_counter() - t0)
        finally:
            if not ok:
                buf.release()


class _Race:
    """One fetch's attempts: started in the plan's order (the next one when the leading runs late or one
    fails), each settled as it finishes, the first verified body the winner."""

    def __init__(self, fetcher: Fetcher, want: Want, plan: Sequence[Route], make: Callable[[int], Buffer],
                 tally: Tally | None, obs: Observer) -> None:
        self.fetcher, self.want, self.plan, self.make, self.tally, self.obs = fetcher, want, plan, make, tally, obs
        self.pending: dict[asyncio.Task[Body | None], Route] = {}
        self.started: dict[asyncio.Task[Body | None], float] = {}
        self.marks: dict[asyncio.Task[Body | None], Mark] = {}
        self.leading: asyncio.Task[Body | None] | None = None
        self.launched = 0
        self.errors: list[str] = []
        self.lies = 0

    def launch(self) -> None:
        route = self.plan[self.launched]
        self.launched += 1
        task = asyncio.ensure_future(self.fetcher._attempt(self.want, route, self.make, self.tally))
        self.pending[task], self.started[task] = route, time.perf_counter()
        mark = self.fetcher.company.start(route.url)
        self.marks[task] = mark
        task.add_done_callback(lambda _: self.fetcher.company.end(mark))  # (cancelled ones too)
        if self.leading is None:
            self.leading = task

    def settle(self, task: asyncio.Task[Body | None]) -> Body | None:
        """A finished attempt: its body if it was verified (its link measured), None if it failed or missed."""
        route, estimates = self.pending.pop(task), self.fetcher.estimates
        t = time.perf_counter() - self.started[task]
        try:
            body = task.result()
        except (SourceError, DigestMismatch) as e:
            self.fetcher.failovers += 1
            estimates[route.url].fail()
            self.errors.append(f"{route.label}: {e}")
            self.lies += isinstance(e, DigestMismatch)
            self.obs.failed(route, e)
            return None
        if body is None:  # a cached-only ask that missed: a round trip, measured as one
            estimates[route.url].observe(0, t)
            self.obs.missed(route, t)
            return None
        # An upper tier's full fill counts too: it is what every miss costs an edge below it.
        if body.served_by.split(":", 1)[0] in ("memory", "disk") or route.kind in ("origin", "upper"):
            estimates[route.url].observe(self.want.nbytes, body.seconds, self.fetcher.company.end(self.marks[task]))
        self.losers_took_at_least()
        self.obs.delivered(route, body)
        return body

    def losers_took_at_least(self) -> None:
        """A hedge cancelled because another request won took at least as long as it ran: past its
        expected time, that is a measurement (a lower bound). Without it a hedge target that always
        loses is never measured: a hedge kept going to a region edge behind a slowed link while the
        origin, 30 ms away, was never tried (bench/faults.py slow_region_link). Not the leading
        request (it is hedged only when slow, so a sample taken when it loses is biased upward), and
        not an edge of the client's own region: its slow answer is mostly a fill shared through the
        owner, which says nothing about its link (measured so, it sent the geo bench's clients away
        from their near edges: p50 33 -> 130 ms in a seed)."""
        now, nbytes = time.perf_counter(), self.want.nbytes
        for task, route in self.pending.items():
            if task is self.leading or route.kind in ("edge", "peer"):
                continue
            est = self.fetcher.estimates[route.url]
            if now - self.started[task] > est.expected(nbytes):
                est.observe(nbytes, now - self.started[task])

    def failure(self) -> Exception:
        """What to raise when no source delivered."""
        want = self.want
        if self.errors and self.lies == len(self.errors):  # every source that answered sent bytes that are not it
            return DigestMismatch(f"no source delivered {want.address} intact: " + "; ".join(self.errors))
        return SourceError(f"no source delivered {want.address}.{want.encoding}: "
                           + ("; ".join(self.errors) or "none holds it"))

    async def close(self) -> None:
        """The attempts still running cancelled, and waited for, so none outlives the fetch."""
        pending = self.pending
        for task in pending:
            task.cancel()
        if pending:  # a cancelled attempt releases its own buffer (_attempt); wait so none outlives us
            await asyncio.wait(pending)
        for task in pending:  # two bodies can arrive in one wake-up: the one not returned is handed back
            if not task.cancelled() and task.exception() is None and (late := task.result()) is not None:
                late.buffer.release()
