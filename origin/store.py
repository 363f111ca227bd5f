"""The origin's content-addressed object store: blobs on disk plus an in-memory index.

Blobs live in a ``BlobDir`` (atomic temp-file + fsync + rename writes, fan-out
folders). Beside each blob, its BLAKE3 digest is written at write time
(``<blob>.b3``, before the blob itself is renamed into place). A restart
indexes a blob only if its bytes still match that digest: a flipped bit on
the origin's disk is found at start and the blob dropped, never re-hashed into
a new "truth" that a re-publish would then record (a re-publish recomputes and
rewrites it instead). Blobs without a digest file (from before it was kept, or
written by an engine's connector) are indexed by their hash with a warning;
``adopt`` checks them against their registry record. Every read is checked
against the indexed digest too. The index is by address, so looking one up
costs the same in a store of twenty blobs or twenty thousand.

The index also keeps each blob's namespace, read from the header written into
the blob itself: who may read an object is decided from that, never from the
registry record, whose fields any registry writer can change (#28 item 3).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
from dataclasses import dataclass

from kdn.format.address import Address, Digest, blob_digest, validate_address
from kdn.errors import DigestMismatch
from kdn.format.objects import blob_namespace
from kdn.format.pieces import PIECE_BYTES, check_piece_bytes, piece_digests
from kdn.registry.records import Encoding
from kdn.format.store import BlobDir, validate_encoding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlobInfo:
    size: int
    digest: Digest
    namespace: str | None = None  # from the blob's own header; None for a blob that is not a KV object
    # Each PIECE_BYTES piece's BLAKE3 (kdn/format/pieces.py), hashed from the same bytes as ``digest``: at write
    # time, or at a restart only once the digest written beside the blob matched. Never from bytes that
    # were not first proven whole, so a record's pieces always name the bytes its digest names.
    pieces: tuple[Digest, ...] = ()
    piece_bytes: int = 0

    def encoding(self, name: str) -> Encoding:
        """This blob as an object record states it."""
        return Encoding(name, self.size, self.digest, self.piece_bytes if self.pieces else 0, self.pieces)


def blob_info(data: bytes | memoryview, piece_bytes: int) -> BlobInfo:
    pieces = piece_digests(data, piece_bytes)
    return BlobInfo(len(data), blob_digest(data), blob_namespace(data), pieces, piece_bytes if pieces else 0)


class ObjectStore:
    """Blocking store; the async service calls it through ``asyncio.to_thread``."""

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True, piece_bytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = check_piece_bytes(piece_bytes)  # the piece digests each record carries (kdn/format/pieces.py)
        self._index: dict[Address, dict[str, BlobInfo]] = {}  # address -> encoding -> info
        self._lock = threading.Lock()
        self.dropped = 0  # blobs whose bytes no longer matched the digest written with them
        self.where = str(root)
        self._open(root, fsync)
        self._load()
        if self._index:
            log.info("object store %s: %d blobs, %d bytes", self.where, len(self), self.total_bytes)

    # --- the backend: a local folder here, an S3 bucket in kdn.origin.s3store ---

    def _open(self, root: str | os.PathLike, fsync: bool) -> None:
        self.dir = BlobDir(root, fsync=fsync)

    def _load(self) -> None:
        """Index every blob: read whole, checked against the digest written beside it."""
        unattested = 0
        for blob in self.dir.scan():
            data = blob.path.read_bytes()
            info = blob_info(data, self.piece_bytes)
            got = info.digest
            want = self.dir.attested(blob.address, blob.encoding)
            if want is None:
                unattested += 1
            elif want != got:
                log.error("stored blob %s.%s does not match the digest written with it: dropped (a re-publish "
                          "rewrites it)", blob.address, blob.encoding)
                self.dir.delete(blob.address, blob.encoding)
                self.dropped += 1
                continue
            self._index.setdefault(blob.address, {})[blob.encoding] = info
        if unattested:
            log.warning("object store %s: %d blobs have no digest written beside them; indexed by their hash",
                        self.where, unattested)

    def _write(self, address: Address, encoding: str, blob: bytes, info: BlobInfo) -> BlobInfo:
        """Store ``blob``; the info of what is stored under the name afterwards (here: always ``blob``)."""
        self.dir.put(address, encoding, blob, digest=info.digest)  # the digest lands first, beside it
        return info

    def _read(self, address: Address, encoding: str) -> bytes | None:
        return self.dir.read(address, encoding)

    def free_space(self) -> tuple[int, int] | None:
        """The store's file system's (free bytes, total bytes)."""
        usage = shutil.disk_usage(self.dir.root)
        return usage.free, usage.total

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(i.size for encs in self._index.values() for i in encs.values())

    def __len__(self) -> int:
        return sum(len(encs) for encs in self._index.values())

    def info(self, address: Address, encoding: str) -> BlobInfo | None:
        return self._index.get(validate_address(address), {}).get(validate_encoding(encoding))

    def encodings(self, address: Address) -> dict[str, BlobInfo]:
        with self._lock:
            return dict(self._index.get(validate_address(address), {}))

    def namespace(self, address: Address) -> str | None:
        """The namespace this store's blobs of ``address`` carry in their headers; None if it holds none, they
        are not KV objects, or (never written so by an origin) their encodings disagree."""
        names = {i.namespace for i in self.encodings(address).values()}
        if len(names) > 1:
            log.error("stored blobs of %s carry different namespaces %s: served to no one", address, sorted(map(str, names)))
            return None
        return names.pop() if names else None

    def has(self, address: Address, encoding: str) -> bool:
        return self.info(address, encoding) is not None

    def put(self, address: Address, encoding: str, blob: bytes) -> BlobInfo:
        """Store a blob (idempotent: an identical blob already present is not rewritten); the info of what is
        stored (in a store that several origins write, another origin's blob may have been there first)."""
        info = blob_info(blob, self.piece_bytes)
        if self.info(address, encoding) == info:
            return info
        info = self._write(address, encoding, blob, info)
        with self._lock:
            self._index.setdefault(address, {})[encoding] = info
        return info

    def adopt(self, address: Address, encoding: str, digest: Digest | None = None) -> BlobInfo | None:
        """Index a blob that another writer put into the folder (an engine saving through its connector).

        With ``digest`` (from the object's registry record) a file that does not match is not indexed.
        None if there is no such file, or it does not match.
        """
        data = self._read(validate_address(address), validate_encoding(encoding))
        if data is None:
            return None
        info = blob_info(data, self.piece_bytes)
        if digest is not None and info.digest != digest:
            log.warning("stored blob %s.%s does not match its record's digest: not served", address, encoding)
            return None
        with self._lock:
            self._index.setdefault(address, {})[encoding] = info
        return info

    def get(self, address: Address, encoding: str) -> tuple[bytes, BlobInfo] | None:
        """The blob and its info, verified against the indexed digest; None if absent."""
        info = self.info(address, encoding)
        if info is None:
            return None
        data = self._read(address, encoding)
        if data is None:
            with self._lock:
                self._index.get(address, {}).pop(encoding, None)
            return None
        if len(data) != info.size or blob_digest(data) != info.digest:
            raise DigestMismatch(f"stored blob {address}.{encoding} does not match its digest (disk corruption?)")
        return data, info

    async def aget(self, address: Address, encoding: str) -> tuple[bytes, BlobInfo] | None:
        return await asyncio.to_thread(self.get, address, encoding)
