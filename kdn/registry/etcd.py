"""The registry on etcd (v3 API through aetcd, asyncio gRPC): what a deployment uses.

aetcd notes that shaped this file:
- it has no lease keep-alive loop (``NodeLease`` runs one) and a keep-alive of
  an unknown lease is not an error: the reply carries ``TTL == 0``;
- ``get``/``get_prefix`` take no revision, but a range reply's header carries
  the revision it was read at: that is the snapshot a watch starts after;
- a watch that starts below the compaction revision first reports "created",
  then raises ``RevisionCompactedError`` from its iterator;
- keys and values must be ``bytes``; several reads batch into one ``Txn``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import aetcd

from kdn.errors import LeaseExpired, RegistryConflict, RegistryError, RegistryUnavailable
from kdn.registry.base import DEFAULT_PREFIX, Build, Event, KVRegistry

_MAX_ATTEMPTS = 64


class EtcdRegistry(KVRegistry):
    max_txn_ops = 128  # etcd's default --max-txn-ops

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, prefix: str = DEFAULT_PREFIX, *, timeout: float = 5.0):
        super().__init__(prefix)
        self.host, self.port = host, port
        self._client = aetcd.Client(host=host, port=port, timeout=timeout)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"EtcdRegistry(etcd://{self.host}:{self.port}{self.prefix})"

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, aetcd.WatchTimeoutError) as e:
            raise RegistryUnavailable(f"etcd at {self.host}:{self.port} is unreachable: {_first_line(e)}") from e
        except aetcd.ClientError as e:
            if "lease not found" in str(e):
                raise LeaseExpired(f"etcd at {self.host}:{self.port}: {_first_line(e)}") from e
            raise RegistryError(f"etcd at {self.host}:{self.port} failed: {_first_line(e)}") from e

    async def __aenter__(self) -> EtcdRegistry:
        # aetcd connects lazily; touch the server so a wrong address fails here, not later.
        with self._errors():
            await self._client.get(self.prefix.encode())
        return self

    # primitives -------------------------------------------------------------

    async def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._errors():
            if len(keys) == 1:
                got = await self._client.get(keys[0].encode())
                return [None if got is None else got.value]
            values, _ = await self._read_many(keys)
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
        with self._errors():
            got = await self._client.get_prefix(prefix.encode(), sort_order="ascend")
        return [(kv.key.decode(), kv.value) for kv in got], got.header.revision

    async def _transact(self, reads: Sequence[str], build: Build) -> Any:
        tx = self._client.transactions
        with self._errors():
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
        with self._errors():
            lease = await self._client.lease(max(1, math.ceil(ttl)))
        # etcd may grant more than asked (its minimum TTL is 1.5 x the election timeout).
        return lease.id, float(lease.ttl)

    async def _refresh(self, lease_id: int) -> bool:
        with self._errors():
            reply = await self._client.refresh_lease(lease_id)
        return reply is not None and reply.TTL > 0

    async def _revoke(self, lease_id: int) -> None:
        try:
            with self._errors():
                await self._client.revoke_lease(lease_id)
        except LeaseExpired:
            pass  # already expired: its keys are gone, as asked

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision``; watches behind it re-list."""
        with self._errors():
            await self._client.compact(revision, physical=True)

    async def watch(self, prefix: str = "") -> AsyncIterator[Event]:
        full = self._key(prefix).encode()
        while not self._closed:
            items, rev = await self._range(full.decode())
            yield Event("snapshot", items={self._rel(k): v for k, v in items}, revision=rev)
            with self._errors():
                w = await self._client.watch_prefix(full, start_revision=rev + 1)
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
    return text.splitlines()[0][:200]
