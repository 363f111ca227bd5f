"""How many leading tokens of a prompt are published (``KDNClient.lookup``): whole chunks, then a partial tail.

Whole chunks are found with one ``/v1/lookup``, the matched chain's records riding with the answer; past
them, the last matched chunk's record lists its partial tails (length -> address), so a prompt that continues
past a published text (text + question) reuses all of the text. An edge's answer is a claim: with publisher
keys a chunk counts only once its signed record verifies (``kdn.client.trust``).

The client hands in how it asks (``ask``: a JSON request to the first source that answers) and how it reads
one record, so that what it ranks and counts (a bench's client overrides both) holds for lookups too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kdn.format import address as A
from kdn.format.address import Address, ModelId
from kdn.client.lookup import Lookup
from kdn.client.trust import Trust

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import ObjectRecord

Ask = Callable[[str, str, "dict[str, Any] | None"], Awaitable["dict[str, Any] | None"]]
ReadRecord = Callable[[Address], Awaitable["ObjectRecord | None"]]


async def find_prefix(ask: Ask, record: ReadRecord, trust: Trust, toks: list[int], model_id: ModelId,
                      namespace: str, chunk_tokens: int) -> Lookup:
    """The longest published prefix of ``toks`` (``KDNClient.lookup``)."""
    model_id = A.validate_model_id(model_id)
    full = A.prefix_addresses(model_id, namespace, toks, chunk_tokens, full_chunks_only=True)
    n, where, cold = 0, list[object](), set[Address]()
    addrs: list[Address] = []
    records: list[ObjectRecord] = []
    if full:
        n, where, cold, addrs, records = await _whole_chunks(ask, record, trust, full)
    covered = n * chunk_tokens
    if n:
        covered = await _tail(record, toks, addrs, records, covered)
    return Lookup(model_id=model_id, namespace=namespace, addresses=addrs, tokens=covered,
                  chunk_tokens=chunk_tokens, records=records, cold=cold if n else set(),
                  sources=[str(w) for w in where[:n]])


async def _whole_chunks(ask: Ask, record: ReadRecord, trust: Trust, full: list[Address]
                        ) -> tuple[int, list[object], set[Address], list[Address], list[ObjectRecord]]:
    """(chunks matched, the tier of each, those the edge must fill, their addresses, their records)."""
    # The matched chain's records ride with the answer (the edge read them to answer): one round trip
    # where a lookup of 31 chunks took 32, and the engine's scheduler another 31 (bench/lookup.py).
    body = await ask("POST", "/v1/lookup", {"addresses": full, "records": True})
    try:  # an edge's answer is a claim: a number within the chain, or nothing
        n = max(0, min(int(body["length"]), len(full))) if body else 0
    except (KeyError, TypeError, ValueError):
        n = 0
    sources = body.get("sources") if body else None
    where: list[object] = sources if isinstance(sources, list) else []
    sent = body.get("records") if body else None
    inline: list[object] = sent[:n] if isinstance(sent, list) else []
    # Not in the answering edge's tiers: a read fills it (through the owner, or from the origin).
    cold = {a for a, w in zip(full, where) if w not in ("memory", "disk")}
    addrs = full[:n]
    records: list[ObjectRecord] = []
    if n:
        # The edge's "I have n" is a claim; with keys a chunk counts only once its signed record verifies.
        recs = await _records(record, trust, addrs, inline)
        if trust.verifier is not None:
            n = next((i for i, r in enumerate(recs) if r is None), n)
            addrs, recs = addrs[:n], recs[:n]
        records = [r for r in recs if r is not None] if None not in recs else []
    return n, where, cold, addrs, records


async def _tail(record: ReadRecord, toks: list[int], addrs: list[Address], records: list[ObjectRecord],
                covered: int) -> int:
    """Past the whole chunks, the longest partial tail the last one's record lists that ``toks`` continue
    with: appended to ``addrs`` (and its record to ``records``, when they are kept); the tokens covered now."""
    parent = records[-1] if records else await record(addrs[-1])
    tails = parent.tails if parent is not None else {}
    for length in sorted(tails, reverse=True):
        if covered + length <= len(toks):
            cand = A.next_address(addrs[-1], toks[covered:covered + length])
            tail = await record(cand) if cand == tails[length] else None
            if tail is not None:
                addrs.append(cand)
                if records:
                    records.append(tail)
                return covered + length
    return covered


async def _records(record: ReadRecord, trust: Trust, addrs: list[Address],
                   inline: list[object]) -> list[ObjectRecord | None]:
    """The records of ``addrs``, in order: each one sent with the lookup (``inline``) as ``record`` would
    check it; one the answer lacks (an older edge, an entry that is not this address's record) is read by
    itself, with keys. Without keys, a missing one stays None (read later by whoever needs it)."""
    out: list[ObjectRecord | None] = []
    unsent: list[int] = []
    for i, a in enumerate(addrs):
        d = inline[i] if i < len(inline) else None
        if not (isinstance(d, dict) and d.get("address") == a):
            out.append(None)
            unsent.append(i)
        else:
            out.append(trust.record(d, a))  # a refused one stays None: it is never read again
    if unsent and trust.verifier is not None:
        for i, r in zip(unsent, await asyncio.gather(*(record(addrs[i]) for i in unsent))):
            out[i] = r
    return out
