"""A manifest's console page: what it is, where it is cached and what the edges read (edges.py), its own reads
and what they saved (saved.py), the policies that apply to it with a form to set and remove them, and its text
with its emphasis map marked.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from kdn.format.address import validate_name, validate_namespace
from kdn.auth import covers
from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput
from kdn.origin.config import LOADED, SPEED, TOKENIZER
from kdn.origin.console.edges import edge_reads, reads_table, regions_table, where_cached
from kdn.origin.console.listing import stored_sizes
from kdn.origin.console.pages import e, error_page, page, sign_in_page
from kdn.origin.console.policies import MANIFEST_KINDS, applies, may_edit, read_policies
from kdn.origin.console.saved import savings_table
from kdn.origin.console.sessions import COOKIE, PREFIX, SESSIONS, Viewer, viewer_of
from kdn.registry import Manifest, Policy
from kdn.service import REGISTRY
from kdn.units import format_size

MAX_TEXT_TOKENS = 65536  # tokens of a manifest decoded onto its page


async def manifest_page(request: web.Request) -> web.Response:
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_page(request)
    try:
        ns = validate_namespace(request.match_info["namespace"])
        name = validate_name(request.match_info["name"])
    except InvalidInput as err:
        return error_page(viewer, 400, str(err))
    app = request.app
    m = await app[REGISTRY].get_manifest(ns, name) if covers(viewer.reads, ns) else None
    if m is None or m.deleted:
        return error_page(viewer, 404, f"no manifest {ns}/{name} that this token reads")
    policies = [p for p in await read_policies(app[REGISTRY]) if applies(p, ns, name)]
    regions, hits, text = await asyncio.gather(where_cached(app, m), edge_reads(app), _text(app, m))
    sizes = stored_sizes(app, m)
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
    parts.append(regions_table(regions, len(m.addresses)))
    # This origin's prefill shape and speed apply to its own model's manifests only.
    parts.append(savings_table(regions, m, app.get(SPEED) if m.model_id == loaded.model_id else None))
    parts.append(reads_table(hits))
    parts.append(_policies_section(viewer, ns, name, policies))
    parts.append(_text_section(m, text))
    return page(f"{ns}/{name}", "".join(parts), viewer=viewer)


def _policies_section(viewer: Viewer, ns: str, name: str, policies: list[Policy]) -> str:
    from kdn.registry.policy_records import policy_row  # the columns `kdn policy ls` prints

    parts = ["<h2>Policies</h2>"]
    if policies:
        rows = []
        for p in policies:
            _, kind, region, scope, when, setting = policy_row(p)
            remove = ""
            if may_edit(viewer, p):
                remove = (f'<form class="inline" method="post" action="{PREFIX}/policies">'
                          f'<input type="hidden" name="csrf" value="{e(viewer.csrf)}">'
                          '<input type="hidden" name="op" value="delete">'
                          f'<input type="hidden" name="name" value="{e(p.name)}">'
                          f'<input type="hidden" name="manifest" value="{e(ns)}/{e(name)}">'
                          "<button>Remove</button></form>")
            rows.append(f'<tr data-policy="{e(p.name)}"><td>{e(p.name)}</td><td>{e(kind)}</td><td>{e(region)}</td>'
                        f'<td>{e(scope)}</td><td class="schedule">{e(when)}</td><td>{e(setting)}</td>'
                        f"<td>{remove}</td></tr>")
        parts.append("<table><thead><tr><th>name</th><th>kind</th><th>region</th><th>scope</th><th>schedule</th>"
                     "<th>setting</th><th></th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
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
            '<label data-kinds="pin warm push">at (empty: always)<input name="at" placeholder="0 8 * * 1-5"></label>'
            '<label data-kinds="pin warm push">time zone<input name="tz" placeholder="Europe/Berlin"></label>'
            '<label data-kinds="pin warm push">for<input name="for" placeholder="2h"></label>'
            '<label>policy name (empty: kind.namespace.name)<input name="name"></label>'
            "<button>Set</button></form>"
            '<p class="note">pin: never evicted; warm: each edge fetches what it owns now; push: sent to those '
            "regions ahead of their readers; ttl: entries may be dropped that long after they arrive. "
            "With at (minute hour day-of-month month day-of-week), a time zone and for: a pin holds only in "
            "those windows, a warm or push fills ahead of each and holds it until the window ends "
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
