"""An edge reading object records from the origins' stores (edge/records.py ``OriginRecords``).

Real aiohttp servers on loopback play origins: what one lacks is asked of the next; a whole answer of
1,024 records (~1.5 MB, many TCP reads) is read; a malformed or oversized answer is that origin's failure.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kdn.edge.records import OriginRecords
from kdn.errors import RegistryUnavailable
from kdn.registry import Encoding, ObjectRecord


def record(i: int) -> ObjectRecord:
    return ObjectRecord(address=f"{i:064x}", model_id="c" * 64, namespace="public", kind="kv", start=0, end=256,
                        parent=None, standalone=False, origin="o",
                        encodings={"zstd": Encoding("zstd", 6 << 20, "1" * 64, 1 << 20, tuple("2" * 64 for _ in range(6)))},
                        sig={"key": "k" * 16, "ed25519": "e" * 128}, created=1.0)


async def origin(have: dict[str, ObjectRecord], body: bytes | None = None) -> TestServer:
    async def records(request: web.Request) -> web.Response:
        if body is not None:
            return web.Response(body=body, content_type="application/json")
        asked = (await request.json())["addresses"]
        return web.json_response({"records": [have[a].to_dict() if a in have else None for a in asked]})

    app = web.Application()
    app.router.add_post("/v1/records", records)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def test_what_one_origin_lacks_is_asked_of_the_next_and_whole_answers_are_read():
    recs = [record(i) for i in range(1024)]
    a = await origin({r.address: r for r in recs[:1000]})
    b = await origin({r.address: r for r in recs[1000:]})
    try:
        async with aiohttp.ClientSession() as s:
            src = OriginRecords(s, lambda: [url(a), url(b)], lambda u: {})
            got = await src.get_objects([r.address for r in recs] + ["f" * 64])
        assert got[:1024] == recs and got[1024] is None
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("bad", [b"not json", b'{"records": [null, null]}', b"[" * 100_000 + b"]" * 100_000])
async def test_a_malformed_answer_is_that_origins_failure(bad):
    liar, honest = await origin({}, body=bad), await origin({record(1).address: record(1)})
    try:
        async with aiohttp.ClientSession() as s:
            assert await OriginRecords(s, lambda: [url(liar), url(honest)], lambda u: {}).get_object(
                record(1).address) == record(1)
            with pytest.raises(RegistryUnavailable, match="no origin answered"):
                await OriginRecords(s, lambda: [url(liar)], lambda u: {}).get_object(record(1).address)
    finally:
        await liar.close()
        await honest.close()
