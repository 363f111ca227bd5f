"""Origin-signed records: Ed25519 over a canonical encoding of every field a consumer relies on.

A digest is only worth the record it came from. An origin signs each object
record and manifest it writes (the registry signs the final, merged record
inside the write transaction: ``KVRegistry.signer``); a consumer -- the fetch
client, an edge, an engine adapter -- verifies the signature against the
publisher keys it trusts before it believes a digest. An unsigned or badly
signed record is a miss. Because a signed record verifies itself, it can
travel with its object through edges that are not trusted.

    kdn origin keygen --out origin.key          # origin.key (private, 0600) + origin.key.pub
    kdn origin serve --signing-key origin.key ...
    kdn edge serve --trusted-keys keys.txt ...  # one public key per line: ed25519:<64 hex>

Rotation: trust the new key beside the old one, switch the origin to the new
key, re-publish, then drop the old key. Revocation: drop a key from the
trusted set; every record it signed is a miss from then on.

Signed fields (``payload``): models -- every field (id, name, architecture, dtype, chunk size, config,
extra: the kvtc basis's address, the origin's URL); objects -- address, model id, namespace, kind,
token span, parent, standalone, every encoding's size and digest (and its piece digests, kdn/format/pieces.py), tails,
origin, engine; manifests -- namespace, name, model id, addresses, token
counts, the published token ids, template, standalone addresses, the emphasis map (when there is
one; its absence is signed too, since the payload then differs from one with a map); base relations
(``BaseRelation``: a variant model reads a base model's states) -- variant, base, layer count, the layer plan,
metric, budget, what was measured, name, and (when set) its per-variant version with its ``created`` and a
tombstone's ``deleted``; operator policies -- every field, the schedule when there is one. Not signed: an
object record's and a version-0 record's ``created`` (no consumer decides anything by it) and the signature
itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from blake3 import blake3

from kdn.format.address import canonical_json
from kdn.errors import InvalidInput, KDNError

if TYPE_CHECKING:  # pragma: no cover - imported where used: kdn.registry and cryptography load lazily
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from kdn.registry.records import (Admission, BaseRelation, Encoding, Manifest, ModelRecord, NodeRecord,
                                      ObjectRecord, Policy)

    Signable = TypeVar("Signable", bound=ObjectRecord | Manifest | Policy | Admission | ModelRecord | BaseRelation)

KEY_PREFIX = "ed25519:"


class SignatureError(KDNError):
    """A record is unsigned, signed by a key nobody trusts here, or its signature does not match."""


def payload(rec: ObjectRecord | Manifest | Policy | Admission | ModelRecord | BaseRelation) -> bytes:
    """The canonical bytes signed for an ``ObjectRecord``, a ``Manifest``, a ``ModelRecord``, a publisher's
    ``BaseRelation``, or (an operator's) a ``Policy`` or a node's ``Admission``."""
    from kdn.registry.records import Admission, BaseRelation, Manifest, ModelRecord, ObjectRecord, Policy

    if isinstance(rec, ObjectRecord):
        body = {
            "t": "kdn/object-record/v1", "address": rec.address, "model_id": rec.model_id, "namespace": rec.namespace,
            "kind": rec.kind, "start": rec.start, "end": rec.end, "parent": rec.parent, "standalone": rec.standalone,
            "encodings": {n: _signed_encoding(e) for n, e in sorted(rec.encodings.items())},
            "tails": {str(k): v for k, v in sorted(rec.tails.items())}, "origin": rec.origin, "engine": rec.engine,
        }
    elif isinstance(rec, Manifest):
        body = {
            "t": "kdn/manifest/v1", "namespace": rec.namespace, "name": rec.name, "model_id": rec.model_id,
            "addresses": rec.addresses, "tokens": rec.tokens, "chunk_tokens": rec.chunk_tokens,
            "prefix_tokens": rec.prefix_tokens, "template": rec.template, "standalone": rec.standalone,
            "head_tokens": rec.head_tokens,
        }
        if rec.version:  # likewise: a manifest signed before versions verifies, and counts as version 0
            body["version"], body["created"] = rec.version, rec.created
        if rec.deleted:
            body["deleted"] = True
        if rec.body is not None:  # a pointer: its signature binds the whole manifest's digest
            body["body"] = rec.body
        if rec.emphasis is not None:  # only when present: manifests signed before maps existed still verify
            from kdn.emphasis import EmphasisMap

            body["emphasis"] = EmphasisMap.from_dict(rec.emphasis).to_dict()
    elif isinstance(rec, Policy):
        body = {"t": "kdn/policy/v1", "name": rec.name, "kind": rec.kind, "region": rec.region,
                "manifest": rec.manifest, "namespace": rec.namespace, "ttl_s": rec.ttl_s,
                "quota_bytes": rec.quota_bytes, "extra": rec.extra}
        if rec.schedule is not None:  # only when present: policies signed before schedules existed still verify
            body["schedule"] = rec.schedule.to_dict()
    elif isinstance(rec, ModelRecord):
        body = {"t": "kdn/model-record/v1", "model_id": rec.model_id, "name": rec.name,
                "architecture": rec.architecture, "dtype": rec.dtype, "chunk_tokens": rec.chunk_tokens,
                "config": rec.config, "extra": rec.extra}
    elif isinstance(rec, BaseRelation):  # every field but a version-0 relation's ``created``
        body = {"t": "kdn/base-relation/v1", "variant": rec.variant, "base": rec.base, "layers": rec.layers,
                "recompute": rec.recompute, "metric": rec.metric, "budget": rec.budget, "measured": rec.measured,
                "name": rec.name}
        if rec.version:  # as for manifests: a relation signed before versions verifies, and counts as version 0
            body["version"], body["created"] = rec.version, rec.created
        if rec.deleted:
            body["deleted"] = True
    elif isinstance(rec, Admission):
        body = {"t": "kdn/node-admission/v1", "role": rec.role, "region": rec.region, "node_id": rec.node_id,
                "url": rec.url, "expires": rec.expires}
    else:
        raise InvalidInput(f"cannot sign a {type(rec).__name__}")
    return canonical_json(body).encode("utf-8")


def admission_of(node: NodeRecord) -> Admission | None:
    """The admission a node record carries (``extra["admission"]``), None if none or unreadable."""
    from kdn.registry.records import Admission

    raw = node.extra.get("admission") if isinstance(node.extra, dict) else None
    if raw is None:
        return None
    try:
        return Admission.from_dict(raw)
    except (InvalidInput, TypeError, ValueError):
        return None


def unadmitted(node: NodeRecord, operators: Verifier, now: float | None = None) -> str | None:
    """Why ``node`` is not admitted by one of ``operators``' keys (None: it is): no admission, one signed
    by no trusted operator key or changed after signing, one naming another node, one expired, or (where
    ``operators`` is an ``Admitters`` with a revocation list) one the operator revoked."""
    import time

    adm = admission_of(node)
    if adm is None:
        return "carries no admission"
    if not operators.ok(adm):
        return "its admission is not signed by a trusted operator key"
    if not adm.names(node):
        return f"its admission names {adm.role}/{adm.region}/{adm.node_id} at {adm.url[:60]}, not this record"
    if adm.expires <= (time.time() if now is None else now):
        return "its admission has expired"
    if isinstance(operators, Admitters) and admission_id(adm) in operators.revoked:
        return f"its admission {admission_id(adm)[:16]} is revoked"
    return None


def admission_id(adm: Admission) -> str:
    """An admission's name in a revocation list: the BLAKE3 of what its signature covers. A node admitted
    again (a new expiry) has a new one, so revoking one admission never bars the node for good."""
    return blake3(payload(adm)).hexdigest()


def _signed_encoding(e: Encoding) -> dict[str, object]:
    body: dict[str, object] = {"size": e.size, "digest": e.digest}
    if e.pieces:  # only when present: records signed before pieces existed still verify
        body["piece_bytes"], body["pieces"] = e.piece_bytes, list(e.pieces)
    return body


def manifest_pin(rec: Manifest) -> str:
    """A manifest's pin: the BLAKE3 of what its signature covers (``payload``), its version and creation time
    included. A consumer holding a pin takes that manifest and no other -- not an older one replayed, not a
    newer one -- whoever serves it, keys or none (``KDNClient.manifest(..., pin=)``)."""
    return blake3(payload(rec)).hexdigest()


def relation_pin(rec: BaseRelation) -> str:
    """A base relation's pin, as ``manifest_pin`` is a manifest's: the BLAKE3 of its signed payload (version and
    time included). A consumer holding one takes that relation and no other, older or newer
    (``find_relation(..., pin=)``)."""
    return blake3(payload(rec)).hexdigest()


def key_id(public_raw: bytes) -> str:
    """A short name for a public key: the first 16 hex digits of its BLAKE3."""
    return blake3(public_raw).hexdigest()[:16]


def _public_text(public_raw: bytes) -> str:
    return KEY_PREFIX + public_raw.hex()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """``ed25519:<64 hex>`` -> an Ed25519 public key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    t = text.strip()
    if not t.startswith(KEY_PREFIX):
        raise InvalidInput(f"a publisher key looks like {KEY_PREFIX}<64 hex digits>, got {t[:24]!r}")
    try:
        raw = bytes.fromhex(t[len(KEY_PREFIX):])
        if len(raw) != 32:
            raise ValueError("not 32 bytes")
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise InvalidInput(f"bad publisher key {t[:24]!r}: {e}") from None


@dataclass
class Signer:
    """An origin's private key; ``sign(rec)`` returns the record with its signature."""

    key: Ed25519PrivateKey
    key_id: str
    public: str  # ed25519:<hex>

    @classmethod
    def generate(cls, path: str | os.PathLike[str]) -> Signer:
        """A new key in ``path`` (PEM, mode 0600, never overwritten) and its public key in ``path.pub``."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        p = Path(path)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise InvalidInput(f"{p} exists: a signing key is never overwritten") from None
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        signer = cls._of(key)
        Path(f"{p}.pub").write_text(signer.public + "\n")
        return signer

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Signer:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        p = Path(path)
        try:
            data = p.read_bytes()
            mode = p.stat().st_mode
        except OSError as e:
            raise InvalidInput(f"cannot read signing key {str(p)!r}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidInput(f"signing key {p} is readable by others (chmod 600 it)")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise InvalidInput(f"{p} is not a PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidInput(f"{p} is not an Ed25519 key")
        return cls._of(key)

    @classmethod
    def _of(cls, key: Ed25519PrivateKey) -> Signer:
        from cryptography.hazmat.primitives import serialization

        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, key_id(raw), _public_text(raw))

    def sign(self, rec: Signable) -> Signable:
        import dataclasses

        sig = {"key": self.key_id, "ed25519": self.key.sign(payload(rec)).hex()}
        return dataclasses.replace(rec, sig=sig)

    def signed_it(self, rec: ObjectRecord | Manifest) -> bool:
        """Whether this key made ``rec``'s signature: what an origin may build on when it re-signs.

        A stored record is the registry's word, and a registry writer is not the origin: an origin that
        merged an unverified stored record into a new one and signed the result would attest a digest
        someone else planted.
        """
        from cryptography.exceptions import InvalidSignature

        sig = rec.sig or {}
        if sig.get("key") != self.key_id:
            return False
        try:
            self.key.public_key().verify(bytes.fromhex(sig.get("ed25519", "")), payload(rec))
        except (InvalidSignature, ValueError):
            return False
        return True


class Verifier:
    """The publisher keys a consumer trusts; ``check(rec)`` raises ``SignatureError`` unless one signed it."""

    def __init__(self, public_keys: Iterable[str]) -> None:
        from cryptography.hazmat.primitives import serialization

        self.keys: dict[str, Ed25519PublicKey] = {}
        for text in public_keys:
            k = parse_public_key(text)
            raw = k.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            self.keys[key_id(raw)] = k
        if not self.keys:
            raise InvalidInput("no trusted publisher key given")
        self.rejected = 0  # records refused (tests, metrics)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Verifier:
        """One ``ed25519:<hex>`` per line; ``#`` starts a comment at the start of a line."""
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise InvalidInput(f"cannot read trusted keys {str(path)!r}: {e.strerror}") from None
        return cls(ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))

    def check(self, rec: Signable) -> Signable:
        from cryptography.exceptions import InvalidSignature

        sig: object = getattr(rec, "sig", None) or {}
        kid = sig.get("key") if isinstance(sig, dict) else None
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None or not isinstance(sig, dict):  # (no key without a map)
            self.rejected += 1
            raise SignatureError(f"record {_name(rec)} is {'unsigned' if not sig else 'signed by an untrusted key'}")
        try:
            key.verify(bytes.fromhex(str(sig.get("ed25519", ""))), payload(rec))
        except (InvalidSignature, ValueError):
            self.rejected += 1
            raise SignatureError(f"record {_name(rec)}: the signature does not match its fields") from None
        return rec

    def ok(self, rec: ObjectRecord | Manifest | Policy | Admission | ModelRecord | BaseRelation) -> bool:
        try:
            self.check(rec)
            return True
        except SignatureError:
            return False


def _name(rec: ObjectRecord | Manifest | Policy | Admission | ModelRecord | BaseRelation) -> str:
    return str(getattr(rec, "address", None) or getattr(rec, "node_id", None) or getattr(rec, "model_id", None)
               or getattr(rec, "variant", None)
               or f"{getattr(rec, 'namespace', '?')}/{getattr(rec, 'name', '?')}")[:32]


class Admitters(Verifier):
    """Operator keys for node admissions, with the operator's revocation list: a file of admission ids
    (``admission_id``; ``kdn node revoke`` appends to it), one per line, ``#`` comments.

    The list is a file, as the keys are, not a registry record: a registry writer could delete a record,
    and every node it revoked would be admitted again. ``refresh()`` reads it again when it changed
    (the readers call it with their admission recheck, every ``ADMISSION_RECHECK_S``), so a revocation
    takes effect within that while the readers run. A list that cannot be read keeps the one last read
    (logged): a file half-written by a careless copy must not admit what it revoked.
    """

    def __init__(self, public_keys: Iterable[str], revoked: str | os.PathLike[str] | Iterable[str] | None = None) -> None:
        super().__init__(public_keys)
        self.revoked: frozenset[str] = frozenset()
        self.revoked_path: Path | None = None
        self._stamp: tuple[int, int, int, int] | None = None
        if isinstance(revoked, (str, os.PathLike)):
            self.revoked_path = Path(revoked)
            if not self.refresh():
                raise InvalidInput(f"cannot read the revoked admissions {str(revoked)!r}")
        elif revoked is not None:
            self.revoked = frozenset(parse_admission_ids(revoked, "the revoked admissions"))

    @classmethod
    def from_files(cls, keys: str | os.PathLike[str],
                   revoked: str | os.PathLike[str] | Iterable[str] | None = None) -> Admitters:
        try:
            lines = Path(keys).read_text().splitlines()
        except OSError as e:
            raise InvalidInput(f"cannot read operator keys {str(keys)!r}: {e.strerror}") from None
        return cls((ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")), revoked)

    def refresh(self) -> bool:
        """Read the revocation list again if its file changed; False if it cannot be read (the last kept)."""
        import logging

        if self.revoked_path is None:
            return True
        try:
            st = self.revoked_path.stat()
            stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)  # (a rename changes the inode)
            if stamp == self._stamp:
                return True
            ids = parse_admission_ids(self.revoked_path.read_text().splitlines(), str(self.revoked_path))
        except (OSError, InvalidInput) as e:
            logging.getLogger("kdn.registry.signing").error("cannot read the revoked admissions %s (%s): keeping the %d "
                                                   "read before", self.revoked_path, e, len(self.revoked))
            return False
        self.revoked, self._stamp = frozenset(ids), stamp
        return True


def parse_admission_ids(lines: Iterable[str], what: str) -> list[str]:
    out = []
    for ln in lines:
        t = ln.split("#", 1)[0].strip().lower()
        if not t:
            continue
        if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
            raise InvalidInput(f"{what}: {t[:24]!r} is not an admission id (64 hex digits: kdn node revoke)")
        out.append(t)
    return out
