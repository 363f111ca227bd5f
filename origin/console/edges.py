"""What the edges say about a manifest, for its console page: where each region's owner edges hold its chunks now
(asked with a HEAD, as ``kdn registry show ADDRESS`` asks: kdn/client/holding.py, which also answers the reads the edge
answered from its copy of each chunk: saved.py sums them), and the reads each region's edges served by tier (their
``/metrics``: all objects). Bounded in edges, bytes and time: a page never waits on an edge past ``EDGE_SECONDS``.

Which credential: the origin's own probe token (``--probe-token-file``, granted ``read *`` at the edges and nothing
at the origin), sent only to ``--token-hosts``, and only to admitted edges where ``--require-admission`` is set
(the others are left out and their regions show as unknown). A signed-in viewer's token never leaves the origin:
the console does not keep it (sessions.py). Edge URLs come from the registry, which a writer can fill with any host.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import aiohttp
from aiohttp import web

from kdn.format.address import Address
from kdn.origin.config import CONFIG, STORE
from kdn.origin.console.pages import e
from kdn.registry import Manifest, NodeRecord
from kdn.service import REGISTRY
from kdn.units import format_size

log = logging.getLogger("kdn.origin.console")

MAX_CHECKED = 32  # chunks whose owner edges a manifest's page asks (HEAD), from the first
EDGE_SECONDS = 5.0  # the most a manifest's page waits for the edges (HEADs and /metrics)
MAX_EDGES = 64  # edges whose /metrics a manifest's page reads
MAX_METRICS_BYTES = 4 << 20
MAX_SAMPLE = 1e15  # a counter past this (or negative, NaN, infinite) is junk from the network, not a count


def probe_token(app: web.Application) -> str | None:
    """The origin's probe token (``--probe-token-file``, read on each page: a rotated token is used at once), or
    None: the console then asks no edge."""
    path = app[CONFIG].probe_token_file
    if not path:
        return None
    from kdn.auth import read_token

    return read_token(path)


async def trusted_edges(app: web.Application) -> list[NodeRecord]:
    """The live edge records the console may ask: all of them, or with ``--require-admission`` the admitted ones
    (kdn.registry.signing.unadmitted; the others are logged once a page and left out)."""
    nodes = await app[REGISTRY].list_nodes(role="edge")
    operators = app[CONFIG].admitters()
    if operators is None:
        return nodes
    from kdn.registry.signing import unadmitted

    if hasattr(operators, "refresh"):
        operators.refresh()  # an operator's revocation list, read again when it changed
    kept = []
    for n in nodes:
        why = unadmitted(n, operators)
        if why is None:
            kept.append(n)
        else:
            log.info("console: edge %s/%s at %s left out: %s", n.region, n.node_id, n.url[:80], why)
    return kept


async def where_cached(app: web.Application, m: Manifest) -> dict[str, dict[str, Any]] | None:
    """Per region: how many of the manifest's first ``MAX_CHECKED`` chunks their owner edge holds now, asked as
    ``kdn registry show ADDRESS`` asks (a HEAD, which never fills, for each encoding the origin stores until one
    is held), with the origin's probe token (module docstring), and the reads those edges answered from their
    copies (``reads`` by tier; ``chunk_reads``: chunk index -> reads, for saved.py). Without a probe token no
    edge is asked: every region's chunks are unknown. None: the edges took longer than ``EDGE_SECONDS``."""
    from kdn.client.holding import by_region, regions_holding  # the check `kdn registry show ADDRESS` makes

    cfg, store = app[CONFIG], app[STORE]
    edges = await trusted_edges(app)
    token = probe_token(app)
    addresses = m.addresses[:MAX_CHECKED]
    if token is None:
        return {region: {"first": "unknown (no --probe-token-file)", "owner": "-", "held": 0,
                         "unknown": len(addresses), "checked": len(addresses), "reads": {}, "chunk_reads": {}}
                for region in by_region(edges)}
    gate = asyncio.Semaphore(8)

    async def one(address: Address) -> dict[str, dict[str, Any]]:
        async with gate:
            held = sorted(store.encodings(address))  # (raw before zstd: what readers on a fast link take)
            return await regions_holding(edges, address, token, cfg.token_hosts, held)

    try:
        async with asyncio.timeout(EDGE_SECONDS):
            per = await asyncio.gather(*(one(a) for a in addresses))
    except TimeoutError:
        return None
    out: dict[str, dict[str, Any]] = {}
    for i, regions in enumerate(per):
        for region, r in regions.items():
            row = out.setdefault(region, {"first": None, "owner": None, "held": 0, "unknown": 0, "checked": 0,
                                          "reads": {}, "chunk_reads": {}})
            if i == 0:
                row["first"], row["owner"] = r["holds"], r["owner"]
            row["checked"] += 1
            row["held"] += r["holds"] in ("memory", "disk")
            row["unknown"] += r["holds"].startswith("unknown")
            for tier, n in r.get("reads", {}).items():  # (parse_reads: known tiers, bounded counts)
                row["reads"][tier] = row["reads"].get(tier, 0) + n
            if r.get("reads"):
                row["chunk_reads"][i] = sum(r["reads"].values())
    return out


def regions_table(regions: dict[str, dict[str, Any]] | None, chunks: int) -> str:
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
    if any(r["unknown"] for r in regions.values()):
        note += (" An edge tells what it holds only to a token that reads every namespace: the origin asks with its "
                 "own probe token (--probe-token-file), only where --token-hosts allows and, with "
                 "--require-admission, only admitted edges.")
    return (head + "<table><thead><tr><th>region</th><th>owner of chunk 0</th><th>chunk 0</th>"
            "<th>chunks their owner edge holds</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
            f'<p class="note">Each chunk\'s owner edge on its region\'s ring, asked with a HEAD (which never '
            f"fills).{e(note)}</p>")


async def edge_reads(app: web.Application) -> dict[str, dict[str, Any]]:
    """Per region, summed over its live edges' ``/metrics`` (read without a token, ``EDGE_SECONDS`` at most):
    reads served by tier, reads no tier held, bytes filled by source. All objects: an edge counts no manifest."""
    nodes = sorted(await trusted_edges(app), key=lambda n: (n.region, n.node_id))[:MAX_EDGES]
    out: dict[str, dict[str, Any]] = {}
    if not nodes:
        return out
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=EDGE_SECONDS)) as session:
        scraped = await asyncio.gather(*(_scrape(session, n) for n in nodes), return_exceptions=True)
    for node, samples in zip(nodes, scraped):
        row = out.setdefault(node.region, {"edges": 0, "answered": 0, "hits": {}, "misses": {}, "filled": {}})
        row["edges"] += 1
        if isinstance(samples, BaseException):  # one edge's fault costs its own row only, never the page
            if not isinstance(samples, Exception):
                raise samples
            log.info("console: /metrics of edge %s: %s", node.node_id, type(samples).__name__)
            continue
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
            body = bytearray()
            async for piece in r.content.iter_chunked(64 << 10):  # (one read() returns only the first chunk)
                body += piece
                if len(body) > MAX_METRICS_BYTES:
                    log.info("console: /metrics of edge %s is over %d bytes: ignored", node.node_id,
                             MAX_METRICS_BYTES)
                    return None
        text = bytes(body).decode("utf-8", "replace")
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in _SAMPLES:
                    value = float(s.value)
                    if not (math.isfinite(value) and 0 <= value <= MAX_SAMPLE):
                        continue  # +Inf, NaN, a negative or huge count: junk, left out
                    metric, label = _SAMPLES[s.name]
                    key = (metric, s.labels.get(label, "")[:64])
                    if key not in out and len(out) >= 64:
                        continue  # a bounded set of labels per edge
                    out[key] = min(out.get(key, 0.0) + value, MAX_SAMPLE)
        return out
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        log.info("console: /metrics of edge %s at %s: %s", node.node_id, node.url, type(err).__name__)
        return None


def reads_table(regions: dict[str, dict[str, Any]]) -> str:
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
            "this page and <code>kdn registry show</code> send count too. Every object each edge served, not this "
            "manifest's: its own reads are in the table above.</p>")
