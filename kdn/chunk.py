"""One object of a prefix chain as a load sees it (``Chunk``): the one type the load planner costs
(``kdn.planner``), the vLLM connector's load plan carries (``kdn.adapters.vllm.plan``) and the client's prefix
fetch reads (``kdn.client.prefix``). A lookup makes them from its records (``kdn.client.Lookup.chunk``).

Plain data, no I/O: which tokens the object covers, the encoding chosen for it with that encoding's digest,
size and piece digests as its record states them, and where it would come from (the tier the entry edge named,
whether this client knows it warm, whether the machine's host tier holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.address import Address, Digest
    from kdn.format.pieces import Pieces

FILL_TIERS = ("peer", "region", "upper", "origin")  # sources an entry edge names for what it must fill first


def fills(tier: str) -> bool:
    """Whether the entry edge said it must fill an object first (from a peer, another region, the upper
    tier or the origin) before it can serve it."""
    return tier.split(":", 1)[0] in FILL_TIERS


@dataclass(frozen=True)
class Chunk:
    """One object of a prefix: tokens ``[start, end)`` (prompt positions), fetched in ``encoding``.

    ``encoding`` "" (and ``digest`` ""): its record was not at hand (an older edge sent none with the lookup),
    so ``size`` is an estimate, for costing only. A caller that costs only part of an object (a load that writes
    some of its tokens, or fetches only its K/V) hands the planner a copy with that span or size.
    """

    address: Address
    start: int
    end: int
    encoding: str
    digest: Digest  # as the record states it (the client checks its form before fetching)
    size: int  # bytes on the wire
    tier: str = ""  # where the entry edge said it would come from (memory, disk, peer:..., origin)
    # The record's piece digests (kdn/format/pieces.py): the body is verified piece by piece as it lands.
    pieces: Pieces | None = None
    warm: bool | None = None  # known warm (``KDNClient.warm``): its read costs only this link (None: by ``tier``)
    host: bool = False  # the machine's host tier held it at lookup: the planner costs it at the host's speed

    def __post_init__(self) -> None:
        assert 0 <= self.start < self.end and self.size >= 0, (self.start, self.end, self.size)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def cold(self) -> bool:
        """Its read may cost the entry edge's upstream too: not known warm (``KDNClient.warm``), or, where
        that was not asked, a tier the edge must fill first (``fills``)."""
        if self.warm is not None:
            return not self.warm
        return fills(self.tier)
