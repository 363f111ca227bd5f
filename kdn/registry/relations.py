"""Base relations in the registry: ``relations/{variant_model_id}`` beside ``models/{model_id}`` (issue #30).

A publisher measures a fine-tune against its base (``kdn.adapters.hf.variants``), signs the ``BaseRelation``
with its key (``kdn relation sign``) and puts it here (``kdn relation put``); one relation per variant, the
latest put wins. The registry stores it as it was signed: a registry writer never signs a relation (the
publisher's key does), so whoever can write the registry can plant one, and a reader believes only what
``find_relation`` returns: a relation a trusted key signed. Finding is not accepting: a consumer still
passes the relation as ``agenerate_variant(..., accept_base=relation)``.

Records are validated when read: a stored value that is not a ``BaseRelation`` (junk, a newer writer's) is
logged and read as absent, and hides only itself in a listing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kdn.format.address import ModelId, validate_model_id
from kdn.errors import InvalidInput
from kdn.registry.records import BaseRelation

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


async def find_relation(registry: RelationStore, variant: ModelId, trusted: Any) -> BaseRelation | None:
    """The registry's relation for ``variant`` if a key of ``trusted`` signed it, else None (absent, junk,
    unsigned, or signed by a key not trusted here: logged).

    ``trusted``: a ``kdn.registry.signing.Verifier``, or anything holding one as ``.verifier`` (a ``KDNClient`` made
    with ``trusted_keys``). Found is not accepted: pass it on as ``agenerate_variant(..., accept_base=rel)``.
    The client itself reads through edges, which serve no relations: open the registry for this read
    (``kdn.registry.open_registry(url)``), or have the publisher ship the packed file (``BaseRelation.pack``).
    """
    from kdn.registry.signing import SignatureError

    verifier = getattr(trusted, "verifier", trusted)
    if verifier is None or not callable(getattr(verifier, "check", None)):
        raise InvalidInput("find_relation needs the publisher keys trusted here: a Verifier, or a client "
                           "made with trusted_keys")
    rel = await registry.get_relation(variant)
    if rel is None:
        return None
    try:
        verifier.check(rel)
    except SignatureError as e:
        log.warning("relation for %s in the registry is refused: %s", variant[:16], e)
        return None
    return rel
