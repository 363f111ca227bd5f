"""The registry read routes the origin and the edge both serve (``GET /v1/registry/objects/{address}``,
``POST /v1/records``, ``GET /v1/registry/manifests/{namespace}/{name}``), each answering only what the
caller may read, and the registry the app opens."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from kdn.format.address import Digest, validate_address, validate_digest, validate_name, validate_namespace
from kdn.auth import may_read
from kdn.wire.fetch import HOP
from kdn.registry import Manifest, open_registry

from .inputs import bearer, read_addresses
from .keys import GRANTS, MANIFEST_BODIES, RECORDS, REGISTRY, RecordSource

MAX_RECORDS = 1024  # records one POST /v1/records may ask for (~1.4 KB each, signed with pieces)


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
    """Before answering "no" (absent, or not yours): wait as the app's record source says, where it caches
    records for every tenant (an edge: ``RecordCache.hold``), so that the answer's timing tells nothing."""
    hold = getattr(records_of(request.app), "hold", None)
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
