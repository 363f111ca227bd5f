"""The engine's side of the host tier: one connection to its socket and a read-only mapping of its segment.

    async with HostClient("/dev/shm/kdn-host-1000.sock", token=TOKEN) as host:
        found = await host.lookup(addresses)              # which leading objects the host holds
        async with host.lease(addresses[0], "raw") as obj:  # filled from the edges first if absent
            builder.add(0, obj.object())                   # the one copy: mapping -> engine cache

A lease keeps the object's bytes where they are until the block exits, or until the connection ends (a
crashed engine leaks nothing). Requests may run concurrently on one client; each carries the token. A host
that goes away fails the requests in flight and every later one with ``HostError("unavailable")``: the
engine reads from the edge instead, and makes a new client to come back (a restarted host has a new
segment, mapped anew). Imports no web framework and no model library.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kdn.errors import KDNError
from kdn.format.address import Address
from kdn.client.leased import Leased
from kdn.wire.host import ERRORS, MAX_LEASE_MANY, STAMP, VERSION, HostError, pack, read_frame, unpack


@dataclass(frozen=True)
class Identity:
    """Which file a segment is: engines map only the file the host names."""

    device: int
    inode: int
    size: int



def map_readonly(path: str | os.PathLike[str], identity: Identity) -> tuple[mmap.mmap, memoryview]:
    """An engine's mapping of the segment the host named: read-only (``PROT_READ``), and refused unless
    ``path`` is that very file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (identity.device, identity.inode) or st.st_size < identity.size:
            raise KDNError(f"{path} is not the segment the host tier serves (a host restarted meanwhile?)")
        mm = mmap.mmap(fd, identity.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mm, memoryview(mm)


@dataclass(frozen=True)
class HostLookup:
    """What the host holds of a chain of addresses: ``prefix`` leading ones, and per address its encodings."""

    prefix: int
    held: list[bool]
    encodings: list[list[str]]
    records: list[dict[str, Any] | None] | None = None  # asked with ``records``: each held one's signed record


class HostClient:
    def __init__(self, socket_path: str | os.PathLike[str], *, token: str | None = None, timeout: float = 30.0,
                 on_map: Callable[[memoryview], Callable[[], None] | None] | None = None) -> None:
        """``timeout`` bounds each request (a lease's fill from the edges included). ``on_map``: called with the
        segment's read-only view each time one is mapped (at connect, and again after a restart's
        ``reconnect``); what it returns is called before that mapping goes. On a GPU machine pass
        ``kdn.kernels.pinned.pin_mapping``: the mapping page-locked, so a device copy out of a lease is a DMA."""
        self.path, self.token, self.timeout = os.fspath(socket_path), token, timeout
        self.on_map = on_map
        self._unmap: Callable[[], None] | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._gone: HostError | None = None
        self._mm: mmap.mmap | None = None
        self._segment: memoryview | None = None

    async def connect(self) -> HostClient:
        """Connect and map the segment the host names (read-only); HostError("unavailable") if it is not up."""
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.path)
        except OSError as e:
            self._gone = HostError("unavailable", f"no host tier at {self.path}: {e.strerror}")
            raise self._gone from None
        self._listener = asyncio.create_task(self._listen())
        try:
            hello = await self._request("hello")
            if hello.get("version") != VERSION:
                raise HostError("unavailable", f"the host tier speaks protocol {hello.get('version')}, this "
                                               f"client {VERSION}")
            identity = Identity(int(hello["device"]), int(hello["inode"]), int(hello["size"]))
            try:
                self._mm, self._segment = map_readonly(hello["segment"], identity)
            except OSError as e:  # another user's segment (no --group), or gone
                raise HostError("unavailable", f"cannot map the segment {hello['segment']}: {e.strerror}") from None
            if self.on_map is not None:
                self._unmap = self.on_map(self._segment)
        except BaseException:
            await self.close()
            raise
        return self

    @classmethod
    def unconnected(cls, socket_path: str | os.PathLike[str], **kw: Any) -> HostClient:
        """A client that has not connected yet (its host may not be up): ``gone`` until ``reconnect`` succeeds."""
        client = cls(socket_path, **kw)
        client._gone = HostError("unavailable", f"not connected to {client.path} yet")
        return client

    @property
    def gone(self) -> bool:
        """The host went away (or was never reached): every request fails until ``reconnect``."""
        return self._gone is not None

    async def reconnect(self) -> HostClient:
        """After the host went away (a restart makes a new segment): hang up, unmap, connect and map anew.
        HostError("unavailable") if it is still not up."""
        await self.close()
        self._reader = self._writer = None
        self._listener, self._mm, self._segment, self._gone = None, None, None, None
        self._waiting.clear()
        return await self.connect()

    async def __aenter__(self) -> HostClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests --------------------------------------------------------------------------------------------

    async def lookup(self, addresses: Sequence[Address], encoding: str | None = None, *,
                     records: bool = False) -> HostLookup:
        """What the host holds of ``addresses``; with ``records``, each held one's signed record too (a map, as
        the host's frame sends it: the caller checks it, ``kdn.client.trust``)."""
        a = await self._request("lookup", addresses=list(addresses), encoding=encoding,
                                **({"records": True} if records else {}))
        recs = a.get("records") if records else None
        if recs is not None and (not isinstance(recs, list) or len(recs) != len(addresses)):
            raise HostError("unavailable", "the host's lookup sent records that do not match its addresses")
        return HostLookup(int(a["prefix"]), [bool(x) for x in a["held"]], [list(e) for e in a["encodings"]],
                          [r if isinstance(r, dict) else None for r in recs] if recs is not None else None)

    @contextlib.asynccontextmanager
    async def lease(self, address: Address, encoding: str) -> AsyncIterator[Leased]:
        """The object, pinned in the segment while the block runs (filled from the edges first if the host
        does not hold it). HostError: ``absent``, ``no-room``, ``unavailable``, ..."""
        a = await self._request("lease", address=address, encoding=encoding)
        segment = self._segment
        assert segment is not None
        got = self._leased(address, encoding, a, segment)
        if isinstance(got, HostError):
            raise got
        view = got.view
        try:
            yield got
        finally:
            # Reading ``obj.view`` after the lease raises from here on. (Arrays the caller made of it cannot be
            # revoked, and one that holds a buffer export keeps the view open: the caller's to drop in time.)
            with contextlib.suppress(BufferError):
                view.release()
            await self._release(got.lease)

    async def lease_many(self, addresses: Sequence[Address], encoding: str) -> list[Leased | HostError]:
        """``lease`` of each address (one encoding) in as few round trips as the protocol allows
        (``MAX_LEASE_MANY`` each): per address its ``Leased``, or the ``HostError`` its lease would have raised.
        The caller ends every ``Leased`` with ``release_many`` (or the connection ends them). A first batch the host
        refuses raises (an older host without the op: ``bad-request``, lease one by one); a later one gives its
        addresses that error, the leases granted before it still the caller's."""
        return [x async for batch in self.lease_batches(addresses, encoding) for x in batch]

    async def lease_batches(self, addresses: Sequence[Address], encoding: str
                            ) -> AsyncIterator[list[Leased | HostError]]:
        """``lease_many``, a round trip's batch at a time: the caller can read one batch while the next is
        leased. Batch ``k`` answers ``addresses[k * MAX_LEASE_MANY:][:MAX_LEASE_MANY]``; past a batch the host
        refused (the first one raises), one last batch gives every address left that error."""
        segment = self._segment
        for at in range(0, len(addresses), MAX_LEASE_MANY):
            part = list(addresses[at:at + MAX_LEASE_MANY])
            try:
                a = await self._request("lease_many", addresses=part, encoding=encoding)
            except HostError as e:
                if not at:
                    raise
                yield [e] * (len(addresses) - at)  # what was leased before is still the caller's
                return
            answers = a.get("leases")
            if not isinstance(answers, list) or len(answers) != len(part):
                raise HostError("unavailable", "the host tier answered lease_many with another count of leases")
            assert segment is not None
            yield [self._leased(address, encoding, x, segment) for address, x in zip(part, answers)]

    def _leased(self, address: Address, encoding: str, x: object, segment: memoryview) -> Leased | HostError:
        if not isinstance(x, dict):
            return HostError("unavailable", "a lease_many answer that is not a map")
        if "error" in x:
            code = str(x.get("error"))
            return HostError(code if code in ERRORS else "unavailable", str(x.get("message"))[:200])
        try:
            lease, offset, length, record = int(x["lease"]), int(x["offset"]), int(x["length"]), dict(x["record"])
            generation = int(x["generation"])
        except (KeyError, TypeError, ValueError):
            if isinstance(x.get("lease"), int):
                self._orphan(x["lease"])
            return HostError("unavailable", "a malformed lease in the host tier's answer")
        if not STAMP <= offset <= offset + length <= len(segment):
            self._orphan(lease)
            return HostError("unavailable", f"the host leased bytes [{offset}, {offset + length}) of a "
                                            f"{len(segment)}-byte segment")
        return Leased(address, encoding, lease, offset, segment[offset:offset + length], record,
                      bool(x.get("filled")), generation, segment[offset - STAMP:offset - STAMP + 8])

    async def release_many(self, leases: Sequence[int]) -> None:
        """End these leases (the views of them must not be read after), in as few round trips as allowed."""
        for at in range(0, len(leases), MAX_LEASE_MANY):
            try:
                await self._request("release_many", leases=list(leases[at:at + MAX_LEASE_MANY]))
            except HostError:
                if self._gone is None:
                    raise
                return  # the connection ended (before or during the release), and every lease with it

    async def _release(self, lease: int) -> None:
        try:
            await self._request("release", lease=lease)
        except HostError:
            if self._gone is None:
                raise
            # the connection ended (before or during the release), and every lease with it

    async def warm(self, addresses: Sequence[Address], encoding: str) -> list[str]:
        """Have the host fill these ahead of the leases that will want them; per address what happened."""
        a = await self._request("warm", addresses=list(addresses), encoding=encoding)
        return [str(x) for x in a["outcomes"]]

    async def stats(self) -> dict[str, int]:
        a = await self._request("stats")
        return {k: int(v) for k, v in a.items() if k not in ("id", "ok")}

    async def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._gone is not None:
            raise self._gone
        assert self._writer is not None, "connect() first"
        rid = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = answer
        try:
            self._writer.write(pack({"id": rid, "op": op, "token": self.token, **fields}))
            async with asyncio.timeout(self.timeout):
                await self._writer.drain()
                a = await answer
        except (ConnectionError, TimeoutError) as e:
            raise HostError("unavailable", f"host tier {op}: {type(e).__name__}") from None
        finally:
            self._waiting.pop(rid, None)
        if not a.get("ok"):
            raise HostError(str(a.get("error")), str(a.get("message")))
        return a

    async def _listen(self) -> None:
        """Hand each answer to its request; when the host goes, fail them all, and every later one."""
        assert self._reader is not None
        why = "the host tier closed the connection"
        try:
            while (frame := await read_frame(self._reader)) is not None:
                a = unpack(frame)
                waiting = self._waiting.get(a.get("id"))  # type: ignore[arg-type]
                if waiting is not None and not waiting.done():
                    waiting.set_result(a)
                elif a.get("ok") and "lease" in a:
                    self._orphan(a["lease"])
                elif a.get("ok") and isinstance(a.get("leases"), list):  # a lease_many nobody waits for now
                    for x in a["leases"]:
                        if isinstance(x, dict) and "lease" in x:
                            self._orphan(x["lease"])
                elif a.get("id") is None and not a.get("ok"):  # a refusal of no request: the stream's end
                    why = f"the host tier refused the stream: {a.get('message')}"
        except (HostError, ConnectionError, asyncio.IncompleteReadError) as e:
            why = f"the host tier's connection broke ({type(e).__name__})"
        finally:
            self._gone = HostError("unavailable", why)
            for f in self._waiting.values():
                if not f.done():
                    f.set_exception(self._gone)

    def _orphan(self, lease: object) -> None:
        """A lease granted to a request that stopped waiting (cancelled, or past its timeout) after the host
        pinned the object: nobody will release it, so it is released here, not left pinned until the
        connection ends. Written without waiting (its answer, to an id nobody waits for, is dropped)."""
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(pack({"id": next(self._ids), "op": "release", "token": self.token, "lease": lease}))

    async def close(self) -> None:
        """Hang up (every lease ends with the connection) and unmap the segment."""
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        if self._listener is not None:
            await self._listener
        unmap, self._unmap = self._unmap, None
        if unmap is not None:  # (a page-locked registration ends before its pages are unmapped)
            unmap()
        if self._segment is not None:
            self._segment.release()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # arrays made of leased bytes are still alive: the mapping goes with the last of them
        self._gone = self._gone or HostError("unavailable", "this client is closed")
