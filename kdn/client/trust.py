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
from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from kdn.format import address as A
from kdn.errors import InvalidInput

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from kdn.client.versions import ManifestState
    from kdn.registry.records import BaseRelation
    from kdn.registry.signing import Verifier

    # Publisher keys: a Verifier, key strings (ed25519:<hex>), or a file of them.
    TrustedKeys = Verifier | str | os.PathLike[str] | Iterable[str]

log = logging.getLogger("kdn.client")

# Object records that verified, remembered by the digest of their exact content: a hot chain's records are
# checked on every lookup, and a check costs ~150 us a record (Ed25519 and parsing; bench/lookup.py), against
# ~20 us to recognise the same bytes. Bounded; never holds a refused record.
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
    """A client's checks on what its sources answer: ``record`` and ``manifest`` return what they are given,
    or None for what they refuse."""

    def __init__(self, trusted_keys: TrustedKeys | None = None, manifest_state: ManifestState = None) -> None:
        from kdn.client.versions import RELATIONS, VersionFile, state_file

        self.verifier = verifier(trusted_keys)
        self.rejected = 0
        self._verified: OrderedDict[bytes, object] = OrderedDict()  # content digest -> the key that verified it
        # namespace/name (variant model id) -> the highest manifest (relation) version taken; in a file
        # (kdn.client.versions) unless manifest_state says memory, so that a new process still refuses what an
        # earlier one saw superseded.
        self.manifest_versions: MutableMapping[str, int] = {}
        self.relation_versions: MutableMapping[str, int] = {}
        self.state_path: Path | None = state_file(manifest_state, keys=self.verifier is not None)
        if self.state_path is not None:
            self.manifest_versions = VersionFile(self.state_path)
            self.relation_versions = VersionFile(self.state_path, RELATIONS)

    def record(self, d: dict[str, Any] | None, address: A.Address) -> dict[str, Any] | None:
        """An object record as sent for ``address``: ``d`` if no keys are configured, or if a trusted key
        signed it and it is ``address``'s. The same bytes verified before (by a key still trusted) are taken
        without a second check."""
        if d is None or self.verifier is None:
            return d
        try:
            memo = blake3(A.canonical_json([address, d]).encode()).digest()
            sig = d.get("sig")
            kid = sig.get("key") if isinstance(sig, dict) else None
        except (TypeError, ValueError):  # not JSON-shaped: the full check names what is wrong
            return self._signed(d, "object", address)
        key = self.verifier.keys.get(kid) if isinstance(kid, str) else None
        if key is not None and self._verified.get(memo) is key:
            self._verified.move_to_end(memo)
            return d
        out = self._signed(d, "object", address)
        if out is not None and key is not None:
            self._verified[memo] = key
            if len(self._verified) > VERIFIED_MEMO:
                self._verified.popitem(last=False)
        return out

    def manifest(self, d: dict[str, Any] | None, ref: str, pin: str | None = None) -> dict[str, Any] | None:
        """The manifest sent for ``ref`` (``namespace/name``), unless refused: unsigned by a trusted key (with
        keys), not the pinned one (with ``pin``, keys or not), or older than a version taken before (with keys,
        which make the version the origin's word). A signed tombstone reads as absent, and from then on refuses
        every older version."""
        d = self._signed(d, "manifest", ref)
        if pin is not None and d is not None:
            from kdn.registry import Manifest
            from kdn.registry.signing import manifest_pin

            try:
                got = manifest_pin(Manifest.from_dict(d))
            except InvalidInput as e:
                got = f"unreadable ({e})"
            if got != A.validate_digest(pin):
                self.rejected += 1
                log.warning("KDN manifest %s refused: it is not the pinned one (%s, pinned %s)", ref, got[:16],
                            pin[:16])
                return None
        if d is None or self.verifier is None:  # without keys a version is the sender's word: nothing to hold to
            return None if d is not None and d.get("deleted") else d
        version = d.get("version", 0)
        if not (isinstance(version, int) and not isinstance(version, bool) and version >= 0):
            self.rejected += 1
            log.warning("KDN manifest %s refused: version %r", ref, str(version)[:20])
            return None
        seen = self.manifest_versions.get(ref, 0)
        if version < seen:
            self.rejected += 1
            log.warning("KDN manifest %s refused: version %d is older than version %d taken before (a replay)",
                        ref, version, seen)
            return None
        self.manifest_versions[ref] = version
        return None if d.get("deleted") else d

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

    def _signed(self, d: dict[str, Any] | None, kind: str, what: str) -> dict[str, Any] | None:
        """``d`` if no keys are configured or a trusted key signed it (and it says what it was asked for)."""
        if d is None or self.verifier is None:
            return d
        from kdn.registry import Manifest, ObjectRecord
        from kdn.registry.signing import SignatureError

        try:
            rec: ObjectRecord | Manifest
            got: str
            if kind == "object":
                rec = ObjectRecord.from_dict(d)
                got = rec.address
            else:
                rec = Manifest.from_dict(d)
                got = rec.ref
            self.verifier.check(rec)
            if got != what:
                raise SignatureError(f"asked for {what}, got a record of {got}")
        except (SignatureError, InvalidInput) as e:
            self.rejected += 1
            log.warning("KDN record refused: %s", e)
            return None
        return d
