"""The console's credential (#51 item 1): a manifest's page asks edges what they hold with the origin's own probe
token, never with the signed-in viewer's, and with ``--require-admission`` asks no unadmitted node at all.

The attack: a registry writer adds an edge record pointing at a listener of its own on 127.0.0.2 (loopback, so
inside the default ``--token-hosts``). Before the fix, every manifest page an operator opened sent that listener
the operator's ``admin *`` token (four times a page), which then published into a tenant and signed in to the
console. Real etcd, a real origin and edge, a real rogue HTTP server on 127.0.0.2.
"""

from __future__ import annotations

import json
import time

import aiohttp
import pytest
from aiohttp import web
from edge_helpers import EDGE_TOKEN, PUBLISH, TENANT_A, cluster, get, publish

from kdn.registry import Admission, NodeRecord
from kdn.service import REGISTRY
from kdn.registry.signing import Signer
from ports import free_port  # bench/lib/ports.py

TEXT = ("The ferry timetable changes with the tide; the winter schedule starts in November. " * 12)[:900]


class Rogue:
    """An HTTP listener on 127.0.0.2 that records the Authorization header of every request and answers like an
    edge that holds everything (so a console would keep asking it)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _any(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path, request.headers.get("Authorization")))
        if request.path == "/metrics":
            return web.Response(text='kdn_edge_hits_total{tier="memory"} 5\n')
        return web.Response(headers={"X-KDN-Source": "memory", "Content-Length": "0"})

    async def __aenter__(self) -> Rogue:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.2", 0)  # (bound at once, in this process: port 0 is safe)
        await site.start()
        self.url = f"http://127.0.0.2:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def tokens(self) -> set[str | None]:
        return {auth for _, _, auth in self.seen}


async def view_manifest(origin_url: str, token: str, path: str = "/console/manifests/public/doc") -> str:
    """Sign in to the console with ``token`` (as a browser would: the form, then the cookie) and open ``path``."""
    jar = aiohttp.CookieJar(unsafe=True)  # (cookies for an IP host)
    async with aiohttp.ClientSession(origin_url, cookie_jar=jar) as s:
        async with s.post("/console/login", data={"token": token}, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        async with s.get(path) as r:
            assert r.status == 200, await r.text()
            return await r.text()


async def plant(c, rogue: Rogue, region: str = "eu") -> None:
    """A registry writer's edge record for the rogue, beside the real edges of ``region``."""
    rec = NodeRecord(role="edge", region=region, node_id="zz-rogue", url=rogue.url)
    await c.origin.app[REGISTRY].register_node(rec, ttl=30)


async def test_the_console_never_sends_a_viewers_admin_token_to_an_edge_record(tmp_path, etcd_url):
    (tmp_path / "probe-token").write_text(EDGE_TOKEN + "\n")
    async with Rogue() as rogue, cluster(tmp_path, etcd_url, edges=("e1",),
                                         origin_kw={"probe_token_file": str(tmp_path / "probe-token")}) as c:
        await publish(c, TEXT, name="doc")
        await publish(c, TEXT, name="plan", namespace="acme", token=TENANT_A)
        await plant(c, rogue, region="xx")  # a region of its own: it owns every chunk there
        await view_manifest(c.origin_url(), PUBLISH)
        await view_manifest(c.origin_url(), TENANT_A, "/console/manifests/acme/plan")
        assert rogue.seen, "the console asked no edge record at all: the test proves nothing"
        # Only the origin's probe token (read *, granted at the edges), never the viewer's admin * token.
        assert PUBLISH not in str(rogue.tokens()) and TENANT_A not in str(rogue.tokens()), rogue.seen
        assert rogue.tokens() <= {f"Bearer {EDGE_TOKEN}", None}, rogue.seen


async def test_without_a_probe_token_the_console_asks_no_edge_and_says_unknown(tmp_path, etcd_url):
    async with Rogue() as rogue, cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT, name="doc")
        status, _, _ = await get(c.edge_url("e1"), m["addresses"][0])  # e1 holds chunk 0 now
        assert status == 200
        await plant(c, rogue, region="xx")
        page = await view_manifest(c.origin_url(), PUBLISH)
        heads = [s for s in rogue.seen if s[0] == "HEAD"]
        assert heads == [], heads
        assert "unknown (no --probe-token-file)" in page
        assert all(auth is None for _, _, auth in rogue.seen), rogue.seen  # (its /metrics, without a token)


async def test_with_require_admission_an_unadmitted_edge_record_is_never_asked(tmp_path, etcd_url):
    op = Signer.generate(tmp_path / "op.key")
    (tmp_path / "op.pub").write_text(op.public + "\n")
    (tmp_path / "probe-token").write_text(EDGE_TOKEN + "\n")
    port = free_port()
    adm = op.sign(Admission("edge", "eu", "e1", f"http://127.0.0.1:{port}", time.time() + 3600))
    (tmp_path / "e1.adm").write_text(json.dumps(adm.to_dict()))
    origin_kw = {"probe_token_file": str(tmp_path / "probe-token"), "operator_keys": str(tmp_path / "op.pub"),
                 "require_admission": True}
    async with Rogue() as rogue, cluster(tmp_path, etcd_url, edges=(), origin_kw=origin_kw) as c:
        await c.start_edge("e1", "eu", port=port, admission=str(tmp_path / "e1.adm"))
        await c.wait_ring(["e1"], "eu")
        m = await publish(c, TEXT, name="doc")
        status, _, _ = await get(c.edge_url("e1"), m["addresses"][0])
        assert status == 200
        await plant(c, rogue, region="eu")
        await plant(c, rogue, region="xx")
        page = await view_manifest(c.origin_url(), PUBLISH)
        # Not a HEAD, not a /metrics scrape. (e1 runs without --require-admission here, so it may ask the planted
        # record as its peer: that is the edge's own choice, tested in tests/edge/test_admission.py.)
        console = [s for s in rogue.seen if s[0] == "HEAD" or s[1] == "/metrics"]
        assert console == [], console
        assert 'data-region="eu"' in page and 'data-region="xx"' not in page
        # The admitted edge was asked, and told (it holds chunk 0, read above in whatever encoding it chose).
        assert "memory" in page.split('data-region="eu"', 1)[1].split("</tr>", 1)[0]


@pytest.mark.parametrize("sample", ["+Inf", "NaN", "-5", "1e300"])
async def test_one_edges_junk_metrics_sample_costs_nothing_but_its_value(tmp_path, etcd_url, sample):
    """#51 item 8: an edge's /metrics sample of +Inf or NaN made every console manifest page a 500."""

    class Junk(Rogue):
        async def _any(self, request):
            self.seen.append((request.method, request.path, request.headers.get("Authorization")))
            if request.path == "/metrics":
                return web.Response(text=f'kdn_edge_hits_total{{tier="memory"}} {sample}\n'
                                         'kdn_edge_hits_total{tier="disk"} 7\n')
            return web.Response(status=404)

    async with Junk() as rogue, cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        await publish(c, TEXT, name="doc")
        await plant(c, rogue, region="xx")
        page = await view_manifest(c.origin_url(), PUBLISH)
        assert any(p == "/metrics" for _, p, _ in rogue.seen)
        row = page.split('<h2>Reads at the edges', 1)[1].split('data-region="xx"', 1)[1].split("</tr>", 1)[0]
        assert '<td class="n">7</td>' in row and "inf" not in row.lower() and "nan" not in row.lower(), row


async def test_chunks_readers_took_raw_show_as_cached(tmp_path, etcd_url):
    """#51 item 13: after `kdn up`'s demo read every chunk raw from the eu edges (a reader on a fast link takes
    ``raw``), the page said "0 of 11": it asked the owners for the lossless preference (``zstd``) only."""
    (tmp_path / "probe-token").write_text(EDGE_TOKEN + "\n")
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2"),
                       origin_kw={"probe_token_file": str(tmp_path / "probe-token")}) as c:
        m = await publish(c, TEXT * 3, name="doc", encodings=["zstd", "raw"])
        n = len(m["addresses"])
        assert n >= 2
        for a in m["addresses"]:
            status, _, headers = await get(c.edge_url("e1"), a, encoding="raw")
            assert status == 200 and headers["X-KDN-Encoding"] == "raw"
        page = await view_manifest(c.origin_url(), PUBLISH)
        row = page.split("<h2>Where it is cached", 1)[1].split('data-region="eu"', 1)[1].split("</tr>", 1)[0]
        assert f'<td class="held">{n} of {n}</td>' in row, row
