"""The registry in one SQLite file: for one machine, tests, and ``kdn`` without etcd.

It mirrors etcd's semantics closely enough that the same contract suite passes:

- a global revision, bumped once per write transaction;
- a ``changes`` log (revision, key, kind, value) that watches follow. The log
  lives in the file, so a watch sees writes from any process sharing it. One
  poller per handle reads it for every watch of that handle (``_Hub``): five
  watches cost one poll every ``poll_s``, not five;
- the log keeps the last ``log_revisions`` revisions (the "compaction"); a
  watcher that fell further behind re-lists, as with etcd's ErrCompacted;
- leases are rows with an expiry time. Nothing runs in the background: any
  operation on the file (a read, a write, a watch poll) first deletes the
  keys of expired leases, logging delete events, in a write transaction.

All SQLite calls run on one dedicated thread per instance (a connection is
used by one thread only); writes are ``BEGIN IMMEDIATE`` transactions, so a
read-modify-write holds the file's write lock from its read to its commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, Literal, TypeVar, cast

from kdn.errors import InvalidInput, LeaseExpired, RegistryError, RegistryUnavailable
from kdn.registry.base import DEFAULT_PREFIX, Build, Event, KVRegistry

T = TypeVar("T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL, lease INTEGER)",
    "CREATE INDEX IF NOT EXISTS kv_lease ON kv (lease) WHERE lease IS NOT NULL",
    "CREATE TABLE IF NOT EXISTS changes (id INTEGER PRIMARY KEY AUTOINCREMENT,"
    " rev INTEGER NOT NULL, key TEXT NOT NULL, kind TEXT NOT NULL, value BLOB)",
    "CREATE INDEX IF NOT EXISTS changes_rev ON changes (rev)",
    # AUTOINCREMENT: a lease id is never reused, so a stale holder cannot refresh someone else's.
    "CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY AUTOINCREMENT, ttl REAL NOT NULL, expires REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('compacted', 0)",
)
_PRUNE_EVERY = 64  # revisions between log prunes
_LOCKED_RETRY_S = 30.0  # how long a call retries SQLite's immediate 'database is locked'


def _range_end(prefix: str) -> str:
    """The smallest string above every string that starts with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class _Tx:
    """The writes of one ``BEGIN IMMEDIATE`` transaction; the revision is taken on the first change."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.rev: int | None = None

    def _revision(self) -> int:
        if self.rev is None:
            self.conn.execute("UPDATE meta SET value = value + 1 WHERE name = 'revision'")
            self.rev = self.conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0]
        return self.rev

    def put(self, key: str, value: bytes, lease: int | None) -> None:
        rev = self._revision()
        self.conn.execute(
            "INSERT INTO kv (key, value, lease) VALUES (?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value, lease = excluded.lease",
            (key, value, lease),
        )
        self.conn.execute("INSERT INTO changes (rev, key, kind, value) VALUES (?, ?, 'put', ?)", (rev, key, value))

    def delete(self, key: str) -> None:
        if self.conn.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount:
            self.conn.execute("INSERT INTO changes (rev, key, kind, value) VALUES (?, ?, 'delete', NULL)", (self._revision(), key))


class _Signal(enum.Enum):
    RELIST = "relist"


_RELIST: Final = _Signal.RELIST  # tells a watch to list again: it fell behind the pruned log, or its queue overflowed
_Item = Event | Exception | _Signal  # what a watch's queue holds: an event, an error to raise, or _RELIST
_Change = tuple[int, str, Literal["put", "delete"], bytes | None]  # a row of the change log: rev, key, kind, value
_MAX_QUEUED = 10_000  # events one watch may have waiting before it is made to re-list instead


class _Sub:
    def __init__(self, prefix: str, after: int) -> None:
        self.prefix, self.end = prefix, _range_end(prefix)
        self.after = after  # the revision of its snapshot: events at or below it are already in it
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.dead = False

    def offer(self, item: _Item) -> None:
        if self.dead:
            return
        if self.queue.qsize() >= _MAX_QUEUED:  # a watch that does not keep up: bounded, it re-lists
            self.dead = True
            item = _RELIST
        self.queue.put_nowait(item)


class _Hub:
    """Every watch of one registry handle, fed from one poll of the change log.

    Subscribing and polling take the same lock, so a new watch is caught up from
    its snapshot's revision to the hub's (one query of its own) before the next
    shared poll: no event is missed between its snapshot and its first poll, and
    none is delivered twice.
    """

    def __init__(self, reg: EmbeddedRegistry) -> None:
        self.reg = reg
        self.subs: set[_Sub] = set()
        self.rev: int | None = None  # the change log is read up to here
        self.lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None
        self.polls = 0

    async def subscribe(self, prefix: str, after: int) -> _Sub:
        sub = _Sub(prefix, after)
        async with self.lock:
            if self.rev is None:
                self.rev = after
            if after < self.rev:
                rows, _ = await self.reg._call(self.reg._poll_sync, prefix, after, self.rev)
                self._deliver(sub, rows)
            self.subs.add(sub)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="kdn-registry-watch")
        return sub

    def unsubscribe(self, sub: _Sub) -> None:
        self.subs.discard(sub)

    def _deliver(self, sub: _Sub, rows: list[_Change] | None) -> None:
        if rows is None:
            sub.offer(_RELIST)
            return
        for r, key, kind, value in rows:
            if r > sub.after and sub.prefix <= key < sub.end:
                sub.offer(Event(kind, key=self.reg._rel(key), value=value, revision=r))

    async def _run(self) -> None:
        try:
            while self.subs and not self.reg._closed:
                async with self.lock:
                    rows, current = await self.reg._call(self.reg._poll_sync, self.reg.prefix, self.rev, None)
                    self.polls += 1
                    for sub in list(self.subs):
                        self._deliver(sub, rows)
                    self.rev = current
                if not rows:
                    await asyncio.sleep(self.reg.poll_s)
        except asyncio.CancelledError:
            self.wake(_RELIST)
            raise
        except Exception as e:  # noqa: BLE001 -- handed to every watch, whose owner retries
            self.wake(e)

    def wake(self, item: Exception | _Signal) -> None:
        """Give every waiting watch ``item`` (an error to raise, or _RELIST) and forget them."""
        for sub in list(self.subs):
            sub.queue.put_nowait(item)
        self.subs.clear()


class EmbeddedRegistry(KVRegistry):
    max_txn_ops = None  # one SQLite transaction holds any number of keys

    def __init__(
        self,
        path: str | os.PathLike[str],
        prefix: str = DEFAULT_PREFIX,
        *,
        poll_s: float = 0.05,
        log_revisions: int = 10_000,
    ) -> None:
        super().__init__(prefix)
        self.path = os.fspath(path)
        self.poll_s = poll_s
        self.log_revisions = log_revisions
        self._conn: sqlite3.Connection | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-registry")
        self._hub = _Hub(self)

    def __repr__(self) -> str:
        return f"EmbeddedRegistry(file:{self.path}, prefix={self.prefix!r})"

    # the thread -------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RegistryError(f"{self!r} is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _LOCKED_RETRY_S
        delay = 0.005
        while True:
            try:
                return await loop.run_in_executor(self._executor, fn, *args)
            except sqlite3.OperationalError as e:
                # SQLite answers "database is locked" at once, without its busy wait, where waiting
                # could deadlock (two connections of a fresh file switching it to WAL together, or
                # a lock upgrade). Every call is a whole transaction, rolled back on error, so
                # running it again is safe.
                if "locked" in str(e) and loop.time() < deadline:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                raise RegistryUnavailable(f"registry file {self.path}: {e}") from e
            except sqlite3.Error as e:
                raise RegistryError(f"registry file {self.path}: {e}") from e
            except OSError as e:  # e.g. its folder cannot be created
                raise RegistryUnavailable(f"registry file {self.path}: {e.strerror or e}") from e

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0, check_same_thread=False)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                for stmt in _SCHEMA:
                    conn.execute(stmt)
            except BaseException:
                conn.execute("ROLLBACK")
                conn.close()
                raise
            conn.execute("COMMIT")
            self._conn = conn
        return self._conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[_Tx]:
        conn = self._db()
        conn.execute("BEGIN IMMEDIATE")
        try:
            tx = _Tx(conn)
            self._expire(tx)
            yield tx
            if tx.rev is not None and tx.rev % _PRUNE_EVERY == 0:
                self._compact(conn, tx.rev - self.log_revisions + 1)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextlib.contextmanager
    def _read_txn(self) -> Iterator[sqlite3.Connection]:
        """A consistent read (one WAL snapshot), after lazily expiring leases."""
        conn = self._db()
        if conn.execute("SELECT 1 FROM leases WHERE expires <= ? LIMIT 1", (time.time(),)).fetchone():
            with self._write():
                pass  # _write expires them
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def _expire(self, tx: _Tx) -> None:
        expired = [r[0] for r in tx.conn.execute("SELECT id FROM leases WHERE expires <= ?", (time.time(),))]
        for lease_id in expired:
            self._drop_lease(tx, lease_id)

    @staticmethod
    def _drop_lease(tx: _Tx, lease_id: int) -> None:
        for (key,) in tx.conn.execute("SELECT key FROM kv WHERE lease = ? ORDER BY key", (lease_id,)).fetchall():
            tx.delete(key)
        tx.conn.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    @staticmethod
    def _compact(conn: sqlite3.Connection, revision: int) -> None:
        if revision <= 0:
            return
        conn.execute("DELETE FROM changes WHERE rev < ?", (revision,))
        conn.execute("UPDATE meta SET value = max(value, ?) WHERE name = 'compacted'", (revision,))

    @staticmethod
    def _meta(conn: sqlite3.Connection, name: str) -> int:
        value: int = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]
        return value

    # primitives, on the thread ----------------------------------------------

    def _read_sync(self, keys: Sequence[str]) -> list[bytes | None]:
        found: dict[str, bytes] = {}
        with self._read_txn() as conn:
            for i in range(0, len(keys), 500):  # SQLite bounds the number of parameters
                part = keys[i : i + 500]
                marks = ",".join("?" * len(part))
                found.update(conn.execute(f"SELECT key, value FROM kv WHERE key IN ({marks})", part).fetchall())
        return [found.get(k) for k in keys]

    def _range_sync(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        with self._read_txn() as conn:
            rows = conn.execute(
                "SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key", (prefix, _range_end(prefix))
            ).fetchall()
            return rows, self._meta(conn, "revision")

    def _transact_sync(self, reads: Sequence[str], build: Build) -> Any:
        with self._write() as tx:
            values = [
                (row[0] if (row := tx.conn.execute("SELECT value FROM kv WHERE key = ?", (k,)).fetchone()) else None)
                for k in reads
            ]
            w = build(values)
            if w.lease is not None and w.puts:
                if not tx.conn.execute("SELECT 1 FROM leases WHERE id = ?", (w.lease,)).fetchone():
                    raise LeaseExpired(f"lease {w.lease:x} expired before its key was written")
            for k in w.deletes:
                tx.delete(k)
            for k, v in w.puts:
                tx.put(k, v, w.lease)
            return w.result

    def _grant_sync(self, ttl: float) -> int:
        with self._write() as tx:
            cur = tx.conn.execute("INSERT INTO leases (ttl, expires) VALUES (?, ?)", (ttl, time.time() + ttl))
            return cast(int, cur.lastrowid)  # an INSERT always sets it

    def _refresh_sync(self, lease_id: int) -> bool:
        with self._write() as tx:  # expired leases are dropped first, so an expired one is not revived
            cur = tx.conn.execute("UPDATE leases SET expires = ? + ttl WHERE id = ?", (time.time(), lease_id))
            return cur.rowcount > 0

    def _revoke_sync(self, lease_id: int) -> None:
        with self._write() as tx:
            self._drop_lease(tx, lease_id)

    def _poll_sync(self, prefix: str, after: int,
                   upto: int | None) -> tuple[list[_Change] | None, int]:
        """Changes under ``prefix`` in revisions ``(after, upto]`` (``upto`` None: up to now) and the
        revision read up to; None if ``after`` was compacted away."""
        with self._read_txn() as conn:
            rev = self._meta(conn, "revision") if upto is None else upto
            if after + 1 < self._meta(conn, "compacted"):
                return None, rev
            rows = conn.execute(
                "SELECT rev, key, kind, value FROM changes WHERE rev > ? AND rev <= ? AND key >= ? AND key < ?"
                " ORDER BY id",
                (after, rev, prefix, _range_end(prefix)),
            ).fetchall()
            return rows, rev

    def _compact_sync(self, revision: int) -> None:
        with self._write() as tx:
            if revision > self._meta(tx.conn, "revision"):
                raise InvalidInput(f"cannot compact at future revision {revision}")
            self._compact(tx.conn, revision)

    def _close_sync(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # primitives, async ------------------------------------------------------

    async def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._call(self._read_sync, list(keys))

    async def _range(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        return await self._call(self._range_sync, prefix)

    async def _transact(self, reads: Sequence[str], build: Build) -> Any:
        return await self._call(self._transact_sync, list(reads), build)

    async def _grant(self, ttl: float) -> tuple[int, float]:
        return await self._call(self._grant_sync, ttl), ttl

    async def _refresh(self, lease_id: int) -> bool:
        return await self._call(self._refresh_sync, lease_id)

    async def _revoke(self, lease_id: int) -> None:
        await self._call(self._revoke_sync, lease_id)

    async def compact(self, revision: int) -> None:
        """Drop the change log before ``revision``; watches behind it re-list."""
        await self._call(self._compact_sync, revision)

    async def watch(self, prefix: str = "") -> AsyncIterator[Event]:
        full = self._key(prefix)
        while not self._closed:
            items, rev = await self._call(self._range_sync, full)
            yield Event("snapshot", items={self._rel(k): v for k, v in items}, revision=rev)
            sub = await self._hub.subscribe(full, rev)
            try:
                while not self._closed:
                    item = await sub.queue.get()
                    if item is _RELIST:
                        break  # fell behind the pruned log (or did not keep up, or closed): list again
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                self._hub.unsubscribe(sub)

    async def _close(self) -> None:
        self._hub.wake(_RELIST)
        task = self._hub.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(RuntimeError):  # executor already shut down
            await asyncio.get_running_loop().run_in_executor(self._executor, self._close_sync)
        self._executor.shutdown(wait=False)
