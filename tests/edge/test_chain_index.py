"""The prefetch chain index is bounded (#29): at 10^7 manifests it would hold every chunk address of every
published document in every edge, and an edge's start read every manifest pointer's body from the origins.
Past its budget the chains read least recently go first; a snapshot reads the bodies of the newest pointers
only while there is room for them."""

from __future__ import annotations

import pytest
from blake3 import blake3

from edge_helpers import cluster, metric, publish, wait_until

from kdn.edge.config import EdgeConfig
from kdn.edge.prefetch import ChainIndex
from kdn.edge.views import _to_read
from kdn.errors import InvalidInput
from kdn.registry import Manifest

pytestmark = pytest.mark.timeout(60)

MID = "c" * 64


def _addr(tag: str, i: int) -> str:
    return blake3(f"{tag}/{i}".encode()).hexdigest()


def _manifest(name: str, n: int, *, version: int = 1, tag: str | None = None) -> Manifest:
    return Manifest(namespace="public", name=name, model_id=MID, addresses=[_addr(tag or name, i) for i in range(n)],
                    tokens=256 * n, chunk_tokens=256, prefix_tokens=list(range(256 * n)), version=version)


def test_past_its_budget_the_chain_read_least_recently_goes_first():
    idx = ChainIndex(budget=10)
    a, b, c = _manifest("a", 4), _manifest("b", 4), _manifest("c", 4)
    idx.put(a)
    idx.put(b)
    assert idx.addresses == 8 and len(idx) == 2
    assert idx.following(a.addresses[0], 2) == a.addresses[1:3]  # a is read: b is now the least recent
    idx.put(c)
    assert idx.addresses == 8 and idx.evicted == 1
    assert idx.following(b.addresses[0], 2) == []  # b went, its reads are no longer prefetched
    assert idx.following(a.addresses[1], 1) == a.addresses[2:3] and idx.following(c.addresses[0], 1) == c.addresses[1:2]
    # A new version of a chain replaces it in place (its old addresses go with it).
    a2 = _manifest("a", 2, version=2, tag="x")
    idx.put(a2)
    assert idx.addresses == 6 and idx.following(a.addresses[0], 1) == [] and idx.following(a2.addresses[0], 1) == a2.addresses[1:]
    idx.remove("public/c")
    assert idx.addresses == 2 and len(idx) == 1
    # A chain longer than the whole budget is not kept, and evicts nothing.
    idx.put(_manifest("huge", 11))
    assert idx.addresses == 2 and idx.evicted == 2 and idx.following(_addr("huge", 0), 1) == []
    assert not idx.full() and ChainIndex(budget=0).full()


def test_a_snapshot_reads_the_newest_pointers_while_the_index_has_room():
    whole = _manifest("w", 3)
    old, mid, new = (_manifest(n, 4, version=v).pointer("0" * 64) for n, v in (("old", 1), ("mid", 2), ("new", 3)))
    tomb = dataclass_tombstone()
    items: dict[str, Manifest | None] = {f"manifests/public/{m.name}": m for m in (whole, old, mid, new, tomb)}
    items["manifests/public/broken"] = None  # unreadable: watch_manifests counts it and reads nothing for it
    # 10 addresses: the whole manifest's 3 leave room for one pointer of 4, the newest.
    assert _to_read(items, 10) == ["manifests/public/new"]
    assert _to_read(items, 11) == ["manifests/public/new", "manifests/public/mid"]
    assert _to_read(items, 100) == ["manifests/public/new", "manifests/public/mid", "manifests/public/old"]
    assert _to_read(items, 3) == []


def dataclass_tombstone() -> Manifest:
    import dataclasses

    return dataclasses.replace(_manifest("gone", 1).tombstone(), version=9)


def test_the_bound_is_checked():
    assert EdgeConfig().chain_index == 1_000_000
    with pytest.raises(InvalidInput, match="chain_index"):
        EdgeConfig(chain_index=-1)


TEXT = ("Each log names the lamp, the oil, the wind and the ships that passed in the night. " * 30)[:1500]


async def test_an_edge_keeps_the_chains_its_budget_holds_and_counts_the_rest(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        m1 = await publish(c, TEXT)
        a1 = m1["addresses"]
        assert len(a1) >= 2
        # Room for doc1's chain exactly: it is in the edge's first snapshot.
        await c.start_edge("e1", prefetch=2, chain_index=len(a1))
        await c.wait_ring(["e1"])
        edge = c.edge("e1")
        await wait_until(lambda: edge.chains.following(a1[0], 1) == a1[1:2])
        m2 = await publish(c, "A second, shorter log. " + TEXT[:len(TEXT) // 2], name="doc2")
        a2 = m2["addresses"]
        assert 1 <= len(a2) <= len(a1)
        await wait_until(lambda: edge.chains.addresses == len(a2) and edge.chains.following(a1[0], 1) == [])
        assert edge.chains.following(a2[0], 1) == a2[1:2]  # the newest kept, doc1 dropped for room
        assert metric(c.edges["e1"], "kdn_edge_chain_index_evicted") == 1
        assert metric(c.edges["e1"], "kdn_edge_chain_index_addresses") == len(a2)
