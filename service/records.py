"""The registry read routes the origin and the edge both serve (``GET /v1/registry/objects/{address}``,
``POST /v1/records``, ``GET /v1/registry/manifests/{namespace}/{name}``), each answering only what the
caller may read; the registry the app opens; and the floor every "no" is held to.

A "no" (absent, or not yours) must not tell by its timing which of the two it was: at an origin, another
tenant's object is refused from the store's index at once while an absent one costs a read of the records
store and the registry (~540 vs ~957 us, told apart 90-97% of the time, #51 item 6); at an edge, a record
cached for its owner is refused without a read. So every "no" waits until ``hold_no``: an edge's record
cache holds it (``edge/records.py``: it times its own reads), any other app by its ``DENY_FLOOR``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from kdn.format.address import Digest, validate_address, validate_digest, validate_name, validate_namespace
from kdn.auth import may_read
from kdn.errors import InvalidInput
from kdn.wire.fetch import HOP
from kdn.registry import Manifest, open_registry

from .inputs import bearer, read_addresses
from .keys import GRANTS, MANIFEST_BODIES, RECORDS, REGISTRY, RecordSource

MAX_RECORDS = 1024  # records one POST /v1/records may ask for (~1.4 KB each, signed with pieces)
# A "no" follows slow ones up to this (a slower store then shows in its timing, but a slow spell does not make
# every refusal wait a second), over the last minute only: edge/records.py's bounds for its record reads.
MAX_FLOOR_S, NOS_WINDOW_S = 0.05, 60.0


def floor_of(floor_s: float, samples: deque[tuple[float, float]], window_s: float = NOS_WINDOW_S) -> float:
    """Seconds a "no" takes at least: ``floor_s``, or the 99th percentile of ``samples`` ((when, seconds) pairs)
    of the last ``window_s`` if longer, up to ``MAX_FLOOR_S`` (a slower one then shows). 0: the floor off."""
    if floor_s <= 0:
        return 0.0
    since = time.monotonic() - window_s
    took = sorted(s for at, s in samples if at >= since)
    return max(floor_s, min(MAX_FLOOR_S, took[int(len(took) * 0.99)] if took else 0.0))


async def wait_floor(since: float, floor: float) -> None:
    """Wait until ``floor`` seconds have passed since ``since`` (``time.monotonic()``: when the request came).

    The wake-up is put on a whole millisecond of the loop's clock (``time.monotonic`` too): the event loop's poll
    sleeps in whole milliseconds from when it is called, so a wait begun at once (a cached answer) and one begun
    after a read would otherwise overshoot by different amounts, and that difference showed (told apart 62% of
    the time with the floor alone, against 50% for chance)."""
    if floor <= 0:
        return
    loop = asyncio.get_running_loop()
    at = math.ceil((since + floor) * 1000) / 1000
    if at <= loop.time():
        return
    wake: asyncio.Future[None] = loop.create_future()

    def ring() -> None:
        if not wake.done():
            wake.set_result(None)

    handle = loop.call_at(at, ring)
    try:
        await wake
    finally:
        handle.cancel()


class DenyFloor:
    """How long a "no" takes at least: ``floor_s`` after the request came, or the 99th percentile of how long
    the last minute's "no"s took to be known if that is longer (up to ``MAX_FLOOR_S``). Every "no" then takes
    the floor, whatever it read first, and only one slower than it still shows. 0: answered as soon as known."""

    def __init__(self, floor_s: float = 0.002) -> None:
        if not 0 <= floor_s <= 1:
            raise InvalidInput(f"the floor of a 'no' must be 0-1000 ms, not {floor_s * 1000:g} ms")
        self.floor_s = floor_s
        self._took: deque[tuple[float, float]] = deque(maxlen=256)  # (when, how long) of the last "no"s

    def no_floor(self) -> float:
        return floor_of(self.floor_s, self._took)

    async def hold(self, since: float) -> None:
        """Wait until ``no_floor()`` seconds have passed since ``since`` (``time.monotonic()``, when the request
        came), having noted how long this "no" took to be known (``wait_floor``)."""
        now = time.monotonic()
        self._took.append((now, now - since))
        await wait_floor(since, self.no_floor())


DENY_FLOOR = web.AppKey("deny_floor", DenyFloor)  # an origin's (an edge's record cache holds its own "no"s)


def registry_ctx(url: str | None) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` entry that opens the registry at ``url`` for the app and closes it at shutdown."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        reg = open_registry(url)
        app[REGISTRY] = reg
        try:
            yield
        finally:
            await reg.close()

    return ctx


def records_of(app: web.Application) -> RecordSource:
    """The app's record source: an edge's record cache where it set one, else its registry."""
    src = app.get(RECORDS)
    return src if src is not None else app[REGISTRY]


async def hold_no(request: web.Request, since: float) -> None:
    """Before answering "no" (absent, or not yours): wait as the app's ``DENY_FLOOR`` says (an origin), or its
    record source where that caches records for every tenant (an edge: ``RecordCache.hold``), so that the
    answer's timing tells nothing."""
    floor = request.app.get(DENY_FLOOR)
    hold = floor.hold if floor is not None else getattr(records_of(request.app), "hold", None)
    if hold is not None and "*" not in request.app[GRANTS].namespaces(bearer(request), "read"):
        await hold(since)  # (a caller that may read every namespace, a peer edge, has nothing kept from it)


async def get_registry_object(request: web.Request) -> web.Response:
    address = validate_address(request.match_info["address"])
    t0 = time.monotonic()
    rec = await records_of(request.app).get_object(address)
    if rec is None or not _may_read(request, rec.namespace, rec.kind):
        await hold_no(request, t0)
        raise web.HTTPNotFound(text=f"no object {address}")  # do not reveal other tenants' objects
    return web.json_response(rec.to_dict())


async def post_records(request: web.Request) -> web.Response:
    """Many object records in one request (an edge asking its origin, where records live beside the blobs):
    ``{"addresses": [...]}`` in, ``{"records": [record or null, ...]}`` out, in order; a record the caller
    may not read is null, as an absent one is."""
    _, addrs = await read_addresses(request, MAX_RECORDS)
    t0 = time.monotonic()
    src = records_of(request.app)
    if HOP in request.headers and getattr(src, "takes_hop", False):  # an edge asking its region's owner
        recs = await src.get_objects(list(addrs), hop=True)  # type: ignore[call-arg]  # (RecordCache)
    else:
        recs = await src.get_objects(list(addrs))
    out = [r.to_dict() if r is not None and _may_read(request, r.namespace, r.kind) else None for r in recs]
    if None in out:
        await hold_no(request, t0)
    return web.json_response({"records": out})


async def get_registry_manifest(request: web.Request) -> web.Response:
    ns = validate_namespace(request.match_info["namespace"])
    name = validate_name(request.match_info["name"])
    if not _may_read(request, ns):
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    asked = request.query.get("body")  # one body by its digest (an edge following a pointer it read)
    if asked is not None:
        man = await _manifest_body(request.app, ns, name, validate_digest(asked))
        if man is None or (man.namespace, man.name) != (ns, name):
            raise web.HTTPNotFound(text=f"no body {asked[:16]} of manifest {ns}/{name}")
        return web.json_response(man.to_dict())
    man = await request.app[REGISTRY].get_manifest(ns, name)
    if man is not None and man.body is not None:  # a pointer (records beside the blobs): its whole manifest
        whole = await _manifest_body(request.app, ns, name, man.body)
        if whole is None or not man.points_at(whole):
            raise web.HTTPBadGateway(text=f"manifest {ns}/{name} v{man.version}: its body {man.body[:16]} "
                                          "could not be read from the origins")
        man = whole
    if man is None:
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    return web.json_response(man.to_dict())


async def _manifest_body(app: web.Application, namespace: str, name: str, digest: Digest) -> Manifest | None:
    bodies = app.get(MANIFEST_BODIES)
    if bodies is None:
        reg = app[REGISTRY]
        get = getattr(reg, "get_manifest_body", None)  # an origin's records store (kdn.registry.split)
        return await get(digest) if get is not None else None
    return await bodies.get_manifest_body(namespace, name, digest)


def _may_read(request: web.Request, namespace: str, kind: str | None = None) -> bool:
    grants = request.app[GRANTS]
    return may_read(grants.namespaces(bearer(request), "read"), namespace, kind)
