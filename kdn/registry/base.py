"""The registry interface, and the record-level logic both implementations share.

``Registry`` is the Protocol callers program against. It is composed of small
protocols, one per kind of record, so a component can ask for only what it
uses (an edge that watches policies wants ``Watchable``, not manifests).

``KVRegistry`` implements the whole interface on top of five key-value
primitives (read, range, read-modify-write transaction, leases, watch); the
etcd and the embedded SQLite registries each provide only those primitives.
Keys live under one prefix (default ``/kdn/``)::

    models/{model_id}
    relations/{variant_model_id}         (kdn.registry.relations: a publisher-signed BaseRelation)
    objects/{address}
    manifests/{namespace}/{name}
    nodes/{role}/{region}/{node_id}      (bound to a lease)
    policies/{name}

Values are msgpack records (``kdn.registry.records``).
"""

from __future__ import annotations

import abc
import dataclasses
import time
import logging
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from kdn.format.address import Address, ModelId, validate_address, validate_model_id, validate_name, validate_namespace
from kdn.errors import InvalidInput
from kdn.registry.lease import NodeLease, bounded
from kdn.registry.records import Encoding, Manifest, ModelRecord, NodeRecord, ObjectRecord, Policy
from kdn.registry.relations import RelationRecords, RelationStore

if TYPE_CHECKING:  # pragma: no cover - kdn.registry.signing loads cryptography, which only an origin needs
    from kdn.registry.signing import Signable, Signer

DEFAULT_PREFIX = "/kdn/"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """One item of a watch.

    ``snapshot``: ``items`` holds every key under the watched prefix at
    ``revision``. ``put``/``delete``: one key changed at ``revision``; ``value``
    is the new bytes (``None`` for a delete). Keys are relative to the registry
    prefix (``"policies/p1"``).
    """

    kind: Literal["snapshot", "put", "delete"]
    key: str | None = None
    value: bytes | None = None
    revision: int = 0
    items: dict[str, bytes] = field(default_factory=dict)


# --- the interface -----------------------------------------------------------


class ModelStore(Protocol):
    async def put_model(self, rec: ModelRecord) -> None: ...
    async def get_model(self, model_id: ModelId) -> ModelRecord | None: ...
    async def list_models(self) -> list[ModelRecord]: ...


class ObjectStore(Protocol):
    async def put_objects(self, records: Sequence[ObjectRecord]) -> None: ...
    async def get_object(self, address: Address) -> ObjectRecord | None: ...
    async def get_objects(self, addresses: Sequence[Address]) -> list[ObjectRecord | None]: ...
    async def add_encoding(self, address: Address, enc: Encoding) -> ObjectRecord | None: ...
    async def add_tail(self, parent: Address, length: int, address: Address) -> ObjectRecord | None: ...


class ManifestStore(Protocol):
    async def put_manifest(self, manifest: Manifest, objects: Sequence[ObjectRecord] = ()) -> Manifest: ...
    async def get_manifest(self, namespace: str, name: str) -> Manifest | None: ...
    async def list_manifests(self, namespace: str | None = None) -> list[Manifest]: ...
    async def delete_manifest(self, namespace: str, name: str) -> bool: ...


class Membership(Protocol):
    async def register_node(self, rec: NodeRecord, ttl: float) -> NodeLease: ...
    async def update_node(self, rec: NodeRecord, lease: NodeLease) -> None: ...
    async def list_nodes(self, role: str | None = None, region: str | None = None) -> list[NodeRecord]: ...


class PolicyStore(Protocol):
    async def put_policy(self, p: Policy) -> None: ...
    async def delete_policy(self, name: str) -> bool: ...
    async def list_policies(self) -> list[Policy]: ...


class Watchable(Protocol):
    def watch(self, prefix: str = "") -> AsyncIterator[Event]: ...
    async def list_keys(self, prefix: str = "") -> list[tuple[str, bytes]]: ...


@runtime_checkable
class Registry(ModelStore, RelationStore, ObjectStore, ManifestStore, Membership, PolicyStore, Watchable, Protocol):
    """Everything KDN keeps in its registry. Misses are ``None``, never exceptions."""

    async def close(self) -> None: ...
    async def __aenter__(self) -> Registry: ...
    async def __aexit__(self, *exc: object) -> None: ...


class Compactable(Protocol):
    """Optional: drop watch history before ``revision`` (tests; operators)."""

    async def compact(self, revision: int) -> None: ...


# --- the shared implementation -----------------------------------------------


@dataclass
class Writes:
    """What a transaction writes once its reads are known; ``result`` is returned to the caller."""

    puts: list[tuple[str, bytes]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    lease: int | None = None  # bound to every put
    result: Any = None


Build = Callable[[list[bytes | None]], Writes]


def _expect(value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise InvalidInput(f"expected a {cls.__name__}, got {type(value).__name__}")


def _object(v: bytes | None) -> ObjectRecord | None:
    return None if v is None else ObjectRecord.unpack(v)


class KVRegistry(RelationRecords, abc.ABC):
    """The record-level registry over key-value primitives; subclasses provide those."""

    #: Most keys one transaction may touch (etcd's --max-txn-ops is 128); None: no limit.
    max_txn_ops: int | None = None

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = normalize_prefix(prefix)
        self._leases: weakref.WeakSet[NodeLease] = weakref.WeakSet()
        self._closed = False
        self.signer: Signer | None = None  # an origin signs every object record and manifest it writes
        # The highest manifest version this writer has given: its next is above it, even in the same
        # millisecond after a planted manifest (not counted) replaced the one it wrote last.
        self._last_version = 0

    # primitives: full keys (prefix included) --------------------------------

    @abc.abstractmethod
    async def _read(self, keys: Sequence[str]) -> list[bytes | None]: ...

    @abc.abstractmethod
    async def _range(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        """Sorted ``(key, value)`` pairs under ``prefix`` and the revision they were read at."""

    @abc.abstractmethod
    async def _transact(self, reads: Sequence[str], build: Build) -> Any:
        """Read ``reads``, call ``build`` on their values, apply its writes atomically.

        The writes apply only if none of ``reads`` changed since they were read
        (the implementation retries ``build`` otherwise), so ``build`` must be a
        pure function of its input. Returns ``Writes.result``.
        """

    @abc.abstractmethod
    async def _grant(self, ttl: float) -> tuple[int, float]:
        """A new lease: ``(lease_id, granted ttl)``."""

    @abc.abstractmethod
    async def _refresh(self, lease_id: int) -> bool:
        """Extend a lease; False if it no longer exists."""

    @abc.abstractmethod
    async def _revoke(self, lease_id: int) -> None:
        """Delete a lease and its keys; a lease already gone is not an error."""

    @abc.abstractmethod
    def watch(self, prefix: str = "") -> AsyncIterator[Event]:
        """Snapshot of ``prefix`` (relative), then its changes; a new snapshot after compaction."""

    @abc.abstractmethod
    async def _close(self) -> None: ...

    # keys -------------------------------------------------------------------

    def _key(self, rel: str) -> str:
        return self.prefix + rel

    def _rel(self, key: str) -> str:
        return key[len(self.prefix) :]

    def _model_key(self, model_id: ModelId) -> str:
        return self._key(f"models/{validate_model_id(model_id)}")

    def _object_key(self, address: Address) -> str:
        return self._key(f"objects/{validate_address(address)}")

    def _manifest_key(self, namespace: str, name: str) -> str:
        return self._key(f"manifests/{validate_namespace(namespace)}/{validate_name(name)}")

    def _node_key(self, rec: NodeRecord) -> str:
        return self._key(f"nodes/{rec.role}/{rec.region}/{rec.node_id}")

    def _policy_key(self, name: str) -> str:
        return self._key(f"policies/{validate_name(name)}")

    async def _put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._transact([], lambda _: Writes(puts=[(key, value)], lease=lease))

    async def _delete(self, key: str) -> bool:
        def build(values: list[bytes | None]) -> Writes:
            return Writes(result=False) if values[0] is None else Writes(deletes=[key], result=True)

        deleted: bool = await self._transact([key], build)
        return deleted

    # models -----------------------------------------------------------------

    async def put_model(self, rec: ModelRecord) -> None:
        _expect(rec, ModelRecord)
        await self._put(self._model_key(rec.model_id), self._signed(rec).pack())

    async def get_model(self, model_id: ModelId) -> ModelRecord | None:
        (v,) = await self._read([self._model_key(model_id)])
        return None if v is None else ModelRecord.unpack(v)

    async def list_models(self) -> list[ModelRecord]:
        items, _ = await self._range(self._key("models/"))
        return [ModelRecord.unpack(v) for _, v in items]

    # objects ----------------------------------------------------------------

    async def put_objects(self, records: Sequence[ObjectRecord]) -> None:
        await self._put_objects_then(records, None)

    async def get_object(self, address: Address) -> ObjectRecord | None:
        (v,) = await self._read([self._object_key(address)])
        return _object(v)

    async def get_objects(self, addresses: Sequence[Address]) -> list[ObjectRecord | None]:
        keys = [self._object_key(a) for a in addresses]
        return [_object(v) for v in await self._read(keys)] if keys else []

    async def add_encoding(self, address: Address, enc: Encoding) -> ObjectRecord | None:
        _expect(enc, Encoding)
        return await self._update_object(address, lambda rec: rec.with_encoding(enc))

    async def add_tail(self, parent: Address, length: int, address: Address) -> ObjectRecord | None:
        validate_address(address, what="tail address")
        if not (isinstance(length, int) and not isinstance(length, bool) and length > 0):
            raise InvalidInput(f"tail length must be a positive int, got {length!r}")
        return await self._update_object(parent, lambda rec: rec.with_tail(length, address))

    def _signed(self, rec: Signable) -> Signable:
        """``rec`` signed by this writer's key (``signer``, set by an origin), else as it is.

        Signing here, on the final record inside the write transaction, is what keeps a
        signature true: a record merged with what was stored, or given a tail, is signed
        as it is stored, not as the writer built it.
        """
        return self.signer.sign(rec) if self.signer is not None else rec

    def _own(self, old: ObjectRecord | None) -> ObjectRecord | None:
        """The stored record a signing writer may build on: one its own key signed, else None (absent).

        Whatever a signing writer merges into a record it then signs, it attests. A stored record
        signed by anyone else (or by no one) is only what the registry says, and whoever can write
        the registry could have planted its digests: it is treated as absent, and replaced.
        """
        if old is None or self.signer is None or self.signer.signed_it(old):
            return old
        log.warning("object record %s in the registry is not signed by this writer's key %s: nothing of it is "
                    "kept or signed", old.address[:16], self.signer.key_id)
        return None

    async def _update_object(self, address: Address, change: Callable[[ObjectRecord], ObjectRecord]) -> ObjectRecord | None:
        key = self._object_key(address)

        def build(values: list[bytes | None]) -> Writes:
            old = self._own(_object(values[0]))
            if old is None:
                return Writes(result=None)
            new = change(old)
            if new == old:
                return Writes(result=new)
            new = self._signed(new)
            return Writes(puts=[(key, new.pack())], result=new)

        updated: ObjectRecord | None = await self._transact([key], build)
        return updated

    async def _put_objects_then(self, records: Sequence[ObjectRecord], last: tuple[str, bytes] | None) -> None:
        """Write object records (merged into any existing ones), then ``last``.

        One transaction when they fit; otherwise in batches, in order, with
        ``last`` in the final batch. Either way ``last`` (a manifest) is never
        visible before every object it names: the objects are content-addressed
        and may harmlessly appear first.
        """
        by_addr: dict[Address, ObjectRecord] = {}
        for r in records:
            _expect(r, ObjectRecord)
            by_addr[r.address] = by_addr[r.address].merged(r) if r.address in by_addr else r
        recs = list(by_addr.values())
        step = (self.max_txn_ops - 1) if self.max_txn_ops else max(1, len(recs))
        batches = [recs[i : i + step] for i in range(0, len(recs), step)] or [[]]
        for i, batch in enumerate(batches):
            extra = [last] if last is not None and i == len(batches) - 1 else []
            await self._transact([self._object_key(r.address) for r in batch], _merge_build(self, batch, extra))

    # manifests --------------------------------------------------------------

    async def put_manifest(self, manifest: Manifest, objects: Sequence[ObjectRecord] = ()) -> Manifest:
        """Record ``manifest`` (after ``objects``), versioned above the stored one of its name; returns it as
        stored (versioned, and signed where this writer signs).

        The version is the publish time in milliseconds, or one more than the stored manifest's where that
        is higher (a clock stepped back): it rises with every publish, also across a delete and a
        re-publish. A signing writer counts only a stored manifest its own key signed (another's version,
        planted, could otherwise push it anywhere), and never gives a version at or below one it gave before. Two writers publishing one name in the same
        millisecond can end at one version; the later write wins the name, as before.
        """
        manifest = await self.versioned(manifest)
        key = self._manifest_key(manifest.namespace, manifest.name)
        await self._put_objects_then(objects, (key, manifest.pack()))
        return manifest

    async def versioned(self, manifest: Manifest) -> Manifest:
        """``manifest`` as ``put_manifest`` would store it: versioned above the stored one of its name (see
        there), and signed where this writer signs. Nothing is written."""
        _expect(manifest, Manifest)
        try:
            old = await self.get_manifest(manifest.namespace, manifest.name)
        except InvalidInput:  # not a manifest at all: replaced
            old = None
        if old is not None and self.signer is not None and not self.signer.signed_it(old):
            old = None
        version = max(manifest.version, int(time.time() * 1000), old.version + 1 if old is not None else 1,
                      self._last_version + 1)
        self._last_version = version
        signed: Manifest = self._signed(dataclasses.replace(manifest, version=version))
        return signed

    async def get_manifest(self, namespace: str, name: str) -> Manifest | None:
        (v,) = await self._read([self._manifest_key(namespace, name)])
        return None if v is None else Manifest.unpack(v)

    async def list_manifests(self, namespace: str | None = None) -> list[Manifest]:
        rel = "manifests/" if namespace is None else f"manifests/{validate_namespace(namespace)}/"
        items, _ = await self._range(self._key(rel))
        return [Manifest.unpack(v) for _, v in items]

    async def delete_manifest(self, namespace: str, name: str) -> bool:
        return await self._delete(self._manifest_key(namespace, name))

    # nodes ------------------------------------------------------------------

    async def register_node(self, rec: NodeRecord, ttl: float) -> NodeLease:
        _expect(rec, NodeRecord)
        if not (isinstance(ttl, (int, float)) and ttl > 0):
            raise InvalidInput(f"lease ttl must be a positive number of seconds, got {ttl!r}")
        lease_id, granted = await self._grant(float(ttl))
        try:
            await self._put(self._node_key(rec), rec.pack(), lease=lease_id)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._revoke(lease_id)
            raise
        lease = NodeLease(lease_id, granted, self._refresh, self._revoke)
        self._leases.add(lease)
        return lease

    async def update_node(self, rec: NodeRecord, lease: NodeLease) -> None:
        """Rewrite a registered node's record (the same role, region and id: its key) under its lease:
        a node's advertised figures change while it lives (``edge/upper.py``). ``LeaseExpired`` or another
        ``RegistryError`` when the lease is gone or the registry does not answer."""
        _expect(rec, NodeRecord)
        if not isinstance(lease, NodeLease):
            raise InvalidInput(f"expected a NodeLease, got {type(lease).__name__}")
        await self._put(self._node_key(rec), rec.pack(), lease=lease.lease_id)

    async def list_nodes(self, role: str | None = None, region: str | None = None) -> list[NodeRecord]:
        rel = "nodes/"
        if role is not None:
            rel += f"{validate_name(role)}/"
            if region is not None:
                rel += f"{validate_name(region)}/"
        items, _ = await self._range(self._key(rel))
        nodes = []
        for key, v in items:
            try:
                nodes.append(NodeRecord.unpack(v))
            except InvalidInput as e:  # one bad record (a rogue URL, a newer writer) hides only itself
                logging.getLogger(__name__).warning("ignoring node record %s: %s", self._rel(key), e)
        return [n for n in nodes if region is None or n.region == region]

    # policies ---------------------------------------------------------------

    async def put_policy(self, p: Policy) -> None:
        _expect(p, Policy)
        await self._put(self._policy_key(p.name), p.pack())

    async def delete_policy(self, name: str) -> bool:
        return await self._delete(self._policy_key(name))

    async def list_policies(self) -> list[Policy]:
        items, _ = await self._range(self._key("policies/"))
        return [Policy.unpack(v) for _, v in items]

    # raw --------------------------------------------------------------------

    async def list_keys(self, prefix: str = "") -> list[tuple[str, bytes]]:
        items, _ = await self._range(self._key(prefix))
        return [(self._rel(k), v) for k, v in items]

    # lifecycle --------------------------------------------------------------

    async def close(self) -> None:
        """Revoke the leases this registry granted (a clean shutdown leaves at once), then disconnect."""
        if self._closed:
            return
        for lease in list(self._leases):
            await bounded(lease.close(), 2.0, "revoking a lease")
        self._closed = True
        await bounded(self._close(), 5.0, "closing the registry client")

    async def __aenter__(self) -> KVRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _merge_build(reg: KVRegistry, batch: list[ObjectRecord], extra: list[tuple[str, bytes]]) -> Build:
    def build(values: list[bytes | None]) -> Writes:
        puts = []
        for rec, old_bytes in zip(batch, values):
            old = reg._own(_object(old_bytes))
            for name in set(rec.encodings) & set(old.encodings if old is not None else ()):
                assert old is not None
                was, now = old.encodings[name], rec.encodings[name]
                if (was.size, was.digest) != (now.size, now.digest):  # gaining piece digests is no conflict
                    log.error("object %s: the registry records %s as %s (%d B), the writer holds %s (%d B): "
                              "the writer's is recorded", rec.address[:16], name, old.encodings[name].digest[:16],
                              old.encodings[name].size, rec.encodings[name].digest[:16], rec.encodings[name].size)
            new = rec if old is None else old.merged(rec)
            if old is not None and dataclasses.replace(new, sig=old.sig) == old and (old.sig or reg.signer is None):
                continue  # re-publishing the same object is not a change watchers hear about
            puts.append((reg._object_key(rec.address), reg._signed(new).pack()))
        return Writes(puts=puts + extra)

    return build


def normalize_prefix(prefix: str) -> str:
    """``kdn`` -> ``/kdn/``: keys always sit under ``/.../``."""
    if not isinstance(prefix, str) or not prefix.strip("/"):
        raise InvalidInput(f"registry prefix must be a non-empty path like '/kdn/', got {prefix!r}")
    return "/" + prefix.strip("/") + "/"
