"""What the scheduler-side connector tells the worker-side one each step (pickled between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kdn.adapters.vllm.blend import BlendJob
from kdn.adapters.vllm.compat import KVConnectorMetadata
from kdn.adapters.vllm.plan import LoadPlan
from kdn.adapters.vllm.steer import SteerJob

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.address import Address


@dataclass(frozen=True)
class LoadJob:
    """Write ``plan``'s tokens (and, for a hybrid model, the state at ``plan.end``) into these blocks."""

    req_id: str
    plan: LoadPlan
    block_ids: tuple[list[int], ...]  # per KV cache group, the request's block table
    background: bool  # async: load between steps and report in get_finished; else inside this step's forward
    host: bool = True  # the machine's host tier first, where one is set (a request's ``"kdn": {"host": false}``: not)


@dataclass(frozen=True)
class SaveChunk:
    address: Address
    parent: Address | None
    start: int
    end: int


@dataclass(frozen=True)
class SaveJob:
    """Read these chunks out of the request's blocks once this step's forward has computed them."""

    req_id: str
    namespace: str
    encodings: tuple[str, ...]
    chunks: tuple[SaveChunk, ...]
    block_ids: tuple[list[int], ...]
    state_blocks: dict[int, int] = field(default_factory=dict)  # mamba group -> block holding the state at chunks[-1].end


@dataclass
class KDNMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    steers: list[SteerJob] = field(default_factory=list)  # steered requests' rows this step (steer.py)
    blends: list[BlendJob] = field(default_factory=list)  # RAG prompts composed from standalone chunks (blend.py)
