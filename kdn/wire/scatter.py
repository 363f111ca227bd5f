"""Receive a raw object straight into an engine's memory: each tensor's bytes land where the cache wants them.

A raw object's tensors are the engine's K/V as they are, so the copy from a
receive buffer into the cache is pure overhead: on this project's 2-core VM,
~40 ms of CPU for SmolLM2's 8k-token prefix (189 MB) on top of the receive and
the hash, with no core free to hide it. ``Scatter`` is a ``kdn.wire.bodyget.Sink``:
the head (8 bytes + the header) lands in a small buffer and is parsed and
validated (``kdn.format.objects.read_layout``) the moment it is complete; ``place``
(the engine's, e.g. ``kdn.adapters.hf.CacheBuilder.scatter``) checks the header
against what it expects and names, per tensor, the runs of its own memory the
tensor's bytes go to, in order; every byte no tensor claims (padding, tensors
the engine does not take) goes to a scratch buffer. (Its runs are small, 32 KB
per head of a chunk, so ``kdn.wire.bodyget`` reads them through a 1 MiB bounce buffer
per connection and copies them out while still in cache: a hot copy costs less
than one socket read per run, and far less than the cold copy of a whole
received body this module exists to avoid.) The bytes are hashed as
they land, as always: the fetch succeeds only if the digest of the whole body
matches its signed record, and only then does the engine count the chunk as
loaded. A body that fails (a lying source) may have written into the runs:
the next source rewrites every byte of them, and a chunk whose fetch fails is
never used. So a scattered fetch is never hedged: two bodies racing for the
same runs could interleave.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kdn.errors import CorruptObject
from kdn.format.objects import Layout, head_length, read_layout

Place = Callable[[Layout], Mapping[str, Sequence[memoryview]]]


class Scatter:
    """One object's body placed in the caller's memory; also a ``kdn.wire.fetch.Buffer`` (``release`` is a no-op)."""

    def __init__(self, size: int, place: Place) -> None:
        self.size = size
        self._place = place
        self._head = bytearray(8)
        self._head_len: int | None = None
        self.layout: Layout | None = None
        self._starts: list[int] = []  # run starts (absolute body offsets), ascending
        self._runs: list[tuple[int, memoryview]] = []  # (start, destination)

    @property
    def view(self) -> memoryview:  # the Buffer protocol's: a scattered body has no one view
        raise TypeError("a scattered body has no single buffer")

    def release(self) -> None:
        pass

    def region(self, offset: int) -> memoryview:
        """Where the body bytes from ``offset`` on go."""
        if self._head_len is None:
            if offset < 8:
                return memoryview(self._head)[offset:]
            self._head_len = head_length(self._head)
            if self._head_len > self.size:
                raise CorruptObject(f"a {self._head_len}-byte head in a {self.size}-byte body")
            head = bytearray(self._head_len)  # a new buffer: the reader may still hold a view of the first
            head[:8] = self._head
            self._head = head
        if self.layout is None:
            if offset < self._head_len:
                return memoryview(self._head)[offset:]
            self._plan()
        i = bisect.bisect_right(self._starts, offset) - 1
        start, dst = self._runs[i]
        return dst[offset - start:]

    def _plan(self) -> None:
        layout = read_layout(self._head, self.size)
        placed = self._place(layout)  # raises when the header is not what the engine expects
        runs: list[tuple[int, memoryview]] = []
        for name, dests in placed.items():
            b, e = layout.span(name)
            pos = b
            for d in dests:
                d = d.cast("B") if d.format != "B" or d.ndim != 1 else d
                if len(d):
                    runs.append((pos, d))
                pos += len(d)
            if pos != e:
                raise CorruptObject(f"tensor {name[:64]!r}: {pos - b} bytes placed for {e - b}")
        runs.sort(key=lambda r: r[0])
        filled: list[tuple[int, memoryview]] = []
        pos = self._head_len or 0
        for start, d in runs:  # gaps (padding, tensors not taken) go to scratch
            if start > pos:
                filled.append((pos, memoryview(bytearray(start - pos))))
            elif start < pos:
                raise CorruptObject("two tensors placed over the same bytes")
            filled.append((start, d))
            pos = start + len(d)
        if pos < self.size:
            filled.append((pos, memoryview(bytearray(self.size - pos))))
        self._runs = filled
        self._starts = [s for s, _ in filled]
        self.layout = layout


class Placer(Protocol):
    """An engine's side of a scattered load (``KDNClient.fetch_prefix(scatter=...)``)."""

    def placeable(self, index: int) -> bool:
        """Whether chunk ``index`` may be received in place (else it is decoded the usual way)."""
        ...

    def place(self, index: int, layout: Layout) -> Mapping[str, Sequence[memoryview]]:
        """Check chunk ``index``'s header; name the memory runs each tensor's bytes go to (raise to refuse)."""
        ...

    def placed(self, index: int, layout: Layout) -> None:
        """Chunk ``index`` arrived whole and verified in the runs ``place`` named."""
        ...
