"""``GET /console``: what is published, by namespace, with the bytes it takes in this origin's store and the
policies that apply to it (and, for an admin of the namespace, a form for the namespace's own policies).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from aiohttp import web

from kdn.auth import ANY, covers
from kdn.origin.config import LOADED, STORE
from kdn.origin.console.pages import e, manifest_url, page, sign_in_page
from kdn.origin.console.policies import (FLEET_KINDS, NAMESPACE_KINDS, applies, fleet_admin, policy_badge, read_policies,
                                         scopes_of)
from kdn.origin.console.sessions import COOKIE, PREFIX, SESSIONS, Viewer, viewer_of
from kdn.registry import Manifest, Registry
from kdn.registry.split import RecordsBeside
from kdn.service import REGISTRY
from kdn.units import format_size

MAX_LISTED = 500  # manifests on the listing (the rest are counted, not read)


async def listed_manifests(reg: Registry, reads: frozenset[str]) -> tuple[list[Manifest], int]:
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


def stored_sizes(app: web.Application, m: Manifest) -> dict[str, int]:
    """Bytes this origin's store holds for the manifest's objects, per encoding (an object another manifest
    shares is counted in each)."""
    sizes: dict[str, int] = {}
    store = app[STORE]
    for a in dict.fromkeys([*m.addresses, *m.standalone]):
        for enc, info in store.encodings(a).items():
            sizes[enc] = sizes.get(enc, 0) + info.size
    return sizes


async def index(request: web.Request) -> web.Response:
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_page(request)
    app = request.app
    reg = app[REGISTRY]
    manifests, more = await listed_manifests(reg, viewer.reads)
    policies = await read_policies(reg)
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
        fleet = [p for p in policies if not scopes_of(p)]
        if fleet:
            parts.append("<p>Policies for every namespace: " + "".join(policy_badge(p) for p in fleet) + "</p>")
    for ns, items in by_ns.items():
        ns_policies = [p for p in policies if p.kind in NAMESPACE_KINDS and p.namespace == ns and p.manifest is None]
        parts.append(f'<h2 id="ns-{e(ns)}">namespace {e(ns)}</h2>')
        if ns_policies:
            parts.append("<p>Namespace policies: " + "".join(policy_badge(p) for p in ns_policies) + "</p>")
        rows = []
        for m in items:
            sizes = stored_sizes(app, m)
            chunks = len(m.addresses) if m.body is None else math.ceil(m.tokens / m.chunk_tokens)
            model = (loaded.name if m.model_id == loaded.model_id else m.model_id[:16] + "...")
            stored = (format_size(sum(sizes.values())) + " (" + ", ".join(f"{k} {format_size(v)}" for k, v in
                                                                           sorted(sizes.items())) + ")"
                      if sizes else "not in this origin's store" if m.body is None else "-")
            pols = "".join(policy_badge(p) for p in policies if applies(p, m.namespace, m.name))
            rows.append(f'<tr data-manifest="{e(m.namespace)}/{e(m.name)}">'
                        f'<td><a href="{e(manifest_url(m.namespace, m.name))}">{e(m.name)}</a></td>'
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
    return page("Published knowledge", "".join(parts), viewer=viewer)


def _namespace_form(viewer: Viewer, ns: str) -> str:
    return (f'<form class="row" method="post" action="{PREFIX}/policies" data-policy>'
            f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
            f'<input type="hidden" name="op" value="set"><input type="hidden" name="namespace" value="{e(ns)}">'
            f'<label>namespace policy<select name="kind">'
            + "".join(f'<option value="{k}">{k}</option>' for k in NAMESPACE_KINDS
                      if k not in FLEET_KINDS or fleet_admin(viewer)) + "</select></label>"
            '<label data-kinds="quota">bytes per tier<input name="quota" placeholder="5GiB"></label>'
            '<label data-kinds="ttl">entries may go after<input name="ttl" placeholder="2h"></label>'
            '<label>region (empty: every region)<input name="region"></label>'
            '<label>policy name (empty: kind.namespace)<input name="name"></label>'
            "<button>Set</button></form>")
