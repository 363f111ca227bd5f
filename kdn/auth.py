"""Bearer tokens and what they grant: roles and the namespaces a caller may use.

A token file has one grant per line; ``#`` starts a comment::

    # token                          roles            namespaces
    3f9c...e1                        publish,read     public,acme
    77aa...02                        read             acme
    b0b0...ff                        admin            *

Every line names its roles and namespaces: ``TOKEN admin *`` is the one
that grants everything (a token alone on a line is refused, so no grant is
ever broader than written). The namespace a reader may use comes from its token,
never from a field the client fills in: servers call ``Grants.check`` with
the token from the ``Authorization`` header and get the allowed namespaces.

Tokens are compared by their SHA-256 (a dict lookup on the digest), so the
comparison time does not depend on how many leading characters match.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kdn.format.address import PUBLIC_NAMESPACE, validate_namespace
from kdn.errors import InvalidInput, KDNError

ROLES = frozenset({"read", "publish", "admin"})
_COMMENT = re.compile(r"(?:^|\s)#")
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,512}")
ANY = "*"


class AuthError(KDNError):
    """Missing or unknown token (401), or a token without the needed grant (403)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


def covers(namespaces: frozenset[str], namespace: str) -> bool:
    """Whether granted ``namespaces`` (``*``: all of them) include ``namespace``: the one namespace check."""
    return ANY in namespaces or namespace in namespaces


# Objects of a model rather than of a text: a kvtc basis, fitted once per model on the origin's own
# calibration text and named by the objects coded with it. A tenant's kvtc objects cannot be decoded without
# it, so any token that reads some namespace reads these too (they hold nothing of any tenant's text).
MODEL_LEVEL_KINDS = frozenset({"basis"})


def may_read(namespaces: frozenset[str], namespace: str, kind: str | None = None) -> bool:
    """``covers``, and a model-level object (``MODEL_LEVEL_KINDS``, in the public namespace, where an origin
    records its bases) for any token with a read grant."""
    return covers(namespaces, namespace) or (bool(namespaces) and kind in MODEL_LEVEL_KINDS
                                             and namespace == PUBLIC_NAMESPACE)


@dataclass(frozen=True)
class Grant:
    roles: frozenset[str]
    namespaces: frozenset[str]  # may contain "*"

    def allows(self, role: str, namespace: str) -> bool:
        role_ok = role in self.roles or "admin" in self.roles
        return role_ok and covers(self.namespaces, namespace)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class Grants:
    """The grants of a token file. ``open_access`` grants read on ``public`` to callers without a token."""

    def __init__(self, grants: dict[bytes, Grant] | None = None, *, anonymous: Grant | None = None) -> None:
        self._grants = dict(grants or {})
        self.anonymous = anonymous

    @classmethod
    def parse(cls, text: str, *, anonymous: Grant | None = None) -> Grants:
        grants: dict[bytes, Grant] = {}
        seen: dict[bytes, int] = {}  # token digest -> its line
        for lineno, raw in enumerate(text.splitlines(), 1):
            # A comment starts with '#' at the start of a line or after whitespace; a '#' inside a token
            # is a bad token (once it silently cut the line to one field: every role, every namespace).
            line = _COMMENT.split(raw, 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if not _TOKEN.fullmatch(parts[0]):
                raise InvalidInput(f"token file line {lineno}: a token is made of A-Z a-z 0-9 . _ ~ + / = - (at most 512)")
            if len(parts) == 3:
                roles = frozenset(r for r in parts[1].split(",") if r)
                if not roles <= ROLES:
                    raise InvalidInput(f"token file line {lineno}: unknown role(s) {sorted(roles - ROLES)}")
                nss = frozenset(n for n in parts[2].split(",") if n)
                for ns in nss - {ANY}:
                    try:
                        validate_namespace(ns)
                    except InvalidInput as e:
                        raise InvalidInput(f"token file line {lineno}: {e}") from None
                grant = Grant(roles, nss)
            elif len(parts) == 1:
                # Once a bare token granted every role on every namespace: a line cut short by accident
                # (a stray '#', a lost field) became the most powerful grant in the file.
                raise InvalidInput(f"token file line {lineno}: a token alone grants nothing; write 'TOKEN admin *' "
                                   "for every role on every namespace, or 'TOKEN ROLES NAMESPACES'")
            else:
                raise InvalidInput(f"token file line {lineno}: expected 'TOKEN ROLES NAMESPACES'")
            if len(parts[0]) < 16:
                raise InvalidInput(f"token file line {lineno}: tokens must be at least 16 characters")
            digest = _digest(parts[0])
            if digest in seen:
                # Which line wins would be an accident of order: say so instead of granting either.
                raise InvalidInput(f"token file line {lineno}: the token of line {seen[digest]} again; "
                                   "one line per token, its roles and namespaces comma-separated")
            seen[digest] = lineno
            grants[digest] = grant
        return cls(grants, anonymous=anonymous)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None, *, anonymous: Grant | None = None) -> Grants:
        if path is None:
            return cls(anonymous=anonymous)
        try:
            text = Path(path).read_text()
            mode = os.stat(path).st_mode
        except OSError as e:
            raise InvalidInput(f"cannot read token file {str(path)!r}: {e.strerror}") from None
        if mode & 0o004:
            logging.getLogger(__name__).warning(
                "token file %s is readable by every user on this machine (mode %o): chmod o-r it", path, mode & 0o777)
        return cls.parse(text, anonymous=anonymous)

    @property
    def empty(self) -> bool:
        return not self._grants

    def lookup(self, authorization: str | None) -> Grant | None:
        """The grant of an ``Authorization: Bearer TOKEN`` header value, or the anonymous one."""
        if not authorization:
            return self.anonymous
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("Authorization must be 'Bearer TOKEN'", status=401)
        grant = self._grants.get(_digest(token.strip()))
        if grant is None:
            raise AuthError("unknown token", status=401)
        return grant

    def check(self, authorization: str | None, role: str, namespace: str) -> Grant:
        grant = self.lookup(authorization)
        if grant is None or (not authorization and not grant.allows(role, namespace)):
            # No token, and anonymous access does not cover this: ask for credentials (401), not 403.
            raise AuthError(f"a bearer token with the {role!r} role is required", status=401)
        if not grant.allows(role, namespace):
            raise AuthError(f"token may not {role} in namespace {namespace!r}", status=403)
        return grant

    def namespaces(self, authorization: str | None, role: str = "read") -> frozenset[str]:
        """The namespaces a caller may use for ``role`` ("*" = any); empty if none."""
        grant = self.lookup(authorization)
        if grant is None or not (role in grant.roles or "admin" in grant.roles):
            return frozenset()
        return grant.namespaces


def read_token(path: str | None) -> str | None:
    """The first token of a token file (its first field: a grants file works too), else $KDN_TOKEN."""
    if path is None:
        return os.environ.get("KDN_TOKEN")
    try:
        for line in Path(path).read_text().splitlines():
            line = _COMMENT.split(line, 1)[0].strip()
            if line:
                return line.split()[0]
    except OSError as e:
        raise InvalidInput(f"cannot read token file {path!r}: {e.strerror}") from None
    raise InvalidInput(f"token file {path!r} holds no token")


DEFAULT_TOKEN_HOSTS = ("localhost", "127.0.0.0/8", "::1")


class TokenScope:
    """Where a node may send its own token: to hosts an operator named, over http or https alike.

    The URLs an edge fills from come from the registry (peers, other regions,
    origins); a registry writer could name any host. So the token goes only to
    hosts matching one of ``patterns``: an exact name, a glob or an address
    block (``10.0.0.0/8``). Loopback by default. A glob matches label by label
    (``edge-*`` is ``edge-eu-1``, never ``edge-1.attacker.example``); a leading
    ``**.`` stands for one or more labels (``**.kdn.svc.cluster.local``).
    https does not widen the list: a certificate proves a host's name, not that
    the operator meant the token for it (any CA in the trust store signs names
    for anyone who owns them; a private CA, ``--ca``, narrows that).
    """

    def __init__(self, patterns: list[str] | tuple[str, ...] | str | None = None) -> None:
        if patterns is None:
            patterns = DEFAULT_TOKEN_HOSTS
        if isinstance(patterns, str):
            patterns = [p for p in (x.strip() for x in patterns.split(",")) if p]
        self.names: list[str] = []
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for p in patterns:
            if not isinstance(p, str) or not p or any(c.isspace() for c in p) or len(p) > 253:
                raise InvalidInput(f"bad token host pattern {str(p)[:80]!r}")
            try:
                self.nets.append(ipaddress.ip_network(p.strip("[]"), strict=False))
            except ValueError:
                labels = p.lower().rstrip(".").split(".")
                if "" in labels or "**" in labels[1:] or labels == ["**"]:
                    raise InvalidInput(f"bad token host pattern {p[:80]!r}: labels are non-empty, and '**' "
                                       "only leads a domain ('**.svc.cluster.local')") from None
                self.names.append(".".join(labels))
        self.patterns = tuple(patterns)

    def allows(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower().rstrip(".")
        except ValueError:
            return False
        if not host or parts.username is not None or parts.scheme not in ("http", "https"):
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return any(_host_matches(host, n) for n in self.names)
        return any(ip in net for net in self.nets) or host in self.names

    def __repr__(self) -> str:
        return f"TokenScope({','.join(self.patterns)})"


def _host_matches(host: str, pattern: str) -> bool:
    """``pattern`` (lower case, validated) against ``host``, one DNS label at a time."""
    hl, pl = host.split("."), pattern.split(".")
    if pl[0] == "**":
        pl = pl[1:]
        if len(hl) <= len(pl):
            return False
        hl = hl[len(hl) - len(pl):]
    return len(hl) == len(pl) and all(fnmatch.fnmatchcase(h, p) for h, p in zip(hl, pl))
