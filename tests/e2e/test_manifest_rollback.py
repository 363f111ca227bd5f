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
from kdn.registry.signing import Signer  # noqa: E402

async def served_manifest(c, namespace: str, name: str):
    """The manifest as the origin serves it, whole and signed: what an attacker keeps to replay later (under the
    origin's default the registry holds only a pointer to it; the attacker writes the whole one back)."""
    import aiohttp

    from kdn.registry import Manifest

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{c.origin_url()}/v1/registry/manifests/{namespace}/{name}") as r:
            assert r.status == 200, await r.text()
            return Manifest.from_dict(await r.json())


OLD = ("The harbour opens at six; boats moor on the east quay. " * 8)[:400]
NEW = ("The harbour opens at eight; boats moor on the west quay, never the east. " * 8)[:400]


async def test_a_superseded_manifest_replayed_through_the_registry_is_refused(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        old = await publish(c, OLD, name="hours")
        writer = open_registry(c.registry)
        try:
            stale = await served_manifest(c, "public", "hours")  # the attacker keeps the old, signed, manifest
            new = await publish(c, NEW, name="hours")
            async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
                got = await client.manifest("public", "hours")
                assert got.addresses == new["addresses"] and got.version > old["version"] > 0
                await writer._put(writer._manifest_key("public", "hours"), stale.pack())  # the replay
                assert (await writer.get_manifest("public", "hours")).addresses == old["addresses"]
                assert await client.manifest("public", "hours") is None, "the client took the superseded manifest"
                assert client.rejected_records == 1
            async with KDNClient(edges=[c.edge_url("e1")]) as fresh:  # no keys, no memory: fooled (the control)
                assert (await fresh.manifest("public", "hours")).addresses == old["addresses"]
        finally:
            await writer.close()


async def test_a_superseded_manifest_replayed_to_a_new_process_is_refused_with_a_state_file(tmp_path, etcd_url):
    """The residual of the version check, closed: a manifest's high-water mark was held per process, so a new
    one (a restarted engine) took a replayed superseded manifest. With ``manifest_state`` the mark is in a file:
    a client made after the replay, sharing only that file, refuses it."""
    import asyncio

    key = Signer.generate(tmp_path / "origin.key")
    state = tmp_path / "versions.json"
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        await publish(c, OLD, name="hours")
        writer = open_registry(c.registry)
        try:
            stale = await served_manifest(c, "public", "hours")
            new = await publish(c, NEW, name="hours")
            async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public], manifest_state=state) as first:
                assert (await first.manifest("public", "hours")).addresses == new["addresses"]
            await writer._put(writer._manifest_key("public", "hours"), stale.pack())  # the replay, between processes
            code = ("import asyncio, sys\n"
                    "from kdn.client import KDNClient\n"
                    "async def main():\n"
                    f"    async with KDNClient(edges=[{c.edge_url('e1')!r}], trusted_keys=[{key.public!r}],\n"
                    f"                         manifest_state={str(state)!r}) as c:\n"
                    "        m = await c.manifest('public', 'hours')\n"
                    "        print('refused' if m is None else 'TOOK', c.rejected_records)\n"
                    "asyncio.run(main())\n")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            # (a process of its own, waited for asynchronously: the edge answering it runs in this event loop)
            proc = await asyncio.create_subprocess_exec(sys.executable, "-P", "-c", code, env=env,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert out.decode().split() == ["refused", "1"], out.decode() + err.decode()
            async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public],
                                 manifest_state=False) as forgetful:  # the control: marks in memory only
                assert (await forgetful.manifest("public", "hours")).addresses == stale.addresses
        finally:
            await writer.close()


def test_a_manifest_state_file_only_rises_and_an_unreadable_one_is_an_error(tmp_path):
    import json

    import pytest

    from kdn.errors import InvalidInput
    from kdn.client.versions import FORMAT, VersionFile

    path = tmp_path / "v.json"
    a, b = VersionFile(path), VersionFile(path)  # two processes' clients sharing one file
    a["public/x"] = 3
    b["public/y"] = 5
    b["public/x"] = 2  # lower than stored: nothing written
    assert json.loads(path.read_text())[FORMAT] == {"public/x": 3, "public/y": 5}
    assert VersionFile(path) == {"public/x": 3, "public/y": 5} and b.writes == 1
    for bad in ("{", '{"other": {}}', json.dumps({FORMAT: {"public/x": -1}}), json.dumps({FORMAT: {"no-slash": 1}}),
                json.dumps({FORMAT: {"public/x": True}})):
        path.write_text(bad)
        with pytest.raises(InvalidInput, match="unreadable"):
            VersionFile(path)  # never a silent reset to 0: that reset is the replay


async def test_a_deleted_name_stays_deleted_for_a_client_that_saw_its_tombstone(tmp_path, etcd_url):
    import aiohttp

    from edge_helpers import PUBLISH, TENANT_A

    key = Signer.generate(tmp_path / "origin.key")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        await publish(c, OLD, name="hours")
        writer = open_registry(c.registry)
        try:
            stale = await served_manifest(c, "public", "hours")
            async with aiohttp.ClientSession(c.origin_url()) as s:
                for token, want in ((None, 401), (TENANT_A, 403), (PUBLISH, 200), (PUBLISH, 404)):
                    headers = {"Authorization": f"Bearer {token}"} if token else {}
                    async with s.delete("/v1/manifests/public/hours", headers=headers) as r:
                        assert r.status == want, (token, r.status, await r.text())
                        if r.status == 200:
                            tomb = await r.json()
            assert tomb["deleted"] and tomb["addresses"] == [] and tomb["version"] > stale.version
            async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
                assert await client.manifest("public", "hours") is None  # deleted (the tombstone, verified)
                assert client.manifest_versions["public/hours"] == tomb["version"] and client.rejected_records == 0
                await writer._put(writer._manifest_key("public", "hours"), stale.pack())  # the deleted one replayed
                assert await client.manifest("public", "hours") is None and client.rejected_records == 1
        finally:
            await writer.close()


async def test_a_pinned_manifest_is_the_only_one_a_fresh_client_takes(tmp_path, etcd_url):
    """The residual of the version check: a new process has no high-water mark. A pin (what ``kdn publish``
    prints) holds without keys or memory: a replayed older manifest, and a newer one, are both refused."""
    from kdn.registry import Manifest
    from kdn.registry.signing import manifest_pin

    Signer.generate(tmp_path / "o.key")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "o.key")}) as c:
        old = await publish(c, OLD, name="hours")
        writer = open_registry(c.registry)
        try:
            stale = await served_manifest(c, "public", "hours")
            pin = manifest_pin(Manifest.from_dict(old))
            assert pin == manifest_pin(stale)  # the job's manifest is the stored one: the pin names it
            new = await publish(c, NEW, name="hours")
            async with KDNClient(edges=[c.edge_url("e1")]) as fresh:  # no keys, no memory
                assert await fresh.manifest("public", "hours", pin=pin) is None  # the newer one is not the pinned
                await writer._put(writer._manifest_key("public", "hours"), stale.pack())
                got = await fresh.manifest("public", "hours", pin=pin)
                assert got is not None and got.addresses == old["addresses"] != new["addresses"]
                forged = Manifest.from_dict({**stale.to_dict(), "prefix_tokens": [1] + stale.prefix_tokens[1:]})
                await writer._put(writer._manifest_key("public", "hours"), forged.pack())
                assert await fresh.manifest("public", "hours", pin=pin) is None
                assert fresh.rejected_records == 2
        finally:
            await writer.close()


def test_a_mark_another_process_raised_holds_at_once(tmp_path):
    """Two clients (processes) share a state file: a version one of them took is the other's floor at its next
    check, not only once it writes a rise of its own."""
    from kdn.client.versions import VersionFile

    path = tmp_path / "v.json"
    early, late = VersionFile(path), VersionFile(path)
    late["public/hours"] = 7  # the other process takes version 7
    assert early.get("public/hours", 0) == 7  # read again: the file changed
    early["public/hours"] = 6  # lower than what is known now: nothing written
    assert VersionFile(path)["public/hours"] == 7 and early.writes == 0
