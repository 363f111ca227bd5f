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
    from kdn.client.hosted import Held
    from kdn.registry.records import ObjectRecord

Ask = Callable[[str, str, "dict[str, Any] | None"], Awaitable["dict[str, Any] | None"]]
ReadRecord = Callable[[Address], Awaitable["ObjectRecord | None"]]
AskHost = Callable[[list[Address]], Awaitable["Held"]]  # kdn.client.hosted.held, with records


async def find_prefix(ask: Ask, record: ReadRecord, trust: Trust, toks: list[int], model_id: ModelId,
                      namespace: str, chunk_tokens: int, host: AskHost | None = None) -> Lookup:
    """The longest published prefix of ``toks`` (``KDNClient.lookup``). With the machine's host tier (``host``)
    it is asked first, over its local socket: where it holds every whole chunk of the prompt and each signed
    record it sends checks, no edge is asked (none could match more); else the edge answers, as ever. Either
    way what the host said it holds rides with the lookup (``Lookup.held``), so a load does not ask again."""
    model_id = A.validate_model_id(model_id)
    full = A.prefix_addresses(model_id, namespace, toks, chunk_tokens, full_chunks_only=True)
    n, where, cold = 0, list[object](), set[Address]()
    addrs: list[Address] = []
    records: list[ObjectRecord] = []
    on_host: list[frozenset[str]] | None = None
    chain = None
    if full:
        if host is not None:
            chain, on_host = await _host_chain(host, trust, full)
        if chain is not None:
            n, where, addrs, records = len(full), ["host"] * len(full), list(full), chain
        else:
            n, where, cold, addrs, records = await _whole_chunks(ask, record, trust, full)
    covered = n * chunk_tokens
    if n:
        if chain is not None and on_host is not None:  # its tail, too, from the host where it holds it
            tier, held_tail = host, on_host
            assert tier is not None

            async def record_of(a: Address) -> ObjectRecord | None:
                r, encs = await _host_record(tier, trust, a)
                if r is not None:
                    held_tail.append(encs)
                    return r
                return await record(a)

            covered = await _tail(record_of, toks, addrs, records, covered)
        else:
            covered = await _tail(record, toks, addrs, records, covered)
    n_held = len(addrs) if chain is not None else n
    return Lookup(model_id=model_id, namespace=namespace, addresses=addrs, tokens=covered,
                  chunk_tokens=chunk_tokens, records=records, cold=cold if n else set(),
                  sources=[str(w) for w in where[:n]], held=on_host[:n_held] if on_host is not None else None)


async def _host_chain(host: AskHost, trust: Trust, full: list[Address]
                      ) -> tuple[list[ObjectRecord] | None, list[frozenset[str]] | None]:
    """(the chain's records, where the host holds all of ``full`` and every record it sent checks, else None;
    the encodings it holds of each, None where it did not answer)."""
    got = await host(full)
    if len(got.encodings) != len(full):  # no host answer (down, slow, gone): it holds nothing it could say
        return None, None
    if got.records is None or not all(got.encodings):
        return None, got.encodings
    recs = [trust.record(d, a) if d is not None else None for d, a in zip(got.records, full)]
    if any(r is None for r in recs):
        return None, got.encodings
    return [r for r in recs if r is not None], got.encodings


async def _host_record(host: AskHost, trust: Trust, address: Address) -> tuple[ObjectRecord | None, frozenset[str]]:
    """One object's record from the host tier, checked, and the encodings it holds; (None, ...) where it does
    not hold it or its record does not check."""
    got = await host([address])
    if len(got.encodings) != 1 or not got.encodings[0] or not got.records or got.records[0] is None:
        return None, frozenset()
    return trust.record(got.records[0], address), got.encodings[0]


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
