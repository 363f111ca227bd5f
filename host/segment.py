"""The host tier's shared memory: one fixed-size file (under /dev/shm by default) that the host maps
read-write and every engine on the machine maps read-only.

A mapping is a read grant to everything in it, so the file is the trust domain: mode 0600 (the host's own
user), or 0640 and the ``group``'s when engines run as other users of one group. Tenants whose engines run
as different users get a host (and a segment) each. The mode is set on the new file before anyone can open
it (``O_EXCL`` under a mode no wider than asked, then ``fchmod``), and its pages are reserved up front
(``posix_fallocate``): a full tmpfs fails the start with a clear error, never a write later with SIGBUS.

A host that restarts makes a new file in the old one's place: an engine still mapping the old inode keeps
reading its pages (unlinked files live while mapped) until it reconnects and maps the new one.
``Identity`` (device, inode, size) is what the host tells engines, so an engine never reads a file the
host did not make. A running host holds an exclusive ``flock`` on its file: a second host given the same
path refuses to start rather than replace it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

from kdn.client.host import Identity
from kdn.errors import InvalidInput

DEFAULT_DIR = Path("/dev/shm")


def group_id(group: str) -> int:
    """A group name (or number) as its id; a clear error for an unknown one."""
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise InvalidInput(f"no group {group[:40]!r} on this machine") from None


class Segment:
    """The host's read-write mapping of its segment file (``Segment.create``); ``view`` is the whole of it."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, identity: Identity) -> None:
        self.path, self._fd, self._mm, self.identity = path, fd, mm, identity
        self.view = memoryview(mm)

    @property
    def size(self) -> int:
        return self.identity.size

    @classmethod
    def create(cls, path: str | os.PathLike[str], size: int, *, group: str | None = None) -> Segment:
        """A new segment file of ``size`` bytes at ``path`` (one left by an earlier host is replaced)."""
        path = Path(path)
        if size <= 0:
            raise InvalidInput(f"--segment-bytes must be positive, got {size}")
        mode = 0o640 if group is not None else 0o600
        _replace_stale(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this host lives (_replace_stale)
            if group is not None:
                os.fchown(fd, -1, group_id(group))
            os.fchmod(fd, mode)  # exactly this mode, whatever the umask took away
            _reserve(fd, size, path)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, mm, Identity(st.st_dev, st.st_ino, size))

    def close(self, *, unlink: bool = True) -> None:
        """Unmap (and remove) the segment. Engines that map it keep their pages until they unmap."""
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            # A view of it is still alive (a fill cut short at shutdown, its buffer not yet collected): the
            # mapping goes with the last view; the file is unlinked below either way.
            pass
        if unlink:
            try:
                if os.stat(self.path).st_ino == self.identity.inode:  # never another host's new file
                    self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self._fd)  # (and its lock: a host may start on this path now)


def _replace_stale(path: Path) -> None:
    """Remove the segment file an earlier host left (engines still mapping it keep their pages); refuse one a
    live host holds (its lock), which would pull the objects out from under its engines."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        raise InvalidInput(f"--segment {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InvalidInput(f"a running host tier holds the segment {path}: stop it first, or give this one "
                           "another --segment") from None
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)


def _reserve(fd: int, size: int, path: Path) -> None:
    """The file's pages reserved now (tmpfs counts them at once), or the file sized where that is not
    supported."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise InvalidInput(f"no room for a {size}-byte segment at {path} ({e.strerror}): a smaller "
                               "--segment-bytes, or a larger /dev/shm") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
