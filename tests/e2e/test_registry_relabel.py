"""The attack (#28 item 3): a registry writer relabels a tenant's object ``public`` and waits for a restart.

Who may read an object is the origin's own knowledge: the namespace it wrote into
the blob's header when it made the blob, not the registry record's field, which
anyone with write access to the registry can change. An edge without publisher
keys takes records as the registry holds them, but the bytes it fills were made
by the origin: a record that disagrees with its blob is refused, and an entry
kept for acme is not handed out under a record that now says public.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import EDGE_TOKEN, TENANT_A, cluster, get, publish  # noqa: E402

from kdn.registry import open_registry  # noqa: E402

TEXT = ("Acme's quarterly plan: ship the sensor board in March, the firmware in May. " * 10)[:600]


async def test_a_tenant_object_relabelled_public_in_the_registry_stays_the_tenants(tmp_path, etcd_url):
    # An origin on --records registry: its object records are in the registry, where the writer can reach them
    # (under the default, --records store, they are beside the blobs and the registry holds none to relabel).
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"records": "registry"}) as c:
        m = await publish(c, TEXT, namespace="acme", token=TENANT_A)
        cached, filled = m["addresses"][:2]
        assert (await get(c.edge_url("e1"), cached, TENANT_A))[0] == 200
        edge = c.edge("e1")
        for _ in range(200):  # the owner's disk copy lands off the response path
            if edge.disk.contains((cached, "zstd")):
                break
            await asyncio.sleep(0.02)
        assert edge.disk.contains((cached, "zstd"))
        writer = open_registry(c.registry)  # a registry writer: no origin key, just write access
        try:
            for a in (cached, filled):
                rec = await writer.get_object(a)
                assert rec is not None and rec.namespace == "acme"
                await writer.put_objects([dataclasses.replace(rec, namespace="public", sig={})])
                assert (await writer.get_object(a)).namespace == "public"
        finally:
            await writer.close()
        # Restarts: what the origin and the edge knew in memory is gone; they re-read the relabelled records.
        await c.stop_edge("e1")
        await c.origin.close()
        await c.start_origin(records="registry")
        c.configs["e1"] = dataclasses.replace(c.configs["e1"], origin=c.origin_url())  # its disk tier kept
        await c.start_edge("e1")
        for a in (cached, filled):
            status, _, headers = await get(c.origin_url(), a)
            assert status == 404, f"an anonymous reader got acme's object (Cache-Control {headers.get('Cache-Control')})"
            status, _, headers = await get(c.origin_url(), a, TENANT_A)
            assert status == 200 and headers["Cache-Control"].startswith("private")
            status, body, _ = await get(c.edge_url("e1"), a)
            assert status != 200, f"an anonymous reader got acme's object {a[:12]} from the edge"
            assert status in (404, 503), (status, body[:200])
        assert c.edge("e1").disk.contains((cached, "zstd"))  # refused as kept, not merely absent
        assert (await get(c.edge_url("e1"), filled, EDGE_TOKEN))[0] == 503  # the origin's bytes say acme
