"""Object records beside the blobs, the control plane in the registry: one ``Registry`` over two stores.

One record per 256-token chunk is what caps a registry (docs/scale.md: an 8 GiB
etcd holds ~5.7 million signed records). An origin started with ``--records
store`` keeps its object records in its own store instead, in an embedded
key-value file beside the blobs (``<store>/records.sqlite3``), and the
registry keeps the control plane: models, manifests, nodes (leases), policies.
Manifests too: their token lists (3.25 B a token) fill an 8 GiB etcd at ~320,000
8k-token documents. The whole manifest (signed, versioned) is stored in the
records store under the BLAKE3 of its bytes, and the registry keeps a signed
pointer (``Manifest.pointer``: name, model, version, sizes and that digest),
so a name's version still rises in one place and watches still see it change.
Readers find records where the blobs are: the origin answers
``/v1/registry/objects/{address}`` and ``POST /v1/records`` from its store, and
an edge started with ``--records origin`` asks the origin (through its record
cache) instead of the registry. A signed record verifies itself wherever it is
read, so moving it changes who stores it, not who vouches for it.

Whoever can write the records store's file (or bucket) can plant a record
there, so a record read from it is bounded before it is parsed: one over
``MAX_RECORD_BYTES`` (a planted 14.5 MB record of 200,000 tails cost the
origin's event loop ~1.4 s per anonymous ``POST /v1/records``, #51 item 10),
or one that does not parse as a record (its tails are checked: each shorter
than its parent's chunk), reads as absent and is logged, once per address.
Many records are parsed on a worker thread, off the event loop.

``RecordsBeside`` routes every object method to the records store and the
rest to the registry. The records store is a ``KVRegistry`` like any other, so
merging a re-publish into a stored record, signing inside the write (and
never signing what another key wrote: ``KVRegistry._own``), tails and
encodings added later behave exactly as in the registry. ``put_manifest``
writes the objects first, then the manifest: a manifest is never visible
before the records it names.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from blake3 import blake3

from kdn.format.address import Address, Digest, ModelId, blob_digest, validate_digest
from kdn.errors import InvalidInput
from kdn.registry.base import KVRegistry, Writes
from kdn.registry.lease import NodeLease
from kdn.registry.records import BaseRelation, Encoding, Manifest, ModelRecord, NodeRecord, ObjectRecord, Policy

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.base import Event
    from kdn.registry.signing import Signer

log = logging.getLogger("kdn.registry")

RECORDS_FILE = "records.sqlite3"
OBJECTS = "objects/"  # the relative key prefix of object records (KVRegistry._object_key)
BODIES = "manifest-bodies/"  # whole manifests in the records store, by the BLAKE3 of their packed bytes
SHARDS = 4096  # migrate_records reads object records by their address's first three hex digits
# The most bytes one stored object record may take, in every records store (``records.sqlite3`` here, S3Records'
# objects): far over a real one (~1.5 KB with piece digests), and over the largest one could be (a 1 GiB blob in
# 64 KiB pieces lists 16,384 piece digests: ~1.1 MB an encoding).
MAX_RECORD_BYTES = 4 << 20
PARSE_ON_LOOP_BYTES = 64 << 10  # records read at once past this many bytes are parsed on a worker thread
MAX_REPORTED = 4096  # bad records already logged, by address (each is logged once, not on every read)


class RecordsBeside:
    """A ``Registry`` whose object records live in ``records`` and everything else in ``control``."""

    def __init__(self, control: KVRegistry, records: KVRegistry) -> None:
        self.control = control
        self.records = records
        self._reported: OrderedDict[Address, None] = OrderedDict()  # bad records logged already

    def __repr__(self) -> str:
        return f"RecordsBeside(control={self.control!r}, records={self.records!r})"

    @property
    def signer(self) -> Signer | None:
        return self.control.signer

    @signer.setter
    def signer(self, signer: Signer | None) -> None:
        self.control.signer = signer
        self.records.signer = signer

    # objects: the records store ------------------------------------------------

    async def put_objects(self, records: Sequence[ObjectRecord]) -> None:
        await self.records.put_objects(records)

    async def get_object(self, address: Address) -> ObjectRecord | None:
        (rec,) = await self.get_objects([address])
        return rec

    async def get_objects(self, addresses: Sequence[Address]) -> list[ObjectRecord | None]:
        """The records of ``addresses``, in order; None for one absent, over ``MAX_RECORD_BYTES`` or not a record
        (logged). Read as bytes and bounded here, not by ``KVRegistry.get_objects``, which parses whatever it
        reads on the caller's thread: an origin's event loop."""
        keys = [self.records._object_key(a) for a in addresses]
        try:
            values = await self.records._read(keys) if keys else []
        except InvalidInput:  # a store that refuses to read a record at all (S3Records: one too large to download)
            values = list(await asyncio.gather(*(self._read_one(a, k) for a, k in zip(addresses, keys))))
        if sum(len(v) for v in values if v is not None) <= PARSE_ON_LOOP_BYTES:
            recs, bad = _parse(addresses, values)
        else:
            recs, bad = await asyncio.to_thread(_parse, addresses, values)
        for address, why in bad:
            self._report(address, why)
        return recs

    async def _read_one(self, address: Address, key: str) -> bytes | None:
        try:
            (value,) = await self.records._read([key])
        except InvalidInput as e:
            self._report(address, f"could not be read ({str(e)[:200]})")
            return None
        return value

    def _report(self, address: Address, why: str) -> None:
        """Log a bad record once per address (a flood of reads of it is not a flood of lines)."""
        if address in self._reported:
            return
        self._reported[address] = None
        while len(self._reported) > MAX_REPORTED:
            self._reported.popitem(last=False)
        log.error("object record %s in the records store %r %s: read as absent", address, self.records, why)

    async def add_encoding(self, address: Address, enc: Encoding) -> ObjectRecord | None:
        return await self.records.add_encoding(address, enc)

    async def add_tail(self, parent: Address, length: int, address: Address) -> ObjectRecord | None:
        return await self.records.add_tail(parent, length, address)

    # manifests: objects first, then the body, then the pointer ---------------------------

    async def put_manifest(self, manifest: Manifest, objects: Sequence[ObjectRecord] = ()) -> Manifest:
        """The objects, then the whole manifest (versioned and signed as the registry would) in the records
        store under its digest, then its pointer (``Manifest.pointer``: name, version, sizes, the digest;
        signed) in the registry: the registry never names a body or objects that are not stored. A
        tombstone names nothing and stays whole in the registry."""
        if objects:
            await self.records.put_objects(objects)
        full = await self.control.versioned(manifest)
        if full.deleted:
            await self.control._put(self.control._manifest_key(full.namespace, full.name), full.pack())
            return full
        body = full.pack()
        digest = blob_digest(body)
        await self.records._put(self.records._key(BODIES + digest), body)
        pointer = self.control._signed(full.pointer(digest))
        await self.control._put(self.control._manifest_key(full.namespace, full.name), pointer.pack())
        return full

    async def get_manifest(self, namespace: str, name: str) -> Manifest | None:
        """The whole manifest: a pointer in the registry is followed to its body (checked against its digest
        and its name and version); a body that is missing or does not match is logged and reads as none."""
        m = await self.control.get_manifest(namespace, name)
        return await self._whole(m) if m is not None and m.body is not None else m

    async def get_manifest_body(self, digest: Digest) -> Manifest | None:
        """A manifest body by its digest (what an edge asks the origin for), checked; None if not stored."""
        (data,) = await self.records._read([self.records._key(BODIES + validate_digest(digest))])
        if data is None:
            return None
        if blake3(data).hexdigest() != digest:
            log.error("manifest body %s in the records store does not match its digest: not served", digest[:16])
            return None
        return Manifest.unpack(data)

    async def _whole(self, pointer: Manifest) -> Manifest | None:
        assert pointer.body is not None
        full = await self.get_manifest_body(pointer.body)
        if full is None or not pointer.points_at(full):
            log.error("manifest %s/%s v%d points at body %s, which is %s", pointer.namespace, pointer.name,
                      pointer.version, pointer.body[:16], "missing" if full is None else "another manifest")
            return None
        return full

    async def list_manifests(self, namespace: str | None = None) -> list[Manifest]:
        listed = await self.control.list_manifests(namespace)
        whole = await asyncio.gather(*(self._whole(m) if m.body is not None else _same(m) for m in listed))
        return [m for m in whole if m is not None]

    async def delete_manifest(self, namespace: str, name: str) -> bool:
        return await self.control.delete_manifest(namespace, name)

    # the control plane ---------------------------------------------------------------

    async def put_model(self, rec: ModelRecord) -> None:
        await self.control.put_model(rec)

    async def get_model(self, model_id: ModelId) -> ModelRecord | None:
        return await self.control.get_model(model_id)

    async def list_models(self) -> list[ModelRecord]:
        return await self.control.list_models()

    async def put_relation(self, rec: BaseRelation) -> None:
        await self.control.put_relation(rec)

    async def get_relation(self, variant: ModelId) -> BaseRelation | None:
        return await self.control.get_relation(variant)

    async def list_relations(self) -> list[BaseRelation]:
        return await self.control.list_relations()

    async def register_node(self, rec: NodeRecord, ttl: float) -> NodeLease:
        return await self.control.register_node(rec, ttl)

    async def update_node(self, rec: NodeRecord, lease: NodeLease) -> None:
        await self.control.update_node(rec, lease)

    async def list_nodes(self, role: str | None = None, region: str | None = None) -> list[NodeRecord]:
        return await self.control.list_nodes(role, region)

    async def put_policy(self, p: Policy) -> None:
        await self.control.put_policy(p)

    async def delete_policy(self, name: str) -> bool:
        return await self.control.delete_policy(name)

    async def list_policies(self) -> list[Policy]:
        return await self.control.list_policies()

    def watch(self, prefix: str = "") -> AsyncIterator[Event]:
        """Watches follow the registry (the control plane); object records are immutable content, not news."""
        return self.control.watch(prefix)

    async def list_keys(self, prefix: str = "") -> list[tuple[str, bytes]]:
        """The registry's keys, and under ``objects/`` the records store's."""
        if prefix.startswith(OBJECTS):
            return await self.records.list_keys(prefix)
        out = await self.control.list_keys(prefix)
        if OBJECTS.startswith(prefix):
            out += await self.records.list_keys(OBJECTS)
        return out

    async def close(self) -> None:
        try:
            await self.records.close()
        finally:
            await self.control.close()

    async def __aenter__(self) -> RecordsBeside:
        await self.control.__aenter__()
        await self.records.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def migrate_records(registry: KVRegistry, records: KVRegistry, *, delete: bool = False,
                          progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Copy every object record of ``registry`` into ``records`` (an origin's ``records.sqlite3``); with
    ``delete``, then remove it from ``registry``. Returns ``(copied, kept)``: ``kept`` counts records the
    store already had (an origin in ``--records store`` wrote a newer one: it is not overwritten).

    Read in 4,096 shards by the address's first three hex digits, so memory (and one etcd answer, under
    gRPC's 4 MiB) holds one shard at a time: ~1,400 records of 1.5 KB at 5.7 million. Stop the origins
    that write ``registry`` first (or switch them to ``--records store``): a record written there after
    its shard was read would be deleted uncopied. Each record is checked to be one (a key that does not
    parse is left where it is, and logged).
    """
    copied = kept = 0
    for shard in range(SHARDS):
        items, _ = await registry._range(registry._key(f"{OBJECTS}{shard:03x}"))
        good: list[tuple[str, bytes]] = []
        for key, value in items:
            try:
                ObjectRecord.unpack(value)
            except InvalidInput as e:
                log.error("registry key %s is not an object record (%s): left where it is", registry._rel(key)[:80], e)
                continue
            good.append((records._key(registry._rel(key)), value))
        if good:
            keys = [k for k, _ in good]

            def build(values: list[bytes | None], good: list[tuple[str, bytes]] = good) -> Writes:
                return Writes(puts=[kv for kv, old in zip(good, values) if old is None],
                              result=sum(old is not None for old in values))

            kept_here: int = await records._transact(keys, build)
            kept += kept_here
            copied += len(good) - kept_here
            if delete:
                step = (registry.max_txn_ops - 1) if registry.max_txn_ops else len(good)
                gone = [registry._key(records._rel(k)) for k in keys]
                for i in range(0, len(gone), step):
                    await registry._transact([], _deleting(gone[i:i + step]))
        if progress is not None:
            progress(shard, copied + kept)
    return copied, kept


# A manifest's namespace starts with one of these (kdn.format.address._NAMESPACE): migrate_manifests reads the
# manifests in that many ranges, one namespace initial at a time, not all in one answer.
_INITIALS = "0123456789abcdefghijklmnopqrstuvwxyz"


async def migrate_manifests(registry: KVRegistry, records: KVRegistry, *, signer: Signer | None = None,
                            progress: Callable[[int, int], None] | None = None) -> tuple[int, int, int]:
    """Move every whole manifest of ``registry`` into ``records``: its body under its digest there, and in
    the registry, in its place, the pointer ``put_manifest`` would have written (``RecordsBeside``), signed
    by ``signer``. Returns ``(moved, kept, skipped)``: ``kept`` were pointers or tombstones already (nothing
    to move), ``skipped`` were left whole (logged): signed by a key that is not ``signer``'s, or changed
    between the read and the write (a publish won: run again).

    A pointer is only as good as its signature: a manifest its publisher signed is moved only with that
    key (``signer``; a reader that checks publisher keys would refuse an unsigned pointer), and a manifest
    signed by no one gets an unsigned pointer. Each move is one compare-and-swap on the manifest's key, so
    a publish that lands meanwhile is never overwritten. The body is written first: the registry never
    points at a body that is not stored. Readers then read bodies from the origins (``GET
    /v1/registry/manifests/NS/NAME?body=DIGEST``, which an origin with ``--records store`` answers from
    ``records``): switch the origins first.
    """
    moved = kept = skipped = 0
    for i, initial in enumerate(_INITIALS):
        items, _ = await registry._range(registry._key(f"manifests/{initial}"))
        for key, value in items:
            try:
                m = Manifest.unpack(value)
            except InvalidInput as e:
                log.error("registry key %s is not a manifest (%s): left where it is", registry._rel(key)[:80], e)
                skipped += 1
                continue
            if m.deleted or m.body is not None:
                kept += 1
                continue
            if m.sig and (signer is None or not signer.signed_it(m)):
                log.error("manifest %s/%s v%d is signed by key %s, not by the key given: left whole (pass "
                          "the key that signed it)", m.namespace, m.name, m.version, str(m.sig.get("key"))[:80])
                skipped += 1
                continue
            body = m.pack()
            digest = blob_digest(body)
            await records._put(records._key(BODIES + digest), body)
            pointer = m.pointer(digest)
            if m.sig and signer is not None:
                pointer = signer.sign(pointer)

            def swap(values: list[bytes | None], old: bytes = value, new: bytes = pointer.pack()) -> Writes:
                return Writes(puts=[(key, new)], result=True) if values[0] == old else Writes(result=False)

            if await registry._transact([key], swap):
                moved += 1
            else:
                log.warning("manifest %s/%s changed while it was moved: left as it is now (run again)",
                            m.namespace, m.name)
                skipped += 1
        if progress is not None:
            progress(i, moved + kept + skipped)
    return moved, kept, skipped


def _parse(addresses: Sequence[Address], values: Sequence[bytes | None]
           ) -> tuple[list[ObjectRecord | None], list[tuple[Address, str]]]:
    """Stored records as read (``RecordsBeside.get_objects``): each parsed, or None where absent, over
    ``MAX_RECORD_BYTES`` (not parsed) or not a record; and why each bad one was refused. Pure: it may run on a
    worker thread."""
    out: list[ObjectRecord | None] = []
    bad: list[tuple[Address, str]] = []
    for address, value in zip(addresses, values):
        rec = None
        if value is not None and len(value) > MAX_RECORD_BYTES:
            bad.append((address, f"is {len(value):,} bytes, over {MAX_RECORD_BYTES:,}"))
        elif value is not None:
            try:
                rec = ObjectRecord.unpack(value)
            except InvalidInput as e:
                bad.append((address, f"is not an object record ({str(e)[:200]})"))
        out.append(rec)
    return out, bad


async def _same(m: Manifest) -> Manifest:
    return m


def _deleting(keys: list[str]) -> Callable[[list[bytes | None]], Writes]:
    return lambda _values: Writes(deletes=keys)
