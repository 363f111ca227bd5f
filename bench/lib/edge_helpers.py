"""A small CDN on loopback for edge tests: real etcd, a real origin, real edges."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from blake3 import blake3

from kdn.edge.app import EDGE, EdgeConfig, create_app as create_edge
from kdn.origin.app import OriginConfig, create_app as create_origin
from kdn.registry import ObjectRecord
from kdn.registry.records import Encoding
from kdn.service import server_options
from jobs import publish_and_wait  # bench/lib/jobs.py
from origin_records import open_records  # bench/lib/origin_records.py
from ports import free_port  # bench/lib/ports.py

PUBLISH = "pub-" + "a" * 28
EDGE_TOKEN = "edge-" + "c" * 27  # read * : what edges show each other and the origin
TENANT_A = "tenant-a-" + "d" * 23
TENANT_B = "tenant-b-" + "e" * 23

# One object, for a Filler against small servers that stall, lie or fail (``serve_objects``).
BLOB = b"kv bytes " * 1000
ADDRESS = "a" * 64
RECORD = ObjectRecord(address=ADDRESS, model_id="b" * 64, namespace="public", kind="kv", start=0, end=256,
                      parent=None, standalone=False, origin="o",
                      encodings={"zstd": Encoding("zstd", len(BLOB), blake3(BLOB).hexdigest())})


async def serve_objects(handler) -> tuple[web.AppRunner, str]:
    """``GET /v1/objects/{address}`` answered by ``handler`` on a free loopback port: (runner, base URL)."""
    app = web.Application()
    app.router.add_get("/v1/objects/{address}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001


def write_tokens(path: Path) -> Path:
    path.write_text(f"{PUBLISH} admin *\n{EDGE_TOKEN} read *\n{TENANT_A} publish,read acme\n{TENANT_B} publish,read beta\n")
    return path


@dataclass
class Cluster:
    tmp: Path
    registry: str
    origin: TestServer | None = None
    edges: dict[str, TestServer] = field(default_factory=dict)
    configs: dict[str, EdgeConfig] = field(default_factory=dict)

    @property
    def tokens(self) -> Path:
        return self.tmp / "tokens"

    def origin_url(self) -> str:
        return str(self.origin.make_url("")).rstrip("/")

    def edge_url(self, node_id: str) -> str:
        return self.configs[node_id].advertised_url

    def edge(self, node_id: str):
        return self.edges[node_id].app[EDGE]

    def open_records(self):
        """The origin's object records where it keeps them: beside its blobs (its default), or the registry."""
        from kdn.origin.app import CONFIG

        cfg = self.origin.app[CONFIG]
        return open_records(self.registry, cfg.store if cfg.records == "store" else None,
                            credentials=cfg.store_credentials)

    async def start_origin(self, model: str = "tiny-llama", *, prepare=None, **kw) -> None:
        port = free_port()
        kw.setdefault("store", str(self.tmp / "origin-store"))
        kw.setdefault("raw_copies", "always")  # what a test loads is the same on a nearly full disk
        cfg = OriginConfig(model=model, registry=self.registry, port=port, token_file=str(self.tokens),
                           node_id="origin-1", fsync=False, **kw)
        app = create_origin(cfg)
        if prepare is not None:
            prepare(app)  # e.g. a signal handler a test adds before the app is frozen
        self.origin = TestServer(app, host="127.0.0.1", port=port)
        await self.origin.start_server(**server_options(app))  # (TestServer drops its constructor's options)

    async def start_edge(self, node_id: str, region: str = "eu", *, mem_budget: int = 64 << 20,
                         disk_budget: int = 256 << 20, prefetch: int = 0, origin: bool | str = True, prepare=None,
                         **kw) -> None:
        cfg = self.configs.get(node_id)
        if cfg is None:
            port = kw.pop("port", None) or free_port()  # (a test that signs the edge's URL first picks its port)
            upstream = origin if isinstance(origin, str) else (self.origin_url() if origin else None)
            cfg = EdgeConfig(region=region, registry=self.registry, origin=upstream,
                             mem_budget=mem_budget, disk=str(self.tmp / f"disk-{node_id}"), disk_budget=disk_budget,
                             port=port, node_id=node_id, token_file=str(self.tokens),
                             upstream_token_file=str(self.tokens.with_name("edge-token")), prefetch=prefetch,
                             lease_ttl=2.0, fsync=False, **kw)
            self.tokens.with_name("edge-token").write_text(EDGE_TOKEN + "\n")
            self.configs[node_id] = cfg
        app = create_edge(cfg)
        if prepare is not None:
            prepare(app)
        server = TestServer(app, host="127.0.0.1", port=cfg.port)
        await server.start_server(**server_options(app))
        self.edges[node_id] = server

    async def stop_edge(self, node_id: str) -> None:
        await self.edges.pop(node_id).close()

    async def wait_ring(self, node_ids: list[str], region: str = "eu", timeout: float = 10.0) -> None:
        """Every running edge of ``region`` sees exactly ``node_ids`` in its ring."""
        want = sorted(node_ids)
        for nid, server in self.edges.items():
            if self.configs[nid].region == region:
                m = server.app[EDGE].membership
                await m.wait_for(lambda m: sorted(m.ring.nodes) == want, timeout=timeout)

    async def close(self) -> None:
        for nid in list(self.edges):
            await self.stop_edge(nid)
        if self.origin is not None:
            await self.origin.close()


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, registry_url: str, *, edges=("e1", "e2", "e3"), model: str = "tiny-llama",
                  origin_kw: dict | None = None, **kw):
    c = Cluster(tmp_path, registry_url)
    write_tokens(c.tokens)
    try:
        await c.start_origin(model, **(origin_kw or {}))
        for nid in edges:
            await c.start_edge(nid, **kw)
        await c.wait_ring(list(edges))
        yield c
    finally:
        await c.close()


async def publish(c: Cluster, text: str, name: str = "doc", namespace: str = "public", token: str = PUBLISH,
                  **fields) -> dict:
    """Publish through the origin and wait for the job; ``fields`` go into the body (encodings, standalone...)."""
    async with aiohttp.ClientSession(c.origin_url(), headers={"Authorization": f"Bearer {token}"}) as s:
        body = {"name": name, "namespace": namespace, "text": text, **fields}
        return await publish_and_wait(s, body, timeout=120, poll=0.02)


async def wait_until(pred, timeout: float = 10.0, every: float = 0.01) -> None:
    """Poll a condition that has no event of its own (cache contents, an index), bounded in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(every)


async def get(url: str, address: str, token: str | None = None, **params) -> tuple[int, bytes, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/objects/{address}", params=params, headers=headers) as r:
            return r.status, await r.read(), r.headers.copy()  # case-insensitive


def origin_served(c: Cluster) -> float:
    """Objects the origin has served so far (its own Prometheus counter)."""
    from kdn.service import METRICS

    reg = c.origin.app[METRICS]
    total = 0.0
    for metric in reg.collect():
        if metric.name == "kdn_origin_objects_served":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def metric(server: TestServer, name: str, **labels) -> float:
    from kdn.service import METRICS

    total = 0.0
    for m in server.app[METRICS].collect():
        for s in m.samples:
            if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
