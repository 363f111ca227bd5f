"""The attack: one flipped bit on the origin's disk, then a re-publish.

Before: a restart re-hashed the rotten file, the re-publish wrote that hash into
the record, and every client accepted the rotten bytes. Now the digest written
with each blob finds the rot at start (the blob is dropped), the re-publish
recomputes and rewrites it, and the record's digest never changes.
"""

from __future__ import annotations

from blake3 import blake3

from kdn.origin.app import STORE
from origin_records import open_records  # bench/lib/origin_records.py
from origin_helpers import PUBLISH_TOKEN, publish, running_origin

TEXT = ("Sourdough wants a warm kitchen and a patient baker; the starter is fed twice a day. " * 9)[:700]


async def test_a_rotten_blob_is_dropped_at_start_and_a_republish_repairs_it(tmp_path, etcd_url):
    async with running_origin(tmp_path, etcd_url) as (_, session):
        job = await publish(session, {"name": "doc", "text": TEXT})
        assert job["state"] == "done"
    address = job["manifest"]["addresses"][1]
    reg = open_records(etcd_url, tmp_path / "store")
    try:
        digest = (await reg.get_object(address)).encodings["zstd"].digest
    finally:
        await reg.close()
    path = tmp_path / "store" / address[:2] / address[2:4] / f"{address}.zstd"
    rotten = bytearray(path.read_bytes())
    rotten[len(rotten) // 2] ^= 0x01  # one bit
    path.write_bytes(bytes(rotten))

    async with running_origin(tmp_path, etcd_url) as (server, session):
        assert server.app[STORE].dropped == 1 and not server.app[STORE].has(address, "zstd")
        async with session.get(f"/v1/objects/{address}?encoding=zstd") as r:
            assert r.status == 404  # not served rotten, not served at all until repaired
        async with session.get(f"/v1/objects/{address}") as r:  # the healthy raw copy still serves
            assert r.status == 200 and r.headers["X-KDN-Encoding"] == "raw"
        job = await publish(session, {"name": "doc", "text": TEXT})
        assert job["state"] == "done" and job["progress"]["computed"] >= 1  # recomputed, not re-hashed
        async with session.get(f"/v1/objects/{address}?encoding=zstd",
                               headers={"Authorization": f"Bearer {PUBLISH_TOKEN}"}) as r:
            assert r.status == 200
            assert blake3(await r.read()).hexdigest() == digest
    reg = open_records(etcd_url, tmp_path / "store")
    try:
        assert (await reg.get_object(address)).encodings["zstd"].digest == digest  # the record never changed
    finally:
        await reg.close()
