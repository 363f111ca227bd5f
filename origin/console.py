"""The operator console (issue #30): a web page on the origin that lists published knowledge and steers it.

The people who know which knowledge is hot are often not the ones at a shell. ``GET /console`` lists what is
published, by namespace: each manifest's model, chunks, tokens, the bytes its objects take in this origin's
store, and the policies that apply to it. A manifest's page adds where it is cached now (each region's owner
edge of each chunk, asked with a HEAD, which never fills: the check ``kdn registry show ADDRESS`` makes), the
reads each region's edges served by tier (their ``/metrics``: all objects, not this one's), its text with the
emphasis map marked over it, and forms that set and remove its pin, warm, push and TTL policies, through the
same function as ``kdn policy set`` (``kdn.edge.policies.policy_from_options``).

Why this shape: server-rendered HTML from the origin's own aiohttp app, plain string templates with
``html.escape`` on every value, and one small inline script (it shows the fields the chosen policy kind takes).
No template engine or front-end framework to keep current, no build step, nothing from a CDN (it works offline
and on an air-gapped network), and a page is what the registry, the store and the edges say when it is asked.
A strict Content-Security-Policy allows that one script and style by their hashes, and nothing else.

Sign-in. A browser cannot put a bearer token on a navigation, so a token from the origin's token file is posted
once to a form; the origin answers with a cookie holding a random session id (HttpOnly, SameSite=Strict, Secure
over TLS, path ``/console``) and keeps ``session -> grant`` in memory: at most ``MAX_SESSIONS`` (the oldest goes
first), each for ``SESSION_SECONDS`` after sign-in. A form that changes something carries the session's CSRF
token, and a POST whose ``Origin`` is another site is refused. A grant that reads a namespace sees its manifests;
``admin`` there may set and remove the policies of its manifests; any other POST is a 403. Without a session a
page is a 401 with the sign-in form and nothing else. An origin without a token file has no token to sign in
with: its console shows what an anonymous API caller reads (``public``), read-only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import aiohttp
from aiohttp import web

from kdn.address import Address, validate_name, validate_namespace
from kdn.auth import ANY, Grant, covers
from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput, KDNError
from kdn.origin.app import CONFIG, LOADED, STORE, TOKENIZER
from kdn.registry import Manifest, NodeRecord, Policy, Registry
from kdn.registry.split import RecordsBeside
from kdn.service import DEADLINES, GRANTS, REGISTRY, Deadlines
from kdn.units import format_size

log = logging.getLogger(__name__)

PREFIX = "/console"
COOKIE = "kdn_console"
MAX_SESSIONS = 1024  # signed-in browsers kept; past it the oldest session ends
SESSION_SECONDS = 8 * 3600  # a session ends this long after its sign-in
MAX_FORM_BYTES = 16 << 10  # a console form is a few fields: a larger body is a 413, never parsed
MAX_FORM_FIELDS = 32
MAX_LISTED = 500  # manifests on the listing (the rest are counted, not read)
MAX_CHECKED = 32  # chunks whose owner edges a manifest's page asks (HEAD), from the first
EDGE_SECONDS = 5.0  # the most a manifest's page waits for the edges (HEADs and /metrics)
MAX_EDGES = 64  # edges whose /metrics a manifest's page reads
MAX_METRICS_BYTES = 4 << 20
MAX_TEXT_TOKENS = 65536  # tokens of a manifest decoded onto its page
MANIFEST_KINDS = ("pin", "warm", "push", "ttl")  # what a manifest's form sets
NAMESPACE_KINDS = ("quota", "ttl")  # what a namespace's form sets

SCRIPT = """\
// Show the fields the chosen policy kind takes; the others are disabled, so they are not sent.
for (const form of document.querySelectorAll("form[data-policy]")) {
  const kind = form.querySelector("select[name=kind]");
  const show = () => {
    for (const el of form.querySelectorAll("[data-kinds]")) {
      el.hidden = !el.dataset.kinds.split(" ").includes(kind.value);
      for (const input of el.querySelectorAll("input")) input.disabled = el.hidden;
    }
  };
  kind.addEventListener("change", show);
  show();
}
"""

STYLE = """\
body{font:15px/1.45 system-ui,sans-serif;margin:0;color:#1d232b;background:#f6f7f9}
header{display:flex;gap:1em;align-items:center;padding:.6em 1.5em;background:#16324f;color:#fff}
header a{color:#fff;text-decoration:none;font-weight:600}header .who{margin-left:auto;font-size:.9em}
header form{display:inline}main{padding:1em 1.5em;max-width:1200px}
h1{font-size:1.4em;margin:.3em 0}h2{font-size:1.15em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff;width:100%;margin:.3em 0 1em}
th,td{border-bottom:1px solid #e2e5ea;padding:.35em .6em;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.pol{display:inline-block;border-radius:3px;padding:0 .4em;margin:0 .25em .15em 0;background:#e3ecf7;font-size:.85em}
.pol.pin{background:#fde9c8}.pol.push,.pol.warm{background:#d9f0dc}.pol.quota{background:#ece0f6}
.note{color:#5a6472;font-size:.9em}.err{background:#fde2e1;padding:.6em;border-left:4px solid #c0392b}
.ok{background:#e3f4e6;padding:.6em;border-left:4px solid #2e8b57}
form.row{display:flex;flex-wrap:wrap;gap:.6em;align-items:end;background:#fff;padding:.6em;border:1px solid #e2e5ea}
form.row label{display:flex;flex-direction:column;font-size:.85em}input,select,button{font:inherit;padding:.2em .4em}
button{cursor:pointer}form.inline{display:inline}code{font-size:.9em}[hidden]{display:none!important}
pre.text{white-space:pre-wrap;background:#fff;border:1px solid #e2e5ea;padding:.8em;max-height:32em;overflow:auto}
pre.text .head{color:#8a94a3}mark{background:#ffe066;padding:0 .1em}
"""


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# Only this page's own script and style run (by their hashes), forms post only here, no frame holds it.
HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # (no-referrer would make a browser send `Origin: null` with our own forms)
    "Cache-Control": "no-store",
}


def e(value: object) -> str:
    """Every value a page shows goes through this: text, never markup."""
    return html.escape(str(value), quote=True)


# --- sessions ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a signed-in session's grant (and its token, which asks edges what they hold), or, on an
    origin without a token file, the anonymous grant (``open``: nothing to sign in with, nothing to edit)."""

    grant: Grant
    token: str | None
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

    def open(self, grant: Grant, token: str) -> tuple[str, Viewer]:
        now = self.clock()
        while self._by_digest and next(iter(self._by_digest.values())).expires <= now:
            self._drop_oldest()  # (in sign-in order, so in expiry order)
        while len(self._by_digest) >= self.limit:
            self._drop_oldest()
        sid = secrets.token_urlsafe(32)
        viewer = Viewer(grant, token, secrets.token_urlsafe(32), now + self.seconds)
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


def _viewer(request: web.Request) -> Viewer | None:
    grants = request.app[GRANTS]
    if grants.empty:
        return Viewer(grants.anonymous or Grant(frozenset(), frozenset()), None, "", math.inf, open=True)
    return request.app[SESSIONS].get(request.cookies.get(COOKIE))


def _same_site(request: web.Request) -> bool:
    """A POST's ``Origin``, where the browser sent one, names this host (SameSite=Strict keeps the cookie off
    other sites' requests already; this refuses a cross-site sign-in too)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == (request.host or "").lower()


async def _read_form(request: web.Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body, bounded: 415 for another type, 413 past
    ``MAX_FORM_BYTES``, 400 if it is not UTF-8 form fields (a field given twice: the last one)."""
    if request.content_type != "application/x-www-form-urlencoded":
        raise web.HTTPUnsupportedMediaType(text="a console form is application/x-www-form-urlencoded")
    if request.content_length is not None and request.content_length > MAX_FORM_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_FORM_BYTES, actual_size=request.content_length,
                                            text=f"form larger than {MAX_FORM_BYTES} bytes")
    seconds = (request.app.get(DEADLINES) or Deadlines()).body
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.content.iter_chunked(1 << 14):
                body += chunk
                if len(body) > MAX_FORM_BYTES:
                    raise web.HTTPRequestEntityTooLarge(max_size=MAX_FORM_BYTES, actual_size=len(body),
                                                        text=f"form larger than {MAX_FORM_BYTES} bytes")
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"body not received within {seconds:g} s",
                                     headers={"Connection": "close"}) from None
    try:
        fields = parse_qsl(body.decode("ascii"), keep_blank_values=True, strict_parsing=bool(body),
                           encoding="utf-8", errors="strict", max_num_fields=MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError):
        raise web.HTTPBadRequest(text="the body is not form fields (UTF-8, percent-encoded)") from None
    return {k: v.strip() for k, v in fields}


# --- pages ---------------------------------------------------------------------------------------------------


def _page(title: str, body: str, *, viewer: Viewer | None = None, status: int = 200) -> web.Response:
    who = ""
    if viewer is not None and viewer.open:
        who = '<span class="who">open origin (no token file): read-only</span>'
    elif viewer is not None:
        roles = ",".join(sorted(viewer.grant.roles))
        nss = ",".join(sorted(viewer.grant.namespaces))
        who = (f'<span class="who">signed in: {e(roles)} on {e(nss)} '
               f'<form class="inline" method="post" action="{PREFIX}/logout">'
               f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}"><button>Sign out</button></form></span>')
    text = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{e(title)} - KDN console</title><style>{STYLE}</style></head><body>"
            f'<header><a href="{PREFIX}">KDN console</a>{who}</header><main>{body}</main>'
            f"<script>{SCRIPT}</script></body></html>")
    resp = web.Response(text=text, status=status, content_type="text/html", charset="utf-8")
    resp.headers.update(HEADERS)
    return resp


def _sign_in_page(request: web.Request, status: int = 401, message: str | None = None) -> web.Response:
    open_note = ("<p class=\"err\">This origin runs without a token file: there is no token to sign in with. "
                 "Start it with <code>--token-file</code> to sign in and edit policies.</p>"
                 if request.app[GRANTS].empty else "")
    body = (f"<h1>Sign in</h1>{open_note}"
            + (f'<p class="err">{e(message)}</p>' if message else "")
            + f'<form class="row" method="post" action="{PREFIX}/login">'
            '<label>token (a line of the origin\'s token file)'
            '<input type="password" name="token" autocomplete="off" required size="48"></label>'
            "<button>Sign in</button></form>"
            '<p class="note">A read token sees what it may read; an admin token may also edit policies.</p>')
    return _page("Sign in", body, status=status)


def _error_page(viewer: Viewer | None, status: int, message: str, back: str = PREFIX) -> web.Response:
    return _page("Not done", f'<p class="err">{e(message)}</p><p><a href="{e(back)}">Back</a></p>',
                 viewer=viewer, status=status)


def _see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})


def _manifest_url(namespace: str, name: str) -> str:
    return f"{PREFIX}/manifests/{quote(namespace, safe='')}/{quote(name, safe='')}"


# --- what the registry and the store say ----------------------------------------------------------------------


async def _manifests(reg: Registry, reads: frozenset[str]) -> tuple[list[Manifest], int]:
    """The live manifests of the namespaces ``reads`` covers, by namespace and name: at most ``MAX_LISTED``
    read whole (a pointer's body from the records store), and how many more there are."""
    control: Any = reg.control if isinstance(reg, RecordsBeside) else reg  # pointers: one registry range read
    listed = [m for m in await control.list_manifests() if not m.deleted and covers(reads, m.namespace)]
    listed.sort(key=lambda m: (m.namespace, m.name))
    shown, more = listed[:MAX_LISTED], max(0, len(listed) - MAX_LISTED)
    gate = asyncio.Semaphore(16)

    async def whole(m: Manifest) -> Manifest:
        if m.body is None:
            return m
        async with gate:
            full = await reg.get_manifest(m.namespace, m.name)
        return full if full is not None and not full.deleted else m  # (a body that did not read: its pointer)

    return list(await asyncio.gather(*(whole(m) for m in shown))), more


def _stored(app: web.Application, m: Manifest) -> dict[str, int]:
    """Bytes this origin's store holds for the manifest's objects, per encoding (an object another manifest
    shares is counted in each)."""
    sizes: dict[str, int] = {}
    store = app[STORE]
    for a in dict.fromkeys([*m.addresses, *m.standalone]):
        for enc, info in store.encodings(a).items():
            sizes[enc] = sizes.get(enc, 0) + info.size
    return sizes


async def _policies(reg: Registry) -> list[Policy]:
    """The policies an edge would apply (tombstones and records that do not read left out)."""
    from kdn.edge.policies import is_tombstone, validate_policy

    out = []
    for _, value in await reg.list_keys("policies/"):
        try:
            p = Policy.unpack(value)
            if not is_tombstone(p):
                out.append(validate_policy(p))
        except KDNError:
            continue
    return sorted(out, key=lambda p: p.name)


def _applies(p: Policy, namespace: str, name: str) -> bool:
    ref = f"{namespace}/{name}"
    if p.kind in ("pin", "warm", "push"):
        return p.manifest == ref
    if p.kind == "ttl":
        return p.namespace in (None, namespace) and p.manifest in (None, ref)
    return p.kind == "quota" and p.namespace == namespace


def _scopes(p: Policy) -> set[str]:
    """The namespaces a policy is about (none: every namespace)."""
    return {s for s in (p.manifest.split("/")[0] if p.manifest else None, p.namespace) if s is not None}


def _may_edit(viewer: Viewer, p: Policy | None) -> bool:
    """Admin on every namespace the policy is about; one about every namespace (or a record that does not
    read: ``None``) needs admin on ``*``."""
    if viewer.open:
        return False
    scopes = _scopes(p) if p is not None else set()
    if not scopes:
        return "admin" in viewer.grant.roles and ANY in viewer.grant.namespaces
    return all(viewer.may_admin(ns) for ns in scopes)


async def _policy_named(reg: Registry, name: str) -> tuple[bool, Policy | None]:
    """Whether a record is stored under ``name``, and the policy it holds (None: a tombstone or unreadable)."""
    from kdn.edge.policies import is_tombstone

    raw = dict(await reg.list_keys(f"policies/{name}")).get(f"policies/{name}")
    if raw is None:
        return False, None
    try:
        p = Policy.unpack(raw)
    except KDNError:
        return True, None
    return not is_tombstone(p), (None if is_tombstone(p) else p)


def _policy_badge(p: Policy) -> str:
    from kdn.edge.cli import _row  # the columns `kdn policy ls` prints

    _, kind, region, scope, setting = _row(p)
    where = "" if region == "*" else f" in {region}" if kind != "push" else f" to {region}"
    extra = "" if setting == "-" or kind in ("pin", "warm") else f" {setting}"
    return (f'<span class="pol {e(kind)}" title="{e(p.name)}: {e(scope)}">{e(kind)}{e(extra)}{e(where)}</span>')


# --- the listing --------------------------------------------------------------------------------------------


async def index(request: web.Request) -> web.Response:
    viewer = _viewer(request)
    if viewer is None:
        return _sign_in_page(request)
    app = request.app
    reg = app[REGISTRY]
    manifests, more = await _manifests(reg, viewer.reads)
    policies = await _policies(reg)
    by_ns: dict[str, list[Manifest]] = {}
    for m in manifests:
        by_ns.setdefault(m.namespace, []).append(m)
    loaded = app[LOADED]
    parts = ["<h1>Published knowledge</h1>"]
    done = app[SESSIONS].take_flash(request.cookies.get(COOKIE))
    if done:
        parts.append(f'<p class="ok">{e(done)}</p>')
    if not viewer.reads:
        parts.append('<p class="note">This token reads no namespace: nothing to list.</p>')
    elif not manifests:
        parts.append('<p class="note">Nothing published in the namespaces this token reads.</p>')
    if viewer.may_admin("*") or (ANY in viewer.reads and not viewer.open):
        fleet = [p for p in policies if not _scopes(p)]
        if fleet:
            parts.append("<p>Policies for every namespace: " + "".join(_policy_badge(p) for p in fleet) + "</p>")
    for ns, items in by_ns.items():
        ns_policies = [p for p in policies if p.kind in NAMESPACE_KINDS and p.namespace == ns and p.manifest is None]
        parts.append(f'<h2 id="ns-{e(ns)}">namespace {e(ns)}</h2>')
        if ns_policies:
            parts.append("<p>Namespace policies: " + "".join(_policy_badge(p) for p in ns_policies) + "</p>")
        rows = []
        for m in items:
            sizes = _stored(app, m)
            chunks = len(m.addresses) if m.body is None else math.ceil(m.tokens / m.chunk_tokens)
            model = (loaded.name if m.model_id == loaded.model_id else m.model_id[:16] + "...")
            stored = (format_size(sum(sizes.values())) + " (" + ", ".join(f"{k} {format_size(v)}" for k, v in
                                                                           sorted(sizes.items())) + ")"
                      if sizes else "not in this origin's store" if m.body is None else "-")
            pols = "".join(_policy_badge(p) for p in policies if _applies(p, m.namespace, m.name))
            rows.append(f'<tr data-manifest="{e(m.namespace)}/{e(m.name)}">'
                        f'<td><a href="{e(_manifest_url(m.namespace, m.name))}">{e(m.name)}</a></td>'
                        f"<td>{e(model)}</td><td class=\"n\">{chunks}</td><td class=\"n\">{m.tokens:,}</td>"
                        f'<td class="n stored">{e(stored)}</td><td>{pols or "-"}</td>'
                        f"<td>{e(time.strftime('%Y-%m-%d %H:%M', time.gmtime(m.created)))}</td></tr>")
        parts.append("<table><thead><tr><th>name</th><th>model</th><th>chunks</th><th>tokens</th>"
                     "<th>stored here</th><th>policies</th><th>published (UTC)</th></tr></thead><tbody>"
                     + "".join(rows) + "</tbody></table>")
        if viewer.may_admin(ns):
            parts.append(_namespace_form(viewer, ns))
    if more:
        parts.append(f'<p class="note">{more} more manifests not listed (the listing shows the first {MAX_LISTED} '
                     "by namespace and name).</p>")
    return _page("Published knowledge", "".join(parts), viewer=viewer)


def _namespace_form(viewer: Viewer, ns: str) -> str:
    return (f'<form class="row" method="post" action="{PREFIX}/policies" data-policy>'
            f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
            f'<input type="hidden" name="op" value="set"><input type="hidden" name="namespace" value="{e(ns)}">'
            f'<label>namespace policy<select name="kind">'
            + "".join(f'<option value="{k}">{k}</option>' for k in NAMESPACE_KINDS) + "</select></label>"
            '<label data-kinds="quota">bytes per tier<input name="quota" placeholder="5GiB"></label>'
            '<label data-kinds="ttl">entries may go after<input name="ttl" placeholder="2h"></label>'
            '<label>region (empty: every region)<input name="region"></label>'
            '<label>policy name (empty: kind.namespace)<input name="name"></label>'
            "<button>Set</button></form>")


# --- a manifest ----------------------------------------------------------------------------------------------


async def manifest_page(request: web.Request) -> web.Response:
    viewer = _viewer(request)
    if viewer is None:
        return _sign_in_page(request)
    try:
        ns = validate_namespace(request.match_info["namespace"])
        name = validate_name(request.match_info["name"])
    except InvalidInput as err:
        return _error_page(viewer, 400, str(err))
    app = request.app
    m = await app[REGISTRY].get_manifest(ns, name) if covers(viewer.reads, ns) else None
    if m is None or m.deleted:
        return _error_page(viewer, 404, f"no manifest {ns}/{name} that this token reads")
    policies = [p for p in await _policies(app[REGISTRY]) if _applies(p, ns, name)]
    regions, hits, text = await asyncio.gather(_where_cached(app, m, viewer), _edge_reads(app), _text(app, m))
    sizes = _stored(app, m)
    loaded = app[LOADED]
    done = app[SESSIONS].take_flash(request.cookies.get(COOKIE))
    parts = [f"<h1>{e(ns)}/{e(name)}</h1>"]
    if done:
        parts.append(f'<p class="ok">{e(done)}</p>')
    stored = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(sizes.items())) or "-"
    standalone = f", and {len(m.standalone)} standalone" if m.standalone else ""
    published = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created))
    signed = f"signed by {m.sig.get('key', '')[:24]}" if m.sig else "unsigned"
    model = f"{loaded.name} " if m.model_id == loaded.model_id else ""
    parts.append(
        "<table><tbody>"
        f"<tr><th>model</th><td>{e(model)}<code>{e(m.model_id)}</code></td></tr>"
        f"<tr><th>tokens</th><td>{m.tokens:,} ({m.head_tokens:,} of them the template's head)</td></tr>"
        f"<tr><th>chunks</th><td>{len(m.addresses)} of {m.chunk_tokens} tokens{e(standalone)}</td></tr>"
        f'<tr><th>stored here</th><td class="stored">{e(stored)}</td></tr>'
        f"<tr><th>version</th><td>{m.version} (published {e(published)} UTC), {e(signed)}</td></tr>"
        "</tbody></table>")
    parts.append(_regions_table(regions, len(m.addresses), viewer))
    parts.append(_reads_table(hits))
    parts.append(_policies_section(viewer, ns, name, policies))
    parts.append(_text_section(m, text))
    return _page(f"{ns}/{name}", "".join(parts), viewer=viewer)


async def _where_cached(app: web.Application, m: Manifest, viewer: Viewer) -> dict[str, dict[str, Any]] | None:
    """Per region: how many of the manifest's first ``MAX_CHECKED`` chunks their owner edge holds now, asked as
    ``kdn registry show ADDRESS`` asks (a HEAD, which never fills), with the viewer's token where it may go
    (``--token-hosts``; an edge tells a token that reads every namespace only). None: the edges took longer than
    ``EDGE_SECONDS``."""
    from kdn.cli import _regions_holding  # the check `kdn registry show ADDRESS` makes

    reg, hosts = app[REGISTRY], app[CONFIG].token_hosts
    addresses = m.addresses[:MAX_CHECKED]
    gate = asyncio.Semaphore(8)

    async def one(address: Address) -> dict[str, dict[str, str]]:
        async with gate:
            return await _regions_holding(reg, address, viewer.token, hosts)

    try:
        async with asyncio.timeout(EDGE_SECONDS):
            per = await asyncio.gather(*(one(a) for a in addresses))
    except TimeoutError:
        return None
    out: dict[str, dict[str, Any]] = {}
    for i, regions in enumerate(per):
        for region, r in regions.items():
            row = out.setdefault(region, {"first": None, "owner": None, "held": 0, "unknown": 0, "checked": 0})
            if i == 0:
                row["first"], row["owner"] = r["holds"], r["owner"]
            row["checked"] += 1
            row["held"] += r["holds"] in ("memory", "disk")
            row["unknown"] += r["holds"].startswith("unknown")
    return out


def _regions_table(regions: dict[str, dict[str, Any]] | None, chunks: int, viewer: Viewer) -> str:
    head = "<h2>Where it is cached</h2>"
    if regions is None:
        return head + f'<p class="err">The edges did not all answer within {EDGE_SECONDS:g} s.</p>'
    if not regions:
        return head + '<p class="note">No live edge in the registry.</p>'
    rows = []
    for region, r in sorted(regions.items()):
        held = f"{r['held']} of {r['checked']}" + (f" ({r['unknown']} unknown)" if r["unknown"] else "")
        rows.append(f'<tr data-region="{e(region)}"><td>{e(region)}</td><td>{e(r["owner"])}</td>'
                    f'<td>{e(r["first"])}</td><td class="held">{e(held)}</td></tr>')
    note = (f" The first {MAX_CHECKED} of its {chunks} chunks were asked." if chunks > MAX_CHECKED else "")
    if viewer.token is None or "*" not in viewer.reads:
        note += " An edge tells what it holds only to a token that reads every namespace: here it says unknown."
    return (head + "<table><thead><tr><th>region</th><th>owner of chunk 0</th><th>chunk 0</th>"
            "<th>chunks their owner edge holds</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
            f'<p class="note">Each chunk\'s owner edge on its region\'s ring, asked with a HEAD (which never '
            f"fills).{e(note)}</p>")


async def _edge_reads(app: web.Application) -> dict[str, dict[str, Any]]:
    """Per region, summed over its live edges' ``/metrics`` (read without a token, ``EDGE_SECONDS`` at most):
    reads served by tier, reads no tier held, bytes filled by source. All objects: an edge counts no manifest."""
    nodes = sorted(await app[REGISTRY].list_nodes(role="edge"), key=lambda n: (n.region, n.node_id))[:MAX_EDGES]
    out: dict[str, dict[str, Any]] = {}
    if not nodes:
        return out
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=EDGE_SECONDS)) as session:
        scraped = await asyncio.gather(*(_scrape(session, n) for n in nodes))
    for node, samples in zip(nodes, scraped):
        row = out.setdefault(node.region, {"edges": 0, "answered": 0, "hits": {}, "misses": {}, "filled": {}})
        row["edges"] += 1
        if samples is None:
            continue
        row["answered"] += 1
        for (metric, label), value in samples.items():
            row[metric][label] = row[metric].get(label, 0.0) + value
    return out


_SAMPLES = {"kdn_edge_hits_total": ("hits", "tier"), "kdn_edge_misses_total": ("misses", "tier"),
            "kdn_edge_fill_bytes_total": ("filled", "source")}


async def _scrape(session: aiohttp.ClientSession, node: NodeRecord) -> dict[tuple[str, str], float] | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(f"{node.url}/metrics", allow_redirects=False) as r:
            if r.status != 200:
                return None
            text = (await r.content.read(MAX_METRICS_BYTES)).decode("utf-8", "replace")
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in _SAMPLES:
                    metric, label = _SAMPLES[s.name]
                    key = (metric, s.labels.get(label, ""))
                    out[key] = out.get(key, 0.0) + float(s.value)
        return out
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        log.info("console: /metrics of edge %s at %s: %s", node.node_id, node.url, type(err).__name__)
        return None


def _reads_table(regions: dict[str, dict[str, Any]]) -> str:
    head = "<h2>Reads at the edges, by region (all objects)</h2>"
    if not regions:
        return head + '<p class="note">No live edge in the registry.</p>'
    rows = []
    for region, r in sorted(regions.items()):
        hits, misses = r["hits"], r["misses"]
        last = "disk" if "disk" in misses else "memory"  # a read no tier held missed the last one
        filled = ", ".join(f"{k} {format_size(int(v))}" for k, v in sorted(r["filled"].items()) if v) or "-"
        rows.append(f'<tr data-region="{e(region)}"><td>{e(region)}</td><td class="n">{r["answered"]} of '
                    f'{r["edges"]}</td><td class="n">{int(hits.get("memory", 0)):,}</td>'
                    f'<td class="n">{int(hits.get("disk", 0)):,}</td><td class="n">{int(misses.get(last, 0)):,}</td>'
                    f"<td>{e(filled)}</td></tr>")
    return (head + "<table><thead><tr><th>region</th><th>edges answering</th><th>memory hits</th><th>disk hits</th>"
            "<th>reads no tier held</th><th>bytes filled, by source</th></tr></thead><tbody>" + "".join(rows)
            + "</tbody></table><p class=\"note\">From each edge's <code>/metrics</code>, since it started; the HEADs "
            "this page and <code>kdn registry show</code> send count too. Edges count reads per tier, not per "
            "manifest, and no one measures the time or compute a hit saved yet: neither is shown.</p>")


def _policies_section(viewer: Viewer, ns: str, name: str, policies: list[Policy]) -> str:
    from kdn.edge.cli import _row

    parts = ["<h2>Policies</h2>"]
    if policies:
        rows = []
        for p in policies:
            _, kind, region, scope, setting = _row(p)
            remove = ""
            if _may_edit(viewer, p):
                remove = (f'<form class="inline" method="post" action="{PREFIX}/policies">'
                          f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
                          '<input type="hidden" name="op" value="delete">'
                          f'<input type="hidden" name="name" value="{e(p.name)}">'
                          f'<input type="hidden" name="manifest" value="{e(ns)}/{e(name)}">'
                          "<button>Remove</button></form>")
            rows.append(f'<tr data-policy="{e(p.name)}"><td>{e(p.name)}</td><td>{e(kind)}</td><td>{e(region)}</td>'
                        f"<td>{e(scope)}</td><td>{e(setting)}</td><td>{remove}</td></tr>")
        parts.append("<table><thead><tr><th>name</th><th>kind</th><th>region</th><th>scope</th><th>setting</th>"
                     "<th></th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
    else:
        parts.append('<p class="note">No policy applies to it: edges cache it as they cache anything.</p>')
    if viewer.may_admin(ns):
        parts.append(
            f'<form class="row" id="set-policy" method="post" action="{PREFIX}/policies" data-policy>'
            f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}"><input type="hidden" name="op" value="set">'
            f'<input type="hidden" name="manifest" value="{e(ns)}/{e(name)}">'
            '<label>kind<select name="kind">'
            + "".join(f'<option value="{k}">{k}</option>' for k in MANIFEST_KINDS) + "</select></label>"
            '<label data-kinds="pin warm ttl">region (empty: every region)<input name="region"></label>'
            '<label data-kinds="push">to regions (empty: every region)<input name="to" placeholder="eu,us"></label>'
            '<label data-kinds="push">at most, per edge<input name="rate" placeholder="50MiB/s"></label>'
            '<label data-kinds="ttl">entries may go after<input name="ttl" placeholder="2h"></label>'
            '<label>policy name (empty: kind.namespace.name)<input name="name"></label>'
            "<button>Set</button></form>"
            '<p class="note">pin: never evicted; warm: each edge fetches what it owns now; push: sent to those '
            "regions ahead of their readers; ttl: entries may be dropped that long after they arrive "
            "(docs/operations.md, Policies). Written as <code>kdn policy set</code> writes it, signed with this "
            "origin's key where it has one.</p>")
    return "".join(parts)


async def _text(app: web.Application, m: Manifest) -> list[tuple[str, int, int, str]] | None:
    """The manifest's tokens decoded by this origin's tokenizer, cut where the template's head and the emphasis
    map's spans begin and end: ``(kind, start, end, text)`` with kind ``head``, ``plain`` or ``marked``. None
    when the manifest is another model's (this tokenizer would decode its ids into the wrong text)."""
    loaded = app[LOADED]
    if m.model_id != loaded.model_id or not m.prefix_tokens:
        return None
    tokens = m.prefix_tokens[:MAX_TEXT_TOKENS]
    n = len(tokens)
    spans = list(EmphasisMap.from_dict(m.emphasis).spans) if m.emphasis else []
    cuts = sorted({0, n, min(m.head_tokens, n), *(min(x, n) for s in spans for x in s)})
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        if a < b:
            kind = ("head" if b <= m.head_tokens else
                    "marked" if any(s <= a and b <= t for s, t in spans) else "plain")
            pieces.append((kind, a, b))

    def decode() -> list[str]:
        return [str(loaded.tokenizer.decode(tokens[a:b])) for _, a, b in pieces]

    texts = await asyncio.get_running_loop().run_in_executor(app[TOKENIZER], decode)
    return [(kind, a, b, t) for (kind, a, b), t in zip(pieces, texts)]


def _text_section(m: Manifest, text: list[tuple[str, int, int, str]] | None) -> str:
    parts = ["<h2>Text and emphasis</h2>"]
    emap = EmphasisMap.from_dict(m.emphasis) if m.emphasis else None
    if emap is None:
        parts.append('<p class="note">No emphasis map: engines steer nothing on it.</p>')
    else:
        ranges = ", ".join(f"[{s}, {t})" for s, t in emap.spans)
        parts.append(f"<p>Emphasis map ({e(emap.source)}): {len(emap.spans)} spans, {emap.n_emphasized:,} tokens "
                     f"of the region [{emap.region[0]}, {emap.region[1]}); alpha {emap.alpha:g}"
                     f"{', on by default' if emap.default_on else ', when a request asks'}"
                     f"{f', {len(emap.heads)} heads' if emap.heads else ''}.</p>"
                     f'<p class="note spans">token ranges: {e(ranges) or "-"}</p>')
    if text is None:
        parts.append('<p class="note">The origin does not store the text, and this origin\'s model is not the '
                     "manifest's, so its tokens cannot be decoded here: the token ranges above are what there is.</p>")
        return "".join(parts)
    body = []
    for kind, a, b, t in text:
        if kind == "plain":
            body.append(e(t))
        else:
            body.append(f'<{"mark" if kind == "marked" else "span class=head"} title="tokens {a}-{b}">{e(t)}'
                        f'</{"mark" if kind == "marked" else "span"}>')
    cut = len(m.prefix_tokens) > MAX_TEXT_TOKENS
    parts.append('<pre class="text">' + "".join(body) + "</pre>"
                 + ('<p class="note">The template\'s head is grey; emphasized spans are marked. Decoded from the '
                    "manifest's tokens by this origin's tokenizer"
                    + (f"; the first {MAX_TEXT_TOKENS:,} tokens." if cut else ".") + "</p>"))
    return "".join(parts)


# --- forms ---------------------------------------------------------------------------------------------------


async def login(request: web.Request) -> web.Response:
    if not _same_site(request):
        return _error_page(None, 403, "a sign-in from another site")
    form = await _read_form(request)
    token = form.get("token", "")
    grants = request.app[GRANTS]
    if grants.empty:
        return _sign_in_page(request, 401, "this origin has no token file: nothing to sign in with")
    if not token or len(token) > 512:
        return _sign_in_page(request, 401, "give a token")
    from kdn.auth import AuthError

    try:
        grant = grants.lookup(f"Bearer {token}")
    except AuthError:
        grant = None
    if grant is None:
        return _sign_in_page(request, 401, "unknown token")
    sid, _ = request.app[SESSIONS].open(grant, token)
    log.info("console: signed in (%s on %s)", ",".join(sorted(grant.roles)), ",".join(sorted(grant.namespaces)))
    resp = _see_other(PREFIX)
    resp.set_cookie(COOKIE, sid, max_age=SESSION_SECONDS, path=PREFIX, httponly=True, samesite="Strict",
                    secure=request.secure)
    return resp


async def _posted(request: web.Request) -> tuple[Viewer, dict[str, str]] | web.Response:
    """A console POST that changes something: a session first (no body is read without one), then a same-site
    ``Origin``, then the form and its CSRF token."""
    viewer = _viewer(request)
    if viewer is None:
        return _sign_in_page(request)
    if viewer.open:
        return _error_page(viewer, 403, "an origin without a token file: the console is read-only")
    if not _same_site(request):
        return _error_page(viewer, 403, "a form posted from another site")
    form = await _read_form(request)
    if not hmac.compare_digest(form.get("csrf", "").encode(), viewer.csrf.encode()):
        return _error_page(viewer, 403, "this form is stale or not this console's: reload the page")
    return viewer, form


async def logout(request: web.Request) -> web.Response:
    got = await _posted(request)
    if isinstance(got, web.Response):
        return got
    request.app[SESSIONS].close(request.cookies.get(COOKIE))
    resp = _see_other(PREFIX)
    resp.del_cookie(COOKIE, path=PREFIX, httponly=True, samesite="Strict", secure=request.secure)
    return resp


def _default_name(kind: str, scope: str) -> str:
    """``kind.namespace.name`` (a manifest's) or ``kind.namespace``: for a push the name a publish's ``push``
    sets too, so a publish with ``"push": false`` ends it; a digest past 128 characters, as there."""
    from kdn.address import blob_digest

    full = f"{kind}.{scope.replace('/', '.')}"
    return full if len(full) <= 128 else f"{kind}." + blob_digest(full.encode())[:40]


async def policies(request: web.Request) -> web.Response:
    """Set (``op=set``) or remove (``op=delete``) a policy of a manifest or a namespace, as ``kdn policy set``
    and ``rm`` do; then back to the page the form was on."""
    got = await _posted(request)
    if isinstance(got, web.Response):
        return got
    viewer, form = got
    manifest, namespace = form.get("manifest") or None, form.get("namespace") or None
    try:
        if manifest is not None:
            ns, _, name = manifest.partition("/")
            ns, name = validate_namespace(ns), validate_name(name)
            back, scope_ns = _manifest_url(ns, name), ns
        elif namespace is not None:
            scope_ns = validate_namespace(namespace)
            back = f"{PREFIX}#ns-{quote(scope_ns)}"
        else:
            raise InvalidInput("a console policy names a manifest or a namespace")
    except InvalidInput as err:
        return _error_page(viewer, 400, str(err))
    op = form.get("op", "set")
    if op not in ("set", "delete"):
        return _error_page(viewer, 400, "op is set or delete", back)
    if not viewer.may_admin(scope_ns):
        return _error_page(viewer, 403, f"this token may not change policies of namespace {scope_ns}", back)
    reg = request.app[REGISTRY]
    signer = getattr(reg, "signer", None)
    try:
        if op == "set":
            done = await _set(reg, viewer, form, manifest, scope_ns, signer)
        else:
            done = await _remove(reg, viewer, form, signer)
    except PermissionError as err:
        return _error_page(viewer, 403, str(err), back)
    except LookupError as err:
        return _error_page(viewer, 404, str(err.args[0]), back)
    except InvalidInput as err:
        return _error_page(viewer, 400, str(err), back)
    log.info("console: %s", done)
    request.app[SESSIONS].flash(request.cookies.get(COOKIE), done)
    return _see_other(back)


async def _set(reg: Registry, viewer: Viewer, form: dict[str, str], manifest: str | None, scope_ns: str,
               signer: Any) -> str:
    from kdn.edge.policies import policy_from_options

    kind = form.get("kind", "")
    allowed = MANIFEST_KINDS if manifest is not None else NAMESPACE_KINDS
    if kind not in allowed:
        raise InvalidInput(f"kind must be one of {', '.join(allowed)}")
    scope = manifest if manifest is not None else scope_ns
    name = validate_name(form.get("name") or _default_name(kind, scope))
    options: dict[str, Any] = {"region": form.get("region") or None}
    if kind in ("pin", "warm", "push"):
        options[kind] = manifest
        if kind == "push":
            options.update(to=form.get("to") or None, rate=form.get("rate") or None)
    elif kind == "ttl":
        options.update(ttl=form.get("ttl", ""), manifest=manifest, namespace=None if manifest else scope_ns)
    else:
        options.update(quota=form.get("quota", ""), namespace=scope_ns)
    p = policy_from_options(name, **options)
    taken, old = await _policy_named(reg, name)
    if taken and not _may_edit(viewer, old):
        raise PermissionError(f"policy {name} exists and is about namespaces this token may not change")
    if signer is not None:
        p = signer.sign(p)
    await reg.put_policy(p)
    return f"policy {p.name} set: {p.kind}" + (f" in region {p.region}" if p.region else "")


async def _remove(reg: Registry, viewer: Viewer, form: dict[str, str], signer: Any) -> str:
    from kdn.edge.policies import remove_policy

    name = validate_name(form.get("name", ""))
    taken, old = await _policy_named(reg, name)
    if not taken:
        raise LookupError(f"no policy named {name}")
    if not _may_edit(viewer, old):
        raise PermissionError(f"policy {name} is about namespaces this token may not change")
    done = await remove_policy(reg, name, signer)
    if not done.done:
        raise LookupError(done.message.removeprefix("kdn: "))
    return done.message


def _routes() -> Iterable[web.AbstractRouteDef]:
    return [web.get(PREFIX, index), web.post(f"{PREFIX}/login", login), web.post(f"{PREFIX}/logout", logout),
            web.get(PREFIX + "/manifests/{namespace}/{name}", manifest_page), web.post(f"{PREFIX}/policies", policies)]


def add_routes(app: web.Application) -> None:
    """Mount the console on an origin's app (``create_app`` does)."""
    app[SESSIONS] = Sessions()
    app.router.add_routes(_routes())
