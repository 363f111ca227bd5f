"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config``, validated at attach. No SGLang here.

Every key, its default, and what it is for (the README's "From SGLang" section shows them in a command line)::

    edges        list of edge URLs of this region, or ``{"id": url}`` pairs: where pages are read (verified)
    origin       an origin URL, the source of last resort for reads
    ingest       the origin URL pages are written to (``PUT /v1/objects``: the origin checks the token's
                 ``publish`` grant and the page's address, stores it and signs its record with who sent it).
                 The recommended way to write: no shared file system, no registry access, no signing key here
    namespace    the writing tenant's namespace (default ``public``); the token must grant ``read`` there, and
                 ``publish`` too for writes through ``ingest``
    token_file   file whose first token is sent to edges and the ingest origin (or ``$KDN_TOKEN``)
    ca           CA bundle for HTTPS edges and origins
    trusted_keys file of publisher keys: a page whose record they did not sign is a miss
    model_id     KDN's id of the served model (``kdn.format.address.model_id``); default: derived from SGLang's
                 model name and the page geometry (a name, not the weights: see ``keys.py``)
    store        the older way to write, kept for existing deployments: the origin's object-store folder that
                 pages are written into (on its machine or a shared file system; with ``registry``: writes on)
    registry     with ``store``: registry URL the pages' records are written to (``etcd://...``, ``file:...``)
    signing_key  with ``registry``: the Ed25519 key (``kdn origin keygen``) those records are signed with
    node_id      with ``registry``: the ``origin`` named in those records (default ``sglang-<hostname>``)
    encoding     the stored encoding, ``raw`` (default: a page is a plain copy both ways) or ``zstd``
    timeout      seconds one storage call may take before its pages count as misses (default 10)

Writes are on with ``ingest`` or with ``store`` and ``registry``, never both: a backend that names both is
refused at start (one write path, chosen by whoever configures it, not by a precedence rule). With neither the
backend only reads, and SGLang's writes report failure. SGLang's own keys in the same object (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``) are taken and left alone; any other key is refused by name.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from kdn.adapters.keyed import COMMON_KEYS, ENCODINGS, BackendSettings, common_settings
from kdn.format.address import validate_name
from kdn.errors import InvalidInput

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
_KEYS = COMMON_KEYS | {"store", "registry", "signing_key", "node_id"}


@dataclass(frozen=True)
class StorageSettings(BackendSettings):
    store: str | None = None
    registry: str | None = None
    signing_key: str | None = None
    node_id: str = field(default_factory=lambda: "sglang-" + (socket.gethostname().split(".")[0][:50] or "node"))

    def __post_init__(self) -> None:
        assert self.encoding in ENCODINGS and self.timeout > 0

    @property
    def writes(self) -> bool:
        """Pages are written through the origin's ingest, or as blob into its store and record into the registry."""
        return bool(self.ingest or (self.store and self.registry))

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> StorageSettings:
        """Validate the extra config; raise ``InvalidInput`` naming the bad key."""
        extra = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise InvalidInput(f"unknown KDN storage setting(s) {unknown}; known: {sorted(_KEYS)}")
        kw = common_settings(extra, "KDN storage", ("token_file", "ca", "trusted_keys", "store", "registry",
                                                   "signing_key"))
        if "node_id" in extra:
            kw["node_id"] = validate_name(extra["node_id"])
        cfg = cls(**kw)
        if not (cfg.edges or cfg.origin):
            raise InvalidInput("the KDN storage backend needs 'edges' or 'origin' to read pages from")
        if cfg.ingest and (cfg.store or cfg.registry):
            raise InvalidInput("KDN storage setting 'ingest' writes pages through the origin, 'store' and 'registry' "
                               "write them into its folder and registry: name one way to write, not both "
                               "('ingest' is the recommended one)")
        if bool(cfg.store) != bool(cfg.registry):
            raise InvalidInput("KDN storage settings 'store' and 'registry' go together: a page is written as its "
                               "blob into the origin's store and its record into the registry")
        if cfg.signing_key and not cfg.registry:
            raise InvalidInput("KDN storage setting 'signing_key' signs registry records: it needs 'registry'")
        return cfg
