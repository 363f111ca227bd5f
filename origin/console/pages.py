"""The console's HTML: the frame every page shares (its one script and style, allowed by hash in a strict
Content-Security-Policy), ``e()`` that every shown value goes through, the sign-in and error pages, and URLs.
"""

from __future__ import annotations

import base64
import hashlib
import html
from urllib.parse import quote

from aiohttp import web

from kdn.origin.console.sessions import PREFIX, Viewer
from kdn.service import GRANTS

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


def page(title: str, body: str, *, viewer: Viewer | None = None, status: int = 200) -> web.Response:
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


def sign_in_page(request: web.Request, status: int = 401, message: str | None = None) -> web.Response:
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
    return page("Sign in", body, status=status)


def error_page(viewer: Viewer | None, status: int, message: str, back: str = PREFIX) -> web.Response:
    return page("Not done", f'<p class="err">{e(message)}</p><p><a href="{e(back)}">Back</a></p>',
                 viewer=viewer, status=status)


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})


def manifest_url(namespace: str, name: str) -> str:
    return f"{PREFIX}/manifests/{quote(namespace, safe='')}/{quote(name, safe='')}"
