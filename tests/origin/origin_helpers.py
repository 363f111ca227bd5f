"""A running origin (real aiohttp server on loopback, real etcd) for origin tests."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kdn.origin.app import OriginConfig, create_app
from kdn.service import server_options
from ports import free_port  # bench/lib/ports.py

PUBLISH_TOKEN = "pub-" + "a" * 28
TENANT_TOKEN = "acme-" + "b" * 27  # publish + read in namespace acme only
READ_ALL = "edge-" + "c" * 27  # read everywhere (what an edge uses)


def write_tokens(path: Path) -> Path:
    path.write_text(
        f"# test grants\n{PUBLISH_TOKEN} admin *\n{TENANT_TOKEN} publish,read acme\n{READ_ALL} read *\n"
    )
    return path


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@contextlib.asynccontextmanager
async def running_origin(tmp_path: Path, registry_url: str, model: str = "tiny-llama", **kw):
    # A port picked before start: the origin registers its URL at start, and port 0 is no URL.
    port = free_port()
    kw.setdefault("raw_copies", "always")  # what a test loads is the same on a nearly full disk
    cfg = OriginConfig(model=model, registry=registry_url, store=str(tmp_path / "store"), port=port,
                       token_file=str(write_tokens(tmp_path / "tokens")), node_id="origin-test", fsync=False, **kw)
    app = create_app(cfg)
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server(**server_options(app))
    try:
        async with aiohttp.ClientSession(str(server.make_url(""))) as session:
            yield server, session
    finally:
        await server.close()


async def publish(session: aiohttp.ClientSession, body: dict, token: str = PUBLISH_TOKEN, timeout: float = 120) -> dict:
    """POST /v1/publish, wait for the job; the finished job dict."""
    async with session.post("/v1/publish", json=body, headers=auth(token)) as r:
        assert r.status == 202, await r.text()
        job_id = (await r.json())["job"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        async with session.get(f"/v1/jobs/{job_id}", headers=auth(token)) as r:
            assert r.status == 200
            job = await r.json()
        if job["state"] in ("done", "failed"):
            return job
        assert loop.time() < deadline, f"publish job did not finish: {job}"
        await asyncio.sleep(0.02)


@pytest.fixture
def etcd_url(etcd_server) -> str:
    """A fresh key prefix on the session's etcd server for each test."""
    base = etcd_server if isinstance(etcd_server, str) else etcd_server.url
    base = base.replace("http://", "etcd://")
    return f"{base}/t{secrets.token_hex(4)}/"
