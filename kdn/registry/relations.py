"""Base relations in the registry: ``relations/{variant_model_id}`` beside ``models/{model_id}`` (issue #30).

A publisher measures a fine-tune against its base (``kdn.adapters.hf.variants``), signs the ``BaseRelation``
with its key (``kdn relation sign``) and puts it here (``kdn relation put``); one relation per variant, the
latest put wins. The registry stores it as it was signed: a registry writer never signs a relation (the
publisher's key does), so whoever can write the registry can plant one, and a reader believes only what
``find_relation`` returns: a relation a trusted key signed. Finding is not accepting: a consumer still
passes the relation as ``agenerate_variant(..., accept_base=relation)``.

A writer can also keep a relation the publisher has since superseded or withdrawn and write it back (issue
#51). So a relation carries what a manifest carries (``take_relation``): a signed per-variant version, which
a consumer holds to (its high-water mark per variant: a ``kdn.client.Trust``'s, kept in its state file);
a signed tombstone (``kdn relation rm``), which reads as absent and outranks every older version; and a pin
(``kdn.registry.signing.relation_pin``), which takes exactly one relation, older or newer ones refused.

Records are validated when read: a stored value that is not a ``BaseRelation`` (junk, a newer writer's) is
logged and read as absent, and hides only itself in a listing.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kdn.format.address import ModelId, validate_digest, validate_model_id
from kdn.errors import InvalidInput
from kdn.registry.records import BaseRelation
from kdn.registry.signing import SignatureError

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.signing import Verifier

log = logging.getLogger(__name__)


class RelationStore(Protocol):
    async def put_relation(self, rec: BaseRelation) -> None: ...
    async def get_relation(self, variant: ModelId) -> BaseRelation | None: ...
    async def list_relations(self) -> list[BaseRelation]: ...


class RelationRecords:
    """``RelationStore`` over ``KVRegistry``'s primitives (mixed into it)."""

    if TYPE_CHECKING:  # provided by KVRegistry
        def _key(self, rel: str) -> str: ...
        def _rel(self, key: str) -> str: ...
        async def _put(self, key: str, value: bytes, lease: int | None = None) -> None: ...
        async def _read(self, keys: Sequence[str]) -> list[bytes | None]: ...
        async def _range(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]: ...

    def _relation_key(self, variant: ModelId) -> str:
        return self._key(f"relations/{validate_model_id(variant)}")

    async def put_relation(self, rec: BaseRelation) -> None:
        """Store ``rec`` under its variant, as it is (signed by its publisher, or not: readers decide)."""
        if not isinstance(rec, BaseRelation):
            raise InvalidInput(f"expected a BaseRelation, got {type(rec).__name__}")
        await self._put(self._relation_key(rec.variant), rec.pack())

    async def get_relation(self, variant: ModelId) -> BaseRelation | None:
        key = self._relation_key(variant)
        (v,) = await self._read([key])
        return None if v is None else _relation(self._rel(key), v, variant)

    async def list_relations(self) -> list[BaseRelation]:
        items, _ = await self._range(self._key("relations/"))
        found = (_relation(self._rel(k), v, self._rel(k).rpartition("/")[2]) for k, v in items)
        return [r for r in found if r is not None]


def _relation(key: str, value: bytes, variant: str) -> BaseRelation | None:
    """The relation stored at ``key``, or None (logged) when it is junk or names another variant."""
    try:
        rec = BaseRelation.unpack(value)
    except InvalidInput as e:
        log.warning("ignoring relation record %s: %s", key, e)
        return None
    if rec.variant != variant:
        log.warning("ignoring relation record %s: it names variant %s", key, rec.variant[:16])
        return None
    return rec


class RefusedRelation(SignatureError):
    """A validly signed relation a consumer does not take: older than one of its variant it took before (a
    replay), or not the one it pinned."""


def take_relation(rel: BaseRelation, verifier: Verifier, marks: MutableMapping[str, int] | None = None,
                  pin: str | None = None) -> BaseRelation:
    """``rel`` if a key of ``verifier`` signed it, it is ``pin``'s (with a pin), and it is not older than
    ``marks`` (variant -> the highest version taken; raised to ``rel``'s) holds for its variant. Raises
    ``SignatureError`` (``RefusedRelation``: signed, but superseded or not the pinned one). A tombstone is
    returned like any relation: the caller reads ``deleted`` as withdrawn. Without ``marks`` (a bare
    ``Verifier``) only a pin stops a replay."""
    from kdn.registry.signing import relation_pin

    verifier.check(rel)  # SignatureError: unsigned, an untrusted key, a field changed after signing
    if pin is not None and (got := relation_pin(rel)) != validate_digest(pin):
        raise RefusedRelation(f"relation for {rel.variant[:16]} is not the pinned one ({got[:16]}, pinned "
                              f"{pin[:16]})")
    if marks is not None:
        seen = marks.get(rel.variant, 0) or 0
        if rel.version < seen:
            raise RefusedRelation(f"relation for {rel.variant[:16]}: version {rel.version} is older than version "
                                  f"{seen} taken before (a replay)")
        marks[rel.variant] = rel.version  # (a VersionFile's rise is on disk before this returns)
    return rel


async def find_relation(registry: RelationStore, variant: ModelId, trusted: Any,
                        pin: str | None = None) -> BaseRelation | None:
    """The registry's relation for ``variant`` if a key of ``trusted`` signed it and it is not superseded,
    else None (absent, junk, unsigned, signed by a key not trusted here, older than one taken before, not
    ``pin``'s, or withdrawn by a signed tombstone: logged).

    ``trusted``: a ``KDNClient`` made with ``trusted_keys`` or its ``kdn.client.Trust`` (``.trust``), which hold
    the relation to their high-water mark for the variant (kept in their state file); or a bare
    ``kdn.registry.signing.Verifier`` (or anything holding one as ``.verifier``), which checks the signature
    and a pin and remembers nothing. Found is not accepted: pass it on as
    ``agenerate_variant(..., accept_base=rel)``. The client itself reads through edges, which serve no
    relations: open the registry for this read (``kdn.registry.open_registry(url)``), or have the publisher
    ship the packed file (``BaseRelation.pack``).
    """
    judge = getattr(trusted, "trust", trusted)  # a client's kdn.client.Trust: its marks, its count of refusals
    verifier = getattr(judge, "verifier", judge)
    if verifier is None or not callable(getattr(verifier, "check", None)):
        raise InvalidInput("find_relation needs the publisher keys trusted here: a Verifier, or a client "
                           "made with trusted_keys")
    rel = await registry.get_relation(variant)
    if rel is None:
        return None
    try:
        take = getattr(judge, "relation", None)
        rel = take(rel, pin) if callable(take) else take_relation(rel, verifier, None, pin)
    except SignatureError as e:
        log.warning("relation for %s in the registry is refused: %s", variant[:16], e)
        return None
    if rel.deleted:
        log.info("relation for %s is withdrawn (a signed tombstone, version %d)", variant[:16], rel.version)
        return None
    return rel
