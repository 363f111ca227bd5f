"""Authenticated ingest: an engine's object, sent by a tenant's producer over HTTP, stored and recorded by the origin.

    PUT /v1/objects/{address}?encoding=raw|zstd
        Authorization: Bearer TOKEN            (role ``publish`` on the object's namespace)
        X-KDN-Key-Scheme: lmcache-chunk        (kdn.adapters.keyed.SCHEMES)
        X-KDN-Key-Shard: SHARD                 X-KDN-Key: KEY      (the address's preimage)
        X-KDN-Engine: "lmcache 0.5.6"          (optional, at most 64 characters: what the producer says made it)
        body: the object (docs/format.md), at most the origin's --max-body-bytes

What the origin checks before it keeps a byte: the token grants ``publish`` on the namespace the object's own
header names; the header names this address, this encoding, kind ``kv`` and no parent; the address is
``keyed_address(scheme, model_id, namespace, shard, key)`` of that header's model and namespace (so a tenant
can only ever write addresses of its own namespace, in an engine-key scheme that no prefix chain or standalone
address shares: it cannot take another tenant's address, nor a published text's); the object parses and
decodes. Then the blob goes into the store (never over a different blob of the same address: a 409) and its
record into the registry, signed by the origin's key where it has one, with ``origin`` saying from whom it
came: ``NODE ingest sha256:FP``, FP the first 16 hex digits of the SHA-256 of the sender's token (what the
token file is keyed by: ``printf %s TOKEN | sha256sum``). Answers 201 (stored), 200 (the same bytes were
already there), 400, 401, 403, 409, 413.

The signature attests that this origin received these bytes, for this address and namespace, from the holder
of that token; it does not attest that they are the model's true states for that key: the origin computed
nothing (``docs/security.md``).
"""

from __future__ import annotations

import asyncio
import hashlib
import re

from aiohttp import web
from prometheus_client import Counter

from kdn.adapters.keyed import SCHEMES, keyed_address
from kdn.auth import AuthError
from kdn.errors import KDNError
from kdn.format.address import blob_digest, validate_address
from kdn.format.objects import ObjectView
from kdn.registry import ObjectRecord
from kdn.service import GRANTS, METRICS, bearer, json_error

from kdn.origin.config import CONFIG, STORE
from kdn.origin.publish_job import writer

ENCODINGS = ("raw", "zstd")  # lossless only: a lossy encoding's quality is measured by whoever computed it
_ENGINE = re.compile(r"[ -~]{0,64}")  # printable ASCII, as short as a record's ``engine`` must be
INGESTED = web.AppKey("ingested", Counter)


def add_routes(app: web.Application) -> None:
    app[INGESTED] = Counter("kdn_origin_ingested", "Objects producers sent to PUT /v1/objects, by outcome "
                            "(stored, same, refused, conflict)", ["outcome"], registry=app[METRICS])
    app.router.add_put("/v1/objects/{address}", put_object)


def token_fingerprint(authorization: str) -> str:
    """``sha256:`` and the first 16 hex digits of the bearer token's SHA-256: who sent an object."""
    token = authorization.partition(" ")[2].strip()
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]


def _refused(app: web.Application, status: int, code: str, detail: str) -> web.Response:
    app[INGESTED].labels("conflict" if status == 409 else "refused").inc()
    return json_error(status, code, detail)


async def put_object(request: web.Request) -> web.Response:
    app = request.app
    address = validate_address(request.match_info["address"])
    auth = bearer(request)
    grant = app[GRANTS].lookup(auth)  # (an unknown token: a 401 here, before the body is read)
    if not auth or grant is None:
        app[INGESTED].labels("refused").inc()
        raise AuthError("a bearer token with the 'publish' role is required", status=401)
    if not ({"publish", "admin"} & grant.roles):
        app[INGESTED].labels("refused").inc()
        raise AuthError("token may not publish", status=403)
    encoding = request.query.get("encoding", "raw")
    if encoding not in ENCODINGS:
        return _refused(app, 400, "invalid_input", f"an ingested object is stored as one of {list(ENCODINGS)}, "
                        f"not {encoding[:32]!r}")
    scheme = request.headers.get("X-KDN-Key-Scheme", "")
    shard, key = request.headers.get("X-KDN-Key-Shard"), request.headers.get("X-KDN-Key")
    if scheme not in SCHEMES or shard is None or not key:
        return _refused(app, 400, "invalid_input", f"an ingest names the address's preimage: X-KDN-Key-Scheme (one of "
                        f"{sorted(SCHEMES)}), X-KDN-Key-Shard and X-KDN-Key")
    engine = request.headers.get("X-KDN-Engine", "")
    if not _ENGINE.fullmatch(engine):
        return _refused(app, 400, "invalid_input", "X-KDN-Engine must be at most 64 printable ASCII characters")
    blob = await request.read()  # (past --max-body-bytes: a 413)
    try:
        view = ObjectView(blob)
        h = view.header
        if (h.address, h.encoding, h.kind, h.parent) != (address, encoding, "kv", None):
            return _refused(app, 400, "invalid_input", f"the object's header names address {h.address[:16]}..., "
                            f"encoding {h.encoding!r}, kind {h.kind!r}, parent {h.parent!r}: an ingest takes a "
                            f"kv object of this address and encoding, with no parent")
        app[GRANTS].check(auth, "publish", h.namespace)  # the namespace the bytes themselves name
        if keyed_address(scheme, h.model_id, h.namespace, shard, key) != address:
            return _refused(app, 400, "invalid_input", f"{address[:16]}... is not the {scheme} address of this key "
                            f"in namespace {h.namespace!r} for model {h.model_id[:16]}...")
        await asyncio.to_thread(view.decode)  # what the origin signs at least decodes
    except AuthError:
        app[INGESTED].labels("refused").inc()
        raise
    except KDNError as e:
        return _refused(app, 400, "invalid_input", f"not an object this origin takes: {e}")
    store, digest = app[STORE], blob_digest(blob)
    have = store.encodings(address)
    if have and store.namespace(address) != h.namespace:
        return _refused(app, 409, "conflict", f"{address[:16]}... is stored for another namespace")
    same = encoding in have and have[encoding].digest == digest
    if encoding in have and not same:
        return _refused(app, 409, "conflict", f"{address[:16]}... is stored with other bytes, which are never "
                        "rewritten (edges may hold their digest)")
    info = have[encoding] if same else await asyncio.to_thread(store.put, address, encoding, bytes(blob))
    rec = ObjectRecord(address=address, model_id=h.model_id, namespace=h.namespace, kind="kv", start=h.start,
                       end=h.end, parent=None, standalone=False, encodings={encoding: info.encoding(encoding)},
                       origin=f"{app[CONFIG].node_id} ingest {token_fingerprint(auth)}", engine=engine)
    await writer(app).put_objects([rec])  # blob first, then its record (signed where this origin signs)
    app[INGESTED].labels("same" if same else "stored").inc()
    return web.json_response({"address": address, "namespace": h.namespace, "encoding": encoding,
                              "digest": info.digest, "size": info.size, "origin": rec.origin},
                             status=200 if same else 201)
