"""An object an engine holds a lease on: its blob's bytes in the engine's read-only mapping of the segment,
and the ways to read tensors out of them without another copy.

The bytes were verified when they landed in the host tier (signed record, BLAKE3 of every byte), and a
lease keeps them from being evicted or rewritten, so nothing here hashes them again. What is checked is
cheap and catches a wrong offset: the blob's own header must name the address and encoding leased.

A lease ends with its connection. Should the connection drop while the host lives on (and the engine is still
copying), the host may give the block to another object; the block's stamp (``kdn.wire.host.STAMP``) changes
before any of that object's bytes land. So a copy is trusted only if ``intact()`` holds after it: read it
once the copy is done (every thread of it joined), and treat False as bytes never received.

Everything read from ``view`` (``object()``'s views, ``tensors()``'s raw tensors) aliases the mapping and is
valid only while the lease is held: copy it into the engine's cache (``ObjectView.decode_into``, or
``kdn.adapters.hf.CacheBuilder.add(index, leased.object())``) before the lease ends.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdn.errors import CorruptObject
from kdn.format.address import Address

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.objects import ObjectView, RawTensor


@dataclass(frozen=True)
class Leased:
    address: Address
    encoding: str
    lease: int  # the connection's lease id
    offset: int  # where the blob lies in the segment
    view: memoryview  # the blob's bytes, read-only, in the mapping
    record: dict[str, Any]  # the signed object record the host verified the blob against
    filled: bool  # the host filled it for this lease (a miss there), rather than holding it already
    generation: int = 0  # the object's stamp, as the lease answered it
    stamp: memoryview | None = field(default=None, repr=False)  # the block's generation word in the mapping

    def intact(self) -> bool:
        """The block still holds this object: its stamp is the generation the lease answered. Read after a copy
        out of ``view``: True means every byte that copy read was this object's."""
        return self.stamp is not None and struct.unpack_from("<Q", self.stamp)[0] == self.generation

    def object(self, *, max_decoded: int | None = None) -> ObjectView:
        """The blob parsed and checked (header, layout, decode bound), its tensors decoded on demand."""
        from kdn.format.objects import ObjectView

        view = ObjectView(self.view, max_decoded=max_decoded)
        h = view.header
        if h.address != self.address or h.encoding != self.encoding:
            raise CorruptObject(f"leased {self.address[:16]}.{self.encoding} but the bytes at {self.offset} hold "
                                f"{h.address[:16]}.{h.encoding}")
        return view

    def tensors(self, names: Collection[str] | None = None) -> dict[str, RawTensor]:
        """The tensors ``names`` (all by default): a ``raw`` tensor is a view of the mapping (no copy at all);
        other codecs decode into fresh memory. ``kdn.format.objects.to_torch`` makes torch tensors of them (a
        raw one copied once, as the mapping is read-only)."""
        return self.object().decode(names)
