"""Object records at an edge: a bounded cache in front of where they live (the registry, or the origins).

Records are immutable once written (a new encoding or tail is a new version,
``RecordCache.forget``), so the cache keeps them without expiry, bounded; it
remembers absent ones for a short while, so that a flood of misses costs one
read per address per ``negative_ttl``. It is also what the edge's own
``/v1/registry/objects/{address}`` and ``POST /v1/records`` answer from.

A cache shared by tenants tells by its timing what others read: another
tenant's record, cached because its owner read it lately, is refused without
a registry read, an absent one after one (~570 vs ~800 us medians on loopback).
So every "no" (absent, or not yours) is held until ``hold(since)``: no sooner
than ``floor_s`` after the request came, nor than the 99th percentile of the
last minute's reads from the source (at most 50 ms). Both kinds of "no" then
take the floor, and only a read slower than it still shows.

Where they live (``kdn edge serve --records``):

- ``registry``: one registry read per miss, batched for a lookup;
- ``origin``: the origins' stores, where an origin started with ``--records
  store`` keeps them beside the blobs (``kdn.registry.split``). A miss goes to
  the owner edge of the address (``OwnerRecords``, ``X-KDN-Hop``: its cache
  stands for the whole region), which asks, as the edge does for what it owns,
  ``POST /v1/records`` of the origins (configured, or listed in the registry),
  in batches of ``kdn.service.MAX_RECORDS``, with its upstream token where the
  token may go; what one origin lacks is asked of the next. A record is believed
  only as far as its signature (with ``--trusted-keys``) and its address allow. An
  owner is another node of the registry, not a publisher: its "no" (``null``, a
  record not believed, no answer) is asked of the origins, and only theirs is
  cached as absent. No object record is read from the registry on a request's path.
- ``auto`` (the default): as ``origin`` while any origin is known, and then the
  registry for what no origin has (records a producer without an origin store
  wrote there: ``kdn.adapters.vllm.save``; an origin still on ``--records
  registry`` answers from the registry itself); the registry alone while no
  origin is known or none answers (its "no" final only where no origin was
  ever listed: a deployment of producers alone). A record found in the registry is believed
  as far as one from an origin is (signature and address), no further: an
  operator who wants no registry read at all, even for an absent record, runs
  ``origin``. A record the registry lacks while no origin answered is unknown,
  not absent: the read fails (a 503), never a cached "no".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from urllib.parse import quote

import aiohttp
from blake3 import blake3

from kdn.format.address import Address, Digest
from kdn.errors import InvalidInput, RegistryUnavailable
from kdn.wire.fetch import HOP
from kdn.registry import Manifest, NodeRecord, ObjectRecord
from kdn.service import MAX_RECORDS
from kdn.service.records import floor_of, wait_floor

log = logging.getLogger("kdn.edge")

# A "no" follows slow record reads up to this (a slower registry then shows in its timing, but a slow spell
# does not make every refusal wait a second), over the reads of the last minute only.
READS_WINDOW_S = 60.0  # the record reads whose p99 a "no" follows (at most MAX_FLOOR_S: kdn.service.records)
MAX_RECORDS_BODY = MAX_RECORDS * 16 << 10  # bytes of one answer: far above a real record's ~1.4 KB each


class RecordCache:
    """Object records by address: immutable once written, so cached without expiry (bounded LRU).

    With a ``verifier`` (the publisher keys this edge trusts), a record that is not
    signed by one of them is treated as absent, and never cached: its digest is
    not believed, so no byte is fetched, kept or served for it.
    """

    def __init__(self, source, size: int, verifier=None, on_refused=None, negative_ttl: float = 2.0,
                 floor_s: float = 0.002, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source  # the registry, or (--records origin) the origins' stores: get_object(s)
        self.size = size
        self.verifier = verifier
        self.on_refused = on_refused
        self._lru: OrderedDict[Address, ObjectRecord] = OrderedDict()
        # Addresses the registry did not have (or whose record is not trusted), for negative_ttl
        # seconds: a flood of requests for absent addresses costs one registry read each per TTL,
        # not one per request. A record published meanwhile is seen at most that late.
        self.negative_ttl = negative_ttl
        self._absent: OrderedDict[Address, float] = OrderedDict()  # address -> when to ask again, by ``clock``
        self.clock = clock  # (the negative TTL's; tests step it)
        if not 0 <= floor_s <= 1:
            raise InvalidInput(f"the floor of a 'no' must be 0-1000 ms, not {floor_s * 1000:g} ms")
        self.floor_s = floor_s  # 0: a "no" is answered as soon as known (its timing then tells cached from not)
        # (when, how long) of the last successful reads from the source: a failed one (a registry down for a
        # while) says nothing of how long a read takes, and once made every "no" wait out its timeout.
        self._read_s: deque[tuple[float, float]] = deque(maxlen=256)

    def _took(self, t0: float) -> None:
        """A read from the source *and* the checks of what it gave (signatures: ~0.1 ms a record, so a batch of
        present records took longer than one of absent ones past a floor that timed the read alone)."""
        now = time.monotonic()
        self._read_s.append((now, now - t0))

    def no_floor(self) -> float:
        """Seconds a "no" takes at least: ``floor_s``, or the 99th percentile of the source reads of the last
        ``READS_WINDOW_S`` if longer, up to ``MAX_FLOOR_S`` (a read slower than that shows). 0: the floor off."""
        return floor_of(self.floor_s, self._read_s, READS_WINDOW_S)

    async def hold(self, since: float) -> None:
        """Wait until ``no_floor()`` seconds have passed since ``since`` (``time.monotonic()``): what a
        handler does before it answers "no", whether or not the source was asked (``wait_floor``)."""
        await wait_floor(since, self.no_floor())

    def _known_absent(self, address: Address) -> bool:
        until = self._absent.get(address)
        if until is None:
            return False
        if self.clock() < until:
            return True
        del self._absent[address]
        return False

    def _note_absent(self, address: Address) -> None:
        if self.negative_ttl > 0:
            self._absent[address] = self.clock() + self.negative_ttl
            self._absent.move_to_end(address)
            while len(self._absent) > self.size:
                self._absent.popitem(last=False)

    def _trusted(self, rec: ObjectRecord | None, address: Address) -> ObjectRecord | None:
        """``rec`` if this edge believes it is ``address``'s record, else None (counted, logged)."""
        if rec is not None and rec.address != address:  # a record stored under another address: a writer's lie
            log.warning("the record read for %s is %s's: not believed", address[:16], rec.address[:16])
            if self.on_refused is not None:
                self.on_refused()
            return None
        if rec is None or self.verifier is None or self.verifier.ok(rec):
            return rec
        log.warning("object record %s is not signed by a trusted publisher key: not believed", rec.address)
        if self.on_refused is not None:
            self.on_refused()
        return None

    def _keep(self, rec: ObjectRecord) -> None:
        self._lru[rec.address] = rec
        self._lru.move_to_end(rec.address)
        while len(self._lru) > self.size:
            self._lru.popitem(last=False)

    async def _read(self, addresses: list[Address], hop: bool) -> list[ObjectRecord | None]:
        """Each record from the source if believed (``_trusted``), else None: what is cached as absent. An
        ``OwnerRecords`` source is handed the check, so that what an owner edge relays and this edge does not
        believe goes on to the origins there: a "no" kept here is an origin's or the registry's, never a relay's."""
        if isinstance(self.source, OwnerRecords):
            return await self.source.get_objects(addresses, hop=hop, trusted=self._trusted)
        if len(addresses) == 1:
            got = [await self.source.get_object(addresses[0])]
        else:
            got = await self.source.get_objects(addresses)
        return [self._trusted(rec, a) for a, rec in zip(addresses, got)]

    async def get(self, address: Address, hop: bool = False) -> ObjectRecord | None:
        rec = self._lru.get(address)
        if rec is None and not self._known_absent(address):
            t0 = time.monotonic()
            rec = (await self._read([address], hop))[0]
            self._took(t0)
            if rec is not None:
                self._keep(rec)
            else:
                self._note_absent(address)
        return rec

    async def get_many(self, addresses: Sequence[Address], hop: bool = False) -> list[ObjectRecord | None]:
        """``hop``: the caller is an edge of this region asking its owner (``X-KDN-Hop``): misses go to the
        origins, never to another owner (``OwnerRecords``)."""
        missing = list(dict.fromkeys(a for a in addresses if a not in self._lru and not self._known_absent(a)))
        if missing:
            t0 = time.monotonic()
            got = await self._read(missing, hop)
            for address, rec in zip(missing, got):
                if rec is not None:
                    self._keep(rec)
                else:
                    self._note_absent(address)
            self._took(t0)
        return [self._lru.get(a) for a in addresses]

    # the names a record source has (kdn.service.RecordSource): the edge serves its records from here
    get_object = get

    async def get_objects(self, addresses: Sequence[Address], hop: bool = False) -> list[ObjectRecord | None]:
        return await self.get_many(addresses, hop=hop)

    takes_hop = True  # kdn.service.post_records passes a hop through

    def forget(self, address: Address) -> None:
        """Encodings can be added to a record later: drop it so the next read sees them."""
        self._lru.pop(address, None)
        self._absent.pop(address, None)


class OriginRecords:
    """Object records from the origins' stores (``POST /v1/records``), for an edge's ``RecordCache``."""

    def __init__(self, session: aiohttp.ClientSession, origin_urls: Callable[[], list[str]],
                 headers: Callable[[str], dict[str, str]], timeout: float = 10.0, fallback=None,
                 on_fallback: Callable[[int], None] | None = None,
                 ever_listed: Callable[[], bool] | None = None) -> None:
        self.session = session
        self.origin_urls = origin_urls
        self.headers = headers
        self.timeout = timeout
        # ``--records auto``: the registry (get_objects), asked for what no origin has, and for everything while
        # no origin is known or none answers; ``on_fallback(n)`` counts the records asked of it.
        self.fallback = fallback
        self.on_fallback = on_fallback
        # Once an origin was listed, an empty list means they are all away (restarting, their leases lapsed),
        # not that none exists: the registry's "no" is then not the last word on records kept in their stores.
        self.ever_listed = ever_listed

    async def get_object(self, address: Address) -> ObjectRecord | None:
        return (await self.get_objects([address]))[0]

    async def get_objects(self, addresses: Sequence[Address]) -> list[ObjectRecord | None]:
        out: list[ObjectRecord | None] = []
        unheard = False  # origins are known and none answered for some of these
        for i in range(0, len(addresses), MAX_RECORDS):
            got, heard = await self._batch(list(addresses[i:i + MAX_RECORDS]))
            out += got
            unheard = unheard or not heard
        if self.fallback is not None and (missing := [i for i, rec in enumerate(out) if rec is None]):
            got = await self.fallback.get_objects([addresses[i] for i in missing])
            if self.on_fallback is not None:
                self.on_fallback(len(missing))
            for i, rec in zip(missing, got):
                out[i] = rec
            if unheard and any(rec is None for rec in out):
                # Not in the registry, and the origins that would know did not answer: unknown, not absent
                # (a "no" would be cached, and a client would compute instead of asking another source).
                raise RegistryUnavailable("no origin answered for object records, and the registry lacks "
                                          f"{sum(rec is None for rec in out)} of them")
        return out

    async def _batch(self, addresses: list[Address]) -> tuple[list[ObjectRecord | None], bool]:
        """Each origin keeps the records of what it published: the ones the first did not have are asked of
        the next, and so on; absent only if no origin that answered has it. With the records, whether an
        origin answered (or none is listed and none ever was, so that the registry's word is the last one)."""
        urls = self.origin_urls()
        if not urls:
            if self.fallback is not None:  # the registry is asked for all of them; its word is the last ...
                away = self.ever_listed is not None and self.ever_listed()
                return [None] * len(addresses), not away  # ... only where no origin was ever listed
            raise RegistryUnavailable("no origin to read object records from (--records origin)")
        out: list[ObjectRecord | None] = [None] * len(addresses)
        missing = list(range(len(addresses)))
        errors, answered = [], 0
        for url in urls:
            try:
                got = await self._ask(url, [addresses[i] for i in missing])
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}"[:200])
                continue
            answered += 1
            for i, rec in zip(missing, got):
                out[i] = rec
            missing = [i for i in missing if out[i] is None]
            if not missing:
                break
        if not answered:
            if self.fallback is not None:
                log.info("no origin answered for %d object records (%s): asking the registry", len(addresses),
                         "; ".join(errors)[:300])
                return out, False
            raise RegistryUnavailable("no origin answered for object records: " + "; ".join(errors))
        return out, True

    async def get_manifest_body(self, namespace: str, name: str, digest: Digest) -> Manifest | None:
        """The whole manifest a registry pointer names (an origin with ``--records store`` keeps it beside its
        records): asked of each origin in turn, believed only if its packed bytes hash to ``digest``."""
        errors = []
        for url in self.origin_urls():
            path = f"{url}/v1/registry/manifests/{quote(namespace, safe='')}/{quote(name, safe='')}"
            try:
                async with self.session.get(path, params={"body": digest}, headers=self.headers(url),
                                            allow_redirects=False,  # the edge token is for this host only
                                            timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                    if r.status == 404:
                        continue
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}")
                    body = await _bounded(r)
                full = Manifest.from_dict(json.loads(body))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError, TypeError) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}"[:200])
                continue
            if full.body is None and blake3(full.pack()).hexdigest() == digest:
                return full
            log.warning("origin %s sent a manifest body for %s/%s that is not %s: refused", url, namespace, name,
                        digest[:16])
        if errors:
            log.warning("manifest body %s: %s", digest[:16], "; ".join(errors))
        return None

    async def _ask(self, url: str, addresses: list[Address], extra: dict[str, str] | None = None
                   ) -> list[ObjectRecord | None]:
        async with self.session.post(url + "/v1/records", json={"addresses": addresses},
                                     headers={**self.headers(url), **(extra or {})},
                                     allow_redirects=False,  # the edge token is for this host only
                                     timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}")
            body = await _bounded(r)
        data = json.loads(body)
        recs = data.get("records") if isinstance(data, dict) else None
        if not isinstance(recs, list) or len(recs) != len(addresses):
            raise ValueError("answer is not one record (or null) per address asked")
        out: list[ObjectRecord | None] = []
        for address, d in zip(addresses, recs):
            rec = None
            if d is not None:
                try:
                    rec = ObjectRecord.from_dict(d)
                except (InvalidInput, TypeError, ValueError, KeyError) as e:
                    log.warning("origin %s sent a malformed record for %s: %s", url, address[:16], e)
            out.append(rec)  # one under another address is caught by RecordCache._trusted
        return out


class OwnerRecords:
    """Object records for an edge with ``--records origin``, through the owner edge of each address (its
    region's ring), as its blobs are filled: the owner's record cache, whose misses go to the origins,
    stands for every edge of the region, so the origins read about one record per object per region, not
    one per edge. Addresses this edge owns, and a request that is already a hop (``X-KDN-Hop``, from any
    caller: it only sends the read to the origins), go to the origins (``OriginRecords``).

    An owner is any node record of the region, which a registry writer can add: its answer is a hint, never
    the last word. Every record it relays is checked as it lands (the caller's ``trusted``), and what it
    does not give (no answer, ``null``, a record this edge does not believe: another address's, unsigned,
    forged) is asked of the origins, as a failed owner's is, and counted per owner and outcome
    (``on_fallback``). So an absent address costs each edge an origin read per negative TTL, not each
    region: the price of an owner's "no" not being final, where it once made every chunk a lying owner
    held a 404 for the region."""

    def __init__(self, origins: OriginRecords, owner: Callable[[Address], NodeRecord | None], me: str,
                 on_read: Callable[[str, int], None] | None = None,
                 on_fallback: Callable[[str, str, int], None] | None = None) -> None:
        self.origins = origins
        self.owner = owner  # address -> the region's owner edge (Membership.owner), None: no ring yet
        self.me = me
        self.on_read = on_read  # (where: "owner" | "origin", how many records) for the metrics
        # (owner node id, outcome: "failed" | "absent" | "refused", how many records) asked of the origins instead
        self.on_fallback = on_fallback

    async def get_objects(self, addresses: Sequence[Address], *, hop: bool,
                          trusted: Callable[[ObjectRecord | None, Address], ObjectRecord | None]
                          ) -> list[ObjectRecord | None]:
        """Each address's record, or None where the origins have none this edge believes. ``trusted(rec,
        address)``: ``rec`` if believed, else None (``RecordCache._trusted``), applied to every answer."""
        out: list[ObjectRecord | None] = [None] * len(addresses)
        direct: list[int] = []
        by_owner: dict[str, tuple[str, list[int]]] = {}  # owner URL -> (its node id, indexes it owns)
        for i, a in enumerate(addresses):
            o = None if hop else self.owner(a)
            if o is None or o.node_id == self.me:
                direct.append(i)
            else:
                by_owner.setdefault(o.url, (o.node_id, []))[1].append(i)

        async def from_origins(idx: list[int]) -> None:
            got = await self.origins.get_objects([addresses[i] for i in idx])
            self._count("origin", len(idx))
            for i, rec in zip(idx, got):
                out[i] = trusted(rec, addresses[i])

        async def from_owner(url: str, node_id: str, idx: list[int]) -> None:
            said: dict[int, str] = {}  # what the owner answered and was not taken: "absent" | "refused"
            try:
                for k in range(0, len(idx), MAX_RECORDS):
                    part = idx[k:k + MAX_RECORDS]
                    got = await self.origins._ask(url, [addresses[i] for i in part], {HOP: "1"})
                    self._count("owner", len(part))
                    for i, rec in zip(part, got):
                        out[i] = trusted(rec, addresses[i])
                        if out[i] is None:
                            said[i] = "absent" if rec is None else "refused"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as e:
                log.info("owner %s did not answer for %d records (%s): asking the origins", url, len(idx),
                         f"{type(e).__name__}: {e}"[:160])
            rest = [i for i in idx if out[i] is None]
            if not rest:
                return
            outcomes = Counter(said.get(i, "failed") for i in rest)
            if outcomes["refused"]:
                log.warning("owner %s (%s) sent %d records this edge does not believe: asking the origins", url,
                            node_id[:64], outcomes["refused"])
            if self.on_fallback is not None:
                for outcome, n in outcomes.items():
                    self.on_fallback(node_id, outcome, n)
            await from_origins(rest)

        jobs = [from_owner(url, node_id, idx) for url, (node_id, idx) in by_owner.items()]
        if direct:
            jobs.append(from_origins(direct))
        await asyncio.gather(*jobs)
        return out

    def _count(self, where: str, n: int) -> None:
        if self.on_read is not None and n:
            self.on_read(where, n)

    async def get_manifest_body(self, namespace: str, name: str, digest: Digest) -> Manifest | None:
        return await self.origins.get_manifest_body(namespace, name, digest)


async def _bounded(r: aiohttp.ClientResponse) -> bytearray:
    """A response's whole body, at most ``MAX_RECORDS_BODY`` bytes (ValueError past it)."""
    if (r.content_length or 0) > MAX_RECORDS_BODY:
        raise ValueError(f"answer larger than {MAX_RECORDS_BODY} bytes")
    body = bytearray()
    async for chunk in r.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_RECORDS_BODY:
            raise ValueError(f"answer larger than {MAX_RECORDS_BODY} bytes")
    return body
