"""Registry URLs, the default when none is given, and the ``--registry`` option commands share.

- ``file:PATH``: the embedded registry (one machine).
- ``etcd://[USER@]HOST:PORT[,HOST:PORT...][/PREFIX][?password_file=FILE]``: etcd over plaintext.
- ``etcds://[USER@]HOST:PORT[,HOST:PORT...][/PREFIX][?ca=FILE&cert=FILE&key=FILE&password_file=FILE]``:
  etcd over TLS, verified against ``ca`` (else the system's CAs), with a client
  certificate when etcd runs ``--client-cert-auth`` (etcd takes its CN as the user).

Several endpoints name the members of one cluster: the client uses the first and moves
to the next when one stops answering (``kdn/registry/etcd_client.py``), so a member's death
costs a retry, not the registry.

A password never sits in the URL (it would show in ``ps``, logs and shell
history): it comes from ``password_file`` or ``$KDN_ETCD_PASSWORD``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from kdn.errors import InvalidInput
from kdn.registry.base import DEFAULT_PREFIX, KVRegistry, Registry

if TYPE_CHECKING:  # pragma: no cover - the backends load when a registry is opened (the --registry option needs none)
    from kdn.registry.etcd import EtcdRegistry

ENV_VAR = "KDN_REGISTRY"
PASSWORD_ENV_VAR = "KDN_ETCD_PASSWORD"
_ETCD_FORM = "etcd[s]://[USER@]HOST:PORT[,HOST:PORT...][/PREFIX][?ca=FILE&cert=FILE&key=FILE&password_file=FILE]"
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
    from kdn.registry.embedded import EmbeddedRegistry

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
    if url.startswith(("etcd://", "etcds://")):
        return _open_etcd(url)
    raise InvalidInput(f"bad registry URL {url[:100]!r}: expected {_ETCD_FORM} or file:PATH")


def _open_etcd(url: str) -> EtcdRegistry:
    from kdn.registry.etcd import EtcdRegistry
    from kdn.registry.etcd_client import EtcdAuth

    def bad(why: str) -> InvalidInput:
        return InvalidInput(f"bad registry URL {_shown(url)!r}: {why}")

    try:
        parts = urlsplit(url)
        # The members: HOST:PORT pairs split at commas, each parsed as a URL's host would be (IPv6 in brackets).
        userinfo, _, hosts = parts.netloc.rpartition("@")
        endpoints = [_endpoint(hp) for hp in hosts.split(",")]
    except ValueError as e:
        raise bad(str(e)) from None
    if parts.fragment:
        raise bad(f"expected {_ETCD_FORM}")
    if len(set(endpoints)) != len(endpoints):
        raise bad("an endpoint is named twice")
    if parts.password is not None:
        raise bad("a password does not belong in a URL (ps, logs and shell history show it): "
                  f"use ?password_file=FILE or ${PASSWORD_ENV_VAR}")
    try:
        opts = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError:
        raise bad("its query must be key=value pairs joined by '&'") from None
    unknown = set(opts) - {"ca", "cert", "key", "password_file"}
    if unknown:
        raise bad(f"unknown option(s) {sorted(unknown)}; known: ca, cert, key, password_file")
    tls = parts.scheme == "etcds"
    if not tls and opts.keys() & {"ca", "cert", "key"}:
        raise bad("ca, cert and key are TLS options: use etcds://")
    if ("cert" in opts) != ("key" in opts):
        raise bad("a client certificate needs both cert= and key=")
    user = unquote(parts.username) if parts.username else None
    password = None
    if "password_file" in opts:
        password = _read(opts["password_file"], "password_file").decode("utf-8", "replace").strip()
    elif user is not None:
        password = os.environ.get(PASSWORD_ENV_VAR)
    if user is not None and not password:
        raise bad(f"user {user!r} needs a password: ?password_file=FILE or ${PASSWORD_ENV_VAR}")
    if user is None and password is not None:
        raise bad("a password needs a user: etcd[s]://USER@HOST:PORT")
    auth = EtcdAuth(
        tls=tls,
        ca=_read(opts["ca"], "ca") if "ca" in opts else None,
        cert=_read(opts["cert"], "cert") if "cert" in opts else None,
        key=_read(opts["key"], "key") if "key" in opts else None,
        user=user,
        password=password,
    )
    prefix = parts.path if parts.path.strip("/") else DEFAULT_PREFIX
    (host, port), more = endpoints[0], endpoints[1:]
    return EtcdRegistry(host, port, prefix, auth=auth, more_endpoints=more)


def _endpoint(host_port: str) -> tuple[str, int]:
    """``HOST[:PORT]`` as (host, port); the port defaults to etcd's. ``ValueError`` when malformed."""
    parts = urlsplit(f"//{host_port}")
    if not parts.hostname or parts.username is not None:
        raise ValueError(f"{host_port[:60]!r} is not HOST:PORT")
    return parts.hostname, parts.port or ETCD_DEFAULT_PORT


def _read(path: str, what: str) -> bytes:
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read(1 << 20)
    except OSError as e:
        raise InvalidInput(f"registry URL's {what}={path!r}: cannot read it: {e.strerror or e}") from None


def _shown(url: str) -> str:
    """The URL as errors may print it: cut, and without a password someone put in it."""
    try:
        password = urlsplit(url[:200]).password
    except ValueError:
        password = None
    if password:
        url = url.replace(f":{password}@", ":***@", 1)
    return url[:100]


def registry_arg(p: argparse.ArgumentParser) -> None:
    """The ``--registry URL`` option every command that reads or writes the registry takes (every part's CLI)."""
    p.add_argument(
        "--registry",
        default=None,
        metavar="URL",
        help="etcd://host:port[,host:port...][/prefix], etcds://[user@]host:port[/prefix]?ca=&cert=&key=&password_file= (TLS, credentials) or file:PATH (default: $KDN_REGISTRY, else an embedded file in the user data dir)",
    )


def run_registry(args: argparse.Namespace, fn: Callable[[Registry], Awaitable[int]]) -> int:
    """Open the registry named by ``--registry``, run ``fn(registry)``, close it (parts' commands use this too)."""

    async def go() -> int:
        reg = open_registry(args.registry)
        try:
            return await fn(reg)
        finally:
            await reg.close()

    return asyncio.run(go())
