"""The origin's object store in an S3-compatible bucket: ``--store s3://BUCKET/PREFIX?endpoint=URL``.

The same store as ``kdn.origin.store.ObjectStore`` (content-addressed blobs, an
in-memory index, every read checked against its digest), its bytes in a bucket
instead of one machine's disk, so that several origins can write one store and
it can outgrow a disk. What changes with the medium:

- **Several origins, one bucket.** A blob is written only if its name is free
  (``PUT`` with ``If-None-Match: *``, S3's conditional write); an origin that
  finds the name taken keeps the blob that is there and records *its* digest
  (blobs are never rewritten: edges may already hold them). Two origins
  publishing the same text at once each compute it (a bounded race, no lost or
  half-written object: a PUT lands whole or not at all), and both record the
  first writer's bytes.
- **Beside each blob, its info** (``<blob>.meta``: size, BLAKE3, namespace,
  piece digests, as JSON), written once by the origin that wrote the blob, after
  it. A start indexes the store from these small objects, without reading a
  blob; a blob without one (its writer stopped between the two writes) is read,
  hashed and given one. A flipped bit in a stored blob is found when it is read
  (every read is verified), where the local store also finds it at start.
- **Credentials** come from a file (``--store-credentials``: ``aws_access_key_id``
  and ``aws_secret_access_key``, INI as in ``~/.aws/credentials``) or the
  environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, read by the
  client), never from the URL; with neither, requests go unsigned (a local
  SeaweedFS without identities, say).

The client is ``obstore`` (Python bindings of the Rust ``object_store`` crate
that Apache Arrow, Delta-rs and InfluxDB use): chosen over ``aiobotocore`` for
speed (requests and checksums in Rust, without the GIL; botocore builds every
request in Python) and for its footprint (one wheel, no dependencies; aiobotocore
pins exact botocore releases). Its blocking API is used: the store is called from
worker threads, like the local one.
"""

from __future__ import annotations

import configparser
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from kdn.format.address import Address, validate_address, validate_digest, validate_namespace
from kdn.errors import InvalidInput
from kdn.origin.store import BlobInfo, ObjectStore, blob_info
from kdn.format.pieces import PIECE_BYTES, Pieces
from kdn.format.store import validate_encoding

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules (no uppercase, 3-63)
_PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
_QUERY_KEYS = {"endpoint", "region"}
MAX_META_BYTES = 1 << 20  # a blob's info: ~100 B + 65 B a piece
RECORDS = "records"  # the folder of the object records beside the blobs (``--records store``, origin/s3records.py)


@dataclass(frozen=True)
class S3Location:
    """Where an S3 store lives: ``s3://BUCKET/PREFIX?endpoint=URL&region=NAME``."""

    bucket: str
    prefix: str
    endpoint: str | None
    region: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" + (f"?endpoint={self.endpoint}" if self.endpoint else "")


def is_s3(store: str | os.PathLike[str]) -> bool:
    return isinstance(store, str) and store.startswith("s3://")


def parse_s3_url(url: str) -> S3Location:
    """``s3://BUCKET/PREFIX?endpoint=URL&region=NAME``; credentials are refused here (they would end up in logs,
    process lists and node records)."""
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise InvalidInput(f"an S3 store is s3://BUCKET/PREFIX, got {url[:80]!r}")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise InvalidInput("an S3 store URL must not carry credentials: use --store-credentials FILE or "
                           "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    bucket = parts.netloc
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise InvalidInput(f"invalid S3 bucket {bucket[:70]!r}: 3-63 chars of a-z, 0-9, '.' and '-'")
    prefix = parts.path.strip("/")
    if not prefix or not _PREFIX.fullmatch(prefix) or any(seg in (".", "..") for seg in prefix.split("/")):
        raise InvalidInput(f"an S3 store needs a prefix of plain path segments (s3://{bucket}/kdn), "
                           f"got {parts.path[:70]!r}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(query) - _QUERY_KEYS
    if unknown or len(query) != len(parse_qsl(parts.query, keep_blank_values=True)):
        raise InvalidInput(f"an S3 store URL takes only {sorted(_QUERY_KEYS)} once each (credentials go in "
                           f"--store-credentials), got {sorted(unknown)[:4] or 'a repeated key'}")
    endpoint = query.get("endpoint")
    if endpoint is not None:
        e = urlsplit(endpoint)
        if e.scheme not in ("http", "https") or not e.hostname or e.username or e.password or e.query:
            raise InvalidInput(f"S3 endpoint must be http(s)://HOST[:PORT], got {endpoint[:80]!r}")
        endpoint = endpoint.rstrip("/")
    region = query.get("region", "us-east-1")
    if not re.fullmatch(r"[a-z0-9-]{1,32}", region):
        raise InvalidInput(f"invalid S3 region {region[:40]!r}")
    return S3Location(bucket, prefix, endpoint, region)


def bucket(loc: S3Location, credentials: str | os.PathLike[str] | None = None, *, under: str = "") -> Any:
    """An obstore ``S3Store`` of ``loc``'s prefix (or of ``under`` inside it). Credentials from the file, else
    from the environment (read by the client); with neither, requests go unsigned."""
    from obstore.store import S3Store

    kw: dict[str, Any] = {"region": loc.region, "virtual_hosted_style_request": False,
                          "client_options": {"timeout": "60s", "connect_timeout": "5s",
                                             "allow_http": bool(loc.endpoint and loc.endpoint.startswith("http:"))}}
    if loc.endpoint:
        kw["endpoint"] = loc.endpoint
    if credentials is not None:
        kw["access_key_id"], kw["secret_access_key"] = read_credentials(credentials)
    elif not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        kw["skip_signature"] = True  # no credentials anywhere: unsigned requests
    return S3Store(loc.bucket, prefix=loc.prefix + (f"/{under}" if under else ""), **kw)


def read_credentials(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(access key id, secret) from an INI file: ``[default]`` (or no section) with ``aws_access_key_id`` and
    ``aws_secret_access_key``."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise InvalidInput(f"cannot read S3 credentials {str(path)!r}: {e.strerror}") from None
    cp = configparser.ConfigParser()
    try:
        cp.read_string(text if text.lstrip().startswith("[") else "[default]\n" + text)
    except configparser.Error as e:
        raise InvalidInput(f"S3 credentials {str(path)!r} are not an INI file: {str(e)[:120]}") from None
    sec = cp["default"] if cp.has_section("default") else None
    key, secret = (sec.get("aws_access_key_id"), sec.get("aws_secret_access_key")) if sec else (None, None)
    if not key or not secret:
        raise InvalidInput(f"S3 credentials {str(path)!r} need aws_access_key_id and aws_secret_access_key "
                           "under [default]")
    mode = os.stat(path).st_mode
    if mode & 0o077:
        log.warning("S3 credentials %s are readable by other users (mode %o): chmod 600 it", path, mode & 0o777)
    return key.strip(), secret.strip()


def _info_to_json(info: BlobInfo) -> bytes:
    d: dict[str, Any] = {"size": info.size, "digest": info.digest, "namespace": info.namespace}
    if info.pieces:
        d["piece_bytes"], d["pieces"] = info.piece_bytes, list(info.pieces)
    return json.dumps(d, separators=(",", ":")).encode()


def _info_from_json(data: bytes) -> BlobInfo:
    """A blob's info as its meta object states it (validated: the bucket is the origin's own, but a meta that
    cannot describe a blob is a clear error, not a wrong record)."""
    if len(data) > MAX_META_BYTES:
        raise InvalidInput("blob info is too large")
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInput(f"blob info is not JSON: {str(e)[:80]}") from None
    if not isinstance(d, dict):
        raise InvalidInput("blob info must be a JSON object")
    size, ns = d.get("size"), d.get("namespace")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidInput("blob info: size must be an int >= 0")
    pieces = Pieces.checked(size, d.get("piece_bytes", 0), d.get("pieces", ()))
    return BlobInfo(size, validate_digest(d.get("digest")), None if ns is None else validate_namespace(ns),
                    pieces.digests if pieces else (), pieces.piece_bytes if pieces else 0)


class S3ObjectStore(ObjectStore):
    """``ObjectStore`` over an S3 bucket (obstore's blocking API; call from worker threads, as the local one)."""

    def __init__(self, url: str, *, credentials: str | os.PathLike[str] | None = None,
                 piece_bytes: int = PIECE_BYTES, load_threads: int = 16) -> None:
        self.location = parse_s3_url(url)
        self._credentials = credentials
        self._load_threads = load_threads
        super().__init__(self.location.url, fsync=True, piece_bytes=piece_bytes)

    def _open(self, root: str | os.PathLike[str], fsync: bool) -> None:
        self._s3 = bucket(self.location, self._credentials)

    @staticmethod
    def _key(address: Address, encoding: str) -> str:
        a, e = validate_address(address), validate_encoding(encoding)
        return f"{a[:2]}/{a[2:4]}/{a}.{e}"

    def _load(self) -> None:
        """Index the bucket from the blobs' info objects; a blob without one is read, hashed and given one."""
        import obstore as obs

        blobs: set[tuple[Address, str]] = set()
        metas: set[tuple[Address, str]] = set()
        for batch in obs.list(self._s3, chunk_size=1000):
            for meta in batch:
                if meta["path"].startswith(RECORDS + "/"):
                    continue  # object records (--records store), not blobs
                name = meta["path"].rsplit("/", 1)[-1]
                is_meta = name.endswith(".meta")
                addr, _, enc = name.removesuffix(".meta").partition(".")
                try:
                    key = (validate_address(addr), validate_encoding(enc))
                except InvalidInput:
                    continue  # not ours: leave it, never serve it
                if self._key(*key) != meta["path"].removesuffix(".meta"):
                    continue
                (metas if is_meta else blobs).add(key)

        def one(key: tuple[Address, str]) -> tuple[tuple[Address, str], BlobInfo | None, bool]:
            if key in metas:
                try:
                    return key, _info_from_json(bytes(obs.get(self._s3, self._key(*key) + ".meta").bytes())), True
                except (InvalidInput, FileNotFoundError) as e:
                    log.error("object store %s: info of %s.%s unreadable (%s): the blob is read instead",
                              self.where, key[0][:16], key[1], e)
            data = self._read(*key)
            if data is None:
                return key, None, False
            info = blob_info(data, self.piece_bytes)
            self._put_meta(key[0], key[1], info)
            return key, info, False

        unattested = 0
        with ThreadPoolExecutor(self._load_threads) as pool:
            for got, info, attested in pool.map(one, sorted(blobs)):
                if info is not None:
                    self._index.setdefault(got[0], {})[got[1]] = info
                    unattested += not attested
        if unattested:
            log.warning("object store %s: %d blobs had no info beside them; indexed by their hash", self.where,
                        unattested)

    def _put_meta(self, address: Address, encoding: str, info: BlobInfo) -> None:
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError

        try:
            obs.put(self._s3, self._key(address, encoding) + ".meta", _info_to_json(info), mode="create",
                    use_multipart=False)
        except AlreadyExistsError:
            pass  # written by the blob's writer meanwhile: from the same bytes

    def _write(self, address: Address, encoding: str, blob: bytes, info: BlobInfo) -> BlobInfo:
        """Write if the name is free; else the stored blob's info (another origin's bytes stand)."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError

        try:
            obs.put(self._s3, self._key(address, encoding), blob, mode="create", use_multipart=False)
        except AlreadyExistsError:
            stored = self._read(address, encoding)
            if stored is None:  # deleted between the two requests: try once more, then give up loudly
                obs.put(self._s3, self._key(address, encoding), blob, mode="create", use_multipart=False)
            else:
                theirs = blob_info(stored, self.piece_bytes)
                if theirs.digest != info.digest:
                    log.info("object store %s: %s.%s was written by another origin first: its bytes are recorded",
                             self.where, address[:16], encoding)
                self._put_meta(address, encoding, theirs)
                return theirs
        self._put_meta(address, encoding, info)
        return info

    def _read(self, address: Address, encoding: str) -> bytes | None:
        import obstore as obs

        try:
            return bytes(obs.get(self._s3, self._key(address, encoding)).bytes())
        except FileNotFoundError:
            return None

    def delete(self, address: Address, encoding: str) -> None:
        """Remove a blob and its info (operators' tooling and tests; publishing never deletes)."""
        import obstore as obs

        for key in (self._key(address, encoding) + ".meta", self._key(address, encoding)):
            try:
                obs.delete(self._s3, key)
            except FileNotFoundError:
                pass
        with self._lock:
            self._index.get(address, {}).pop(encoding, None)

    def free_space(self) -> None:
        """A bucket has no disk to fill (its quota is the operator's): raw copies are kept (``--raw-copies auto``)."""
        return None


def open_store(store: str | os.PathLike[str], *, fsync: bool = True, piece_bytes: int = PIECE_BYTES,
               credentials: str | os.PathLike[str] | None = None) -> ObjectStore:
    """The origin's store named by ``--store``: a folder, or ``s3://BUCKET/PREFIX?endpoint=URL``."""
    if is_s3(store):
        return S3ObjectStore(str(store), credentials=credentials, piece_bytes=piece_bytes)
    if credentials is not None:
        raise InvalidInput("--store-credentials is for an s3:// store")
    return ObjectStore(store, fsync=fsync, piece_bytes=piece_bytes)
