"""Who is looking at the console: signed-in sessions, the viewer a request comes from, and its form read.

A session is a random id in a cookie (``COOKIE``, path ``PREFIX``) mapped in memory to a ``Viewer``: the grant of
the token posted once to the sign-in form. See the package's docstring (origin/console/__init__.py), "Sign-in".

Why the bounds are per token and per address (#51 item 7): the sessions were one LRU of 1,024, so anyone with
any token (a ``read`` one will do) ended every other session with 1,050 sign-ins in about a second. Now a token
holds at most ``MAX_SESSIONS_PER_TOKEN`` sessions and its own oldest goes past that, never another token's; at the
memory bound (``MAX_SESSIONS``) the token holding the most sessions gives one up; and each peer address may try
``SIGN_IN_BURST`` sign-ins at once, then one every ``SIGN_IN_EVERY`` seconds (``SignIns``; over it: a 429).
"""

from __future__ import annotations

import hashlib
import ipaddress
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
MAX_SESSIONS = 16_384  # signed-in browsers kept in all; at it, the token holding the most loses its oldest
MAX_SESSIONS_PER_TOKEN = 32  # one token's signed-in browsers; past it that token's own oldest session ends
SIGN_IN_BURST = 30  # sign-in attempts (right or wrong) one peer address may make at once...
SIGN_IN_EVERY = 2.0  # ...and then one each this many seconds
MAX_SIGN_IN_PEERS = 4096  # addresses the sign-in limit remembers (the least recently seen is forgotten)
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


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def peer_key(peer: str | None) -> str:
    """Whose sign-ins a bucket counts: an IPv4 address, or an IPv6 address's /64 (one host is given a whole /64,
    so a bucket per IPv6 address would be no bound at all)."""
    try:
        ip = ipaddress.ip_address(peer or "")
    except ValueError:
        return peer or ""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class SignIns:
    """Sign-in attempts per peer address: a token bucket each (``burst`` at once, then one each ``every`` seconds),
    in a table of at most ``limit`` addresses, the least recently seen forgotten first (a forgotten address starts
    with a full bucket, as it would once its bucket refilled: the least recently seen is the one most likely full).
    """

    def __init__(self, burst: int = SIGN_IN_BURST, every: float = SIGN_IN_EVERY, limit: int = MAX_SIGN_IN_PEERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert burst >= 1 and every > 0 and limit >= 1
        self.burst, self.every, self.limit, self.clock = burst, every, limit, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (attempts left, when)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, peer: str | None) -> float:
        """One attempt for ``peer``: 0 if it may go ahead, else the seconds until its next one may."""
        key, now = peer_key(peer), self.clock()
        left, at = self._buckets.pop(key, (float(self.burst), now))
        left = min(float(self.burst), left + max(0.0, now - at) / self.every)
        wait = 0.0 if left >= 1 else (1 - left) * self.every
        self._buckets[key] = (left - 1 if not wait else left, now)  # (moved to the end: the most recently seen)
        while len(self._buckets) > self.limit:
            self._buckets.popitem(last=False)
        return wait


class Sessions:
    """Signed-in browsers: a random id (the cookie) -> a ``Viewer``, in memory, expiring ``seconds`` after sign-in.
    Bounded per token (``per_token``: past it that token's own oldest session ends, never another token's) and in
    all (``limit``: the token holding the most sessions loses its oldest, so a flood ends the flooders' sessions
    first). Sessions are looked up by the id's SHA-256 and counted by the token's, as tokens are, so neither an id
    nor a token is kept. ``sign_ins`` limits the attempts per address. A restart signs everyone out."""

    def __init__(self, limit: int = MAX_SESSIONS, seconds: float = SESSION_SECONDS,
                 clock: Callable[[], float] = time.monotonic, per_token: int = MAX_SESSIONS_PER_TOKEN,
                 sign_ins: SignIns | None = None) -> None:
        assert limit >= 1 and per_token >= 1
        self.limit, self.seconds, self.clock, self.per_token = limit, seconds, clock, per_token
        self.sign_ins = sign_ins if sign_ins is not None else SignIns(clock=clock)
        self._by_digest: OrderedDict[bytes, Viewer] = OrderedDict()  # in sign-in order, so in expiry order
        self._token_of: dict[bytes, bytes] = {}  # a session's digest -> its token's digest
        self._of_token: dict[bytes, OrderedDict[bytes, None]] = {}  # a token's digest -> its sessions, oldest first
        self._flash: dict[bytes, str] = {}  # what the last form did, shown once on the next page

    def __len__(self) -> int:
        return len(self._by_digest)

    def of_token(self, token: str) -> int:
        """How many sessions ``token`` holds now."""
        return len(self._of_token.get(_digest(token), ()))

    def _end(self, key: bytes) -> None:
        self._by_digest.pop(key, None)
        self._flash.pop(key, None)
        who = self._token_of.pop(key, None)
        if who is not None:
            mine = self._of_token[who]
            mine.pop(key, None)
            if not mine:
                del self._of_token[who]

    def open(self, grant: Grant, token: str) -> tuple[str, Viewer]:
        """A new session for ``grant``, signed in with ``token`` (only its SHA-256 is kept, to count its sessions)."""
        now = self.clock()
        while self._by_digest and next(iter(self._by_digest.values())).expires <= now:
            self._end(next(iter(self._by_digest)))
        who = _digest(token)
        mine = self._of_token.get(who)
        if mine is not None and len(mine) >= self.per_token:
            self._end(next(iter(mine)))  # this token's own oldest
        while len(self._by_digest) >= self.limit:  # (a flood ends the flooders' sessions first)
            most = max(self._of_token.values(), key=lambda sessions: len(sessions))
            self._end(next(iter(most)))
        sid = secrets.token_urlsafe(32)
        viewer = Viewer(grant, secrets.token_urlsafe(32), now + self.seconds)
        key = _digest(sid)
        self._by_digest[key] = viewer
        self._token_of[key] = who
        self._of_token.setdefault(who, OrderedDict())[key] = None
        return sid, viewer

    def get(self, sid: str | None) -> Viewer | None:
        if not sid or len(sid) > 128:
            return None
        key = _digest(sid)
        viewer = self._by_digest.get(key)
        if viewer is not None and viewer.expires <= self.clock():
            self._end(key)
            return None
        return viewer

    def close(self, sid: str | None) -> None:
        if sid and len(sid) <= 128:
            self._end(_digest(sid))

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
