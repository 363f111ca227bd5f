"""An owner edge's "no" is not final (#51 item 3): what an owner relays and this edge does not take goes on to
the origins, and only their "no" is cached.

The attack: a registry writer adds edge records of its own to a region (a listener on 127.0.0.2), so that they
own chunks in that region's ring. An edge with ``--records origin`` asks the owner of each chunk for its object
record first (``OwnerRecords``, ``X-KDN-Hop``). Before the fix, the owner answering ``null``, another address's
signed record or a forged one made every chunk it owns a 404 at a ``--trusted-keys`` edge, on every read (the
answer was cached as absent, and asked of the same owner again when the negative TTL ran out). Real etcd, a real
origin (tiny-llama, signing its records), a real edge, a real lying HTTP server on 127.0.0.2.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from edge_helpers import EDGE_TOKEN, Cluster, cluster, get, metric, publish

from kdn.registry import NodeRecord
from kdn.registry.signing import Signer
from kdn.service import REGISTRY

TEXT = ("The lighthouse keeper wrote down the wind, the ships and the glass each hour of the storm. " * 14)[:900]
ROGUES = tuple(f"zz-rogue-{i}" for i in range(3))  # three ring entries: the liar owns most chunks of the region


class LyingOwner:
    """An HTTP listener on 127.0.0.2 that answers ``POST /v1/records`` as ``lie(address)`` says, and 404 to
    everything else (so the blob itself comes from the origin: only the record hop is under test)."""

    def __init__(self, lie) -> None:
        self.lie = lie  # address -> the record dict (or None) to answer with
        self.asked: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _records(self, request: web.Request) -> web.Response:
        addresses = (await request.json())["addresses"]
        self.asked += addresses
        return web.json_response({"records": [self.lie(a) for a in addresses]})

    async def __aenter__(self) -> LyingOwner:
        app = web.Application()
        app.router.add_post("/v1/records", self._records)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.2", 0)  # (bound at once, in this process: port 0 is safe)
        await site.start()
        self.url = f"http://127.0.0.2:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def origin_records(c: Cluster, addresses: list[str]) -> dict[str, dict]:
    """The origin's own (signed) records of ``addresses``, as the liar could read them too."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {EDGE_TOKEN}"}) as s:
        async with s.post(f"{c.origin_url()}/v1/records", json={"addresses": addresses}) as r:
            assert r.status == 200, await r.text()
            return dict(zip(addresses, (await r.json())["records"]))


async def read_through_a_liar(tmp_path, etcd_url, make_lie) -> tuple[list[int], LyingOwner, dict[str, float]]:
    """Publish, plant the liar as owner of most of region eu's chunks, and read each chunk it owns from e1 (a
    ``--trusted-keys`` edge reading records from the origins). ``make_lie(records)``: the liar's answer, given
    the origin's real records by address. The statuses, the liar, and e1's owner fallbacks by outcome."""
    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    real: dict[str, dict] = {}
    async with LyingOwner(lambda a: make_lie(real)(a)) as liar, cluster(
            tmp_path, etcd_url, edges=("e1",), records="origin", trusted_keys=str(tmp_path / "trusted"),
            origin_kw={"records": "store", "signing_key": str(tmp_path / "origin.key")}) as c:
        m = await publish(c, TEXT)
        real.update(await origin_records(c, m["addresses"]))
        assert all(real.values())
        for nid in ROGUES:
            await c.origin.app[REGISTRY].register_node(NodeRecord(role="edge", region="eu", node_id=nid,
                                                                  url=liar.url), ttl=30)
        await c.wait_ring(["e1", *ROGUES])
        owned = [a for a in m["addresses"] if c.edge("e1").membership.owner(a).node_id in ROGUES]
        assert owned, "the liar owns no chunk: the test proves nothing"
        statuses = [(await get(c.edge_url("e1"), a, token=EDGE_TOKEN))[0] for a in owned]
        assert sorted(set(liar.asked)) == sorted(owned), "e1 did not ask the owner: the test proves nothing"
        # A second read of each, the records now cached: an owner's lie left nothing behind.
        statuses += [(await get(c.edge_url("e1"), a, token=EDGE_TOKEN))[0] for a in owned]
        fallbacks = {o: metric(c.edges["e1"], "kdn_edge_owner_record_fallbacks", outcome=o)
                     for o in ("failed", "absent", "refused")}
        return statuses, liar, fallbacks


async def test_an_owner_answering_null_does_not_make_its_chunks_404(tmp_path, etcd_url):
    statuses, liar, fallbacks = await read_through_a_liar(tmp_path, etcd_url, lambda real: lambda a: None)
    assert set(statuses) == {200}, statuses
    assert fallbacks == {"failed": 0, "absent": len(set(liar.asked)), "refused": 0}


async def test_an_owner_answering_another_addresss_signed_record_falls_back_to_the_origin(tmp_path, etcd_url):
    def other(real: dict[str, dict]):
        addresses = sorted(real)
        return lambda a: real[addresses[(addresses.index(a) + 1) % len(addresses)]]  # validly signed, not a's

    statuses, liar, fallbacks = await read_through_a_liar(tmp_path, etcd_url, other)
    assert set(statuses) == {200}, statuses
    assert fallbacks == {"failed": 0, "absent": 0, "refused": len(set(liar.asked))}


@pytest.mark.parametrize("how", ["unsigned", "fields changed under the signature"])
async def test_an_owner_answering_a_forged_record_falls_back_to_the_origin(tmp_path, etcd_url, how):
    def forged(real: dict[str, dict]):
        def lie(a: str) -> dict:
            rec = {**real[a], "encodings": {name: {**e, "digest": "0" * 64}  # (a blob of the liar's choosing)
                                            for name, e in real[a]["encodings"].items()}}
            if how == "unsigned":
                rec.pop("sig", None)
            return rec
        return lie

    statuses, liar, fallbacks = await read_through_a_liar(tmp_path, etcd_url, forged)
    assert set(statuses) == {200}, statuses
    assert fallbacks == {"failed": 0, "absent": 0, "refused": len(set(liar.asked))}


async def test_an_owner_that_fails_still_falls_back_and_is_counted(tmp_path, etcd_url):
    def broken(real: dict[str, dict]):
        def lie(a: str) -> dict:
            raise RuntimeError("a 500")  # aiohttp answers 500
        return lie

    statuses, liar, fallbacks = await read_through_a_liar(tmp_path, etcd_url, broken)
    assert set(statuses) == {200}, statuses
    assert fallbacks["failed"] == len(set(liar.asked)) and fallbacks["absent"] == fallbacks["refused"] == 0
