"""What a client believes of the records, manifests and base relations its sources send.

Any source can lie: an edge, a registry writer who planted a record, a replay
of an old answer. With publisher keys (``trusted_keys``) a record counts only
if one of them signed it and it is the record of what was asked; a manifest
(or a base relation: ``relation``) also only if it is not older than a version of
that name (variant) this client took before, and, with a pin
(``kdn.registry.signing.manifest_pin``, ``relation_pin``), only if it is exactly the
pinned one. The versions taken are kept in a per-user file by default, so that a
new process holds to what an earlier one took (``kdn.client.versions.state_file``;
``manifest_state=False`` keeps them in memory). Whatever is refused is counted in
``rejected`` and logged, and reads as absent: its digests are never believed.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

from blake3 import blake3

from kdn.format import address as A
from kdn.errors import InvalidInput

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from kdn.client.versions import ManifestState
    from kdn.registry.records import BaseRelation, Manifest, ObjectRecord
    from kdn.registry.signing import Verifier

    # Publisher keys: a Verifier, key strings (ed25519:<hex>), or a file of them.
    TrustedKeys = Verifier | str | os.PathLike[str] | Iterable[str]

log = logging.getLogger("kdn.client")
R = TypeVar("R", "ObjectRecord", "Manifest")

# Object records that verified, remembered by the digest of their exact content: a hot chain's records are
# checked on every lookup, and a check costs ~150 us a record (Ed25519 and parsing; bench/lookup.py), against
# ~20 us to recognise the same bytes. Bounded (each entry holds the record read: a few KB); never holds a
# refused record.
VERIFIED_MEMO = 16384


def verifier(keys: TrustedKeys | None) -> Verifier | None:
    """Publisher keys as a ``kdn.registry.signing.Verifier`` (None: no keys, every record taken as sent)."""
    if keys is None:
        return None
    from kdn.registry.signing import KEY_PREFIX, Verifier

    if isinstance(keys, Verifier):
        return keys
    if isinstance(keys, str):
        return Verifier([keys]) if keys.startswith(KEY_PREFIX) else Verifier.from_file(keys)
    if isinstance(keys, os.PathLike):
        return Verifier.from_file(keys)
    return Verifier(keys)


class Trust:
    """A client's checks on what its sources answer: ``record`` and ``manifest`` return what they are given, read
    (an ``ObjectRecord``, a ``Manifest``), or None for what they refuse or cannot read."""

    def __init__(self, trusted_keys: TrustedKeys | None = None, manifest_state: ManifestState = None) -> None:
        from kdn.client.versions import RELATIONS, VersionFile, state_file

        self.verifier = verifier(trusted_keys)
        self.rejected = 0
        # content digest -> the key that verified it, and the record read
        self._verified: OrderedDict[bytes, tuple[object, ObjectRecord]] = OrderedDict()
        # namespace/name (variant model id) -> the highest manifest (relation) version taken; in a file
        # (kdn.client.versions) unless manifest_state says memory, so that a new process still refuses what an
        # earlier one saw superseded.
        self.manifest_versions: MutableMapping[str, int] = {}
        self.relation_versions: MutableMapping[str, int] = {}
        self.state_path: Path | None = state_file(manifest_state, keys=self.verifier is not None)
        if self.state_path is not None:
            self.manifest_versions = VersionFile(self.state_path)
            self.relation_versions = VersionFile(self.state_path, RELATIONS)

    def record(self, d: dict[str, Any] | None, address: A.Address) -> ObjectRecord | None:
        """An object record as sent for ``address``, read (an ``ObjectRecord``), unless refused: unreadable (keys
        or none: a malformed record reads as absent, counted in ``rejected``, rather than failing whoever reads it
        later), or, with keys, not signed by a trusted key or not ``address``'s. The same bytes verified before
        (by a key still trusted) are taken without a second check."""
        if d is None or self.verifier is None:
            return self._object(d, address)
        try:
            memo = blake3(A.canonical_json([address, d]).encode()).digest()
            sig = d.get("sig")
            kid = sig.get("key") if isinstance(sig, dict) else None
        except (TypeError, ValueError):  # not JSON-shaped: the full check names what is wrong
            return self._object(d, address)
        key = self.verifier.keys.get(kid) if isinstance(kid, str) else None
        seen = self._verified.get(memo) if key is not None else None
        if seen is not None and seen[0] is key:
            self._verified.move_to_end(memo)
            return seen[1]
        out = self._object(d, address)
        if out is not None and key is not None:
            self._verified[memo] = (key, out)
            if len(self._verified) > VERIFIED_MEMO:
                self._verified.popitem(last=False)
        return out

    def manifest(self, d: dict[str, Any] | None, ref: str, pin: str | None = None) -> Manifest | None:
        """The manifest sent for ``ref`` (``namespace/name``), read (a ``Manifest``), unless refused: unreadable (keys
        or none), unsigned by a trusted key or not ``ref``'s (with keys), not the pinned one (with ``pin``, keys or
        not), or older than a version taken before (with keys, which make the version the origin's word). A signed
        tombstone reads as absent, and from then on refuses every older version."""
        m = self._manifest(d, ref)
        if pin is not None and m is not None:
            from kdn.registry.signing import manifest_pin

            got = manifest_pin(m)
            if got != A.validate_digest(pin):
                self.rejected += 1
                log.warning("KDN manifest %s refused: it is not the pinned one (%s, pinned %s)", ref, got[:16],
                            pin[:16])
                return None
        if m is None or self.verifier is None:  # without keys a version is the sender's word: nothing to hold to
            return None if m is None or m.deleted else m
        seen = self.manifest_versions.get(ref, 0)
        if m.version < seen:
            self.rejected += 1
            log.warning("KDN manifest %s refused: version %d is older than version %d taken before (a replay)",
                        ref, m.version, seen)
            return None
        self.manifest_versions[ref] = m.version
        return None if m.deleted else m

    def relation(self, rel: BaseRelation, pin: str | None = None) -> BaseRelation:
        """``rel``, if a trusted key signed it, it is not older than a relation of its variant taken before,
        and (with ``pin``) it is the pinned one: ``kdn.registry.relations.take_relation`` with this client's
        marks. Raises ``SignatureError`` (counted in ``rejected``) for what it refuses, ``InvalidInput``
        without keys. A signed tombstone (``rel.deleted``) is returned: the caller reads it as withdrawn."""
        from kdn.registry.relations import take_relation
        from kdn.registry.signing import SignatureError

        if self.verifier is None:
            raise InvalidInput("a base relation is taken only signed by a trusted publisher key: pass trusted= or "
                               "a client with trusted_keys")
        try:
            return take_relation(rel, self.verifier, self.relation_versions, pin)
        except SignatureError:
            self.rejected += 1
            raise

    def _manifest(self, d: dict[str, Any] | None, ref: str) -> Manifest | None:
        """``d`` read as a manifest, if it is one and (with keys) a trusted key signed it and it is ``ref``'s."""
        if d is None:
            return None
        from kdn.registry import Manifest

        return self._refused(lambda: Manifest.from_dict(d), lambda m: m.ref, ref)

    def _object(self, d: dict[str, Any] | None, address: A.Address) -> ObjectRecord | None:
        """``d`` read as an object record, if it is one and (with keys) a trusted key signed it and it is
        ``address``'s."""
        if d is None:
            return None
        from kdn.registry import ObjectRecord

        return self._refused(lambda: ObjectRecord.from_dict(d), lambda r: r.address, address)

    def _refused(self, read: Callable[[], R], names: Callable[[R], str], what: str) -> R | None:
        """``read()``'s record, checked against the keys (where there are some) and against ``what`` it was asked
        for; None (counted, logged) for one that is unreadable or refused."""
        from kdn.registry.signing import SignatureError

        try:
            rec = read()
            if self.verifier is not None:
                self.verifier.check(rec)
                got = names(rec)
                if got != what:
                    raise SignatureError(f"asked for {what}, got a record of {got}")
        except (SignatureError, InvalidInput) as e:
            self.rejected += 1
            log.warning("KDN record refused: %s", e)
            return None
        return rec
