"""The attack (#28 item 4): a superseded manifest, validly signed, replayed to a client.

The origin signs a per-name version with every manifest (the registry sets it:
``put_manifest``); a client with ``trusted_keys`` never takes a lower version of
a name than one it took before.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, publish  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.registry import open_registry  # noqa: E402
from kdn.signing import Signer  # noqa: E402

OLD = ("The harbour opens at six; boats moor on the east quay. " * 8)[:400]
NEW = ("The harbour opens at eight; boats moor on the west quay, never the east. " * 8)[:400]


async def test_a_superseded_manifest_replayed_through_the_registry_is_refused(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        old = await publish(c, OLD, name="hours")
        writer = open_registry(c.registry)
        try:
            stale = await writer.get_manifest("public", "hours")  # the attacker keeps the old, signed, manifest
            new = await publish(c, NEW, name="hours")
            async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
                got = await client.manifest("public", "hours")
                assert got["addresses"] == new["addresses"] and got["version"] > old["version"] > 0
                await writer._put(writer._manifest_key("public", "hours"), stale.pack())  # the replay
                assert (await writer.get_manifest("public", "hours")).addresses == old["addresses"]
                assert await client.manifest("public", "hours") is None, "the client took the superseded manifest"
                assert client.rejected_records == 1
            async with KDNClient(edges=[c.edge_url("e1")]) as fresh:  # no keys, no memory: fooled (the control)
                assert (await fresh.manifest("public", "hours"))["addresses"] == old["addresses"]
        finally:
            await writer.close()
