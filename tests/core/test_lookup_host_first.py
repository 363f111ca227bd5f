"""A lookup asks the machine's host tier first (``kdn.client.find``, ``KDNClient(host=)``): a chain it holds whole,
with every signed record it sends checking, is found with no edge asked; anything less (a chunk it lacks, a record
that does not verify, no answer) goes to the edge as ever. What the host said it holds rides with the lookup
(``Lookup.held``). The end-to-end case (a real host tier, transformers) is tests/host/test_host_from_edges.py."""

from __future__ import annotations

import asyncio

import pytest

from kdn.client.find import find_prefix
from kdn.client.hosted import Held
from kdn.client.trust import Trust
from kdn.format import address as A
from kdn.registry.records import Encoding, ObjectRecord
from kdn.registry.signing import Signer

MODEL = "b" * 64
CHUNK = 4
TOKS = list(range(3 * CHUNK + 2))  # three whole chunks, and two tokens more


@pytest.fixture
def signer(tmp_path):
    return Signer.generate(tmp_path / "origin.key")


def record(signer: Signer, address: str, i: int) -> dict:
    enc = Encoding("raw", 4096, f"{i + 1:064x}")
    rec = ObjectRecord(address=address, model_id=MODEL, namespace="public", kind="kv", start=i * CHUNK,
                       end=(i + 1) * CHUNK, parent=None, standalone=False, encodings={"raw": enc},
                       origin="http://127.0.0.1:1", tails={}, created=0.0, engine="transformers")
    return signer.sign(rec).to_dict()


class World:
    """The edge's answers and the host's, counted."""

    def __init__(self, signer: Signer, host_holds: int, *, forge: int | None = None, host_up: bool = True) -> None:
        self.full = A.prefix_addresses(MODEL, "public", TOKS, CHUNK, full_chunks_only=True)
        self.recs = [record(signer, a, i) for i, a in enumerate(self.full)]
        self.host_holds, self.forge, self.host_up = host_holds, forge, host_up
        self.edge_asks: list[str] = []
        self.host_asks = 0

    async def ask(self, method: str, path: str, body: dict | None) -> dict | None:
        self.edge_asks.append(path)
        return {"length": len(self.full), "sources": ["memory"] * len(self.full), "records": self.recs}

    async def record(self, address: str) -> ObjectRecord | None:
        self.edge_asks.append("record")
        return None

    async def host(self, addresses: list[str]) -> Held:
        self.host_asks += 1
        if not self.host_up:
            return Held([])
        encs = [frozenset({"raw"}) if self.full.index(a) < self.host_holds else frozenset() for a in addresses]
        recs: list[dict | None] = [self.recs[self.full.index(a)] if e else None for a, e in zip(addresses, encs)]
        if self.forge is not None and recs[self.forge] is not None:
            r = dict(recs[self.forge])  # type: ignore[arg-type]
            r["encodings"] = {"raw": {**r["encodings"]["raw"], "digest": "0" * 64}}
            recs[self.forge] = r
        return Held(encs, recs)

    def lookup(self, trust: Trust, *, host: bool = True):
        return asyncio.run(find_prefix(self.ask, self.record, trust, TOKS, MODEL, "public", CHUNK,
                                       self.host if host else None))


def test_a_chain_the_host_holds_whole_is_found_without_the_edge(signer):
    w = World(signer, host_holds=3)
    hit = w.lookup(Trust([signer.public]))
    assert hit.addresses == w.full and hit.tokens == 3 * CHUNK and w.edge_asks == [] and w.host_asks == 1
    assert [r.address for r in hit.records] == w.full and hit.sources == ["host"] * 3 and not hit.cold
    assert hit.held == [frozenset({"raw"})] * 3


def test_a_chain_the_host_holds_in_part_is_the_edges_and_what_the_host_holds_rides_along(signer):
    w = World(signer, host_holds=2)
    hit = w.lookup(Trust([signer.public]))
    assert w.edge_asks == ["/v1/lookup"] and hit.addresses == w.full and hit.sources == ["memory"] * 3
    assert hit.held == [frozenset({"raw"}), frozenset({"raw"}), frozenset()]


def test_a_record_from_the_host_that_does_not_verify_sends_the_lookup_to_the_edge(signer):
    """A host tier is trusted no further than its records' signatures: one forged record and the edge is asked
    (whose records verify), with the publisher's keys."""
    w = World(signer, host_holds=3, forge=1)
    trust = Trust([signer.public])
    hit = w.lookup(trust)
    assert w.edge_asks == ["/v1/lookup"] and trust.rejected == 1
    assert hit.addresses == w.full and [r.encodings["raw"].digest for r in hit.records] == \
        [f"{i + 1:064x}" for i in range(3)]


def test_a_host_that_does_not_answer_changes_nothing(signer):
    w = World(signer, host_holds=3, host_up=False)
    hit = w.lookup(Trust([signer.public]))
    assert w.edge_asks == ["/v1/lookup"] and hit.addresses == w.full and hit.held is None


def test_without_a_host_the_lookup_is_the_edges(signer):
    w = World(signer, host_holds=3)
    hit = w.lookup(Trust([signer.public]), host=False)
    assert w.edge_asks == ["/v1/lookup"] and w.host_asks == 0 and hit.held is None
