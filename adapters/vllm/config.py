"""The connector's settings: ``kv_connector_extra_config``, validated at engine start. No vLLM here.

Every key, its default, and what it is for (the README's "From vLLM" section
shows them in a ``vllm serve`` command line):

consumer (``kv_role`` ``kv_consumer`` or ``kv_both``)
    ``edges``          list of edge URLs of this region, or ``{"id": url}`` pairs (ids route to owners)
    ``registry``       instead of ``edges``: a registry URL (``etcd://...``, ``file:...``) to find them in
    ``region``         with ``registry``: this engine's region (its edges rank first)
    ``token_hosts``    with ``registry``: hosts the token may reach (http or https), comma-separated names,
                       globs label by label, or CIDRs (default: loopback); other listed nodes are left out
    ``origin``         an origin URL, the source of last resort
    ``host``           the machine's host tier (``kdn host serve --socket PATH``): chunks it holds are copied
                       from its shared memory, the rest fetched as ever (default: none)
    ``namespace``      the namespace to look up (default ``public``); the token must grant it
    ``token_file``     file whose first token is sent to edges (or ``$KDN_TOKEN``)
    ``quality``        ``"lossless"`` (default) or the largest NLL increase in % a lossy encoding may cost
    ``encoding``       fetch this encoding whenever a record has it (e.g. ``kvtc-2`` where bytes are dear);
                       it must fit ``quality``; default: the client's choice by measured link
    ``load_timeout``   seconds a request's load may take before it is abandoned and recomputed (default 10)
    ``lookup_timeout`` seconds a lookup may take before the request is scheduled without it (default 2)
    ``load``           ``"auto"`` (default: layer by layer inside the forward for attention-only models,
                       in the background between steps for hybrid ones), ``"sync"`` or ``"async"``
    ``engines``        producer engines whose states are accepted, e.g. ``["vllm"]``; default: any
    ``ca``             CA bundle for HTTPS edges (default: system CAs, or ``$KDN_CA``)
    ``trusted_keys``   file of publisher keys (``ed25519:<hex>`` per line): records they did not sign are misses
    ``admitted_by``    with ``registry``: file of operator keys; nodes without an admission one of them signed
                       (``kdn node admit``) are left out
    ``revoked_admissions``  with ``admitted_by``: file of admission ids the operator revoked (``kdn node revoke``)
    ``steer``          accept requests that ask for attention steering from an emphasis map (``steer.py``;
                       default false; on GPU it asks vLLM for piecewise CUDA graphs)
    ``blend``          accept RAG requests whose documents were published alone: their chunks composed at
                       question time, CacheBlend style (``blend.py``; default false; attention-only Llama-family
                       models, tensor_parallel_size 1)
    ``plan``           load only what is faster to load than to compute (default true: ``kdn.planner`` on this
                       engine's measured step times, load speeds and link; a request's ``kdn`` params
                       ``"plan": false`` loads all it can regardless, e.g. to measure a load)
    ``decode_threads`` threads that decode arrived compressed chunks into the load's staging (default 2;
                       raw chunks are received in place and need none)
    ``write_threads``  on the CPU, threads that write a step's loads into the paged cache ahead of the forward,
                       each layer shared among them (``ahead.py``); default 0: each layer is written inside the
                       forward's wait for it (on 2 cores the writers helped SmolLM2's 8k hit and slowed the
                       Qwen2-0.5B shape's, whose forward needs the memory bandwidth: docs/benchmarks.md)
    ``host_write``     on the CPU, how a raw chunk from the host tier reaches the paged cache: ``"staged"``
                       (default: one strided copy of its whole K/V region into the load's staging, the lease
                       ended after it, then one cache write per layer for the whole load) or ``"in_place"``
                       (no copy: its lease kept until the forward has written every layer from the mapping, one
                       write per chunk and layer, each an OpenMP fork and join): docs/benchmarks.md
    ``arena``          bytes of host buffers the load path reuses across requests (``kdn.wire.arena``; page-locked
                       on a CUDA host; a load stages its whole K/V there), e.g. ``"8GiB"`` (default 4 GiB);
                       a load that does not fit recomputes

producer (``kv_role`` ``kv_producer`` or ``kv_both``)
    ``store``          the origin's object-store folder that chunk blobs are written into
    ``save``           ``"request"`` (default: only requests that ask, see ``kv_transfer_params``) or ``"all"``
    ``encodings``      encodings to store (default ``["zstd"]``)
    ``registry``       if given, the connector also writes each object's registry record
    ``node_id``        the ``origin`` named in those records (default ``vllm-<hostname>``)
    ``signing_key``    with ``registry``: the Ed25519 key (``kdn origin keygen``) those records are signed with
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from kdn.format.address import DEFAULT_CHUNK_TOKENS, PUBLIC_NAMESPACE, validate_name, validate_namespace
from kdn.format.encodings import affordable, parse_budget
from kdn.errors import InvalidInput

LOAD_MODES = ("auto", "sync", "async")
SAVE_MODES = ("request", "all")
HOST_WRITES = ("staged", "in_place")
_KEYS = frozenset({
    "edges", "registry", "region", "origin", "namespace", "token_file", "quality", "load_timeout",
    "lookup_timeout", "load", "engines", "ca", "store", "save", "encodings", "node_id",
    "chunk_tokens", "trusted_keys", "signing_key", "token_hosts", "steer", "encoding", "arena", "plan", "blend",
    "admitted_by", "revoked_admissions", "decode_threads", "write_threads", "host",
    "host_write",
})
# Two threads decode a zstd load at 8k tokens 15% faster than one here (bench/datapath.py, 2 cores: 294/289 ->
# 253/243 ms); six (the event loop's default pool) were slower than one inside vLLM, whose threads hold the
# cores during a step.
DEFAULT_DECODE_THREADS = 2
DEFAULT_WRITE_THREADS = 0
DEFAULT_ARENA = 4 << 30


@dataclass(frozen=True)
class ConnectorConfig:
    edges: tuple[str | tuple[str, str], ...] = ()
    registry: str | None = None
    region: str | None = None
    token_hosts: str | None = None
    origin: str | None = None
    host: str | None = None  # the host tier's socket
    namespace: str = PUBLIC_NAMESPACE
    token_file: str | None = None
    quality: str | float = "lossless"
    encoding: str | None = None
    load_timeout: float = 10.0
    lookup_timeout: float = 2.0
    load: str = "auto"
    engines: tuple[str, ...] | None = None
    ca: str | None = None
    trusted_keys: str | None = None
    admitted_by: str | None = None
    revoked_admissions: str | None = None
    signing_key: str | None = None
    store: str | None = None
    save: str = "request"
    encodings: tuple[str, ...] = ("zstd",)
    node_id: str = field(default_factory=lambda: "vllm-" + (socket.gethostname().split(".")[0][:50] or "node"))
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    steer: bool = False
    blend: bool = False
    arena: int = DEFAULT_ARENA
    plan: bool = True
    decode_threads: int = DEFAULT_DECODE_THREADS
    write_threads: int = DEFAULT_WRITE_THREADS
    host_write: str = HOST_WRITES[0]

    @property
    def can_look_up(self) -> bool:
        return bool(self.edges or self.origin or (self.registry and self.region))

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, *, consumer: bool, producer: bool) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``; raise ``InvalidInput`` naming the bad key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise InvalidInput(f"unknown KDN connector setting(s) {unknown}; known: {sorted(_KEYS)}")
        kw = {**_where(extra), **_what(extra), **_how(extra), **_sizes(extra)}  # (each key validated in this order)
        cfg = cls(**kw)
        if consumer and not cfg.can_look_up:
            raise InvalidInput("the KDN connector needs 'edges', 'origin', or 'registry' with 'region' to load from")
        if producer and not cfg.store:
            raise InvalidInput("a KDN producer (kv_role kv_producer / kv_both) needs 'store': the origin's store folder")
        return cfg


def check_cache_dtype(cache_dtype: str) -> None:
    """Refuse, at start, a consumer whose KV cache holds quantized values (``kv_cache_dtype`` fp8*): KDN objects
    hold the model's own bf16/fp16/fp32 K/V, and casting them into fp8 storage by value would corrupt them."""
    if str(cache_dtype).startswith("fp8"):
        raise InvalidInput(f"KDN loads bf16/fp16/fp32 K/V; this engine's KV cache is {str(cache_dtype)[:20]} "
                           "(kv_cache_dtype): leave it at 'auto' to load from the KDN")


def _where(extra: dict[str, Any]) -> dict[str, Any]:
    """Where to load from and with what credentials: the sources, the registry, the region, the namespace."""
    kw: dict[str, Any] = {}
    if "edges" in extra:
        kw["edges"] = _edges(extra["edges"])
    for key in ("registry", "region", "origin", "token_file", "ca", "store", "trusted_keys", "signing_key",
                "token_hosts", "admitted_by", "revoked_admissions", "host"):
        if extra.get(key) is not None:
            kw[key] = _string(key, extra[key])
    if "token_hosts" in kw:
        from kdn.auth import TokenScope

        TokenScope(kw["token_hosts"])  # a bad pattern fails at engine start
    if "region" in kw:
        validate_name(kw["region"])
    if "namespace" in extra:
        kw["namespace"] = validate_namespace(extra["namespace"])
    return kw


def _what(extra: dict[str, Any]) -> dict[str, Any]:
    """What may be loaded: the quality budget, and an encoding within it."""
    kw: dict[str, Any] = {}
    if "quality" in extra:
        parse_budget(extra["quality"])  # raises on a bad budget
        kw["quality"] = extra["quality"]
    if extra.get("encoding") is not None:
        enc = _string("encoding", extra["encoding"])
        if not affordable(enc, parse_budget(kw.get("quality", "lossless"))):
            raise InvalidInput(f"KDN connector setting 'encoding': {enc[:32]!r} is unknown or costs more than "
                               f"'quality' ({kw.get('quality', 'lossless')!r}) allows")
        kw["encoding"] = enc
    return kw


def _how(extra: dict[str, Any]) -> dict[str, Any]:
    """How loads and saves run: deadlines, modes, accepted producers, stored encodings, the node's name."""
    kw: dict[str, Any] = {}
    for key in ("load_timeout", "lookup_timeout"):
        if key in extra:
            v = extra[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise InvalidInput(f"KDN connector setting {key!r} must be seconds in (0, 3600], got {v!r}")
            kw[key] = float(v)
    if "load" in extra:
        kw["load"] = _choice("load", extra["load"], LOAD_MODES)
    if "save" in extra:
        kw["save"] = _choice("save", extra["save"], SAVE_MODES)
    if "host_write" in extra:
        kw["host_write"] = _choice("host_write", extra["host_write"], HOST_WRITES)
    if extra.get("engines") is not None:
        kw["engines"] = tuple(_string("engines", e) for e in _list("engines", extra["engines"]))
    if "encodings" in extra:
        encs = tuple(_string("encodings", e) for e in _list("encodings", extra["encodings"]))
        if not encs:
            raise InvalidInput("KDN connector setting 'encodings' must not be empty")
        kw["encodings"] = encs
    if "node_id" in extra:
        kw["node_id"] = validate_name(extra["node_id"])
    return kw


def _sizes(extra: dict[str, Any]) -> dict[str, Any]:
    """Sizes and switches: chunk length, steering and planning, decode threads, the arena's bytes."""
    kw: dict[str, Any] = {}
    if "chunk_tokens" in extra:
        v = extra["chunk_tokens"]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InvalidInput(f"KDN connector setting 'chunk_tokens' must be a positive int, got {v!r}")
        kw["chunk_tokens"] = v
    for key in ("steer", "plan", "blend"):
        if key in extra:
            if not isinstance(extra[key], bool):
                raise InvalidInput(f"KDN connector setting {key!r} must be true or false, got {str(extra[key])[:20]!r}")
            kw[key] = extra[key]
    for key, least in (("decode_threads", 1), ("write_threads", 0)):
        if key in extra:
            v = extra[key]
            if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= 64:
                raise InvalidInput(f"KDN connector setting {key!r} must be an int in [{least}, 64], got {str(v)[:20]!r}")
            kw[key] = v
    if "arena" in extra:
        kw["arena"] = _arena(extra["arena"])
    return kw


def _arena(v: Any) -> int:
    from kdn.units import parse_size

    try:
        n = parse_size(v) if not isinstance(v, bool) else -1
    except (InvalidInput, TypeError, ValueError):
        n = -1
    if n <= 0:
        raise InvalidInput(f"KDN connector setting 'arena' must be a positive size (bytes or '2GiB'), "
                           f"got {str(v)[:30]!r}")
    return n


def _string(key: str, v: object) -> str:
    if not isinstance(v, str) or not v or len(v) > 4096:
        raise InvalidInput(f"KDN connector setting {key!r} must be a non-empty string, got {str(v)[:60]!r}")
    return v


def _list(key: str, v: object) -> list:
    if isinstance(v, str):
        v = [x for x in v.split(",") if x]  # "a,b" as a CLI user would write it
    if not isinstance(v, list) or len(v) > 256:
        raise InvalidInput(f"KDN connector setting {key!r} must be a list, got {str(v)[:60]!r}")
    return v


def _choice(key: str, v: object, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise InvalidInput(f"KDN connector setting {key!r} must be one of {list(allowed)}, got {str(v)[:30]!r}")
    return str(v)


def _edges(v: object) -> tuple[str | tuple[str, str], ...]:
    if isinstance(v, dict):
        return tuple((validate_name(k), _url("edges", u)) for k, u in v.items())
    return tuple(_url("edges", u) for u in _list("edges", v))


def _url(key: str, u: object) -> str:
    s = _string(key, u)
    if not s.startswith(("http://", "https://")):
        raise InvalidInput(f"KDN connector setting {key!r}: {s[:60]!r} is not an http(s) URL")
    return s.rstrip("/")
