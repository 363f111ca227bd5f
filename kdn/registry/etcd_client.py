"""aetcd's client as the etcd registry (``kdn/registry/etcd.py``) uses it.

What aetcd 1.0.0 (pinned in pyproject) lacks, and this module adds:
- it opens only plaintext channels, and authenticates (user + password) once:
  ``Client`` opens a TLS channel when asked, and re-authenticates when etcd
  says a token expired (simple tokens expire after ``--auth-token-ttl`` idle
  seconds, 300 by default), the way etcd's own Go client does;
- it talks to one member: ``Client`` takes the cluster's endpoints and moves to
  another member when the one in use stops answering (``fail_over``);
- its watcher takes a watch etcd refuses for a live one, and can block for ever
  on a wedged stream: ``Watcher`` reports the first and bounds the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

# gRPC's C core logs each failed TLS handshake or reconnect to stderr, the same failure
# the caller gets as one RegistryUnavailable line; GRPC_VERBOSITY=INFO brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import aetcd  # noqa: E402
import aetcd.exceptions  # noqa: E402
import aetcd.rpc  # noqa: E402
import aetcd.watcher  # noqa: E402
import grpc  # noqa: E402


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


class Client(aetcd.Client):  # type: ignore[misc]  # aetcd ships no types: its classes are Any
    """aetcd's client with a TLS channel, re-authentication and a cluster's endpoints (see the module notes).

    ``connect`` follows aetcd 1.0.0's own (pinned in pyproject) but opens the
    channel this deployment asks for, to the endpoint in use (``endpoint``).
    """

    # gRPC backs off reconnecting up to 120 s by default: after an etcd outage of half a minute, the
    # channel kept failing fast ("failed to connect to all addresses") for as long again after etcd
    # was back. Retry the connection every second at most, so a node is back within ~1 s of etcd.
    CHANNEL_OPTIONS: dict[str, int] = {
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.min_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 1000,
    }

    def __init__(self, endpoints: Sequence[tuple[str, int]], auth: EtcdAuth, timeout: float) -> None:
        (host, port), *_ = endpoints
        super().__init__(host=host, port=port, username=auth.user, password=auth.password,
                         timeout=timeout, options=dict(self.CHANNEL_OPTIONS))
        self._auth = auth
        self.endpoints = list(endpoints)
        self.generation = 0  # one more at each fail_over: the channel a failed call ran on
        self._failed_at: dict[tuple[str, int], float] = {}  # endpoint -> when it last failed (monotonic)
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    _is_connecting: bool  # aetcd's, set in its __init__
    _host: str
    _port: int

    @property
    def endpoint(self) -> str:
        """The member in use, as HOST:PORT."""
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    def _channel(self) -> grpc.aio.Channel:
        target = self.endpoint
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
            async with asyncio.timeout(self._connect_wait_timeout):  # not wait_for: see Watcher
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

    def _new_watcher(self) -> Watcher:
        return Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)

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

    def fail_over(self, generation: int) -> None:
        """Leave the member in use for another, after a call begun at ``generation`` found it unreachable.

        The next call connects to the member that failed longest ago (one never failed first, in the
        URL's order). Only the first failure of a generation moves: a member that dies with N calls in
        flight fails all N, together or one by one as their deadlines pass, and the N - 1 after the
        first carry an old generation; moving on each would walk past the good members. A connect in
        progress is left alone: if its member is the dead one, its own failure moves on.

        The old channel is retired, not dropped: its watches end at once (a watch on a member that is
        frozen, or cut off, would wait for ever; ended, its follower lists again on the new member) and
        its other calls get the call timeout to finish before it closes.
        """
        if len(self.endpoints) < 2 or generation != self.generation or self._is_connecting:
            return
        here = (self._host, self._port)
        self._failed_at[here] = time.monotonic()
        at = self.endpoints.index(here)
        after = self.endpoints[at + 1 :] + self.endpoints[:at]
        self._host, self._port = min(after, key=lambda e: self._failed_at.get(e, -math.inf))  # stable: URL order
        self.generation += 1
        channel, watcher = self.channel, self._watcher
        self._init_channel_attrs()
        self._connected.clear()
        if channel is not None:
            task = asyncio.get_running_loop().create_task(self._retire(channel, watcher), name="kdn-etcd-retire")
            self._retiring[task] = channel
            task.add_done_callback(self._retiring.pop)

    async def _retire(self, channel: grpc.aio.Channel, watcher: Watcher | None) -> None:
        if watcher is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout):
                    await watcher.shutdown()
        await channel.close(grace=self._timeout)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for channel in list(self._retiring.values()):
            with contextlib.suppress(Exception):
                await channel.close()  # at once: the client is closing
        await super().close()

    @property
    def call_timeout(self) -> float:
        return float(self._timeout or 5.0)

    async def keep_alive(self, lease_id: int, timeout: float) -> Any:
        """aetcd's ``refresh_lease`` with its own deadline (``EtcdRegistry._refresh`` says why)."""
        await self.connect()
        try:
            async for reply in self.leasestub.LeaseKeepAlive([aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id)],
                                                             timeout=timeout, metadata=self.metadata):
                return reply
        except aetcd.rpc.AioRpcError as e:
            aetcd.exceptions._handle_exception(e)
        return None

    async def open_watch(self, key: bytes, start_revision: int) -> tuple[Any, Watcher]:
        """A watch of the prefix ``key`` from ``start_revision``, and the watcher (stream) it lives on.

        Cancel it on that watcher, never on ``self._watcher``: after a fail over (or a re-authentication)
        the current watcher is another stream, whose watch ids start again at 0, and aetcd's own
        ``Watch.cancel`` would cancel whichever new watch has this one's id there. (Nothing suspends
        between ``connect`` and aetcd reading ``self._watcher``, so the watcher returned is the one used.)
        """
        await self.connect()
        watcher = self._watcher
        return await self.watch_prefix(key, start_revision=start_revision), watcher


class Watcher(aetcd.watcher.Watcher):  # type: ignore[misc]  # aetcd ships no types
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
