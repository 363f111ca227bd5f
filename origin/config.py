"""An origin's settings (``OriginConfig``, ``kdn origin serve``'s options) and the keys its app holds its
resources under (``kdn.service.keys`` has the ones origin and edge share): read by the app, its publish jobs
and the console."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kdn import service
from kdn.format.address import validate_name
from kdn.errors import InvalidInput
from kdn.format.pieces import PIECE_BYTES

from kdn.origin.jobs import JobQueue
from kdn.origin.publish import Producer
from kdn.origin.speed import PublishSpeed
from kdn.origin.store import ObjectStore


@dataclass
class OriginConfig(service.NodeConfig):
    """An origin (``kdn origin serve``): the shared node settings plus the model and its store."""

    port: int = 8000
    node_id: str = field(default_factory=lambda: validate_name(socket.gethostname().split(".")[0][:60] or "origin"))
    model: str = "tiny-llama"
    store: str = "kdn-origin-store"
    region: str = "origin"
    dtype: str | None = None
    max_body_bytes: int = 16 << 20
    max_pending_jobs: int = 16
    cache_dir: str | None = None
    engine: str = "hf"  # what computes the states: "hf" (transformers) or "vllm"
    signing_key: str | None = None  # Ed25519 key (kdn origin keygen): every record and manifest is signed
    max_context: int = 32768  # with the vllm engine: the longest document it is sized for
    kvtc_basis: str | None = None  # a kvtc basis file (kdn.adapters.hf.transform_fit): enables kvtc-B encodings
    raw_copies: str = "auto"  # a publish naming no encodings stores raw beside zstd: auto|always|never
    piece_bytes: int = PIECE_BYTES  # each record carries its blobs' piece digests at this size (kdn/format/pieces.py)
    store_credentials: str | None = None  # an s3:// store's keys (INI file; else AWS_* in the environment)
    records: str = "store"  # where object records are written: "store" (beside the blobs), or the "registry"
    # The token the operator console shows edges when it asks what they hold (a file; `read *` at the edges,
    # nothing at the origin). None: the console does not ask, and says unknown. A viewer's own token never leaves.
    probe_token_file: str | None = None
    # Hosts the probe token may be sent to (kdn.auth.TokenScope; None: loopback): edge URLs come from the registry.
    token_hosts: str | None = None

    def __post_init__(self) -> None:
        if self.records not in ("registry", "store"):
            raise InvalidInput(f"records must be 'registry' or 'store', not {self.records!r}")


CONFIG = web.AppKey("config", OriginConfig)
STORE = web.AppKey("store", ObjectStore)
# The loaded model (kdn.adapters.hf.models.LoadedModel: its module imports torch, so not imported here).
LOADED: web.AppKey[Any] = web.AppKey("loaded")
PRODUCER = web.AppKey("producer", Producer)
JOBS = web.AppKey("jobs", JobQueue)
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)
TOKENIZER = web.AppKey("tokenizer", ThreadPoolExecutor)
BASES = web.AppKey("bases", set)  # addresses of the kvtc bases this origin publishes (model-level objects)
M = web.AppKey("origin_metrics", dict)
SPEED = web.AppKey("publish_speed", PublishSpeed)  # its measured prefill speed (speed.py): the console's time saved
