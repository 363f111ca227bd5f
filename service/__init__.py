"""Server-side HTTP pieces shared by the origin and the edge (aiohttp).

It lives outside the core (``kdn/``, which holds no server): only
``kdn.origin``, ``kdn.edge`` and ``kdn up`` import it.
It holds what both services must do the same way, one module per concern:

- ``config.py``: ``NodeConfig`` (what both are configured with) and ``Deadlines``;
- ``keys.py``: the app keys the shared handlers read (``REGISTRY``, ``GRANTS``, ``METRICS``, ...);
- ``server.py``: what every runner passes to aiohttp, the body and send deadlines, malformed requests logged
  as one line;
- ``inputs.py``: bearer tokens, bounded JSON bodies, a lookup's addresses;
- ``responses.py``: an object response's headers, ranges, 304s and body;
- ``middleware.py``: JSON errors with no stack traces, per-route request counts and latencies;
- ``records.py``: the registry read routes (``POST /v1/records`` among them) and the registry the app opens;
- ``routes.py``: ``add_common_routes`` (those and ``/metrics``);
- ``connections.py``: connection caps, and the loop that serves a node.

``from kdn.service import X`` reaches every public name of them but ``connections.py``'s.
"""

from __future__ import annotations

import prometheus_client

from .config import Deadlines, NodeConfig
from .inputs import MAX_JSON_BODY, MAX_LOOKUP_ADDRESSES, bearer, read_addresses, read_body, read_json
from .keys import (
    DEADLINES,
    GRANTS,
    HTTP_METRICS,
    MANIFEST_BODIES,
    METRICS,
    RECORDS,
    REGISTRY,
    ManifestBodies,
    RecordSource,
)
from .middleware import error_middleware, json_error, metrics_middleware_factory
from .records import (
    MAX_RECORDS,
    get_registry_manifest,
    get_registry_object,
    hold_no,
    post_records,
    records_of,
    registry_ctx,
)
from .responses import Sent, byte_range, not_modified, object_headers, ranged, send_body
from .routes import add_common_routes, get_metrics
from .server import MALFORMED_REQUESTS, install_deadlines, quiet_malformed_requests, send_within, server_options

# `*_created` series double the output and no dashboard reads them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream

__all__ = [
    "DEADLINES",
    "GRANTS",
    "HTTP_METRICS",
    "MALFORMED_REQUESTS",
    "MANIFEST_BODIES",
    "MAX_JSON_BODY",
    "MAX_LOOKUP_ADDRESSES",
    "MAX_RECORDS",
    "METRICS",
    "RECORDS",
    "REGISTRY",
    "Deadlines",
    "ManifestBodies",
    "NodeConfig",
    "RecordSource",
    "Sent",
    "add_common_routes",
    "bearer",
    "byte_range",
    "error_middleware",
    "get_metrics",
    "get_registry_manifest",
    "get_registry_object",
    "hold_no",
    "install_deadlines",
    "json_error",
    "metrics_middleware_factory",
    "not_modified",
    "object_headers",
    "post_records",
    "quiet_malformed_requests",
    "ranged",
    "read_addresses",
    "read_body",
    "read_json",
    "records_of",
    "registry_ctx",
    "send_body",
    "send_within",
    "server_options",
]
