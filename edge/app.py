"""The edge server: its HTTP side and its wiring.

The read path is ``node.py`` (``Edge.load``: memory -> disk -> one flight per
key -> owner peer -> other regions -> origin); the handlers here send what it
returns with ``X-KDN-Source`` saying where the bytes came from, and answer
lookups with the same planner. ``create_app(config)`` builds the aiohttp app;
the registry, the edge (``Edge.open``: every part made, none None), its
membership, background work, policies and the registry views (``views.py``)
are each a ``cleanup_ctx`` resource, started in order and stopped in reverse.
The settings are ``config.py``'s ``EdgeConfig``.

Routes (every GET answers HEAD too, as aiohttp adds it; the last four are ``kdn.service.add_common_routes``,
which the origin serves alike):
    GET  /v1/objects/{address}[?encoding=]       the blob (HEAD: is it here, no fill; to a caller told the
                                                 tier, ``X-KDN-Reads``: each tier's whole reads of its copy)
    POST /v1/lookup                              ordered addresses -> how many leading ones can be served and
                                                 where each would come from (``"records": true``: their records)
    POST /v1/prefetch                            (edge to edge, a read-* token) fill these in the background
    GET  /healthz                                this edge: region, ring, tiers' use, origins, upper tiers
    GET  /v1/registry/objects/{address}          an object record
    POST /v1/records                             many object records in one request
    GET  /v1/registry/manifests/{ns}/{name}      a manifest
    GET  /metrics                                Prometheus text
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from kdn import service
from kdn.service import connections
from kdn.format.address import Address, validate_address
from kdn.auth import Grant, Grants, covers, may_read
from kdn.format.encodings import LOSSLESS_PREFERENCE
from kdn.errors import InvalidInput, SourceError
from kdn.wire.fetch import CACHED_ONLY, HOP, TIER
from kdn.client.holding import READS_HEADER
from kdn.registry import ObjectRecord
from kdn.registry.follow import stop_tasks
from kdn.service import GRANTS, METRICS, REGISTRY, bearer, object_headers, read_json
from kdn.format.store import validate_encoding

from kdn.edge.metrics import EdgeMetrics
from kdn.edge.tiers import Key

from kdn.edge.config import EdgeConfig as EdgeConfig  # (re-exported: the app's settings and its Edge)
from kdn.edge.node import Edge as Edge
from kdn.edge.views import expire_loop, watch_manifests, watch_origins

log = logging.getLogger(__name__)

EDGE = web.AppKey("edge", Edge)


# --- resources -------------------------------------------------------------


# Each long-lived resource is its own cleanup_ctx (create_app lists them): started in that order,
# stopped in reverse, so what produces work (watches, policies) stops before what does it (background
# fills and disk copies), and that before what it uses (membership, the HTTP session, the tiers).


async def _edge_ctx(app: web.Application):
    """The edge itself, every part made (``Edge.open``: the disk tier scanned first); at the end its
    one-flight-per-key table closed, then its upstream session and body reader."""
    edge = await Edge.open(app[EDGE_CONFIG], app[REGISTRY], app[EDGE_METRICS])
    app[EDGE] = edge
    app[service.RECORDS] = edge.records  # the edge serves records from its cache (and where it reads them)
    app[service.MANIFEST_BODIES] = edge.bodies
    try:
        yield
    finally:
        await edge.flight.close()
        edge.getter.close()
        await edge.session.close()


async def _kv_events_ctx(app: web.Application):
    """``--kv-events``: what the tiers hold, as vLLM KV-cache events (edge/kv_events.py), from before the first
    fill to after the last; at the end ``AllBlocksCleared`` on every topic, then the publisher's thread stops."""
    from kdn.edge import kv_events

    feed, publisher = await kv_events.start(app[EDGE], app[EDGE_CONFIG], app[EDGE_METRICS])
    try:
        yield
    finally:
        await feed.close()
        await publisher.close()


async def _upstream_ctx(app: web.Application):
    """The region's membership: a lease on this edge's record and a watch on ``nodes/edge/``; and the
    round trips to the origins it advertises there (``--upper-tier auto``)."""
    edge = app[EDGE]
    await edge.membership.start()
    if edge.auto_upper is not None:  # it rewrites this edge's record: after the membership's lease exists
        edge.auto_upper.start()
    try:
        yield
    finally:
        if edge.auto_upper is not None:
            await edge.auto_upper.close()
        await edge.membership.close()


async def _background_ctx(app: web.Application):
    """Work off the response path (prefetch, durable disk copies, promotions): drained at shutdown;
    and the TTL expiry pass."""
    expiry = asyncio.create_task(expire_loop(app[EDGE]), name="kdn-edge-expiry")
    try:
        yield
    finally:
        expiry.cancel()
        await asyncio.gather(expiry, return_exceptions=True)
        await app[EDGE].drain()


POLICY_WAIT_S = 5.0  # at start, how long the edge waits for its policies before it serves anyway


async def _policies_ctx(app: web.Application):
    edge = app[EDGE]
    await edge.policies.start()
    try:
        yield
    finally:
        await edge.policies.close()


async def _views_ctx(app: web.Application):
    """The edge's registry views: one of ``manifests/`` (the prefetch chain index and the policy engine
    both read it) and, without ``--origin``, one of the live origins."""
    cfg, edge = app[EDGE_CONFIG], app[EDGE]
    watchers = [asyncio.create_task(watch_manifests(edge), name="kdn-edge-manifests")]
    origins_listed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    origins_listed.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is the watch's
    if cfg.origin:
        origins_listed.set_result(None)
    else:
        watchers.append(asyncio.create_task(watch_origins(edge, origins_listed), name="kdn-edge-origins"))
    try:
        # Serve once the policies are applied, so a restarted edge's warm disk tier is not read before its
        # TTLs and pins are known (an entry a TTL expired while the edge was down would be served once more),
        # and once the origins are listed, so that no record read takes the registry's word for theirs.
        # A registry that does not answer in time does not keep the edge down: it serves, applies them later.
        try:
            async with asyncio.timeout(POLICY_WAIT_S):
                await edge.policies.wait_applied(lambda p: p.ready)
                await asyncio.shield(origins_listed)
        except TimeoutError:
            log.warning("serving before the policies and origins are known: the registry did not answer in "
                        "%.0f s; they apply when it does", POLICY_WAIT_S)
        except Exception as e:  # noqa: BLE001 -- the origins' first list failed (the watch retries): serve
            log.warning("serving before the origins are known: %s", e)
        log.info("edge %s in region %s serving at %s", cfg.node_id, cfg.region, cfg.advertised_url)
        yield
    finally:
        await stop_tasks(watchers, what="registry view")


# --- handlers --------------------------------------------------------------


async def _readable_record(request: web.Request, address: Address) -> ObjectRecord:
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
            if not head and rng is None:
                loaded.handle.count_read()  # a whole read answered from this tier (the console's hits)
        if not head:
            edge.prefetcher.after_read(address, encoding)
        # An anonymous HEAD learns whether it can read the object, not which tier holds it, nor its reads.
        tells = peer or bool(bearer(request))
        source = loaded.source if (tells or not head) else "edge"
        headers = object_headers(digest, source, encoding, rec.namespace)
        if head and tells:
            headers[READS_HEADER] = ", ".join(f"{t}={n}" for t, n in edge.reads(key).items())
        if loaded.path is not None:
            return await _send_file(request, loaded.path, loaded.size, headers, head=head, metrics=edge.m, rng=rng)
        if loaded.data is None:
            raise RuntimeError(f"a {loaded.source} handle with neither bytes nor a file")
        return await _send_bytes(request, loaded.data, headers, head=head, metrics=edge.m,
                                 source=loaded.source.split(":", 1)[0], rng=rng)
    finally:
        loaded.release()


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
    out: dict[str, object] = {"length": len(where), "sources": where}
    if body.get("records") is True:  # the matched chain's signed records, read above: no second round trip
        out["records"] = [rec.to_dict() if rec is not None else None for rec in recs[:len(where)]]
    return web.json_response(out)


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
        "ring": edge.membership.ring.nodes,
        "memory": {"used": edge.memory.used, "budget": edge.memory.budget},
        "disk": {"used": edge.disk.used, "budget": edge.disk.budget} if edge.disk else None,
        "origins": edge.origin_urls(),
        "upper_tiers": sorted(edge.upper_regions()),
        "upper_chosen_by": edge.upper_chosen_by,  # "policy", "latency", or null
        "origin_rtt_ms": edge.auto_upper.rtt_ms if edge.auto_upper is not None else None,
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
    app.cleanup_ctx.extend([service.registry_ctx(config.registry), _edge_ctx,
                            *([_kv_events_ctx] if config.kv_events else []), _upstream_ctx, _background_ctx,
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
