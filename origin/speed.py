"""The origin's own measured prefill speed, for the operator console's "time saved" (issue #30).

Each chunk a publish job computes (``Step.computed``: the model ran for it) is timed on the model thread, and
its prefill FLOPs counted with ``kdn.planner.PrefillModel`` built from this origin's model config (the
weights a token multiplies, and attention over the chunk's position: a chunk ``[s, e)`` of a prefix chain
costs ``flops(e - s, s)``; a standalone chunk starts at position 0). The speed is their ratio, summed since
the origin started and kept in memory only: an origin that has computed nothing since it started has not
measured one, and says so.

What a step's time holds: the forward pass of its chunk and the encoding and storing of its blob (with
``--engine vllm`` the whole document's compute lands in its first computed step; the sums are the same). So
the speed is the origin's publish speed, a little slower than its prefill alone: time saved at it leans
high by the cost of writing the blobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kdn.planner import PrefillModel


def prefill_model_of(config: Any) -> PrefillModel:
    """The prefill's shape from a transformers config, as vLLM's planner builds it (embedding and logits not
    counted: a lookup, and the one sampled token's)."""
    from kdn.adapters.vllm.planning import prefill_model  # (config arithmetic only: imports no vLLM)

    return prefill_model(config)


def chunk_flops(prefill: PrefillModel, start: int, end: int, standalone: bool = False) -> float:
    """The prefill FLOPs of tokens ``[start, end)`` after the ``start`` before them (none if standalone)."""
    return prefill.flops(max(end - start, 0), 0 if standalone else start)


@dataclass
class PublishSpeed:
    """Tokens and FLOPs this origin computed in its publish jobs, and the seconds they took (in memory)."""

    prefill: PrefillModel
    tokens: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    chunks: int = 0

    def observe(self, spans: Iterable[tuple[int, int, bool]], seconds: float) -> None:
        """One computed step: its chunks ``(start, end, standalone)`` and the seconds it took."""
        spans = list(spans)
        if seconds <= 0 or not spans:
            return
        self.tokens += sum(e - s for s, e, _ in spans)
        self.flops += sum(chunk_flops(self.prefill, s, e, alone) for s, e, alone in spans)
        self.seconds += seconds
        self.chunks += len(spans)

    @property
    def flops_per_s(self) -> float | None:
        """FLOPs a second over every computed chunk; None until one was timed."""
        return self.flops / self.seconds if self.seconds > 0 and self.flops > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens > 0 else None

    def seconds_for(self, flops: float) -> float | None:
        """Seconds ``flops`` would take at this speed; None when unmeasured."""
        rate = self.flops_per_s
        return None if rate is None else flops / rate
