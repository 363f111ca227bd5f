"""Which published tokens an engine can load: KDN chunks cut to the engine's blocks. Pure, no vLLM.

A KDN prefix chain is cut into 256-token chunks (the last one, a published
text's tail, may be shorter); vLLM keeps KV in blocks of ``block_size`` tokens
(16 on most GPUs, 128 on the CPU backend, a few hundred for hybrid models) and
only ever accepts an external hit that ends on a block boundary. The load
point ``end`` is therefore the largest token count that

- the chain covers (whole chunks, then a tail),
- leaves at least one prompt token to compute (the engine needs its logits),
- is a multiple of ``block_size``, and
- for a hybrid model, is also the end of a chunk: an object carries the
  Mamba/linear-attention state only as it stands at its own end, so a load
  can stop nowhere else.

Attention KV needs no such care: a chunk that straddles ``end`` is sliced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kdn.chunk import Chunk


@dataclass(frozen=True)
class LoadPlan:
    """Load tokens ``[first, end)`` of a request from ``chunks`` (those that overlap that range, each a
    ``kdn.chunk.Chunk``: its span, encoding, digest and size, where it would come from)."""

    first: int  # tokens the engine already holds (its own prefix cache), block aligned
    end: int  # tokens it holds after the load
    chunks: tuple[Chunk, ...]
    deadline_s: float = math.inf  # the load planner's: past it the worker gives up (as at ``load_timeout``)

    @property
    def tokens(self) -> int:
        return self.end - self.first

    @property
    def cold(self) -> bool:
        return any(p.cold for p in self.chunks)

    @property
    def last(self) -> Chunk:
        """The chunk that ends the load (for a hybrid model its state is the one loaded)."""
        return self.chunks[-1]

    def spans(self) -> list[tuple[Chunk, int, int]]:
        """``(chunk, lo, hi)``: the token range ``[lo, hi)`` of each chunk that the load writes."""
        return [(p, max(p.start, self.first), min(p.end, self.end)) for p in self.chunks]


def load_end(chunk_ends: Sequence[int], *, num_tokens: int, block_size: int, needs_state: bool) -> int:
    """The largest loadable token count (0 if none): see the module docstring.

    ``chunk_ends`` are the ends of the published chain's chunks, ascending;
    ``num_tokens`` is the request's token count so far.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not chunk_ends:
        return 0
    cap = min(chunk_ends[-1], num_tokens - 1)
    if not needs_state:
        return max(cap, 0) // block_size * block_size
    best = 0
    for e in chunk_ends:
        if e > cap:
            break
        if e % block_size == 0:
            best = e
    return best


def plan_load(chunks: Sequence[Chunk], *, computed: int, num_tokens: int, block_size: int,
              needs_state: bool) -> LoadPlan | None:
    """What to load beyond the engine's ``computed`` tokens, or None when nothing would be gained.

    ``chunks`` must be a chain from token 0 without gaps (as a lookup returns it).
    """
    for prev, p in zip(chunks, chunks[1:]):
        if p.start != prev.end:
            raise ValueError(f"chunks are not a chain: {prev.end} then {p.start}")
    if chunks and chunks[0].start != 0:
        raise ValueError("a prefix chain starts at token 0")
    end = load_end([p.end for p in chunks], num_tokens=num_tokens, block_size=block_size, needs_state=needs_state)
    if end <= computed:
        return None
    used = tuple(p for p in chunks if p.start < end and p.end > computed)
    return LoadPlan(first=computed, end=end, chunks=used)


def blocks_of(first: int, end: int, block_size: int) -> range:
    """Indices (in the request's block table) of the blocks that hold tokens ``[first, end)``."""
    return range(first // block_size, (end + block_size - 1) // block_size)
