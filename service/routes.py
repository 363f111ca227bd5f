"""The routes every origin and edge serves alike: the registry reads (``records.py``) and ``/metrics``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .keys import METRICS
from .records import get_registry_manifest, get_registry_object, post_records


async def get_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS])
    resp = web.Response(body=body)
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


def add_common_routes(app: web.Application) -> None:
    app.router.add_get("/v1/registry/objects/{address}", get_registry_object)
    app.router.add_post("/v1/records", post_records)
    app.router.add_get("/v1/registry/manifests/{namespace}/{name}", get_registry_manifest)
    app.router.add_get("/metrics", get_metrics)
