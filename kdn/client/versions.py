"""The highest manifest version a consumer has taken, per name, kept in a file across restarts.

A signed manifest carries a per-name version (kdn/registry/signing.py); a client with
publisher keys refuses one older than it took before, so a registry writer or
a lying edge cannot roll a document back to a superseded text. Held in memory
only, that high-water mark starts again at 0 in every new process: a replay
aimed at a fresh process worked. ``VersionFile`` keeps it in a file instead
(``KDNClient(manifest_state=PATH)``, the vLLM connector's ``manifest_state``):

    {"kdn/manifest-versions/v1": {"public/handbook": 7, ...}}

Written atomically (a temporary file, fsync, rename) each time a version rises,
under an exclusive ``flock`` of ``PATH.lock`` and merged with what the file holds,
so processes sharing one file only ever raise a mark, never lower another's; and
read again (``get``) whenever the file changed since, so a mark another process
raised holds here at once.
Rises are rare (one per publish of a name the process reads), so a write each
is cheap. A file that cannot be read is a clear error at start, never a silent
reset to 0: that reset is the very replay this guards against. Bounded: at most
``MAX_NAMES`` names (the oldest written are dropped past it, logged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kdn.registry.records import validate_manifest_ref
from kdn.errors import InvalidInput

log = logging.getLogger("kdn.client")

FORMAT = "kdn/manifest-versions/v1"
MAX_NAMES = 100_000
MAX_BYTES = 32 << 20  # MAX_NAMES refs of up to 192 characters and their versions fit (~22 MB)


class VersionFile(dict[str, int]):
    """``namespace/name -> version``, as a dict; setting a higher version than stored writes it through."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.writes = 0
        self._stamp: tuple[int, int, int] | None = None
        with self._locked():
            super().update(self._read())

    def get(self, ref: str, default: int | None = None) -> int | None:  # type: ignore[override]
        self._follow()
        return super().get(ref, default)

    def _follow(self) -> None:
        """Take the marks other processes wrote since this one last read the file (a stat when none did)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        except OSError as e:
            raise InvalidInput(f"cannot read manifest versions {str(self.path)!r}: {e.strerror}") from None
        if (st.st_ino, st.st_mtime_ns, st.st_size) != self._stamp:
            for k, v in self._read().items():  # (a whole file: written by rename)
                if v > super().get(k, -1):
                    super().__setitem__(k, v)
    def __setitem__(self, ref: str, version: int) -> None:
        self._follow()
        if version <= super().get(ref, -1):
            return
        with self._locked():
            merged = self._read()
            for k, v in [*self.items(), (ref, version)]:  # take the others' rises too: the highest, per name
                merged[k] = max(v, merged.get(k, 0))
            if len(merged) > MAX_NAMES:
                drop = len(merged) - MAX_NAMES
                log.warning("manifest versions %s: over %d names, dropping the %d written first",
                            self.path, MAX_NAMES, drop)
                merged = dict(list(merged.items())[drop:])
            self._write(merged)
            # Raised here only once on disk: a write that failed is tried again by the next rise to it.
            super().update(merged)
            super().__setitem__(ref, version)

    def _read(self) -> dict[str, int]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                raw = f.read(MAX_BYTES + 1)
            self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise InvalidInput(f"cannot read manifest versions {str(self.path)!r}: {e.strerror}") from None
        if len(raw) > MAX_BYTES:
            raise InvalidInput(f"manifest versions {self.path}: more than {MAX_BYTES} bytes")
        try:
            doc = json.loads(raw)
            table = doc[FORMAT]
            if not isinstance(table, dict):
                raise ValueError("not a map")
            out = {}
            for ref, v in table.items():
                validate_manifest_ref(ref)
                if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63):
                    raise ValueError(f"version of {ref[:80]} is {str(v)[:20]}")
                out[ref] = v
        except (ValueError, KeyError, TypeError, InvalidInput) as e:
            raise InvalidInput(f"manifest versions {self.path} are unreadable ({str(e)[:200]}): fix or remove "
                               "the file (removing it forgets which versions were taken)") from None
        return out

    def _write(self, table: dict[str, int]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({FORMAT: table}, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dirfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dirfd)  # the rename itself survives a power loss
            finally:
                os.close(dirfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.writes += 1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl

        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise InvalidInput(f"cannot open {str(self.lock_path)!r}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
