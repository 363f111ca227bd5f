"""The operator console (#30, origin/console/) in a real headless Chromium, driven by Playwright.

One etcd, an origin and two edges (eu, us) on loopback, two published documents (one with an emphasis map, one a
tenant's), and Debian's Chromium (/usr/bin/chromium; Playwright downloads nothing when given its path). Every page
loads from 127.0.0.1 only: each browser context refuses and records any other host, and a test fails if one was
asked (the console works offline). Checked: an unsigned visitor gets the sign-in form and nothing else, and cannot
POST; an admin sees the listing with its sizes and the text with its emphasis; a read token sees but cannot edit
(no form, and a crafted POST is a 403); a policy set through the console's form takes effect at an edge; a
manifest's reads through an edge show on its page with the tokens they served and the compute and time they saved,
to an admin and a read token; and a screenshot of the listing (``KDN_CONSOLE_SCREENSHOT=1`` writes docs/img/console.png).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
from edge_helpers import EDGE_TOKEN, PUBLISH, TENANT_A, cluster, get, publish, wait_until

from kdn.origin.app import STORE
from kdn.units import format_size

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"  # Debian's (apt-get install chromium; scripts/setup)
# No sandbox (CI runs as root), no GPU, and nothing that reaches out on its own: this machine has no network.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
MARKED = "the winter schedule starts in November"
TEXT = (f"The ferry timetable changes with the tide; {MARKED}. Tickets are sold at the pier office, which "
        "opens at six. " * 8)[:900]
TENANT_TEXT = "Acme's plan for the quarter: ship the harbor sensors, then the tide gauges. " * 4


@dataclass
class Env:
    c: Any  # edge_helpers.Cluster
    browser: Any  # playwright Browser
    harbor: dict  # the public manifest (with an emphasis map)
    plan: dict  # the tenant's (namespace acme)
    elsewhere: list[str] = field(default_factory=list)  # URLs of any other host a page asked for


@contextlib.asynccontextmanager
async def chromium():
    """Debian's Chromium under Playwright. A missing browser or library fails the test with the fix, never a skip:
    CI installs both (scripts/setup)."""
    try:
        from playwright.async_api import Error, async_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[dev]' (scripts/setup installs it)", pytrace=False)
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (scripts/setup installs it)", pytrace=False)
    async with async_playwright() as p:
        try:
            # Playwright gives it a fresh temporary profile (--user-data-dir) and removes it on close.
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS, timeout=60_000)
        except Error as err:
            pytest.fail(f"Chromium ({CHROMIUM}) did not start under Playwright: {str(err)[:600]}", pytrace=False)
        try:
            yield browser
        finally:
            await browser.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory, etcd_server):
    registry = f"{etcd_server.replace('http://', 'etcd://')}/console-{secrets.token_hex(4)}/"
    tmp = tmp_path_factory.mktemp("console")
    (tmp / "probe-token").write_text(EDGE_TOKEN + "\n")  # the origin's own token for asking edges (read * there)
    async with cluster(tmp, registry, edges=(), origin_kw={"probe_token_file": str(tmp / "probe-token")}) as c:
        await c.start_edge("e1", "eu")
        await c.start_edge("u1", "us")
        await c.wait_ring(["e1"], "eu")
        await c.wait_ring(["u1"], "us")
        harbor = await publish(c, TEXT, name="harbor", emphasis={"texts": [MARKED]})
        plan = await publish(c, TENANT_TEXT, name="plan", namespace="acme", token=TENANT_A)
        async with chromium() as browser:
            e = Env(c, browser, harbor, plan)
            yield e
            assert not e.elsewhere, f"pages asked hosts other than 127.0.0.1: {e.elsewhere}"


async def context(env: Env):
    """A browser context (its own cookies) whose every request must be for 127.0.0.1, and whose pages log no error
    (a script or style the Content-Security-Policy refused would)."""
    ctx = await env.browser.new_context(base_url=env.c.origin_url())
    ctx.set_default_timeout(15_000)
    errors: list[str] = []

    async def guard(route):
        if urlsplit(route.request.url).hostname != "127.0.0.1":
            env.elsewhere.append(route.request.url)
            await route.abort()
        else:
            await route.continue_()

    await ctx.route("**/*", guard)
    # (a 401 or 403 page is logged as a failed load: an answer, not an error of the page)
    ctx.on("page", lambda page: page.on("console", lambda m: m.type == "error" and "Failed to load resource"
                                        not in m.text and errors.append(m.text)))
    ctx.errors = errors
    return ctx


async def sign_in(ctx, token: str):
    page = await ctx.new_page()
    resp = await page.goto("/console")
    assert resp.status == 401
    await page.fill("input[name=token]", token)
    async with page.expect_navigation():
        await page.click("form[action='/console/login'] button")
    assert urlsplit(page.url).path == "/console"
    return page


async def policy_names(env: Env) -> set[str]:
    """The policies in the registry now (the origin's own handle on it)."""
    from kdn.registry.policy_records import is_tombstone
    from kdn.registry import Policy
    from kdn.service import REGISTRY

    reg = env.c.origin.app[REGISTRY]
    return {k.removeprefix("policies/") for k, v in await reg.list_keys("policies/")
            if not is_tombstone(Policy.unpack(v))}


def stored_bytes(env: Env, m: dict) -> int:
    store = env.c.origin.app[STORE]
    return sum(i.size for a in dict.fromkeys(m["addresses"] + m["standalone"]) for i in store.encodings(a).values())


async def test_an_unsigned_visitor_gets_the_sign_in_form_and_cannot_post(env):
    ctx = await context(env)
    try:
        page = await ctx.new_page()
        for path in ("/console", "/console/manifests/public/harbor", "/console/manifests/acme/plan"):
            resp = await page.goto(path)
            assert resp.status == 401, path
            assert await page.locator("input[name=token]").count() == 1
            body = await page.inner_text("main")
            assert "harbor" not in body and "plan" not in body and "ferry" not in body, body  # nothing listed
            assert await page.locator("table").count() == 0
        # A made-up token: the form again, 401, and still no cookie.
        await page.fill("input[name=token]", "z" * 32)
        async with page.expect_navigation():
            await page.click("form[action='/console/login'] button")
        assert "unknown token" in await page.inner_text("main")
        assert not [c for c in await ctx.cookies() if c["name"] == "kdn_console"]

        before = await policy_names(env)
        form = {"op": "set", "kind": "pin", "manifest": "public/harbor", "csrf": "x" * 43}
        # No cookie, then a forged one: 401 (the body is not even read), nothing written.
        for cookie in (None, "forged-" + secrets.token_urlsafe(32)):
            headers = {"Cookie": f"kdn_console={cookie}"} if cookie else {}
            r = await ctx.request.post("/console/policies", form=form, headers=headers, max_redirects=0)
            assert r.status == 401, (cookie, r.status)
        assert await policy_names(env) == before

        # A real admin session, but the form without its CSRF token, with another's, or from another site: 403.
        admin = await sign_in(ctx, PUBLISH)
        csrf = await admin.locator("input[name=csrf]").first.get_attribute("value")
        other = await context(env)
        try:
            other_csrf = await (await sign_in(other, PUBLISH)).locator("input[name=csrf]").first.get_attribute("value")
        finally:
            await other.close()
        for fields, headers in (({}, {}), ({"csrf": other_csrf}, {}),
                                ({"csrf": csrf}, {"Origin": "http://elsewhere.example"})):
            r = await ctx.request.post("/console/policies", form={**form, **fields}, headers=headers, max_redirects=0)
            assert r.status == 403, (fields, headers, r.status)
        assert await policy_names(env) == before
        # Signed out: the cookie no longer opens anything.
        async with admin.expect_navigation():
            await admin.click("header form button")
        assert (await admin.goto("/console")).status == 401
        assert not ctx.errors, ctx.errors
    finally:
        await ctx.close()


async def test_an_admin_sees_what_is_published_by_namespace_with_its_size_and_emphasis(env):
    ctx = await context(env)
    try:
        page = await sign_in(ctx, PUBLISH)
        cookie = next(c for c in await ctx.cookies() if c["name"] == "kdn_console")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
        assert await page.locator("h2", has_text="namespace public").count() == 1
        assert await page.locator("h2", has_text="namespace acme").count() == 1  # admin * reads every namespace
        row = page.locator('tr[data-manifest="public/harbor"]')
        cells = await row.locator("td").all_inner_texts()
        assert cells[0] == "harbor" and cells[1] == "tiny-llama", cells
        assert cells[2] == str(len(env.harbor["addresses"])) and cells[3] == f"{env.harbor['tokens']:,}", cells
        assert cells[4].startswith(format_size(stored_bytes(env, env.harbor)) + " ("), cells  # the store's bytes
        assert await page.locator('tr[data-manifest="acme/plan"]').count() == 1
        assert await page.locator("form[data-policy]").count() == 2  # a namespace form per namespace

        async with page.expect_navigation():
            await row.locator("a").click()
        assert urlsplit(page.url).path == "/console/manifests/public/harbor"
        marked = await page.locator("pre.text mark").all_inner_texts()
        assert marked and MARKED in "".join(marked), marked  # the emphasis map over the decoded text
        assert "ferry timetable" in await page.inner_text("pre.text")
        # Where it is cached: each region's owner edge answered (nobody read it yet: none held).
        for region in ("eu", "us"):
            held = await page.locator(f'tr[data-region="{region}"] td.held').first.inner_text()
            assert held == f"0 of {len(env.harbor['addresses'])}", (region, held)
        assert await page.locator("#set-policy").count() == 1
        assert not ctx.errors, ctx.errors
    finally:
        await ctx.close()


async def test_a_read_token_sees_the_listing_but_cannot_edit(env):
    ctx = await context(env)
    try:
        page = await sign_in(ctx, EDGE_TOKEN)  # read *
        assert await page.locator('tr[data-manifest="public/harbor"]').count() == 1
        assert await page.locator("form[data-policy]").count() == 0
        await page.goto("/console/manifests/public/harbor")
        assert await page.locator("#set-policy").count() == 0
        assert await page.locator("button", has_text="Remove").count() == 0
        csrf = await page.locator("input[name=csrf]").first.get_attribute("value")  # (its sign-out form's)
        before = await policy_names(env)
        for form in ({"op": "set", "kind": "pin", "manifest": "public/harbor"},
                     {"op": "set", "kind": "quota", "quota": "1GiB", "namespace": "public"}):
            r = await ctx.request.post("/console/policies", form={**form, "csrf": csrf}, max_redirects=0)
            assert r.status == 403, (form, r.status)
        assert await policy_names(env) == before
        assert not ctx.errors, ctx.errors
    finally:
        await ctx.close()
    # A tenant's token sees its own namespace only; another's manifest is a 404, as an absent one.
    ctx = await context(env)
    try:
        page = await sign_in(ctx, TENANT_A)  # publish,read acme
        assert await page.locator('tr[data-manifest="acme/plan"]').count() == 1
        assert await page.locator('tr[data-manifest="public/harbor"]').count() == 0
        assert (await page.goto("/console/manifests/public/harbor")).status == 404
    finally:
        await ctx.close()


async def test_a_push_set_in_the_console_reaches_the_edges_of_its_region(env):
    addrs = env.harbor["addresses"]
    us, eu = env.c.edge("u1"), env.c.edge("e1")
    ctx = await context(env)
    try:
        page = await sign_in(ctx, PUBLISH)
        await page.goto("/console/manifests/public/harbor")
        await page.select_option("#set-policy select[name=kind]", "push")
        assert await page.locator("#set-policy input[name=ttl]").is_hidden()  # the script shows push's fields
        await page.fill("#set-policy input[name=to]", "us")
        async with page.expect_navigation():
            await page.click("#set-policy button")
        assert "policy push.public.harbor set" in await page.inner_text("p.ok")
        assert await page.locator('tr[data-policy="push.public.harbor"]').count() == 1
        assert "push.public.harbor" in await policy_names(env)
        # The edge of us fills every object ahead of any reader; eu, not named, fills none.
        await wait_until(lambda: all(us.holds((a, "zstd")) for a in addrs), timeout=20)
        assert not any(eu.holds((a, "zstd")) for a in addrs)
        await page.reload()
        held = await page.locator('tr[data-region="us"] td.held').first.inner_text()
        assert held == f"{len(addrs)} of {len(addrs)}", held
        assert await page.locator('tr[data-region="eu"] td.held').first.inner_text() == f"0 of {len(addrs)}"

        # Removed from its row: gone from the registry and from the edge's rules.
        async with page.expect_navigation():
            await page.click('tr[data-policy="push.public.harbor"] button')
        assert "push.public.harbor" not in await policy_names(env)
        await us.policies.wait_applied(lambda e: "push.public.harbor" not in e.policies)
        assert await page.locator('tr[data-policy="push.public.harbor"]').count() == 0
        assert not ctx.errors, ctx.errors
    finally:
        await ctx.close()


async def test_a_screenshot_of_the_listing(env, tmp_path):
    """The picture in docs/operations.md: written there with KDN_CONSOLE_SCREENSHOT=1, else to a temp file."""
    out = ROOT / "docs" / "img" / "console.png" if os.environ.get("KDN_CONSOLE_SCREENSHOT") else tmp_path / "c.png"
    ctx = await context(env)
    try:
        page = await sign_in(ctx, PUBLISH)
        # A quota on acme from its namespace's form, a pin on harbor from its page: both show in the listing.
        form = page.locator("form[data-policy]:has(input[value=acme])")
        await form.locator("input[name=quota]").fill("5GiB")
        async with page.expect_navigation():
            await form.locator("button").click()
        await page.goto("/console/manifests/public/harbor")
        await page.select_option("#set-policy select[name=kind]", "pin")
        await page.fill("#set-policy input[name=region]", "eu")
        async with page.expect_navigation():
            await page.click("#set-policy button")
        await page.goto("/console")
        assert await page.locator('tr[data-manifest="acme/plan"] .pol.quota').inner_text() == "quota 5 GiB"
        assert await page.locator('tr[data-manifest="public/harbor"] .pol.pin').inner_text() == "pin in eu"
        assert {"quota.acme", "pin.public.harbor"} <= await policy_names(env)
        await page.set_viewport_size({"width": 1100, "height": 600})
        await page.screenshot(path=str(out))
    finally:
        await ctx.close()
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 400_000, len(data)


async def test_an_origin_without_a_token_file_shows_public_read_only(env, tmp_path):
    """Nothing to sign in with: the console lists what an anonymous caller reads (public), and edits nothing."""
    import aiohttp
    from aiohttp.test_utils import TestServer
    from ports import free_port

    from kdn.origin.app import OriginConfig, create_app
    from kdn.service import server_options

    port = free_port()
    app = create_app(OriginConfig(registry=env.c.registry, store=str(tmp_path / "store"), port=port, node_id="open",
                                  region="open", records="registry", fsync=False))  # no token_file
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server(**server_options(app))
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            async with s.get("/console") as r:
                page = await r.text()
                assert r.status == 200 and "read-only" in page and 'name="token"' not in page
                assert 'data-manifest="public/harbor"' in page and "acme" not in page  # public only
                assert "<form" not in page  # no policy form, no sign-out, no sign-in
            async with s.post("/console/login", data={"token": PUBLISH}, allow_redirects=False) as r:
                assert r.status == 401 and "no token file" in await r.text()
            async with s.post("/console/policies", data={"op": "set", "kind": "pin", "manifest": "public/harbor",
                                                         "csrf": ""}, allow_redirects=False) as r:
                assert r.status == 403
    finally:
        await server.close()


async def test_a_manifests_page_shows_its_reads_and_what_they_saved(env):
    """A client reads harbor's chunks through the eu edge, three times each (the first fills from us, then two
    hits): the page shows each region's reads of them by tier, the tokens they served and the prefill they saved (the
    origin's model's FLOPs, and the time at the speed it measured on its own publishes), to an admin and to a
    read-only token alike."""
    from kdn.format.address import chunk_spans
    from kdn.origin.config import SPEED
    from kdn.origin.console.saved import format_flops
    from kdn.origin.speed import chunk_flops

    m, eu = env.harbor, env.c.edge("e1")
    for a in m["addresses"]:
        for _ in range(3):
            status, _, _ = await get(env.c.edge_url("e1"), a)
            assert status == 200
        assert eu.reads((a, "zstd"))["memory"] == 2, eu.reads((a, "zstd"))
    n = len(m["addresses"])
    speed = env.c.origin.app[SPEED]
    assert speed.chunks >= n and speed.flops_per_s  # the publishes above were timed
    spans = chunk_spans(m["tokens"], m["chunk_tokens"])
    flops = sum(2 * chunk_flops(speed.prefill, s, t) for s, t in spans)
    for token in (PUBLISH, EDGE_TOKEN):  # admin, then read-only
        ctx = await context(env)
        try:
            page = await sign_in(ctx, token)
            await page.goto("/console/manifests/public/harbor")
            row = page.locator('table.saved tr[data-region="eu"]')
            assert await row.locator("td.memory").inner_text() == f"{2 * n:,}"
            assert await row.locator("td.disk").inner_text() == "0"
            assert await row.locator("td.tokens").inner_text() == f"{2 * m['tokens']:,}"
            assert await row.locator("td.flops").inner_text() == format_flops(flops)
            took = await row.locator("td.seconds").inner_text()
            assert took not in ("-", "not measured yet") and took[0].isdigit(), took
            # us holds every chunk (pushed there earlier): the eu edge's first read of each filled from it (another
            # region before the origin), a whole read its copy answered. So three reads of each, all counted.
            us = page.locator('table.saved tr[data-region="us"]')
            us_reads = [int(x) for x in await us.locator("td.memory, td.disk").all_inner_texts()]
            assert sum(us_reads) == n and await us.locator("td.tokens").inner_text() == f"{m['tokens']:,}", us_reads
            note = await page.locator("table.saved + p.note").inner_text()
            assert "Reads since each edge cached the chunk" in note and "at the origin's speed" in note, note
            assert not ctx.errors, ctx.errors
        finally:
            await ctx.close()
