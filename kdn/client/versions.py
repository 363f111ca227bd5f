"""The highest manifest and relation versions a consumer has taken, per name, kept in a file across restarts.

A signed manifest carries a per-name version (kdn/registry/signing.py), a signed base relation a per-variant
one; a client with publisher keys refuses one older than it took before, so a registry writer or a lying edge
cannot roll a document (or a fine-tune's layer plan) back to a superseded one. Held in memory only, that
high-water mark starts again at 0 in every new process: a replay aimed at a fresh process worked. So a client
with keys keeps it in a file by default (``state_file``):

    $KDN_MANIFEST_STATE                              (a path; ``memory``: in memory only, by choice)
    $XDG_STATE_HOME/kdn/manifest-versions            (else)
    ~/.local/state/kdn/manifest-versions             (else: the platform's per-user state folder)

made 0600 in a 0700 folder, or the file ``KDNClient(manifest_state=PATH)`` names (``manifest_state=False`` or
``"memory"``: in memory only). One file, a table per kind of record:

    {"kdn/manifest-versions/v1": {"public/handbook": 7, ...}, "kdn/relation-versions/v1": {"<variant id>": 3}}

Written atomically (a temporary file, fsync, rename) each time a version rises,
under an exclusive ``flock`` of ``PATH.lock`` and merged with what the file holds,
so processes sharing one file only ever raise a mark, never lower another's; and
read again (``get``) whenever the file changed since, so a mark another process
raised holds here at once.
Rises are rare (one per publish of a name the process reads), so a write each
is cheap. A file that cannot be read is a clear error at start, never a silent
reset to 0: that reset is the very replay this guards against. Bounded: at most
``MAX_NAMES`` names a table (the oldest written are dropped past it, logged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from kdn.format.address import validate_model_id
from kdn.registry.records import validate_manifest_ref
from kdn.errors import InvalidInput

log = logging.getLogger("kdn.client")

FORMAT = "kdn/manifest-versions/v1"  # the manifests' table: every file has it
RELATIONS = "kdn/relation-versions/v1"  # base relations' (kdn.registry.relations), per variant model id
KEYS: dict[str, Callable[[object], object]] = {FORMAT: validate_manifest_ref, RELATIONS: validate_model_id}
MAX_NAMES = 100_000
MAX_BYTES = 64 << 20  # MAX_NAMES refs of up to 192 characters (~22 MB) and as many variant ids (~7 MB) fit

ENV_STATE = "KDN_MANIFEST_STATE"
MEMORY = "memory"  # manifest_state=False or "memory" (or KDN_MANIFEST_STATE=memory): marks in memory only
DEFAULT_STATE = "kdn/manifest-versions"  # under $XDG_STATE_HOME, else ~/.local/state

# What ``manifest_state`` may be: a file, False or "memory" (in memory only), None (the default: ``state_file``).
ManifestState = str | os.PathLike[str] | Literal[False] | None


def state_file(manifest_state: ManifestState, keys: bool) -> Path | None:
    """Where a client keeps its marks: the file ``manifest_state`` names, none (in memory) for False or
    ``"memory"``, and by default -- with publisher keys; without them a version is the sender's word and
    nothing is kept -- ``$KDN_MANIFEST_STATE`` (its folder made if absent: a file an operator shares, as
    ``manifest_state=PATH`` is), else ``$XDG_STATE_HOME/kdn/manifest-versions``, else
    ``~/.local/state/kdn/manifest-versions``, in a folder made 0700 and refused if others may write it."""
    if manifest_state is False or manifest_state == MEMORY:
        return None
    if manifest_state is not None:
        return Path(manifest_state)
    env = os.environ.get(ENV_STATE, "")
    if not keys or env == MEMORY:
        return None
    if env:
        _folder(Path(env).parent, private=False)
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME", "")
    path = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state") / DEFAULT_STATE
    _folder(path.parent, private=True)
    return path


def _folder(folder: Path, private: bool) -> None:
    """``folder``, made 0700 if absent; with ``private``, refused if another user owns it or others may write
    it: whoever can replace the file there can reset the marks, which is the replay they guard against."""
    hint = (f"(or set {ENV_STATE}=PATH; {ENV_STATE}={MEMORY} keeps the marks in memory, and a new process then "
            "takes a replayed superseded manifest)")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        st = folder.stat()
    except OSError as e:
        raise InvalidInput(f"cannot make the manifest state folder {str(folder)!r}: {e.strerror} {hint}") from None
    if private and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise InvalidInput(f"manifest state folder {folder} is writable by others or not yours: chmod 700 it "
                           f"{hint}")


class VersionFile(dict[str, int]):
    """``name -> version`` of one table (``FORMAT``: ``namespace/name``; ``RELATIONS``: a variant model id), as
    a dict; setting a higher version than stored writes it through, keeping the file's other tables."""

    def __init__(self, path: str | os.PathLike[str], table: str = FORMAT) -> None:
        super().__init__()
        if table not in KEYS:
            raise InvalidInput(f"no version table {table!r}")
        self.path = Path(path)
        self.table = table
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.writes = 0
        self._stamp: tuple[int, int, int] | None = None
        self._others: dict[str, Any] = {}  # the file's other tables, as last read: written back as they are
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
            raise InvalidInput(f"cannot read versions {str(self.path)!r}: {e.strerror}") from None
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
                log.warning("versions %s (%s): over %d names, dropping the %d written first",
                            self.path, self.table, MAX_NAMES, drop)
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
            self._others = {}
            return {}
        except OSError as e:
            raise InvalidInput(f"cannot read versions {str(self.path)!r}: {e.strerror}") from None
        if len(raw) > MAX_BYTES:
            raise InvalidInput(f"versions {self.path}: more than {MAX_BYTES} bytes")
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or not isinstance(doc[FORMAT], dict):  # every writer writes FORMAT
                raise ValueError("not a map of tables")
            table = doc.get(self.table, {})  # (a file from before relations has none of theirs)
            if not isinstance(table, dict):
                raise ValueError(f"{self.table} is not a map")
            out = {}
            for ref, v in table.items():
                KEYS[self.table](ref)
                if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63):
                    raise ValueError(f"version of {ref[:80]} is {str(v)[:20]}")
                out[ref] = v
        except (ValueError, KeyError, TypeError, InvalidInput) as e:
            raise InvalidInput(f"versions {self.path} are unreadable ({str(e)[:200]}): fix or remove "
                               "the file (removing it forgets which versions were taken)") from None
        self._others = {k: v for k, v in doc.items() if k != self.table}
        return out

    def _write(self, table: dict[str, int]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                # the other tables as read just now, under the lock (FORMAT's at least, empty: it is always there)
                json.dump({FORMAT: {}, **self._others, self.table: table}, f, separators=(",", ":"))
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
