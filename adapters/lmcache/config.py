"""The adapter's settings: ``adapter_params`` of LMCache's ``--l2-adapter`` plugin JSON, checked at start. No LMCache.

Every key, its default, and what it is for (``docs/operations.md``, "From LMCache", shows them in a command)::

    edges        list of edge URLs of this region, or ``{"id": url}`` pairs: where chunks are read (verified)
    origin       an origin URL, the source of last resort for reads
    ingest       the origin URL chunks are written to (``PUT /v1/objects``: the origin checks, stores and signs
                 them); without it the adapter only reads, and every store task fails (counted)
    namespace    the writing tenant's namespace (default ``public``); the token must grant ``read`` there, and
                 ``publish`` too for writes
    token_file   file whose first token is sent to edges and the origin (or ``$KDN_TOKEN``)
    ca           CA bundle for HTTPS edges and origins
    trusted_keys file of origin keys: a chunk whose record they did not sign is a miss
    model_id     KDN's id of the served model (``kdn.format.address.model_id``); default: derived from LMCache's
                 model name (a name, not the weights: see ``keys.py``)
    encoding     the stored encoding, ``raw`` (default: a chunk is a plain copy both ways) or ``zstd``
    timeout      seconds one LMCache task may take before its chunks count as misses or the store as failed
                 (default 10)

Any other key is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdn.adapters.keyed import COMMON_KEYS, BackendSettings, common_settings
from kdn.errors import InvalidInput

_KEYS = COMMON_KEYS


@dataclass(frozen=True)
class AdapterSettings(BackendSettings):

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> AdapterSettings:
        """Check LMCache's ``adapter_params``; raise ``InvalidInput`` naming the bad key."""
        if params is not None and not isinstance(params, dict):
            raise InvalidInput(f"the KDN L2 adapter's adapter_params must be an object, got {type(params).__name__}")
        params = dict(params or {})
        unknown = sorted(set(params) - _KEYS)
        if unknown:
            raise InvalidInput(f"unknown KDN L2 adapter setting(s) {unknown}; known: {sorted(_KEYS)}")
        kw = common_settings(params, "KDN L2 adapter")
        cfg = cls(**kw)
        if not (cfg.edges or cfg.origin):
            raise InvalidInput("the KDN L2 adapter needs 'edges' or 'origin' to read chunks from")
        return cfg
