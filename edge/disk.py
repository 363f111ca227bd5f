"""The disk tier: blobs in a ``BlobDir``, one msgpack sidecar of metadata per blob, survives restarts.

Files, under ``root``::

    ab/cd/<address>.<encoding>        the blob (BlobDir: temp file, fsync, rename)
    ab/cd/<address>.<encoding>.meta   its metadata (msgpack), written the same way

Order of writes: the sidecar is made durable *before* the blob is renamed into
place, and the blob is unlinked *before* its sidecar. So at every instant, and
after a crash at any point, a visible blob has a complete sidecar; the worst a
crash leaves is a temp file or a sidecar without a blob, and the start-up scan
deletes both. A blob whose sidecar is missing, unreadable or disagrees with it
(address, encoding, size) is deleted at the scan, never indexed.

Trust: a blob written by this process came from bytes the server verified, so
it is served as is. After a restart every entry is unverified: its first
``acquire`` hashes the file (BLAKE3, in a thread) and compares the digest in
the sidecar; a mismatch deletes the file, counts ``stats.corrupt`` and is a
miss. A verified entry is served from its path (sendfile) without hashing it
again: bit rot after that point is caught by the client, which checks every
blob against its registry digest end to end.

Pinned/TTL state is not persisted: it is policy, and the server re-applies
its rules (``apply_policy``) after a restart; ``inserted_at`` is persisted so
a TTL rule measured from insertion still holds. A clock stepped while the edge
was down ages entries by the new wall time: forward, they expire early (a
refill); back, an entry stamped in the future counts as arrived long ago
(``scan_future``), so a TTL drops it rather than serving it for the step. (A
step back while the previous process ran has the same effect: its stamps
follow its start-time clock. Conservative: a refill, never a stale read.)

Blocking work (writing a blob, hashing one, the start-up scan) runs in a
thread; unlinks are metadata-only and run on the event loop, which keeps
"remove from the index" and "remove from the disk" one step that no
concurrent put of the same key can slip between.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgpack
from blake3 import blake3

from kdn.edge.eviction import ARC, PolicyFactory
from kdn.edge.tierbase import Entry, HandleBase, TierBase
from kdn.edge.tiers import EntryMeta, EvictCallback, steady_wall
from kdn.errors import InvalidInput
from kdn.format.store import BlobDir, StoredBlob

log = logging.getLogger("kdn.edge.disk")

_META_VERSION = 1
_SUFFIX = ".meta"
# An entry stamped more than this after the start of the edge that finds it is treated as arrived long ago
# (``LONG_AGO``, not 0: a put stamps 0 with the current time).
FUTURE_SLACK_S = 1.0
LONG_AGO = 1.0


def _sidecar(blob: Path) -> Path:
    return blob.with_name(blob.name + _SUFFIX)


class DiskHandle(HandleBase):
    """A pinned read: serve ``path`` with sendfile, or ``await read()`` for the bytes.

    The file is not deleted or replaced before ``release()``.
    """

    def __init__(self, tier: DiskTier, e: Entry) -> None:
        super().__init__(tier, e)
        self._file: Path = e.payload
        self.path = self._file

    async def read(self) -> bytes:
        return await asyncio.to_thread(self._file.read_bytes)


class DiskTier(TierBase):
    """``DiskTier(root, budget_bytes, policy=ARC)``: see ``kdn.edge.tiers`` for the contract.

    The constructor scans ``root`` (blocking); from a running event loop use
    ``await DiskTier.open(...)``, which scans in a thread.
    """

    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike,
        budget: int,
        policy: PolicyFactory = ARC,
        *,
        fsync: bool = True,
        on_evict: EvictCallback | None = None,
        clock: Callable[[], float] = steady_wall,
    ) -> None:
        super().__init__(budget, policy, on_evict=on_evict, clock=clock)
        self.blobs = BlobDir(root, fsync=fsync)
        self._fsync = fsync
        self.scan_dropped = 0  # blobs deleted at start for want of valid metadata
        self.scan_future = 0  # entries stamped after this start (the clock went back): aged as expired
        self._load(self._scan())

    @classmethod
    async def open(cls, root: str | os.PathLike, budget: int, **kw) -> DiskTier:
        return await asyncio.to_thread(cls, root, budget, **kw)

    # --- start-up ----------------------------------------------------------

    def _scan(self) -> list[Entry]:
        found = []
        now, latest = self._clock(), 0.0
        for b in self.blobs.scan():  # also deletes temp files a crash left behind
            meta = self._read_sidecar(b)
            if meta is None:
                b.path.unlink(missing_ok=True)
                _sidecar(b.path).unlink(missing_ok=True)
                self.scan_dropped += 1
                continue
            latest = max(latest, meta.inserted_at)
            if meta.inserted_at > now + FUTURE_SLACK_S:
                # Stamped "later" than now: the wall clock went back while the edge was down (or was ahead
                # before). Its real age is unknown; aging it from a future stamp would keep it past a TTL
                # for as long as the step. Count it as arrived long ago: a TTL drops it, nothing else cares.
                meta = replace(meta, inserted_at=LONG_AGO)
                self.scan_future += 1
            found.append((b.mtime, Entry((b.address, b.encoding), meta, b.path, verified=False)))
        if self.scan_future:
            log.warning("disk tier %s: %d entries were stamped up to %.0f s in the future (the clock went back "
                        "while the edge was down): treated as arrived long ago, so a TTL policy drops them",
                        self.blobs.root, self.scan_future, latest - now)
        for side in self.blobs.root.glob(f"??/??/*{_SUFFIX}"):
            if not side.with_name(side.name[: -len(_SUFFIX)]).exists():
                side.unlink(missing_ok=True)  # a crash between sidecar and blob
        found.sort(key=lambda t: t[0])  # oldest first: the policy's queues start in age order
        return [e for _, e in found]

    @staticmethod
    def _read_sidecar(b: StoredBlob) -> EntryMeta | None:
        try:
            d = msgpack.unpackb(_sidecar(b.path).read_bytes(), raw=False)
            if d["v"] != _META_VERSION or d["address"] != b.address or d["encoding"] != b.encoding:
                return None
            if d["size"] != b.size:
                return None
            return EntryMeta(
                size=d["size"],
                digest=d["digest"],
                namespace=d["namespace"],
                manifest=d.get("manifest"),
                inserted_at=float(d.get("inserted_at", 0.0)),
            )
        except (OSError, ValueError, TypeError, KeyError, msgpack.UnpackException, InvalidInput):
            return None

    # --- hooks -------------------------------------------------------------

    async def _write(self, e: Entry, blob: bytes | bytearray | memoryview) -> Path:
        return await asyncio.to_thread(self._write_sync, e, blob)

    def _write_sync(self, e: Entry, blob: bytes | bytearray | memoryview) -> Path:
        address, encoding = e.key
        final = self.blobs.path(address, encoding)
        final.parent.mkdir(parents=True, exist_ok=True)
        m = e.meta
        side = msgpack.packb(
            {
                "v": _META_VERSION,
                "address": address,
                "encoding": encoding,
                "size": m.size,
                "digest": m.digest,
                "namespace": m.namespace,
                "manifest": m.manifest,
                "inserted_at": m.inserted_at,
            }
        )
        self._write_sidecar(_sidecar(final), side)
        try:
            return self.blobs.put(address, encoding, blob)
        except BaseException:
            _sidecar(final).unlink(missing_ok=True)
            raise

    def _write_sidecar(self, path: Path, data: bytes) -> None:
        tmp = self.blobs.tmp / f"{path.name}.{secrets.token_hex(6)}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:  # e.g. ENOSPC: leave no temp file behind
            tmp.unlink(missing_ok=True)
            raise
        if self._fsync:
            # The sidecar's rename must be durable before the blob's: fsync the folder now.
            BlobDir._fsync_dir(path.parent)

    def _free(self, e: Entry) -> None:
        # Blob first, sidecar second: a blob is never left without its metadata.
        path: Path = e.payload
        path.unlink(missing_ok=True)
        _sidecar(path).unlink(missing_ok=True)

    async def _check(self, e: Entry) -> bool:
        return await asyncio.to_thread(_digest_matches, e.payload, e.meta)

    def _handle(self, e: Entry) -> DiskHandle:
        return DiskHandle(self, e)


def _digest_matches(path: Path, meta: EntryMeta) -> bool:
    try:
        if path.stat().st_size != meta.size:
            return False
        h = blake3(max_threads=blake3.AUTO)
        if meta.size:
            h.update_mmap(path)
        return h.hexdigest() == meta.digest
    except OSError:
        return False  # unreadable counts as corrupt: it is never served
