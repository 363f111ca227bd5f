"""Object records in the origin's S3 bucket, beside the blobs: ``--store s3://... --records store``.

The same records store as ``records.sqlite3`` beside a folder store
(``kdn.registry.split``: a ``KVRegistry``, so merging, signing inside the write
and never signing what another key wrote behave as in the registry), over
the bucket that holds the blobs, so that several origins writing one bucket
share their records as they share their blobs, and no record needs a disk of
its own. Each record is one small object, ``<prefix>/records/<key>`` (its
registry key: ``kdn/objects/<address>``).

What the medium changes:

- **Conditional writes, per record.** A write names the version it read: ``PUT``
  with ``If-Match: <ETag>``, or ``If-None-Match: *`` for a record that was
  absent (S3's conditional writes; SeaweedFS answers both). A writer that lost
  the race (412, or the name taken) reads again and rebuilds, at most
  ``ATTEMPTS`` times: two origins adding an encoding or a tail to one record
  both land, neither overwrites the other. A transaction over several records
  is not atomic across them (S3 has no multi-object transaction): a publish's
  records appear one by one, as content-addressed records may; the manifest,
  in the registry, is written after all of them.
- **No leases, no watches.** A records store holds immutable content, not
  nodes: asking it for a lease or a watch is a programming error.
- **One listing.** A start lists the bucket's prefix to index its blobs, and
  enumerates the records under it too (skipped, not read).
- **Listing by path segment.** S3 (obstore) lists whole path segments, so a
  prefix that ends mid-segment lists its segment and filters: fine for
  ``list_keys("objects/")``, linear in the records for a partial prefix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdn.errors import InvalidInput, KDNError
from kdn.origin.s3store import RECORDS, bucket, is_s3, parse_s3_url
from kdn.registry.base import DEFAULT_PREFIX, Build, KVRegistry
from kdn.registry.split import MAX_RECORD_BYTES

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.base import Event

log = logging.getLogger("kdn.origin")

ATTEMPTS = 32  # a transaction that keeps losing races gives up with a clear error after this many reads
CONCURRENCY = 64  # requests in flight for one transaction's reads or writes


class RecordsConflict(KDNError):
    """A write to the records store lost the race to other writers ``ATTEMPTS`` times in a row."""


class S3Records(KVRegistry):
    """A ``KVRegistry`` for object records over an S3 bucket (obstore's async API)."""

    max_txn_ops = 128  # bounds one transaction's requests; put_objects batches a long publish

    def __init__(self, url: str, *, credentials: str | os.PathLike[str] | None = None,
                 prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(prefix)
        self.location = parse_s3_url(url)
        self._s3 = bucket(self.location, credentials, under=RECORDS)
        self._sem = asyncio.Semaphore(CONCURRENCY)

    def __repr__(self) -> str:
        return f"S3Records({self.location.url}/{RECORDS})"

    def _path(self, key: str) -> str:
        return key.strip("/")  # keys are validated by KVRegistry: plain segments under the prefix

    async def _get(self, key: str) -> tuple[bytes | None, str | None]:
        import obstore as obs

        async with self._sem:
            try:
                r = await obs.get_async(self._s3, self._path(key))
            except FileNotFoundError:
                return None, None
            if int(r.meta["size"]) > MAX_RECORD_BYTES:  # (the bound of every records store: not downloaded)
                raise InvalidInput(f"record {key[-80:]} in the store is {r.meta['size']} bytes, over "
                                   f"{MAX_RECORD_BYTES}")
            data = bytes(await r.bytes_async())
        return data, r.meta.get("e_tag")

    async def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        return [v for v, _ in await asyncio.gather(*(self._get(k) for k in keys))]

    async def _range(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        import obstore as obs

        path = self._path(prefix)
        whole = path if prefix.endswith("/") else path.rpartition("/")[0]  # the last whole segment
        keys: list[str] = []
        async for batch in obs.list(self._s3, prefix=whole or None, chunk_size=1000):
            keys += ["/" + m["path"] for m in batch if m["path"].startswith(path)]
        keys.sort()
        values = await self._read(keys)
        return [(k, v) for k, v in zip(keys, values) if v is not None], 0

    async def _transact(self, reads: Sequence[str], build: Build) -> Any:
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        for attempt in range(ATTEMPTS):
            got = await asyncio.gather(*(self._get(k) for k in reads))
            w = build([v for v, _ in got])
            if w.lease is not None:
                raise InvalidInput("a records store holds no leases")
            tags = {k: tag for k, (v, tag) in zip(reads, got)}
            absent = {k for k, (v, _) in zip(reads, got) if v is None}

            async def put(key: str, value: bytes) -> bool:
                mode: Any = "overwrite"
                if key in absent:
                    mode = "create"  # If-None-Match: *
                elif tags.get(key):
                    mode = {"e_tag": tags[key]}  # If-Match: the version this build read
                async with self._sem:
                    try:
                        await obs.put_async(self._s3, self._path(key), value, mode=mode, use_multipart=False)
                    except (AlreadyExistsError, PreconditionError):
                        return False
                return True

            landed = await asyncio.gather(*(put(k, v) for k, v in w.puts))
            if all(landed):
                for key in w.deletes:  # (S3 deletes are not conditional: only migrations and tools delete)
                    async with self._sem:
                        try:
                            await obs.delete_async(self._s3, self._path(key))
                        except FileNotFoundError:
                            pass
                return w.result
            # Another writer changed a record this build read: read again and rebuild (the build is pure;
            # what did land is read back and merged, not duplicated).
            await asyncio.sleep(random.uniform(0, min(0.5, 0.005 * 2 ** attempt)))
        raise RecordsConflict(f"records store {self.location.url}: a write lost to other writers {ATTEMPTS} "
                              f"times in a row ({len(reads)} records)")

    async def _grant(self, ttl: float) -> tuple[int, float]:
        raise InvalidInput("a records store holds no leases (nodes register in the registry)")

    async def _refresh(self, lease_id: int) -> bool:
        raise InvalidInput("a records store holds no leases")

    async def _revoke(self, lease_id: int) -> None:
        raise InvalidInput("a records store holds no leases")

    def watch(self, prefix: str = "") -> AsyncIterator[Event]:
        raise InvalidInput("a records store is not watched: records are content, the registry carries news")

    async def _close(self) -> None:
        return None


def open_records(store: str | os.PathLike[str], *,
                 credentials: str | os.PathLike[str] | None = None) -> KVRegistry:
    """The object records beside the blobs of ``--store`` (``--records store``, ``kdn.registry.split``):
    ``records.sqlite3`` in a folder store, objects under ``records/`` in an s3:// one."""
    from kdn.registry import EmbeddedRegistry
    from kdn.registry.split import RECORDS_FILE

    if is_s3(store):
        return S3Records(str(store), credentials=credentials)
    if credentials is not None:
        raise InvalidInput("--store-credentials is for an s3:// store")
    return EmbeddedRegistry(Path(store) / RECORDS_FILE)
