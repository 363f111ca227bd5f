"""The Unix-domain socket local engines reach the host tier on.

Mode 0600 (the host's user), or 0660 and the ``group``'s (connecting needs write permission), set between
``bind`` and ``listen``: nobody can connect before the mode is right. A socket file left by a host that
died is replaced; one a live host answers on is not (two hosts on one socket would split its engines).
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

from kdn.errors import InvalidInput
from kdn.host.ops import Ops
from kdn.host.segment import group_id
from kdn.host.session import Session
from kdn.host.store import HostStore

MAX_PATH = 107  # sun_path's room on Linux, less its NUL


class HostServer:
    def __init__(self, ops: Ops, store: HostStore, path: str | os.PathLike[str], *, group: str | None = None) -> None:
        self.ops, self.store, self.path, self.group = ops, store, Path(path), group
        self.connections = 0  # open now
        self._server: asyncio.AbstractServer | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if len(os.fsencode(self.path)) > MAX_PATH:
            raise InvalidInput(f"--socket {str(self.path)[:60]}...: a Unix socket path has at most {MAX_PATH} bytes")
        await check_socket_free(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            if self.group is not None:
                os.chown(self.path, -1, group_id(self.group))
            os.chmod(self.path, 0o660 if self.group is not None else 0o600)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)  # listens from here
        except BaseException:
            sock.close()
            self.path.unlink(missing_ok=True)
            raise

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sessions.add(task)
        self.connections += 1
        try:
            await Session(self.ops, self.store, reader, writer).run()
        except asyncio.CancelledError:
            # Only close() cancels a session, and waits for it: ended here rather than raised, since the
            # streams callback that started this task reads its exception() and logs a cancelled one as an
            # error (Python 3.11).
            pass
        finally:
            self.connections -= 1
            self._sessions.discard(task)

    async def close(self) -> None:
        """Stop listening, end every connection (their leases with them), remove the socket file."""
        if self._server is None:
            return
        self._server.close()
        sessions = list(self._sessions)
        for t in sessions:
            t.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        self.path.unlink(missing_ok=True)


async def check_socket_free(path: str | os.PathLike[str]) -> None:
    """Remove a socket file nobody listens on; refuse one a live host answers on, or a file that is not a
    socket."""
    path = Path(path)
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise InvalidInput(f"--socket {path} exists and is not a socket: name a socket path")
    except FileNotFoundError:
        return
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 2.0)
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
        path.unlink(missing_ok=True)
        return
    except OSError as e:
        raise InvalidInput(f"--socket {path}: {e.strerror}") from None
    writer.close()
    raise InvalidInput(f"another host tier serves {path}: stop it first, or give this one another --socket")
