"""kvtc bases at a client: each fetched once, verified, and shared by every object that names it.

A kvtc object (``kdn.kernels.transform``) names the basis it was encoded with by
address, from inside its own verified bytes; the basis's address is the BLAKE3 of
its bytes, so a basis that is not exactly those bytes is refused whatever its
record says. Decoding needs torch (``kdn.kernels``): imported here only when an
object names a basis, so the core stays free of it otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kdn.format import address as A
from kdn.errors import DigestMismatch, SourceError
from kdn.client.lookup import Fetched

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import ObjectRecord

BASIS_ENCODING = "basis"  # how a model's kvtc basis is stored and served (kind "basis" records)


class Bases:
    """The bases a client has loaded, by address. ``record(address)`` reads a (trusted) record;
    ``fetch(address, encoding=, digest=, size=)`` fetches and verifies a body."""

    def __init__(self, record: Callable[[A.Address], Awaitable[ObjectRecord | None]],
                 fetch: Callable[..., Awaitable[Fetched]]) -> None:
        self._record, self._fetch = record, fetch
        self._tasks: dict[A.Address, asyncio.Task[Any]] = {}
        self.fetched = 0

    async def get(self, address: A.Address) -> Any:
        """The basis (``kdn.kernels.transform.Basis``) at ``address``, registered for decoding; one fetch
        however many objects ask at once (a failed one is tried again by the next)."""
        task = self._tasks.get(address)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._tasks[address] = asyncio.ensure_future(self._load(address))
        return await asyncio.shield(task)

    async def _load(self, address: A.Address) -> Any:
        rec = await self._record(address)
        if rec is None:
            raise SourceError(f"kvtc basis {address[:16]}... is not in the registry")
        enc = rec.encodings.get(BASIS_ENCODING)
        if rec.kind != "basis" or enc is None or enc.digest != A.Digest(address):
            raise DigestMismatch(f"the record of {address[:16]}... is not a kvtc basis stored under its own digest")
        f = await self._fetch(address, encoding=BASIS_ENCODING, digest=address, size=enc.size)
        self.fetched += 1

        def load() -> Any:
            import kdn.kernels  # noqa: F401  (registers the kvtc codec)
            from kdn.kernels.transform import Basis, register_basis

            basis = Basis.from_bytes(f.blob)
            register_basis(basis)
            return basis

        return await asyncio.to_thread(load)

    async def prepare(self, f: Fetched, tokens: int | None = None) -> int | None:
        """Load the bases a fetched object names; the ``max_decoded`` its decode may use (None: default),
        for ``tokens`` tokens (default: the span its header claims; a caller that knows the span passes it)."""
        from kdn.format.objects import read_header

        h = read_header(f.blob)
        addrs = {str(t.params.get("basis")) for t in h.tensors.values() if t.codec == "kvtc"}
        if not addrs:
            return None
        bases = [await self.get(A.validate_address(a)) for a in sorted(addrs)]  # named in the object's header
        from kdn.kernels.transform import decoded_cap

        n = h.end - h.start if tokens is None else tokens
        return int(max(decoded_cap(b, n) for b in bases))
