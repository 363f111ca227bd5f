"""An engine's own cache keys as KDN addresses, and the settings every engine storage backend shares.

SGLang (``kdn.adapters.sglang``) and LMCache (``kdn.adapters.lmcache``) name what they store by their own hash
of a token chain; it is not KDN's prefix-chain address (it hashes other bytes), so KDN cannot derive it from
tokens, only map it. One mapping, per key scheme (version 1)::

    keyed_address = BLAKE3("kdn/" || scheme || "/v1\\0" || raw(model_id) || str(namespace) || str(shard) || str(key))

with ``str`` and ``raw`` as in ``kdn.format.address``. ``scheme`` names the engine's keys (``sglang-page``,
``lmcache-chunk``: each its own tag, never a prefix-chain or standalone tag), ``shard`` which slice of the
model's KV an entry holds (ranks store different bytes under one key), ``key`` the engine's key as text. The
namespace keeps one tenant's entries from another's: the same key in two namespaces is two addresses. So an
address is never an engine's key itself, and a producer that sends the preimage lets an origin check that an
address it is given is the writer's own (``kdn.origin.ingest``). Test vectors: ``tests/adapters/sglang/test_keys.py``,
``tests/adapters/lmcache/test_lmcache_keys.py``.

No engine is imported here: the origin imports this module too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from blake3 import blake3

from kdn.errors import InvalidInput, KDNError
from kdn.format.address import PUBLIC_NAMESPACE, Address, ModelId, _str, model_id, validate_model_id, validate_name, validate_namespace

MAX_KEY_BYTES = 1024  # engines' keys are 64 hex characters or so; a suffixed or salted key a few more
MAX_SHARD_BYTES = 128
# The key schemes an origin accepts at ingest (``kdn.origin.ingest``): each one's tag is its own.
SCHEMES = frozenset({"sglang-page", "lmcache-chunk"})

# What a read may fail with and still be a miss: the network, the sources, KDN's checks, the deadline.
MISSES = (KDNError, aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError)


def keyed_address(scheme: str, mid: ModelId | str, namespace: str, shard: str, key: str) -> Address:
    """The KDN address of engine key ``key`` (of ``scheme``) for model ``mid`` in ``namespace``."""
    if scheme not in SCHEMES:
        raise InvalidInput(f"unknown engine key scheme {str(scheme)[:40]!r}; known: {sorted(SCHEMES)}")
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidInput(f"an engine's cache key must be a non-empty string of at most {MAX_KEY_BYTES} bytes")
    if not isinstance(shard, str) or len(shard.encode()) > MAX_SHARD_BYTES:
        raise InvalidInput(f"a shard name must be a string of at most {MAX_SHARD_BYTES} bytes")
    h = blake3(b"kdn/" + scheme.encode() + b"/v1\0")
    h.update(bytes.fromhex(validate_model_id(mid)))
    h.update(_str(validate_namespace(namespace)))
    h.update(_str(shard))
    h.update(_str(key))
    return Address(h.hexdigest())


def named_model_id(engine: str, model_name: str | None, dtype: str, geometry: dict[str, Any], *,
                   setting: str = "model_id") -> ModelId:
    """A model id from an engine's model name (and what it knows of the KV: dtype, geometry), for a deployment
    that set no ``model_id``. It names the model by its name only: two deployments that serve different weights
    under one name (and one namespace) would read each other's entries, so set ``model_id`` where that can
    happen."""
    if not model_name:
        raise InvalidInput(f"{engine} gave no model name: set the KDN storage setting {setting!r}")
    return model_id(architecture=f"{engine}:{model_name}", dtype=dtype, config_fields=dict(geometry),
                    weights_digest="", tokenizer_digest="")


def engine_version(dist: str) -> str:
    """``"NAME VERSION"`` of an installed engine, for the ``engine`` of the records it produces."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{dist} {version(dist)}"
    except PackageNotFoundError:  # pragma: no cover - an engine from a source tree
        return dist


# --- settings: the checks both backends' extra configs share -----------------------------------------------

def setting_string(key: str, v: object) -> str:
    if not isinstance(v, str) or not v or len(v) > 4096:
        raise InvalidInput(f"KDN storage setting {key!r} must be a non-empty string, got {str(v)[:60]!r}")
    return v


def setting_url(key: str, u: object) -> str:
    s = setting_string(key, u)
    if not s.startswith(("http://", "https://")):
        raise InvalidInput(f"KDN storage setting {key!r}: {s[:60]!r} is not an http(s) URL")
    return s.rstrip("/")


def setting_edges(v: object) -> tuple[str | tuple[str, str], ...]:
    if isinstance(v, dict):
        return tuple((validate_name(k), setting_url("edges", u)) for k, u in v.items())
    if isinstance(v, str):
        v = [x for x in v.split(",") if x]
    if not isinstance(v, list) or len(v) > 256:
        raise InvalidInput(f"KDN storage setting 'edges' must be a list of URLs, got {str(v)[:60]!r}")
    return tuple(setting_url("edges", u) for u in v)


def setting_timeout(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
        raise InvalidInput(f"KDN storage setting 'timeout' must be seconds in (0, 3600], got {str(v)[:20]!r}")
    return float(v)


ENCODINGS = ("raw", "zstd")  # what an engine backend stores its pages or chunks as
COMMON_KEYS = frozenset({"edges", "origin", "ingest", "namespace", "token_file", "ca", "trusted_keys", "model_id",
                         "encoding", "timeout"})  # the settings ``BackendSettings`` holds


@dataclass(frozen=True)
class BackendSettings:
    """What both engine backends are set with (``common_settings`` checks them); each adds its own."""

    edges: tuple[str | tuple[str, str], ...] = ()
    origin: str | None = None
    ingest: str | None = None  # the origin's authenticated ingest, where writes go
    namespace: str = PUBLIC_NAMESPACE
    token_file: str | None = None
    ca: str | None = None
    trusted_keys: str | None = None
    model_id: str | None = None
    encoding: str = "raw"
    timeout: float = 10.0


def common_settings(params: dict[str, Any], who: str,
                    strings: tuple[str, ...] = ("token_file", "ca", "trusted_keys")) -> dict[str, Any]:
    """The settings both engine backends take (SGLang's extra config, LMCache's ``adapter_params``), checked:
    ``edges``, ``origin``, ``ingest``, the file and name ``strings``, ``namespace``, ``model_id``,
    ``encoding``, ``timeout``; the keyword arguments of the backend's settings. ``who`` names the backend in
    errors ("KDN storage", "KDN L2 adapter"); ``InvalidInput`` names the bad key."""
    kw: dict[str, Any] = {}
    if "edges" in params:
        kw["edges"] = setting_edges(params["edges"])
    for key in ("origin", "ingest"):
        if params.get(key) is not None:
            kw[key] = setting_url(key, params[key])
    for key in strings:
        if params.get(key) is not None:
            kw[key] = setting_string(key, params[key])
    if "namespace" in params:
        kw["namespace"] = validate_namespace(params["namespace"])
    if params.get("model_id") is not None:
        kw["model_id"] = validate_model_id(params["model_id"])
    if "encoding" in params:
        if params["encoding"] not in ENCODINGS:
            raise InvalidInput(f"{who} setting 'encoding' must be one of {list(ENCODINGS)}, "
                               f"got {str(params['encoding'])[:30]!r}")
        kw["encoding"] = params["encoding"]
    if "timeout" in params:
        kw["timeout"] = setting_timeout(params["timeout"])
    return kw
