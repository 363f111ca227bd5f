"""A content-addressed blob directory: atomic writes, fan-out folders, restart scan.

Used by the origin's object store and the edge's disk tier. A blob lives at
``root/ab/cd/<address>.<encoding>``. Writes go to ``root/tmp/`` first, are
fsynced, then renamed into place (and the folder fsynced), so a reader sees
either nothing or the whole blob: a crash or a SIGKILL mid-write leaves only
a temp file, which the next ``scan()`` deletes. Nothing here knows about
budgets or eviction; callers keep their own index.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kdn.format.address import Address, Digest, validate_address
from kdn.errors import InvalidInput

# A temp file untouched this long is a crashed writer's (a live one writes to it continuously).
STALE_PART_S = 600.0
_ENCODING = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def validate_encoding(value: object) -> str:
    """An encoding name (``raw``, ``zstd``, ``int8``...): 1-32 chars of ``[a-z0-9_-]``."""
    if isinstance(value, str) and _ENCODING.fullmatch(value):
        return value
    raise InvalidInput(f"invalid encoding {str(value)[:40]!r}: use 1-32 chars of a-z, 0-9, '_' and '-'")


@dataclass(frozen=True)
class StoredBlob:
    address: Address
    encoding: str
    size: int
    path: Path
    mtime: float


class BlobDir:
    """Blobs by ``(address, encoding)`` under one root folder. Blocking I/O: call from a thread."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync

    def path(self, address: Address, encoding: str) -> Path:
        a = validate_address(address)
        e = validate_encoding(encoding)
        return self.root / a[:2] / a[2:4] / f"{a}.{e}"

    def put(self, address: Address, encoding: str, data: bytes | bytearray | memoryview, *, digest: Digest | None = None) -> Path:
        """Write a blob atomically; an existing blob of the same name is replaced whole.

        With ``digest`` (its BLAKE3), the digest is written beside it first (``<blob>.b3``): a reader
        can later tell bit rot from the truth without trusting a re-hash (``attested``).
        """
        final = self.path(address, encoding)
        final.parent.mkdir(parents=True, exist_ok=True)
        if digest is not None:
            side = final.with_name(final.name + ".b3")
            tmp_side = self.tmp / f"{side.name}.{secrets.token_hex(6)}.part"
            tmp_side.write_text(validate_address(digest, what="digest"))
            os.replace(tmp_side, side)
        tmp = self.tmp / f"{final.name}.{secrets.token_hex(6)}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        # rename is atomic within one file system: readers see all or nothing.
        os.replace(tmp, final)
        if self._fsync:
            self._fsync_dir(final.parent)
        return final

    def attested(self, address: Address, encoding: str) -> str | None:
        """The digest written with the blob (``put(..., digest=)``), or None."""
        try:
            text = self.path(address, encoding).with_name(f"{address}.{encoding}.b3").read_text().strip()
        except OSError:
            return None
        return text if len(text) == 64 else None

    def read(self, address: Address, encoding: str) -> bytes | None:
        try:
            return self.path(address, encoding).read_bytes()
        except FileNotFoundError:
            return None

    def size(self, address: Address, encoding: str) -> int | None:
        try:
            return self.path(address, encoding).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, address: Address, encoding: str) -> bool:
        p = self.path(address, encoding)
        p.with_name(p.name + ".b3").unlink(missing_ok=True)
        try:
            p.unlink()
            return True
        except FileNotFoundError:
            return False

    def scan(self) -> Iterator[StoredBlob]:
        """Every complete blob on disk; deletes leftover temp files and strays first. A temp file written to
        within ``STALE_PART_S`` is another writer's (two origins may share one store folder): kept. Deleting
        it once made that origin's write fail (the vLLM tests' two origins on one store, at start)."""
        now = time.time()
        for p in self.tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if now - p.stat().st_mtime > STALE_PART_S:
                    p.unlink(missing_ok=True)
        for d1 in sorted(self.root.iterdir()):
            if d1 == self.tmp or not d1.is_dir() or len(d1.name) != 2:
                continue
            for d2 in sorted(d1.iterdir()):
                if not d2.is_dir():
                    continue
                for p in sorted(d2.iterdir()):
                    addr, _, enc = p.name.partition(".")
                    try:
                        a = validate_address(addr)
                        validate_encoding(enc)
                    except InvalidInput:
                        continue  # not ours: leave it, never serve it
                    if a[:2] != d1.name or a[2:4] != d2.name:
                        continue
                    st = p.stat()
                    yield StoredBlob(a, enc, st.st_size, p, st.st_mtime)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
