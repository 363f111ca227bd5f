"""The registry on etcd (v3 API through aetcd, asyncio gRPC): what a deployment uses.

aetcd notes that shaped this file:
- it has no lease keep-alive loop (``NodeLease`` runs one) and a keep-alive of
  an unknown lease is not an error: the reply carries ``TTL == 0``;
- ``get``/``get_prefix`` take no revision, but a range reply's header carries
  the revision it was read at: that is the snapshot a watch starts after;
- a watch that starts below the compaction revision first reports "created",
  then raises ``RevisionCompactedError`` from its iterator;
- keys and values must be ``bytes``; several reads batch into one ``Txn``;
- it opens only plaintext channels, and authenticates (user + password) once:
  ``_Client`` opens a TLS channel when asked, and re-authenticates when etcd
  says a token expired (simple tokens expire after ``--auth-token-ttl`` idle
  seconds, 300 by default), the way etcd's own Go client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

# gRPC's C core logs each failed TLS handshake or reconnect to stderr, the same failure
# the caller gets as one RegistryUnavailable line; GRPC_VERBOSITY=INFO brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import aetcd  # noqa: E402
import aetcd.exceptions  # noqa: E402
import aetcd.rpc  # noqa: E402
import aetcd.watcher  # noqa: E402
import grpc  # noqa: E402

from kdn.errors import LeaseExpired, RegistryConflict, RegistryError, RegistryUnavailable  # noqa: E402
from kdn.registry.base import DEFAULT_PREFIX, Build, Event, KVRegistry  # noqa: E402

_MAX_ATTEMPTS = 64
# etcd's answers to a client it will not serve (etcdserver/api/v3rpc/rpctypes).
_REFUSED = ("authentication failed", "user name is empty", "permission denied", "invalid auth token")
T = TypeVar("T")


@dataclass(frozen=True)
class EtcdAuth:
    """How to reach a locked-down etcd: TLS (a CA to verify it, a client certificate for
    ``--client-cert-auth``, whose CN etcd takes as the user) and/or a user and password."""

    ca: bytes | None = None  # PEM; None: the system trust store (when tls)
    cert: bytes | None = None  # PEM client certificate chain
    key: bytes | None = None  # PEM private key of ``cert``
    user: str | None = None
    password: str | None = None
    tls: bool = False

    def __repr__(self) -> str:  # never print the password or the key
        return f"EtcdAuth(tls={self.tls}, client_cert={self.cert is not None}, user={self.user!r})"


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd ships no types: its classes are Any
    """aetcd's client with a TLS channel and re-authentication (see the module notes).

    ``connect`` follows aetcd 1.0.0's own (pinned in pyproject) but opens the
    channel this deployment asks for.
    """

    # gRPC backs off reconnecting up to 120 s by default: after an etcd outage of half a minute, the
    # channel kept failing fast ("failed to connect to all addresses") for as long again after etcd
    # was back. Retry the connection every second at most, so a node is back within ~1 s of etcd.
    CHANNEL_OPTIONS: dict[str, int] = {
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.min_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 1000,
    }

    def __init__(self, host: str, port: int, auth: EtcdAuth, timeout: float) -> None:
        super().__init__(host=host, port=port, username=auth.user, password=auth.password,
                         timeout=timeout, options=dict(self.CHANNEL_OPTIONS))
        self._auth = auth

    _is_connecting: bool  # aetcd's, set in its __init__

    def _channel(self) -> grpc.aio.Channel:
        target = f"{self._host}:{self._port}"
        channel: grpc.aio.Channel
        if not self._auth.tls:
            channel = aetcd.rpc.insecure_channel(target, options=self._options.items())
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=self._auth.ca, private_key=self._auth.key,
                                                 certificate_chain=self._auth.cert)
            channel = aetcd.rpc.secure_channel(target, creds, options=self._options.items())
        return channel

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            async with asyncio.timeout(self._connect_wait_timeout):  # not wait_for: see _Watcher
                await self._connected.wait()
            return
        try:
            self._is_connecting = True
            self.channel = self._channel()
            if self._auth.user is not None:
                await self._authenticate()
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = self._new_watcher()
            self._connected.set()
        except aetcd.rpc.AioRpcError as e:
            aetcd.exceptions._handle_exception(e)
        finally:
            self._is_connecting = False

    async def _authenticate(self) -> None:
        self.auth_stub = aetcd.rpc.AuthStub(self.channel)
        req = aetcd.rpc.AuthenticateRequest(name=self._auth.user, password=self._auth.password)
        resp = await self.auth_stub.Authenticate(req, timeout=self._timeout)
        self.metadata = (("token", resp.token),)

    def _new_watcher(self) -> _Watcher:
        return _Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)

    async def reauthenticate(self) -> bool:
        """Fetch a fresh token; False when this client has no password to do it with.

        etcd checks a new watch against the token its stream was opened with, so a
        stream opened with the old token refuses every new watch: the watch stream
        is replaced too. Its watches end, and ``EtcdRegistry.watch`` re-lists and
        re-watches on the new one.
        """
        if self._auth.user is None or not self._connected.is_set():
            return False
        try:
            await self._authenticate()
        except aetcd.rpc.AioRpcError as e:
            aetcd.exceptions._handle_exception(e)
        old, self._watcher = self._watcher, self._new_watcher()
        if old is not None:
            await old.shutdown()
        return True


class _Watcher(aetcd.watcher.Watcher):  # type: ignore[misc]  # aetcd ships no types
    """aetcd's watcher, except that a watch etcd refuses or cancels is an error, not silence.

    etcd answers a watch it will not serve (permission denied, a stale stream
    token) with ``created`` and ``canceled`` together; aetcd 1.0.0 registers it as
    live, and its iterator then waits forever for events that never come.
    """

    # aetcd 1.0.0 puts every request (watch create, watch cancel, and the end-of-stream marker) into a queue of
    # 10 with a blocking put, under its lock. A stream whose requests are not being sent (etcd SIGSTOPped or
    # wedged: its HTTP/2 window fills with ~5,400 cancels, then the queue) blocked the next cancel for ever,
    # and shutdown's marker behind it, so ``close()`` never returned (reproduced with 9,000 watches cancelled
    # while etcd was SIGSTOPped; tests/registry/test_watch_queue.py). Puts are bounded by the watch timeout,
    # and ending a stream drops its unsent requests instead of waiting for room.

    # Every wait here is bounded with ``asyncio.timeout``, never ``asyncio.wait_for``: on Python 3.11, a wait_for
    # whose inner wait has just finished when its task is cancelled returns the result and drops the cancel. aetcd
    # creates each watch under two such waits (the request put, then the "created" answer), so a follower cancelled
    # in that window (~1% of cancels landing while a watch was created, against a real etcd) kept watching, and the
    # shutdown that waited for it hung: the policy engine's teardown in CI (300 s), and about one edge teardown in
    # 15 (tests/registry/test_watch_cancel.py).

    # aetcd's own attributes, declared for the type checker (aetcd is untyped).
    _callbacks: dict[int, Any]
    _request_queue: asyncio.Queue[Any]
    _request_handler: asyncio.Task[Any] | None
    _lock: asyncio.Lock
    _new_callback: Any
    _new_callback_ready: asyncio.Condition
    _timeout: float | None

    async def _enqueue(self, request: Any) -> None:
        try:
            async with asyncio.timeout(self._timeout or 5.0):
                await self._request_queue.put(request)
        except TimeoutError:
            raise aetcd.exceptions.WatchTimeoutError from None

    async def add_callback(self, key: bytes, callback: Callable[[Any], Awaitable[None]], **kwargs: Any) -> Any:
        """aetcd 1.0.0's, but its wait for etcd's "created" answer is an ``asyncio.timeout`` (see above), and the
        create request is put inside the ``try`` that frees the one pending-create slot: aetcd puts it before, so a
        put that timed out (a full queue) left the slot taken and every later watch on this client waited for ever."""
        async with self._lock:
            await self.setup()
            while self._new_callback:  # one create in flight at a time
                await self._new_callback_ready.wait()
            new: Any = aetcd.watcher.WatcherCallback(callback)
            self._new_callback = new
            new.prev_kv = kwargs.get("prev_kv", False)
            try:
                await self._enqueue_watch_create(key, **kwargs)
                try:
                    async with asyncio.timeout(self._timeout):
                        await self._new_callback_ready.wait()
                except TimeoutError:
                    raise aetcd.exceptions.WatchTimeoutError from None
                if new.watch_id is None and new.error is None:
                    raise aetcd.exceptions.WatchTimeoutError
                if new.error is not None:
                    raise new.error
            except BaseException:
                wid = new.watch_id
                if wid is not None and self._callbacks.get(wid) is new:
                    # Cancelled (or failed) after etcd created it: no caller will ever cancel a watch it never
                    # got, and its events would pile up unread. Forget it and ask etcd to end it (best effort:
                    # a full queue means the stream is wedged and will be torn down with it).
                    del self._callbacks[wid]
                    with contextlib.suppress(asyncio.QueueFull):
                        self._request_queue.put_nowait(self._build_watch_cancel_request(wid))
                raise
            finally:
                self._new_callback = None
                self._new_callback_ready.notify_all()
            return new

    async def _enqueue_watch_create(self, *args: Any, **kwargs: Any) -> None:
        await self._enqueue(self._build_watch_create_request(*args, **kwargs))

    async def _enqueue_watch_cancel(self, *args: Any, **kwargs: Any) -> None:
        await self._enqueue(self._build_watch_cancel_request(*args, **kwargs))

    async def _terminate_stream(self, error: BaseException | None) -> None:
        """aetcd's, except that the end-of-stream marker never waits for room in the old queue."""
        async with self._lock:
            if self._new_callback is not None:
                self._new_callback.error = error
                self._new_callback_ready.notify_all()
            callbacks, self._callbacks = self._callbacks, {}
            old, self._request_queue = self._request_queue, asyncio.Queue(maxsize=10)
            while True:
                try:
                    old.put_nowait(None)
                    break
                except asyncio.QueueFull:
                    old.get_nowait()  # a request for the stream being ended: it would never be sent
        for callback in callbacks.values():
            await self._process_callback(callback, error)
        async with self._request_handler_lock:
            if self._request_handler is not None:
                self._request_handler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._request_handler
                self._request_handler = None

    async def _handle_response(self, response: Any) -> None:
        if not response.canceled or response.compact_revision != 0:
            await super()._handle_response(response)  # events, and compaction (aetcd raises it)
            return
        reason = response.cancel_reason or "etcd cancelled the watch"
        kind = aetcd.exceptions.UnauthenticatedError if "invalid auth token" in reason else aetcd.exceptions.ClientError
        error = kind(reason)
        async with self._lock:
            if response.created and self._new_callback is not None:
                self._new_callback.error = error
                self._new_callback_ready.notify_all()
                return
            callback = self._callbacks.pop(response.watch_id, None)
        if callback is not None:  # (None: the answer to our own cancel)
            await self._process_callback(callback, error)


class EtcdRegistry(KVRegistry):
    max_txn_ops = 128  # etcd's default --max-txn-ops

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, prefix: str = DEFAULT_PREFIX, *,
                 timeout: float = 5.0, auth: EtcdAuth | None = None):
        super().__init__(prefix)
        self.host, self.port = host, port
        self.auth = auth or EtcdAuth()
        self._client = _Client(host, port, self.auth, timeout)

    def __repr__(self) -> str:
        scheme = "etcds" if self.auth.tls else "etcd"
        user = f"{self.auth.user}@" if self.auth.user else ""
        return f"EtcdRegistry({scheme}://{user}{self.host}:{self.port}{self.prefix})"

    async def _rpc(self, call: Callable[[], Awaitable[T]]) -> T:
        """One etcd call with errors mapped, retried once on a fresh token if etcd says ours expired."""
        with self._errors():
            try:
                return await call()
            except aetcd.exceptions.UnauthenticatedError as e:
                if "invalid auth token" not in str(e) or not await self._client.reauthenticate():
                    raise
            return await call()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, aetcd.WatchTimeoutError) as e:
            raise RegistryUnavailable(f"etcd at {self.host}:{self.port} is unreachable: {_first_line(e)}") from e
        except aetcd.exceptions.UnauthenticatedError as e:
            raise RegistryError(f"etcd at {self.host}:{self.port} refused this client: {_first_line(e)}"
                                " (check the registry URL's user and password, or its client certificate)") from e
        except aetcd.ClientError as e:
            if any(m in str(e) for m in _REFUSED):
                raise RegistryError(f"etcd at {self.host}:{self.port} refused this client: {_first_line(e)}"
                                    " (check the registry URL's user and password, or its client certificate)") from e
            if "lease not found" in str(e):
                raise LeaseExpired(f"etcd at {self.host}:{self.port}: {_first_line(e)}") from e
            raise RegistryError(f"etcd at {self.host}:{self.port} failed: {_first_line(e)}") from e

    async def __aenter__(self) -> EtcdRegistry:
        # aetcd connects lazily; touch the server so a wrong address fails here, not later.
        await self._rpc(lambda: self._client.get(self.prefix.encode()))
        return self

    # primitives -------------------------------------------------------------

    async def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        if len(keys) == 1:
            got = await self._rpc(lambda: self._client.get(keys[0].encode()))
            return [None if got is None else got.value]
        values, _ = await self._rpc(lambda: self._read_many(keys))
        return values

    async def _read_many(self, keys: Sequence[str]) -> tuple[list[bytes | None], list[int]]:
        """Values and mod revisions (0: absent) of ``keys``, at one revision per batch of 128."""
        tx = self._client.transactions
        values: list[bytes | None] = []
        mods: list[int] = []
        for i in range(0, len(keys), self.max_txn_ops):
            ops = [tx.get(k.encode()) for k in keys[i : i + self.max_txn_ops]]
            _, responses = await self._client.transaction(compare=[], success=ops, failure=[])
            for kvs in responses:
                values.append(kvs[0][0] if kvs else None)
                mods.append(kvs[0][1].mod_revision if kvs else 0)
        return values, mods

    async def _range(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        got = await self._rpc(lambda: self._client.get_prefix(prefix.encode(), sort_order="ascend"))
        return [(kv.key.decode(), kv.value) for kv in got], got.header.revision

    async def _transact(self, reads: Sequence[str], build: Build) -> Any:
        return await self._rpc(lambda: self._transact_once(reads, build))

    async def _transact_once(self, reads: Sequence[str], build: Build) -> Any:
        tx = self._client.transactions
        for attempt in range(_MAX_ATTEMPTS):
            values, mods = await self._read_many(reads) if reads else ([], [])
            w = build(values)
            if not w.puts and not w.deletes:
                return w.result
            # Compare-and-swap on each read key's mod revision (0 = still absent):
            # another writer that changed one between our read and this commit
            # makes the compare fail, and we rebuild from its value.
            compare = [tx.mod(k.encode()) == m for k, m in zip(reads, mods)]
            ops = [tx.delete(k.encode()) for k in w.deletes]
            ops += [tx.put(k.encode(), v, lease=w.lease) for k, v in w.puts]
            ok, _ = await self._client.transaction(compare=compare, success=ops, failure=[])
            if ok:
                return w.result
            if attempt >= 2:  # heavy contention: spread the retries out
                await asyncio.sleep(random.uniform(0, 0.002 * attempt))
        raise RegistryConflict(f"gave up after {_MAX_ATTEMPTS} conflicting writes to {reads[:1]}")

    async def _grant(self, ttl: float) -> tuple[int, float]:
        lease = await self._rpc(lambda: self._client.lease(max(1, math.ceil(ttl))))
        # etcd may grant more than asked (its minimum TTL is 1.5 x the election timeout).
        return lease.id, float(lease.ttl)

    async def _refresh(self, lease_id: int) -> bool:
        reply = await self._rpc(lambda: self._client.refresh_lease(lease_id))
        return reply is not None and reply.TTL > 0

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self._rpc(lambda: self._client.revoke_lease(lease_id))
        except LeaseExpired:
            pass  # already expired: its keys are gone, as asked

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision``; watches behind it re-list."""
        await self._rpc(lambda: self._client.compact(revision, physical=True))

    async def watch(self, prefix: str = "") -> AsyncIterator[Event]:
        full = self._key(prefix).encode()
        while not self._closed:
            items, rev = await self._range(full.decode())
            yield Event("snapshot", items={self._rel(k): v for k, v in items}, revision=rev)
            # A token that expired while the consumer held the snapshot is renewed by _rpc.
            w = await self._rpc(lambda: self._client.watch_prefix(full, start_revision=rev + 1))
            try:
                with self._errors():
                    async for ev in w:
                        deleted = ev.kind == "DELETE"
                        yield Event(
                            "delete" if deleted else "put",
                            key=self._rel(ev.kv.key.decode()),
                            value=None if deleted else ev.kv.value,
                            revision=ev.kv.mod_revision,
                        )
            except RegistryError as e:
                # History we have not seen was compacted away: start over from a
                # fresh snapshot, like etcd's own clients do.
                if not isinstance(e.__cause__, aetcd.RevisionCompactedError):
                    raise
            finally:
                with contextlib.suppress(Exception):
                    await w.cancel()
            # The iterator also ends without error when the client closes.

    async def _close(self) -> None:
        await self._client.close()


def _first_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:300]
