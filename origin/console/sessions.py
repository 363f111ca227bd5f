"""Who is looking at the console: signed-in sessions, the viewer a request comes from, and its form read.

A session is a random id in a cookie (``COOKIE``, path ``PREFIX``) mapped in memory to a ``Viewer``: the grant of
the token posted once to the sign-in form. See the package's docstring (origin/console/__init__.py), "Sign-in".
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from aiohttp import web

from kdn.auth import Grant
from kdn.service import GRANTS, read_body

PREFIX = "/console"
COOKIE = "kdn_console"
MAX_SESSIONS = 1024  # signed-in browsers kept; past it the oldest session ends
SESSION_SECONDS = 8 * 3600  # a session ends this long after its sign-in
MAX_FORM_BYTES = 16 << 10  # a console form is a few fields: a larger body is a 413, never parsed
MAX_FORM_FIELDS = 32


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a signed-in session's grant, or, on an origin without a token file, the anonymous grant
    (``open``: nothing to sign in with, nothing to edit). Never its token: the console keeps none, and asks the
    edges with the origin's own probe token (edges.py)."""

    grant: Grant
    csrf: str
    expires: float
    open: bool = False

    @property
    def reads(self) -> frozenset[str]:
        """The namespaces this viewer may read (``*``: every one)."""
        g = self.grant
        return g.namespaces if ("read" in g.roles or "admin" in g.roles) else frozenset()

    def may_admin(self, namespace: str) -> bool:
        return not self.open and self.grant.allows("admin", namespace)


def _digest(sid: str) -> bytes:
    return hashlib.sha256(sid.encode()).digest()


class Sessions:
    """Signed-in browsers: a random id (the cookie) -> a ``Viewer``, in memory. Bounded (at ``limit`` the oldest
    session ends) and expiring ``seconds`` after sign-in; looked up by the id's SHA-256, as tokens are, so the
    lookup's time does not depend on how much of an id matches. A restart signs everyone out."""

    def __init__(self, limit: int = MAX_SESSIONS, seconds: float = SESSION_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.seconds, self.clock = limit, seconds, clock
        self._by_digest: OrderedDict[bytes, Viewer] = OrderedDict()
        self._flash: dict[bytes, str] = {}  # what the last form did, shown once on the next page

    def __len__(self) -> int:
        return len(self._by_digest)

    def _drop_oldest(self) -> None:
        key, _ = self._by_digest.popitem(last=False)
        self._flash.pop(key, None)

    def open(self, grant: Grant) -> tuple[str, Viewer]:
        now = self.clock()
        while self._by_digest and next(iter(self._by_digest.values())).expires <= now:
            self._drop_oldest()  # (in sign-in order, so in expiry order)
        while len(self._by_digest) >= self.limit:
            self._drop_oldest()
        sid = secrets.token_urlsafe(32)
        viewer = Viewer(grant, secrets.token_urlsafe(32), now + self.seconds)
        self._by_digest[_digest(sid)] = viewer
        return sid, viewer

    def get(self, sid: str | None) -> Viewer | None:
        if not sid or len(sid) > 128:
            return None
        key = _digest(sid)
        viewer = self._by_digest.get(key)
        if viewer is not None and viewer.expires <= self.clock():
            del self._by_digest[key]
            self._flash.pop(key, None)
            return None
        return viewer

    def close(self, sid: str | None) -> None:
        if sid and len(sid) <= 128:
            self._by_digest.pop(_digest(sid), None)
            self._flash.pop(_digest(sid), None)

    def flash(self, sid: str | None, message: str) -> None:
        """Keep ``message`` for the session's next page (a live session only)."""
        if self.get(sid) is not None:
            assert sid is not None
            self._flash[_digest(sid)] = message[:300]

    def take_flash(self, sid: str | None) -> str | None:
        return self._flash.pop(_digest(sid), None) if sid and len(sid) <= 128 else None


SESSIONS = web.AppKey("console_sessions", Sessions)


def viewer_of(request: web.Request) -> Viewer | None:
    """The request's session's viewer (None: not signed in); on an origin without a token file, the anonymous
    grant's."""
    grants = request.app[GRANTS]
    if grants.empty:
        return Viewer(grants.anonymous or Grant(frozenset(), frozenset()), "", math.inf, open=True)
    return request.app[SESSIONS].get(request.cookies.get(COOKIE))


def same_site(request: web.Request) -> bool:
    """A POST's ``Origin``, where the browser sent one, names this host (SameSite=Strict keeps the cookie off
    other sites' requests already; this refuses a cross-site sign-in too)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == (request.host or "").lower()


async def read_form(request: web.Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body, bounded: 415 for another type, 413 past
    ``MAX_FORM_BYTES``, 400 if it is not UTF-8 form fields (a field given twice: the last one)."""
    if request.content_type != "application/x-www-form-urlencoded":
        raise web.HTTPUnsupportedMediaType(text="a console form is application/x-www-form-urlencoded")
    body = await read_body(request, MAX_FORM_BYTES, "form")
    try:
        fields = parse_qsl(body.decode("ascii"), keep_blank_values=True, strict_parsing=bool(body),
                           encoding="utf-8", errors="strict", max_num_fields=MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError):
        raise web.HTTPBadRequest(text="the body is not form fields (UTF-8, percent-encoded)") from None
    return {k: v.strip() for k, v in fields}
