"""What each request to the host tier does (``kdn.wire.host`` lists them): the fields checked, the
caller's namespaces from its token, the store and the fills asked, the answer built. Transport-free: a
connection (``kdn.host.session``) hands each request here with its leases.

Who may see what: the token's read grant (``kdn.auth.Grants``, the edge's own grants file format) names
namespaces; an object is the caller's if ``may_read`` allows its record's namespace. Anything else, held or
not, answers exactly as an unpublished object does, and is never filled for that caller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kdn.auth import AuthError, Grants, may_read
from kdn.errors import DigestMismatch, InvalidInput, SourceError
from kdn.format.address import Address, validate_address
from kdn.format.store import validate_encoding
from kdn.host.fill import Absent, Filler
from kdn.host.leases import Leases
from kdn.wire.host import MAX_ADDRESSES, MAX_LEASE_MANY, RECORDS_BYTES, VERSION, HostError
from kdn.host.segment import Segment
from kdn.host.store import Held, HostStore, Key, NoRoom
from kdn.registry.records import ObjectRecord
from kdn.service.records import wait_floor

if TYPE_CHECKING:  # pragma: no cover
    from kdn.service.records import DenyFloor

WARM_CONCURRENCY = 4  # fills one warm runs at once (each is one fetch from the edges)
LEASE_TRIES = 3  # fills of one lease whose object was evicted before the lease could pin it

Op = Callable[[Leases, frozenset[str], dict[str, Any]], Awaitable[dict[str, Any]]]


class Ops:
    """The host tier's requests, over its store, fills and grants."""

    def __init__(self, store: HostStore, filler: Filler, grants: Grants, segment: Segment,
                 stats: Callable[[], dict[str, int]], *, floor: DenyFloor | None = None) -> None:
        """``floor``: how long an "absent" takes at least (``DenyFloor``); None answers it as soon as known."""
        self.store, self.filler, self.grants, self.segment, self.stats = store, filler, grants, segment, stats
        self.floor = floor
        self.ops: dict[str, Op] = {"hello": self.hello, "lookup": self.lookup, "lease": self.lease,
                                   "lease_many": self.lease_many, "release": self.release,
                                   "release_many": self.release_many, "warm": self.warm, "stats": self.stats_op}

    async def answer(self, leases: Leases, request: dict[str, Any]) -> dict[str, Any]:
        """The answer's fields (without ``id``); HostError for a refusal."""
        name = request.get("op")
        op = self.ops.get(name) if isinstance(name, str) else None
        if op is None:
            raise HostError("bad-request", f"unknown op {str(request.get('op'))[:24]!r}: one of {sorted(self.ops)}")
        since, ns = time.monotonic(), self.namespaces(request.get("token"))
        try:
            out = await op(leases, ns, request)
        except HostError as e:
            if e.code == "absent":
                await self._hold_no(ns, since, sample=True)
            raise
        if _says_absent(str(name), out):
            await self._hold_no(ns, since, sample=False)
        return {"ok": True, **out}

    async def _hold_no(self, ns: frozenset[str], since: float, *, sample: bool) -> None:
        """An answer that says "absent" (for one address or several) waits for the floor: another tenant's
        object held here is refused at once, one never published after its record was asked of the edges, and
        without the floor the difference would tell a tenant what its neighbours' engines read. (A caller that
        may read every namespace has nothing kept from it.) ``sample``: the time it took counts towards the
        floor's percentile (a single lease's; a batch's answer also waited for the fills of its other
        addresses, which would lift every tenant's floor)."""
        if self.floor is None or "*" in ns:
            return
        if sample:
            await self.floor.hold(since)
        else:
            await wait_floor(since, self.floor.no_floor())

    def namespaces(self, token: object) -> frozenset[str]:
        """The namespaces ``token`` may read (anonymous: those of the grants' anonymous grant)."""
        if token is not None and not (isinstance(token, str) and 0 < len(token) <= 512):
            raise HostError("bad-request", "token must be a string of 1..512 characters")
        try:
            return self.grants.namespaces(f"Bearer {token}" if token else None, "read")
        except AuthError as e:
            raise HostError("unauthorized", str(e)) from None

    # --- the ops ---------------------------------------------------------------------------------------------

    async def hello(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        """Where the segment is, and which file it is (an engine maps only that one)."""
        i = self.segment.identity
        return {"version": VERSION, "segment": str(self.segment.path), "size": i.size, "device": i.device,
                "inode": i.inode}

    async def lookup(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        """Per address, the encodings held for this caller; ``prefix``: how many leading addresses have one;
        with ``records``, each held one's signed record (the one its fill verified). Never fills."""
        addresses = _addresses(r)
        encoding = _encoding(r) if r.get("encoding") is not None else None
        # Each address looked at once, however often it is named: 4,096 copies of another tenant's held
        # address would otherwise take measurably longer to answer "not held" than an unpublished one.
        mine = {a: sorted(h.key[1] for h in self.store.encodings(a)
                          if _theirs(ns, h.record) and encoding in (None, h.key[1]))
                for a in dict.fromkeys(addresses)}
        encodings = [mine[a] for a in addresses]
        held = [bool(e) for e in encodings]
        prefix = held.index(False) if False in held else len(held)
        out: dict[str, Any] = {"prefix": prefix, "held": held, "encodings": encodings}
        if r.get("records") is True:  # the signed record of each one held (an engine's lookup: no edge asked)
            out["records"] = self._records(ns, addresses, encodings)
        return out

    def _records(self, ns: frozenset[str], addresses: list[Address], encodings: list[list[str]]
                 ) -> list[dict[str, Any] | None]:
        """Each held address's record, in order, while they fit ``RECORDS_BYTES`` packed (None past that, and
        for one not held): the answer stays inside ``MAX_MESSAGE`` whatever the records' piece lists weigh.
        (Each record's map and packed size were made when its object was held: ``Held.wire``.)"""
        out: list[dict[str, Any] | None] = []
        left = RECORDS_BYTES
        for a, e in zip(addresses, encodings):
            h = next((h for h in self.store.encodings(a) if _theirs(ns, h.record)), None) \
                if e and left > 0 else None
            if h is not None:
                left -= h.wire_bytes
            out.append(h.wire if h is not None and left >= 0 else None)
        return out

    async def lease(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        """The object pinned for this connection (filled first if absent): where its blob lies, its record."""
        key = (_address(r.get("address")), _encoding(r))
        theirs = self.store.get(key)
        if theirs is not None and not _theirs(ns, theirs.record):
            raise _absent(key)  # (untouched: not a hit, not a use in the eviction order)
        h = self.store.acquire(key)
        filled = h is None
        if h is None:
            h = await self._fill_and_pin(key, ns)
        # acquire (or _fill_and_pin's last step) pinned it, and no await came since: the lease table takes the
        # pin over now, so a connection that dies from here on hands it back (Leases.close).
        lease = leases.add(h)
        return {"lease": lease, "offset": h.offset, "length": h.length, "generation": h.generation, "record": h.wire,
                "filled": filled}

    async def lease_many(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        """``lease`` of each address (one encoding), in one round trip: per address its lease's fields, or the
        refusal (``error``, ``message``) that ``lease`` would have answered; the others are still leased."""
        addresses, encoding = _addresses(r, MAX_LEASE_MANY), _encoding(r)

        async def one(address: Address) -> dict[str, Any]:
            try:
                return await self.lease(leases, ns, {"address": address, "encoding": encoding})
            except HostError as e:
                return {"error": e.code, "message": e.message}

        return {"leases": list(await asyncio.gather(*(one(a) for a in addresses)))}

    async def release_many(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        """Every lease named ends; one this connection does not hold is a bad request (the others still end)."""
        ids = r.get("leases")
        if not isinstance(ids, list) or len(ids) > MAX_LEASE_MANY:
            raise HostError("bad-request", f"leases must be a list of at most {MAX_LEASE_MANY} lease ids")
        unknown = []
        for lease in ids:
            try:
                leases.release(lease)
            except HostError:
                unknown.append(str(lease)[:24])
        if unknown:
            raise HostError("bad-request", f"no lease {', '.join(unknown[:4])} on this connection")
        return {}

    async def _fill_and_pin(self, key: Key, ns: frozenset[str]) -> Held:
        rec = await self._record(key[0])
        if rec is None or not _theirs(ns, rec):
            raise _absent(key)
        for _ in range(LEASE_TRIES):
            await self._fill(key, rec)
            # The fill committed, then this task was woken: between the two, other tasks ran, and a fill of
            # another object may have evicted this one (nobody pinned it yet). Pin it now, in the same step
            # as the check; if it went, fill it again.
            h = self.store.acquire(key, count=False)
            if h is not None:
                return h
        raise HostError("no-room", f"{key[0]}.{key[1]} was evicted {LEASE_TRIES} times before it could be "
                                   "leased: the segment is too small for the load on it")

    async def release(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        leases.release(r.get("lease"))
        return {}

    async def warm(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        """Fill what is not held yet, ahead of the requests that will lease it; per address what happened."""
        addresses, encoding = _addresses(r), _encoding(r)
        gate = asyncio.Semaphore(WARM_CONCURRENCY)

        async def one(address: Address) -> str:
            key = (address, encoding)
            h = self.store.get(key)
            if h is not None:
                return "held" if _theirs(ns, h.record) else "absent"
            async with gate:
                try:
                    rec = await self._record(address)
                    if rec is None or not _theirs(ns, rec):
                        return "absent"
                    await self._fill(key, rec)
                except HostError as e:
                    return "failed" if e.code == "unavailable" else e.code  # "absent" or "no-room"
            return "filled"

        return {"outcomes": await asyncio.gather(*(one(a) for a in addresses))}

    async def stats_op(self, leases: Leases, ns: frozenset[str], r: dict[str, Any]) -> dict[str, Any]:
        return self.stats()

    # --- fills, their failures as refusals ----------------------------------------------------------------

    async def _record(self, address: Address) -> ObjectRecord | None:
        try:
            return await self.filler.record(address)
        except SourceError as e:
            raise HostError("unavailable", f"no source answered for {address}'s record: {str(e)[:160]}") from None

    async def _fill(self, key: Key, rec: ObjectRecord) -> None:
        try:
            await self.filler.fill(key, rec)
        except Absent:
            raise _absent(key) from None
        except NoRoom as e:
            raise HostError("no-room", str(e)) from None
        except (SourceError, DigestMismatch) as e:
            raise HostError("unavailable", f"{key[0]}.{key[1]}: {str(e)[:200]}") from None


def _theirs(ns: frozenset[str], record: ObjectRecord) -> bool:
    """Whether the caller whose token reads ``ns`` may see the object ``record`` describes."""
    return may_read(ns, record.namespace, record.kind)


def _says_absent(op: str, answer: dict[str, Any]) -> bool:
    """Whether an answer refuses an address as absent: one of ``lease_many``'s, or a ``warm`` outcome."""
    if op == "lease_many":
        return any(x.get("error") == "absent" for x in answer["leases"])
    return op == "warm" and "absent" in answer["outcomes"]


def _absent(key: Key) -> HostError:
    """One answer for unpublished, no such encoding, and another tenant's."""
    return HostError("absent", f"no object {key[0]} in {key[1]!r} for this token")


def _address(value: object) -> Address:
    try:
        return validate_address(value)
    except InvalidInput as e:
        raise HostError("bad-request", str(e)) from None


def _encoding(r: dict[str, Any]) -> str:
    try:
        return validate_encoding(r.get("encoding"))
    except InvalidInput as e:
        raise HostError("bad-request", str(e)) from None


def _addresses(r: dict[str, Any], limit: int = MAX_ADDRESSES) -> list[Address]:
    a = r.get("addresses")
    if not isinstance(a, list) or len(a) > limit:
        raise HostError("bad-request", f"addresses must be a list of at most {limit}")
    return [_address(x) for x in a]
