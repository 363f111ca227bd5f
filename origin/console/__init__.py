"""The operator console (issue #30): a web page on the origin that lists published knowledge and steers it.

The people who know which knowledge is hot are often not the ones at a shell. ``GET /console`` lists what is
published, by namespace: each manifest's model, chunks, tokens, the bytes its objects take in this origin's
store, and the policies that apply to it. A manifest's page adds where it is cached now (each region's owner
edge of each chunk, asked with a HEAD, which never fills: the check ``kdn registry show ADDRESS`` makes), its
own reads there by tier (each edge counts the reads of each object it caches, and tells them on that HEAD) with
the tokens they served and the prefill compute and time they saved, the reads each region's edges served by tier
(their ``/metrics``: all objects), its text with the
emphasis map marked over it, and forms that set and remove its pin, warm, push and TTL policies, through the
same function as ``kdn policy set`` (``kdn.registry.policy_records.policy_from_options``).

Why this shape: server-rendered HTML from the origin's own aiohttp app, plain string templates with
``html.escape`` on every value, and one small inline script (it shows the fields the chosen policy kind takes).
No template engine or front-end framework to keep current, no build step, nothing from a CDN (it works offline
and on an air-gapped network), and a page is what the registry, the store and the edges say when it is asked.
A strict Content-Security-Policy allows that one script and style by their hashes, and nothing else.

Sign-in. A browser cannot put a bearer token on a navigation, so a token from the origin's token file is posted
once to a form; the origin answers with a cookie holding a random session id (HttpOnly, SameSite=Strict, Secure
over TLS, path ``/console``) and keeps ``session -> grant`` in memory: at most ``MAX_SESSIONS_PER_TOKEN`` per token (that token's
oldest goes first) and ``MAX_SESSIONS`` in all, each for ``SESSION_SECONDS`` after sign-in; sign-ins are limited
per address (``SignIns``). A form that changes something carries the session's CSRF
token, and a POST whose ``Origin`` is another site is refused. A grant that reads a namespace sees its manifests;
``admin`` there may set and remove the policies of its manifests (a quota or an upper tier only ``admin *``); any other POST is a 403. Without a session a
page is a 401 with the sign-in form and nothing else. An origin without a token file has no token to sign in
with: its console shows what an anonymous API caller reads (``public``), read-only.

One module per concern: ``sessions.py`` (who is looking: sessions, the request's viewer, bounded form reads),
``pages.py`` (the HTML frame, its script, style and headers, the sign-in and error pages), ``policies.py`` (the
policies a page shows and who may change them), ``listing.py`` (``GET /console``), ``manifest.py`` (a manifest's
page) over ``edges.py`` (what the edges say: where it is cached, reads by tier) and ``saved.py`` (its reads and
what they saved), and ``forms.py`` (sign-in,
sign-out, setting and removing policies).
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

# The modules, not their handlers: a handler named `policies` here would hide the module policies.py.
from kdn.origin.console import forms, listing, manifest
from kdn.origin.console.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_TOKEN, PREFIX, SESSION_SECONDS, SESSIONS, Sessions, SignIns

__all__ = ["MAX_SESSIONS", "MAX_SESSIONS_PER_TOKEN", "PREFIX", "SESSIONS", "SESSION_SECONDS", "Sessions", "SignIns", "add_routes",
           "routes"]


def routes() -> Iterable[web.AbstractRouteDef]:
    """The console's pages and forms, under ``PREFIX``."""
    return [web.get(PREFIX, listing.index), web.post(f"{PREFIX}/login", forms.login),
            web.post(f"{PREFIX}/logout", forms.logout),
            web.get(PREFIX + "/manifests/{namespace}/{name}", manifest.manifest_page),
            web.post(f"{PREFIX}/policies", forms.policies)]


def add_routes(app: web.Application) -> None:
    """Mount the console on an origin's app (``create_app`` does)."""
    app[SESSIONS] = Sessions()
    app.router.add_routes(routes())
