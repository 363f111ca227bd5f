"""Registry URLs: ``etcd://host:port[/prefix]`` or ``file:PATH``, and the default when none is given."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from kdn.errors import InvalidInput
from kdn.registry.base import DEFAULT_PREFIX, KVRegistry
from kdn.registry.embedded import EmbeddedRegistry
from kdn.registry.etcd import EtcdRegistry

ENV_VAR = "KDN_REGISTRY"
ETCD_DEFAULT_PORT = 2379


def default_registry_path() -> Path:
    """``$XDG_DATA_HOME/kdn/registry.sqlite3``, else ``~/.local/share/kdn/registry.sqlite3``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kdn" / "registry.sqlite3"


def open_registry(url: str | None = None) -> KVRegistry:
    """A registry for ``url``; None means ``$KDN_REGISTRY``, else the embedded file in the user's data dir.

    Nothing is contacted yet: use ``async with open_registry(...) as reg`` to
    fail early on an unreachable registry.
    """
    if url is None:
        url = os.environ.get(ENV_VAR) or None
    if url is None:
        return EmbeddedRegistry(default_registry_path())
    if not isinstance(url, str):
        raise InvalidInput(f"registry URL must be a string, got {type(url).__name__}")
    if url.startswith("file:"):
        path = url[len("file:") :]
        if path.startswith("//"):  # file:///abs/path (an empty host is the only one allowed)
            if not path.startswith("///"):
                raise InvalidInput(f"bad registry URL {url[:100]!r}: use file:PATH or file:///ABSOLUTE/PATH")
            path = path[2:]
        if not path:
            raise InvalidInput(f"bad registry URL {url[:100]!r}: file: needs a path")
        return EmbeddedRegistry(os.path.expanduser(path))
    if url.startswith("etcd://"):
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as e:
            raise InvalidInput(f"bad registry URL {url[:100]!r}: {e}") from None
        if not host or parts.query or parts.fragment or parts.username or parts.password:
            raise InvalidInput(f"bad registry URL {url[:100]!r}: expected etcd://HOST:PORT[/PREFIX]")
        prefix = parts.path if parts.path.strip("/") else DEFAULT_PREFIX
        return EtcdRegistry(host, port or ETCD_DEFAULT_PORT, prefix)
    raise InvalidInput(f"bad registry URL {url[:100]!r}: expected etcd://HOST:PORT[/PREFIX] or file:PATH")
