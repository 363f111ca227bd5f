"""The registry on etcd (v3 API through aetcd, asyncio gRPC): what a deployment uses.

aetcd notes that shaped this file:
- it has no lease keep-alive loop (``NodeLease`` runs one) and a keep-alive of
  an unknown lease is not an error: the reply carries ``TTL == 0``;
- ``get``/``get_prefix`` take no revision, but a range reply's header carries
  the revision it was read at: that is the snapshot a watch starts after;
- a watch that starts below the compaction revision first reports "created",
  then raises ``RevisionCompactedError`` from its iterator;
- keys and values must be ``bytes``; several reads batch into one ``Txn``;
- it opens plaintext channels to one member, authenticates once, and its watcher
  can hang: ``kdn/registry/etcd_client.py`` (TLS, re-authentication, a cluster's
  endpoints, a bounded watcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from kdn.registry.etcd_client import Client, EtcdAuth  # first: it quiets gRPC's logging before gRPC loads

import aetcd  # noqa: E402
import aetcd.exceptions  # noqa: E402

from kdn.errors import LeaseExpired, RegistryConflict, RegistryError, RegistryUnavailable  # noqa: E402
from kdn.registry.base import DEFAULT_PREFIX, Build, Event, KVRegistry  # noqa: E402

_MAX_ATTEMPTS = 64
# etcd's answers to a client it will not serve (etcdserver/api/v3rpc/rpctypes).
_REFUSED = ("authentication failed", "user name is empty", "permission denied", "invalid auth token")
# etcd's answer to a call whose deadline passed on the server (a lease keep-alive held by a member waiting for a
# leader): gRPC code UNKNOWN and Go's context error, not DEADLINE_EXCEEDED, so aetcd raises a plain ClientError.
_TIMED_OUT = ("context deadline exceeded",)
# gRPC's answer when it has no connection to send a call on (the member refused it, or is down): the call never
# left this process, so it may go to the next member whatever it is (a node starting while the first is dead).
_NOT_SENT = ("failed to connect to all addresses",)
T = TypeVar("T")


class EtcdRegistry(KVRegistry):
    max_txn_ops = 128  # etcd's default --max-txn-ops

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, prefix: str = DEFAULT_PREFIX, *,
                 timeout: float = 5.0, auth: EtcdAuth | None = None,
                 more_endpoints: Sequence[tuple[str, int]] = ()):
        """``more_endpoints``: the cluster's other members (host, port), moved to in turn when the one in
        use stops answering; ``host:port`` is tried first."""
        super().__init__(prefix)
        self.host, self.port = host, port
        self.auth = auth or EtcdAuth()
        self._client = Client([(host, port), *more_endpoints], self.auth, timeout)
        self._lease_ttls: dict[int, float] = {}  # lease id -> the TTL etcd granted (its keep-alive's bound)

    def __repr__(self) -> str:
        scheme = "etcds" if self.auth.tls else "etcd"
        user = f"{self.auth.user}@" if self.auth.user else ""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self._client.endpoints)
        return f"EtcdRegistry({scheme}://{user}{hosts}{self.prefix})"

    async def _rpc(self, call: Callable[[], Awaitable[T]], *, retry: bool = False) -> T:
        """One etcd call with errors mapped, retried once on a fresh token if etcd says ours expired.

        A member that is unreachable is left (``_errors``), and the call tried on the next, once per member,
        if it never reached the member (no connection), or if it may run twice (``retry``: reads, a lease
        keep-alive). A write that failed otherwise is not: whether it landed is unknown, and its caller
        decides (a publish retries its idempotent writes, ``origin/publish_job.py``)."""
        tries = len(self._client.endpoints)
        for attempt in range(tries):
            try:
                with self._errors():
                    try:
                        return await call()
                    except aetcd.exceptions.UnauthenticatedError as e:
                        if "invalid auth token" not in str(e) or not await self._client.reauthenticate():
                            raise
                    return await call()
            except RegistryUnavailable as e:
                unsent = any(m in str(e.__cause__) for m in _NOT_SENT)
                if attempt == tries - 1 or not (retry or unsent):
                    raise
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """etcd's errors as the registry's; an unreachable member is left for the next (``fail_over``)."""
        generation, at = self._client.generation, self._client.endpoint
        try:
            yield
        except (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, aetcd.WatchTimeoutError) as e:
            self._client.fail_over(generation)
            raise RegistryUnavailable(f"etcd at {at} is unreachable: {_first_line(e)}") from e
        except aetcd.exceptions.UnauthenticatedError as e:
            raise RegistryError(f"etcd at {at} refused this client: {_first_line(e)}"
                                " (check the registry URL's user and password, or its client certificate)") from e
        except aetcd.ClientError as e:
            if any(m in str(e) for m in _TIMED_OUT):
                self._client.fail_over(generation)
                raise RegistryUnavailable(f"etcd at {at} did not answer in time: {_first_line(e)}") from e
            if any(m in str(e) for m in _REFUSED):
                raise RegistryError(f"etcd at {at} refused this client: {_first_line(e)}"
                                    " (check the registry URL's user and password, or its client certificate)") from e
            if "lease not found" in str(e):
                raise LeaseExpired(f"etcd at {at}: {_first_line(e)}") from e
            raise RegistryError(f"etcd at {at} failed: {_first_line(e)}") from e

    async def __aenter__(self) -> EtcdRegistry:
        # aetcd connects lazily; touch the server so a wrong address fails here, not later.
        await self._rpc(lambda: self._client.get(self.prefix.encode()), retry=True)
        return self

    # primitives -------------------------------------------------------------

    async def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        if len(keys) == 1:
            got = await self._rpc(lambda: self._client.get(keys[0].encode()), retry=True)
            return [None if got is None else got.value]
        values, _ = await self._rpc(lambda: self._read_many(keys), retry=True)
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
        got = await self._rpc(lambda: self._client.get_prefix(prefix.encode(), sort_order="ascend"), retry=True)
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
        self._lease_ttls[lease.id] = float(lease.ttl)
        return lease.id, float(lease.ttl)

    async def _refresh(self, lease_id: int) -> bool:
        # One member gets a third of the lease's TTL to answer, then the next is asked. A member that holds
        # the call without answering (frozen, cut off from its peers) held it for the whole call timeout, 5 s:
        # longer than a 2 s lease, which expired on the leader while a good member was one retry away (the
        # edge left every ring; bench/faults.py etcd_member_stopped).
        wait = min(self._client.call_timeout, self._lease_ttls.get(lease_id, math.inf) / 3)
        reply = await self._rpc(lambda: self._client.keep_alive(lease_id, wait), retry=True)
        alive = reply is not None and reply.TTL > 0
        if not alive:
            self._lease_ttls.pop(lease_id, None)
        return alive

    async def _revoke(self, lease_id: int) -> None:
        self._lease_ttls.pop(lease_id, None)
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
            w, watcher = await self._rpc(lambda: self._client.open_watch(full, rev + 1))
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
                    await watcher.cancel(w.watch_id)  # (on its own stream: see Client.open_watch)
            # The iterator also ends without error when the client closes, or leaves a member (fail_over).

    async def _close(self) -> None:
        await self._client.close()


def _first_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:300]
