"""The keys under which the origin's and the edge's apps hold what the shared handlers read: the registry,
where records and manifest bodies come from, who may do what, the metrics, the deadlines."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from kdn.format.address import Address, Digest
from kdn.auth import Grants
from kdn.registry import Manifest, ObjectRecord, Registry

from .config import Deadlines

REGISTRY = web.AppKey("registry", Registry)


class RecordSource(Protocol):
    """Where a server reads object records from: its registry, or (an edge) its record cache."""

    async def get_object(self, address: Address) -> ObjectRecord | None: ...
    async def get_objects(self, addresses: list[Address]) -> list[ObjectRecord | None]: ...


RECORDS = web.AppKey("records", RecordSource)  # absent: the registry


class ManifestBodies(Protocol):
    """Where a server reads the whole manifest a registry pointer names (``Manifest.body``): an origin's own
    records store, or (an edge) the origins."""

    async def get_manifest_body(self, namespace: str, name: str, digest: Digest) -> Manifest | None: ...


MANIFEST_BODIES = web.AppKey("manifest_bodies", ManifestBodies)  # absent: pointers are not followed
GRANTS = web.AppKey("grants", Grants)
METRICS = web.AppKey("metrics", CollectorRegistry)
HTTP_METRICS = web.AppKey("http_metrics", dict)
DEADLINES = web.AppKey("deadlines", Deadlines)
