"""The memory tier: blobs held as ``bytes`` under a byte budget, read through zero-copy views."""

from __future__ import annotations

from kdn.edge.tierbase import Entry, HandleBase, TierBase
from kdn.edge.tiers import EntryMeta, Key


class MemoryHandle(HandleBase):
    """A pinned read: ``data`` is a read-only view of the cached bytes (no copy).

    The view stays valid after ``release()`` (Python keeps the bytes alive), but
    the tier no longer counts them: release only once the bytes are sent.
    """

    def __init__(self, tier: MemoryTier, e: Entry) -> None:
        super().__init__(tier, e)
        self._view = memoryview(e.payload).toreadonly()
        self.data = self._view

    async def read(self) -> memoryview:
        return self._view


class MemoryTier(TierBase):
    """``MemoryTier(budget_bytes, policy=ARC)``: see ``kdn.edge.tiers`` for the contract."""

    name = "memory"

    async def _write(self, e: Entry, blob: bytes | bytearray | memoryview) -> bytes | bytearray:
        # bytes(b) of an exact bytes object is b itself, and a bytearray is taken over as it is (a fill's
        # fresh buffer: its maker hands it on and never changes it); a view is copied once, because its
        # owner may reuse the buffer after put() returns.
        if type(blob) is bytes or type(blob) is bytearray:
            return blob
        return bytes(blob)

    def _free(self, e: Entry) -> None:
        e.payload = None

    def _handle(self, e: Entry) -> MemoryHandle:
        return MemoryHandle(self, e)


__all__ = ["EntryMeta", "Key", "MemoryHandle", "MemoryTier"]
