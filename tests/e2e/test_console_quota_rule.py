"""A quota is the operator's (#51 item 2): a tenant admin cannot lift it from the console.

The attack: the operator (``admin *``) caps namespace acme at 64 MiB per tier; acme's admin (``admin acme``) opens
the console and removes the quota, or sets it again under its name at 1 TiB, or overwrites its name with another
kind, then pins and warms until other tenants' objects go to the origin. A quota caps a namespace's pinned bytes
too, so it is a fleet-level limit: only ``admin *`` sets, changes or removes one. The tenant admin still sees it.
A real etcd, origin and edge; the console driven over HTTP with the sign-in form, its cookie and the CSRF token
read from the page, as a browser would.
"""

from __future__ import annotations

import contextlib
import re

import aiohttp
from edge_helpers import PUBLISH, Cluster, write_tokens

from kdn.service import REGISTRY

TENANT_ADMIN = "tenant-admin-" + "f" * 19  # admin acme
TEXT = ("The ferry timetable changes with the tide; the winter schedule starts in November. " * 6)[:480]


@contextlib.asynccontextmanager
async def fleet(tmp_path, etcd_url):
    """``edge_helpers.cluster``'s origin and one edge, with a tenant admin in the token file too."""
    c = Cluster(tmp_path, etcd_url)
    write_tokens(c.tokens)
    with c.tokens.open("a") as f:
        f.write(f"{TENANT_ADMIN} admin acme\n")
    try:
        await c.start_origin()
        await c.start_edge("e1")
        await c.wait_ring(["e1"])
        yield c
    finally:
        await c.close()


class Console:
    """A signed-in browser: the sign-in form, then its cookie and the CSRF token of the page it lands on."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token, self.csrf = url, token, ""
        self.s: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Console:
        self.s = aiohttp.ClientSession(self.url, cookie_jar=aiohttp.CookieJar(unsafe=True))  # (cookies for an IP)
        async with self.s.post("/console/login", data={"token": self.token}, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        page = await self.page()
        self.csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.s is not None
        await self.s.close()

    async def page(self, path: str = "/console") -> str:
        assert self.s is not None
        async with self.s.get(path) as r:
            assert r.status == 200, await r.text()
            return await r.text()

    async def post(self, **form: str) -> tuple[int, str]:
        assert self.s is not None
        async with self.s.post("/console/policies", data={**form, "csrf": self.csrf}, allow_redirects=False) as r:
            return r.status, await r.text()


async def stored(c, name: str) -> bytes | None:
    """The policy record under ``name`` in the registry, as stored."""
    return dict(await c.origin.app[REGISTRY].list_keys(f"policies/{name}")).get(f"policies/{name}")


async def publish_acme(c) -> None:
    from jobs import publish_and_wait  # bench/lib

    async with aiohttp.ClientSession(c.origin_url(), headers={"Authorization": f"Bearer {TENANT_ADMIN}"}) as s:
        await publish_and_wait(s, {"name": "plan", "namespace": "acme", "text": TEXT}, timeout=120, poll=0.02)


async def test_a_tenant_admin_cannot_lift_the_operators_quota(tmp_path, etcd_url):
    async with fleet(tmp_path, etcd_url) as c:
        await publish_acme(c)
        async with Console(c.origin_url(), PUBLISH) as operator:  # admin *
            status, _ = await operator.post(op="set", kind="quota", namespace="acme", quota="64MiB")
            assert status == 303
        quota = await stored(c, "quota.acme")
        assert quota is not None
        edge = c.edge("e1")
        await edge.policies.wait_applied(lambda e: "quota.acme" in e.policies)

        async with Console(c.origin_url(), TENANT_ADMIN) as tenant:  # admin acme
            # It sees the quota, on the listing and on its manifest's page, with no Remove button for it.
            listing = await tenant.page()
            assert 'class="pol quota" title="quota.acme' in listing and "quota 64 MiB" in listing, listing
            mpage = await tenant.page("/console/manifests/acme/plan")
            row = mpage.split('data-policy="quota.acme"', 1)[1].split("</tr>", 1)[0]
            assert "Remove" not in row, row
            # Remove it; set it again at 1 TiB under its own name; overwrite the name with a TTL; add a second,
            # larger quota under a new name (the smallest wins at an edge, but none is the tenant's to set).
            for form in ({"op": "delete", "name": "quota.acme", "namespace": "acme"},
                         {"op": "set", "kind": "quota", "namespace": "acme", "quota": "1TiB"},
                         {"op": "set", "kind": "ttl", "namespace": "acme", "ttl": "1h", "name": "quota.acme"},
                         {"op": "set", "kind": "quota", "namespace": "acme", "quota": "1TiB", "name": "mine"}):
                status, page = await tenant.post(**form)
                assert status == 403, (form, status, page)
                assert "fleet-level limit" in page and "admin *" in page, page
            # What a tenant admin may still do: policies of its own manifests (a pin here).
            status, _ = await tenant.post(op="set", kind="pin", manifest="acme/plan")
            assert status == 303
        assert await stored(c, "quota.acme") == quota  # byte for byte: the operator's record
        assert await stored(c, "mine") is None
        assert "quota.acme" in edge.policies.policies


async def test_the_operator_changes_and_removes_a_tenants_quota(tmp_path, etcd_url):
    async with fleet(tmp_path, etcd_url) as c:
        async with Console(c.origin_url(), PUBLISH) as operator:
            assert (await operator.post(op="set", kind="quota", namespace="acme", quota="64MiB"))[0] == 303
            first = await stored(c, "quota.acme")
            assert (await operator.post(op="set", kind="quota", namespace="acme", quota="128MiB"))[0] == 303
            second = await stored(c, "quota.acme")
            assert second is not None and second != first
            edge = c.edge("e1")
            await edge.policies.wait_applied(lambda e: e.policies.get("quota.acme") is not None
                                             and e.policies["quota.acme"].quota_bytes == 128 << 20)
            assert (await operator.post(op="delete", name="quota.acme", namespace="acme"))[0] == 303
            await edge.policies.wait_applied(lambda e: "quota.acme" not in e.policies)
