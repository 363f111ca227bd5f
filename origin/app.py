"""The origin service: publish knowledge, serve the objects it produced.

``create_app(config)`` builds the aiohttp application. Long-lived resources
(registry, model, store, job worker, node lease) live in ``cleanup_ctx`` so
they start in order and stop in reverse, also when startup fails halfway.

Routes (JSON errors ``{"error", "detail"}`` everywhere):
    POST /v1/publish                       publisher token; text or token ids -> 202 + job
                                           (``push``: admin on the namespace, as the console's form; 8 at once
                                           a namespace, then one a minute: ``PushBudget``)
    GET  /v1/jobs/{id}                     progress; the manifest when done
    GET|HEAD /v1/objects/{address}         a blob; ETag = BLAKE3 digest; ?encoding=
                                           (the model's kvtc basis too: ?encoding=basis)
    PUT  /v1/objects/{address}             a producer's engine-keyed object, stored and recorded (ingest.py)
    POST /v1/lookup                        ordered addresses -> longest stored prefix
    GET  /v1/registry/objects/{address}    GET /v1/registry/manifests/{ns}/{name}
    GET  /healthz                          GET /metrics
    GET  /console ...                      the operator console (origin/console/): HTML for a browser

Every "no" to a reader (an object, a record, a lookup that stops short: absent, or not yours) is held to the
``DENY_FLOOR`` (``kdn.service.records``), so its timing does not tell another tenant's object from an absent one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kdn import service
from kdn.service import connections
from kdn.format.address import PUBLIC_NAMESPACE, Address, validate_address, validate_name, validate_namespace
from kdn.auth import Grant, Grants, covers, may_read
from kdn.format.encodings import KVTC_AUTO, LOSSLESS_PREFERENCE, kvtc_bits
from kdn.errors import InvalidInput
from kdn.registry import KVRegistry, ModelRecord, NodeRecord, ObjectRecord
from kdn.registry.split import RecordsBeside
from kdn.service import GRANTS, METRICS, REGISTRY, bearer, json_error, object_headers, read_json
from kdn.service.records import DENY_FLOOR, DenyFloor

from kdn.origin import console, ingest
from kdn.origin.config import BASES, CONFIG, EXECUTOR, JOBS, LOADED, M, PRODUCER, SPEED, STORE, TOKENIZER
from kdn.origin.config import OriginConfig as OriginConfig  # (re-exported: callers import it from here)
from kdn.origin.jobs import JobQueue, QueueFull
from kdn.origin.publish_job import PUSHES, may_push, push_forbidden, push_refused, run_publish, writer
from kdn.origin.publish import Producer, PushBudget, default_encodings, parse_request, push_policy_name
from kdn.origin.s3records import open_records
from kdn.origin.s3store import is_s3, open_store, parse_s3_url
from kdn.origin.speed import PublishSpeed, prefill_model_of
from kdn.origin.store import ObjectStore
from kdn.format.pieces import check_piece_bytes

log = logging.getLogger(__name__)

ADOPT_MISS_S = 10.0  # an address the adopt read found nothing for is not read again for this long
MAX_ADOPT_MISSES = 1 << 16


class AdoptMisses:
    """Addresses the adopt read (``_adopt``) found nothing for, each for ``ttl`` seconds, at most ``size`` (the
    oldest forgotten first): a flood of requests for absent addresses costs one read each per ``ttl``."""

    def __init__(self, ttl: float = ADOPT_MISS_S, size: int = MAX_ADOPT_MISSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.size, self.clock = ttl, size, clock
        self._until: OrderedDict[Address, float] = OrderedDict()

    def __contains__(self, address: Address) -> bool:
        until = self._until.get(address)
        if until is not None and self.clock() >= until:
            del self._until[address]
            return False
        return until is not None

    def add(self, address: Address) -> None:
        self._until[address] = self.clock() + self.ttl
        self._until.move_to_end(address)
        while len(self._until) > self.size:
            self._until.popitem(last=False)


ADOPT_MISSES = web.AppKey("adopt_misses", AdoptMisses)


def _metrics(reg: CollectorRegistry) -> dict:
    return {
        "objects_served": Counter("kdn_origin_objects_served", "Objects served", ["encoding"], registry=reg),
        "bytes_served": Counter("kdn_origin_bytes_served", "Object bytes served", ["encoding"], registry=reg),
        "chunks_computed": Counter("kdn_origin_chunks_computed", "Chunks the model computed", registry=reg),
        "chunks_reused": Counter("kdn_origin_chunks_reused", "Chunks found already stored at publish", registry=reg),
        "publish_seconds": Histogram("kdn_origin_publish_seconds", "Publish job duration", registry=reg,
                                     buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)),
        "jobs": Counter("kdn_origin_jobs", "Publish jobs by outcome", ["outcome"], registry=reg),
        "store_objects": Gauge("kdn_origin_store_objects", "Blobs in the object store", registry=reg),
        "store_bytes": Gauge("kdn_origin_store_bytes", "Bytes in the object store", registry=reg),
    }


# --- resources -------------------------------------------------------------


async def _records_ctx(app: web.Application):
    """With ``--records store``: object records beside the blobs (a file in a folder store, small objects in
    an s3:// one), the rest in the registry (``kdn.registry.split``). Everything the origin writes or reads
    goes through ``app[REGISTRY]``."""
    cfg = app[CONFIG]
    if cfg.records != "store":
        yield
        return
    control = writer(app)
    if not isinstance(control, KVRegistry):
        raise TypeError(f"--records store splits one registry, not {control!r}")
    records = open_records(cfg.store, credentials=cfg.store_credentials)
    app[REGISTRY] = RecordsBeside(control, records)
    log.info("object records in %r (the registry keeps models, manifests, nodes and policies)", records)
    try:
        yield
    finally:
        await records.close()  # (the registry's own ctx closes the registry)


async def _model_ctx(app: web.Application):
    cfg = app[CONFIG]
    if cfg.signing_key:
        from kdn.registry.signing import Signer

        signer = writer(app).signer = Signer.load(cfg.signing_key)
        log.info("origin signs its records with key %s", signer.key_id)
    # One thread owns the model: torch state (inference mode, the model itself) is not shared.
    app[EXECUTOR] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-model")
    # Another tokenizes publish bodies (up to max_body_bytes of text: seconds), off the event loop
    # and not queued behind a forward pass; one thread, so the tokenizer is never used concurrently.
    app[TOKENIZER] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-tokenize")
    from kdn.adapters.hf import load_model

    loop = asyncio.get_running_loop()
    loaded = await loop.run_in_executor(app[EXECUTOR], lambda: load_model(cfg.model, dtype=cfg.dtype, cache_dir=cfg.cache_dir))
    app[LOADED] = loaded
    app[SPEED] = PublishSpeed(prefill_model_of(loaded.model.config))
    app[STORE] = await asyncio.to_thread(open_store, cfg.store, fsync=cfg.fsync, piece_bytes=cfg.piece_bytes,
                                         credentials=cfg.store_credentials)
    if cfg.engine == "vllm":
        app[PRODUCER] = await loop.run_in_executor(app[EXECUTOR], _vllm_producer, cfg, loaded, app[STORE])
    else:
        app[PRODUCER] = Producer(loaded, app[STORE], cfg.node_id)
    extra = {"max_positions": loaded.max_positions, "origin": cfg.advertised_url}
    if cfg.kvtc_basis:
        extra[BASIS_KEY] = await _publish_basis(app, cfg.kvtc_basis)
    await app[REGISTRY].put_model(ModelRecord(
        model_id=loaded.model_id, name=loaded.name, architecture=loaded.architecture, dtype=loaded.dtype,
        chunk_tokens=loaded.chunk_tokens, config=loaded.config_fields, extra=extra,
    ))
    log.info("origin model %s (%s) id %s", loaded.name, loaded.architecture, loaded.model_id)
    try:
        yield
    finally:
        app[EXECUTOR].shutdown(wait=True, cancel_futures=True)
        app[TOKENIZER].shutdown(wait=True, cancel_futures=True)


BASIS_KEY = "kvtc_basis"  # ModelRecord.extra: the address of the model's kvtc basis


async def _publish_basis(app: web.Application, path: str) -> str:
    """Store the kvtc basis file under its address (encoding ``basis``) and record it, so edges and
    clients fetch it like any object: blob first, then its (signed) record. Returns its address."""
    from kdn.kernels.transform import Basis, register_basis

    loaded, store = app[LOADED], app[STORE]
    data = await asyncio.to_thread(Path(path).read_bytes)
    basis = await asyncio.to_thread(Basis.from_bytes, data)
    layout = loaded.model.config
    if basis.model_id != loaded.model_id:
        raise ValueError(f"--kvtc-basis {path} was fitted for model {basis.model_id[:16]}..., "
                         f"this origin serves {loaded.model_id[:16]}...")
    if basis.n_layers != layout.num_hidden_layers:
        raise ValueError(f"--kvtc-basis {path} has {basis.n_layers} layers, the model {layout.num_hidden_layers}")
    address = register_basis(basis)
    info = await asyncio.to_thread(store.put, address, "basis", data)
    await app[REGISTRY].put_objects([ObjectRecord(
        address=address, model_id=loaded.model_id, namespace="public", kind="basis", start=0, end=1, parent=None,
        standalone=False, encodings={"basis": info.encoding("basis")},
        origin=app[CONFIG].node_id, engine=app[PRODUCER].engine)])
    app[BASES].add(address)
    app[PRODUCER].basis = basis
    log.info("kvtc basis %s (%d bytes) for model %s", address[:16], info.size, loaded.model_id[:16])
    return address


def _vllm_producer(cfg: OriginConfig, loaded, store: ObjectStore) -> Producer:
    """vLLM on the model thread, with the KDN connector saving into this origin's store."""
    from kdn.adapters.hf.models import model_folder
    from kdn.adapters.vllm.produce import VllmEngine
    from kdn.origin.publish import VllmProducer

    folder = model_folder(cfg.model, loaded.dtype, cache_dir=cfg.cache_dir)
    engine = VllmEngine(str(folder), dtype=loaded.dtype, store=cfg.store, chunk_tokens=loaded.chunk_tokens,
                        max_model_len=min(loaded.max_positions, cfg.max_context))
    return VllmProducer(loaded, store, cfg.node_id, engine)


async def _jobs_ctx(app: web.Application):
    jobs = JobQueue(max_pending=app[CONFIG].max_pending_jobs)
    app[JOBS] = jobs
    jobs.start()
    try:
        yield
    finally:
        await jobs.stop()


async def _lease_ctx(app: web.Application):
    cfg = app[CONFIG]
    rec = NodeRecord(role="origin", region=cfg.region, node_id=cfg.node_id, url=cfg.advertised_url,
                     extra={"model_id": app[LOADED].model_id, **cfg.record_extra("origin", cfg.region)})
    lease = await app[REGISTRY].register_node(rec, ttl=cfg.lease_ttl)
    try:
        yield
    finally:
        await lease.close()


# --- handlers --------------------------------------------------------------


async def publish(request: web.Request) -> web.Response:
    app = request.app
    # The token first: a caller who may publish nowhere never gets the origin to read (up to
    # max_body_bytes of) a body. The namespace it names is checked once the body is read.
    if not app[GRANTS].namespaces(bearer(request), "publish"):
        app[GRANTS].check(bearer(request), "publish", "public")  # raises 401/403 with the usual answer
    body = await read_json(request, app[CONFIG].max_body_bytes)
    namespace = body.get("namespace", "public")
    grant = app[GRANTS].check(bearer(request), "publish", namespace if isinstance(namespace, str) else "")
    if body.get("push") is not None and not may_push(grant, namespace):  # (before any work: refused whole)
        return push_forbidden(namespace)
    loaded = app[LOADED]
    max_tokens = (min(loaded.max_positions, app[CONFIG].max_context) if app[CONFIG].engine == "vllm"
                  else loaded.max_positions)
    store = app[STORE]
    defaults = default_encodings(app[CONFIG].raw_copies,
                                 await asyncio.to_thread(store.free_space) if "encodings" not in body else None)
    spec = await asyncio.get_running_loop().run_in_executor(app[TOKENIZER], functools.partial(
        parse_request, body, tokenizer=loaded.tokenizer, vocab_size=loaded.model.config.vocab_size,
        max_tokens=max_tokens, default_encodings=defaults))
    if (spec.probes or spec.baseline_heads) and app[CONFIG].engine != "hf":
        return json_error(400, "invalid_input", "emphasis probes and question_heads are run by an origin with "
                          "--engine hf")
    cfg = loaded.model.config
    far = [h for h in spec.baseline_heads if h[0] >= cfg.num_hidden_layers or h[1] >= cfg.num_attention_heads]
    if far:
        return json_error(400, "invalid_input", f"emphasis.question_heads: head {list(far[0])} is not in this model "
                          f"({cfg.num_hidden_layers} layers of {cfg.num_attention_heads} heads)")
    if spec.standalone and app[CONFIG].engine != "hf":
        return json_error(400, "invalid_input", "standalone chunks are computed by an origin with --engine hf")
    kvtc = [e for e in spec.encodings if e == KVTC_AUTO or kvtc_bits(e) is not None]
    if kvtc and app[CONFIG].engine != "hf":
        return json_error(400, "invalid_input", f"{kvtc[0]} objects are encoded by an origin with --engine hf")
    if kvtc and app[PRODUCER].basis is None:
        return json_error(400, "invalid_input", f"encoding {kvtc[0]} needs a kvtc basis for this model, and this "
                          "origin has none (kdn origin serve --kvtc-basis FILE)")
    refused = await push_refused(app, grant, spec)
    if refused is not None:
        return refused
    try:
        job = app[JOBS].submit(spec.name, spec.namespace, lambda job: run_publish(app, spec, job))
    except QueueFull as e:
        if isinstance(spec.push, tuple):
            app[PUSHES].give_back(spec.namespace)
        return json_error(503, "busy", str(e))
    return web.json_response({"job": job.id, "url": f"/v1/jobs/{job.id}", **job.to_dict()}, status=202)


async def delete_manifest(request: web.Request) -> web.Response:
    """Delete a published name: a signed tombstone, versioned above the manifest it replaces, so a client
    that saw it refuses the old manifest replayed. The objects stay (other names may share them)."""
    app = request.app
    ns = validate_namespace(request.match_info["namespace"])
    name = validate_name(request.match_info["name"])
    app[GRANTS].check(bearer(request), "publish", ns)
    stored = await app[REGISTRY].get_manifest(ns, name)
    if stored is None or stored.deleted:
        raise web.HTTPNotFound(text=f"no manifest {ns}/{name}")
    # A push its publish set ends with it, first: a registry that fails here fails the DELETE before the
    # tombstone, so a retry finds the manifest and ends both (the other order left the policy behind a 404).
    if await app[REGISTRY].delete_policy(push_policy_name(ns, name)):
        log.info("manifest %s/%s: its push policy removed", ns, name)
    tombstone = await app[REGISTRY].put_manifest(stored.tombstone())
    log.info("manifest %s/%s deleted (tombstone version %d)", ns, name, tombstone.version)
    return web.json_response(tombstone.to_dict())


async def get_job(request: web.Request) -> web.Response:
    job = request.app[JOBS].get(request.match_info["job_id"])
    if job is None:
        raise web.HTTPNotFound(text="no such job")
    request.app[GRANTS].check(bearer(request), "publish", job.namespace)
    return web.json_response(job.to_dict())


def _namespace_of(app: web.Application, address: Address) -> str | None:
    """Whose object this is, from what this origin holds: the namespace in the stored blob's own header (a
    kvtc basis, which has none, is public). Never the registry record's: any registry writer can relabel it."""
    ns = app[STORE].namespace(address)
    if ns is None and address in app[BASES]:
        return PUBLIC_NAMESPACE
    return ns


async def _adopt(app: web.Application, address: Address) -> dict:
    """Blobs an engine saved into this store on its own (``kv_role`` producer with ``registry``), found by
    their registry record and indexed once their bytes match its digests. With records beside the blobs the
    engine's record is still in the registry (it writes there): asked there too. Only a hint of the digest: a
    blob is adopted only if it is already in this store and its bytes match, so a planted record adopts
    nothing that was not there, and the record itself is not taken into the store.

    Asked only for a caller with a read grant of its own (``get_object``), and a miss is remembered
    (``AdoptMisses``): these two reads were what made an absent address's 404 slower than another tenant's
    (#51 item 6), and what anyone could make the origin do, per request, for free."""
    misses = app[ADOPT_MISSES]
    if address in misses:
        return {}
    reg = app[REGISTRY]
    rec = await reg.get_object(address)
    if rec is None and isinstance(reg, RecordsBeside):
        rec = await reg.control.get_object(address)
    for name, enc in (rec.encodings.items() if rec is not None else ()):
        await asyncio.to_thread(app[STORE].adopt, address, name, enc.digest)
    have = app[STORE].encodings(address)
    if not have:
        misses.add(address)
    return have


async def get_object(request: web.Request) -> web.StreamResponse:
    app = request.app
    t0 = time.monotonic()
    address = validate_address(request.match_info["address"])
    store = app[STORE]
    allowed = app[GRANTS].namespaces(bearer(request), "read")  # (an unknown token: a 401 before any read)
    have = store.encodings(address)
    if not have and allowed and bearer(request):  # the adopt read: for a caller with a read grant of its own
        have = await _adopt(app, address)
    ns = _namespace_of(app, address) if have else None
    if ns is None or not (covers(allowed, ns) or (address in app[BASES] and may_read(allowed, ns, "basis"))):
        await service.hold_no(request, t0)  # the same answer whether absent or not yours, and at the same time
        raise web.HTTPNotFound(text=f"no object {address}")
    want = request.query.get("encoding")
    if want is not None:
        if want not in have:
            raise web.HTTPNotFound(text=f"object {address} has no encoding {want[:32]!r}; it has {sorted(have)}")
        encoding = want
    else:
        lossless = next((e for e in LOSSLESS_PREFERENCE if e in have), None)
        if lossless is None:
            raise web.HTTPNotFound(text=f"object {address} has no lossless encoding")
        encoding = lossless
    info = have[encoding]
    headers = object_headers(info.digest, f"origin:{app[CONFIG].node_id}", encoding, ns)
    if service.not_modified(request, info.digest):
        return web.Response(status=304, headers=headers)
    if request.method == "HEAD":
        return web.Response(headers={**headers, "Content-Length": str(info.size)})
    rng = service.byte_range(request, info.size, info.digest)  # (a 416 before the blob is read)
    got = await store.aget(address, encoding)
    if got is None:
        raise web.HTTPNotFound(text=f"no object {address}")
    blob, _ = got
    # Counted as it starts (a reader may act on the body before this handler resumes); readers cut
    # off are counted by kdn_http_deadline_exceeded_total.
    app[M]["objects_served"].labels(encoding).inc()
    app[M]["bytes_served"].labels(encoding).inc(len(blob) if rng is None else rng[1] - rng[0])
    return (await service.send_body(request, blob, headers, rng=rng))[0]


async def lookup(request: web.Request) -> web.Response:
    """Ordered addresses in; how many leading ones this origin holds out (and, asked for, their records)."""
    body, addrs = await service.read_addresses(request)
    t0 = time.monotonic()
    allowed = request.app[GRANTS].namespaces(bearer(request), "read")
    store, n = request.app[STORE], 0
    for a in addrs:
        have = store.encodings(a)
        ns = _namespace_of(request.app, a) if have else None
        if ns is None or not covers(allowed, ns):
            break
        n += 1
    src = f"origin:{request.app[CONFIG].node_id}"
    out: dict[str, object] = {"length": n, "sources": [src] * n}
    if body.get("records") is True:
        recs = await service.records_of(request.app).get_objects(list(addrs[:n])) if n else []
        out["records"] = [r.to_dict() if r is not None and covers(allowed, r.namespace) else None for r in recs]
    if n < len(addrs):  # it stopped at a "no": held like one (an absent object, or another tenant's)
        await service.hold_no(request, t0)
    return web.json_response(out)


async def healthz(request: web.Request) -> web.Response:
    app = request.app
    loaded = app[LOADED]
    return web.json_response({"status": "ok", "role": "origin", "node_id": app[CONFIG].node_id,
                              "model": loaded.name, "model_id": loaded.model_id, "objects": len(app[STORE])})


def create_app(config: OriginConfig) -> web.Application:
    default_encodings(config.raw_copies, None)  # a bad setting fails at start, not on the first publish
    check_piece_bytes(config.piece_bytes)
    if is_s3(config.store):  # a bad store URL fails at start, in one line
        parse_s3_url(config.store)
        if config.engine == "vllm":
            raise InvalidInput("--engine vllm saves through its connector into a local folder: use a folder --store")
    elif config.store_credentials is not None:
        raise InvalidInput("--store-credentials is for an s3:// store")
    metrics = CollectorRegistry()
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[service.metrics_middleware_factory(metrics, "origin"), service.error_middleware],
    )
    app[CONFIG] = config
    app[METRICS] = metrics
    app[M] = _metrics(metrics)
    service.install_deadlines(app, config.deadlines, metrics, "origin")
    app[BASES] = set()
    app[DENY_FLOOR] = DenyFloor(config.deny_floor_ms / 1000)
    app[ADOPT_MISSES] = AdoptMisses()
    app[PUSHES] = PushBudget()
    # Anonymous callers may read the public namespace; everything else needs a token.
    app[GRANTS] = Grants.from_file(config.token_file, anonymous=Grant(frozenset({"read"}), frozenset({"public"})))
    if not config.store.startswith("s3://"):
        Path(config.store).mkdir(parents=True, exist_ok=True)
    app.cleanup_ctx.extend([service.registry_ctx(config.registry), _records_ctx, _model_ctx, _jobs_ctx, _lease_ctx])
    app.router.add_post("/v1/publish", publish)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_get("/v1/objects/{address}", get_object)  # aiohttp adds HEAD for GET routes
    ingest.add_routes(app)  # PUT /v1/objects/{address}
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_delete("/v1/manifests/{namespace}/{name}", delete_manifest)
    app.router.add_get("/healthz", healthz)
    service.add_common_routes(app)
    console.add_routes(app)
    return app


def run(config: OriginConfig) -> None:
    logging.basicConfig(level=os.environ.get("KDN_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kdn.tls import server_context

    app = create_app(config)
    connections.run(app, config.host, config.port, caps=config.connection_caps(), service="origin",
                    ssl_context=server_context(config.tls_cert, config.tls_key), metrics=app[METRICS],
                    **service.server_options(app))
