"""Origin and edge over HTTPS with a private CA: clients verify, and refuse what they cannot verify."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import EDGE_TOKEN, PUBLISH, free_port, write_tokens  # noqa: E402
from jobs import publish_and_wait  # noqa: E402
from tls_certs import make_ca_and_cert  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.edge.app import EDGE, EdgeConfig, create_app as create_edge  # noqa: E402
from kdn.errors import SourceError  # noqa: E402
from kdn.origin.app import OriginConfig, create_app as create_origin  # noqa: E402
from kdn.tls import server_context  # noqa: E402


async def serve(app: web.Application, port: int, cert: Path, key: Path) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_context(str(cert), str(key))).start()
    return runner


async def test_https_origin_and_edge_with_verification(tmp_path, etcd_server):
    ca, cert, key = make_ca_and_cert(tmp_path)
    registry = f"{etcd_server.replace('http://', 'etcd://')}/tls{secrets.token_hex(4)}/"
    tokens = write_tokens(tmp_path / "tokens")
    (tmp_path / "edge-token").write_text(EDGE_TOKEN + "\n")
    oport, eport = free_port(), free_port()
    ocfg = OriginConfig(model="tiny-llama", registry=registry, store=str(tmp_path / "store"), port=oport,
                        token_file=str(tokens), node_id="o1", fsync=False, tls_cert=str(cert), tls_key=str(key))
    ecfg = EdgeConfig(region="eu", registry=registry, origin=ocfg.advertised_url, port=eport, node_id="e1",
                      token_file=str(tokens), upstream_token_file=str(tmp_path / "edge-token"), lease_ttl=2.0,
                      fsync=False, tls_cert=str(cert), tls_key=str(key), ca=str(ca))
    assert ocfg.advertised_url.startswith("https://") and ecfg.advertised_url.startswith("https://")
    runners = [await serve(create_origin(ocfg), oport, cert, key)]
    try:
        runners.append(await serve(create_edge(ecfg), eport, cert, key))
        await runners[1].app[EDGE].membership.wait_for(lambda m: m.ring.nodes == ["e1"], timeout=10)
        from kdn.tls import client_context

        conn = aiohttp.TCPConnector(ssl=client_context(str(ca)))
        async with aiohttp.ClientSession(connector=conn, headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
            m = await publish_and_wait(s, {"name": "d", "text": "x" * 600}, url=ocfg.advertised_url, timeout=60)
        # the edge fills from the HTTPS origin (verifying it with the CA); the client verifies the edge
        async with KDNClient(edges=[ecfg.advertised_url], ca=str(ca)) as client:
            hit = await client.lookup(m["prefix_tokens"], m["model_id"])
            states = await client.fetch_prefix(hit)
            assert len(states.objects) == len(m["addresses"])
            assert set(states.sources) == {"edge:0/origin"}
        # without the CA the client refuses the server: it never falls back to no verification
        async with KDNClient(edges=[ecfg.advertised_url]) as client:
            with pytest.raises(SourceError):
                await client.fetch(m["addresses"][0])
    finally:
        for r in reversed(runners):
            await r.cleanup()
