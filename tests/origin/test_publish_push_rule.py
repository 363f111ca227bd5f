"""Who may push through a publish, and how often (#51 item 11): a publish-only token made fleet-wide, origin-signed
pushes (``push`` in the publish body, at any rate: 3 regions filled 12 MB nobody read and evicted another tenant's
objects), while the console keeps the same push for admins of the namespace. The publish API now applies the
console's rule (its own functions: ``Viewer.may_admin``, ``may_edit``), refusing the whole request before any work,
and a namespace's publishes may set ``PushBudget.burst`` pushes at once, then one each ``every`` seconds.
"""

from __future__ import annotations

import contextlib

import aiohttp
from aiohttp.test_utils import TestServer
from origin_helpers import auth
from ports import free_port  # bench/lib/ports.py

from kdn.origin.app import PUSHES, OriginConfig, create_app
from kdn.origin.publish import PushBudget
from kdn.registry import open_registry
from kdn.service import server_options

ADMIN = "admin-" + "a" * 26  # admin on acme and beta
PUBLISHER = "pub-" + "p" * 28  # publish,read acme: publishes, may not push
TEXT = "The harbour master posts the tide tables at dawn and again at dusk."


@contextlib.asynccontextmanager
async def origin(tmp_path, registry_url, budget: PushBudget | None = None):
    port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin acme,beta\n{PUBLISHER} publish,read acme\n")
    tokens.chmod(0o600)
    cfg = OriginConfig(model="tiny-llama", registry=registry_url, store=str(tmp_path / "store"), port=port,
                       token_file=str(tokens), node_id="origin-test", fsync=False)
    app = create_app(cfg)
    if budget is not None:
        app[PUSHES] = budget
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server(**server_options(app))
    try:
        async with aiohttp.ClientSession(str(server.make_url(""))) as session:
            yield app, session
    finally:
        await server.close()


async def post(session, token: str, **body) -> tuple[int, dict, dict]:
    async with session.post("/v1/publish", json={"text": TEXT, **body}, headers=auth(token)) as r:
        return r.status, await r.json(), dict(r.headers)


async def test_a_publish_only_token_cannot_push(tmp_path, etcd_url):
    async with origin(tmp_path, etcd_url) as (app, session):
        for push in (True, ["eu"], False):
            status, out, _ = await post(session, PUBLISHER, name="tide", namespace="acme", push=push)
            assert status == 403, out
            assert out["error"] == "forbidden" and "admin" in out["detail"] and "'acme'" in out["detail"]
        async with open_registry(etcd_url) as reg:
            assert await reg.list_policies() == []  # nothing pushed
            assert await reg.get_manifest("acme", "tide") is None  # and nothing published: refused whole
        status, out, _ = await post(session, ADMIN, name="tide", namespace="acme", push=["eu"])
        assert status == 202, out  # an admin of the namespace may (the console's rule)


async def test_an_admin_push_rate_is_bounded(tmp_path, etcd_url):
    async with origin(tmp_path, etcd_url, budget=PushBudget(burst=2, every=3600)) as (app, session):
        answers = [await post(session, ADMIN, name=f"tide-{i}", namespace="acme", push=True) for i in range(3)]
        assert [s for s, _, _ in answers] == [202, 202, 429]
        _, out, headers = answers[2]
        assert out["error"] == "too_many_pushes" and "'acme'" in out["detail"]
        assert 0 < int(headers["Retry-After"]) <= 3600
        status, _, _ = await post(session, ADMIN, name="tide-3", namespace="acme")
        assert status == 202  # a publish without a push is not counted
        status, _, _ = await post(session, ADMIN, name="tide-4", namespace="acme", push=False)
        assert status == 202  # nor is ending one
        status, _, _ = await post(session, ADMIN, name="tide-5", namespace="beta", push=True)
        assert status == 202  # each namespace has its own budget


def test_a_push_budget_refills_one_push_each_period():
    now = [0.0]
    budget = PushBudget(burst=2, every=60, clock=lambda: now[0])
    assert [budget.take("acme") for _ in range(3)] == [0, 0, 60]
    now[0] = 30
    assert budget.take("acme") == 30
    now[0] = 60
    assert budget.take("acme") == 0 and budget.take("acme") == 60
    budget.give_back("acme")
    assert budget.take("acme") == 0


def test_security_md_states_the_push_budget_the_code_has():
    from pathlib import Path

    from kdn.origin.publish import PUSH_BURST, PUSH_EVERY_S

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert (PUSH_BURST, PUSH_EVERY_S) == (8, 60.0)  # "8 pushes at once, then one a minute"
    assert "may set 8 pushes at once, then one a minute (`PushBudget`" in doc
