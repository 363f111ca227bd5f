"""What a client believes of the records and manifests its sources send.

Any source can lie: an edge, a registry writer who planted a record, a replay
of an old answer. With publisher keys (``trusted_keys``) a record counts only
if one of them signed it and it is the record of what was asked; a manifest
also only if it is not older than a version of that name this client took
before (kept in memory, or in a file across processes: ``kdn.client.versions``), and,
with a pin (``kdn.registry.signing.manifest_pin``), only if it is exactly the pinned
one. Whatever is refused is counted in ``rejected`` and logged, and reads as
absent: its digests are never believed.
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

    def __init__(self, trusted_keys: TrustedKeys | None = None,
                 manifest_state: str | os.PathLike[str] | None = None) -> None:
        self.verifier = verifier(trusted_keys)
        self.rejected = 0
        self._verified: OrderedDict[bytes, object] = OrderedDict()  # content digest -> the key that verified it
        # namespace/name -> the highest version taken; with ``manifest_state``, kept in that file (kdn.client.versions)
        # so that a new process still refuses what an earlier one saw superseded.
        self.manifest_versions: MutableMapping[str, int] = {}
        if manifest_state is not None:
            from kdn.client.versions import VersionFile

            self.manifest_versions = VersionFile(manifest_state)

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
