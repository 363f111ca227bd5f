"""How many published tokens an engine can load: KDN chunks (256) cut to engine blocks (16..384+)."""

from __future__ import annotations

import pytest

from kdn.adapters.vllm.plan import blocks_of, load_end, plan_load
from kdn.chunk import Chunk


def chain(*ends: int) -> list[Chunk]:
    out, start = [], 0
    for i, e in enumerate(ends):
        out.append(Chunk(f"{i:064x}", start, e, "zstd", "0" * 64, 100))
        start = e
    return out


@pytest.mark.parametrize("ends, num_tokens, block, state, want", [
    ((256, 512, 768, 1024, 1100), 1140, 128, False, 1024),  # CPU blocks: the tail's last 76 tokens don't fill one
    ((256, 512, 768, 1024, 1100), 1140, 16, False, 1088),  # GPU blocks: most of the tail too (sliced)
    ((256, 512, 768, 1024, 1100), 1100, 16, False, 1088),  # the whole text as prompt: one token left to compute
    ((256, 512, 768, 1024), 1024, 128, False, 896),  # exactly whole chunks: the last block is computed
    ((256, 512, 768, 1024, 1100), 1140, 384, False, 768),  # a block that is not a multiple of the chunk
    ((256, 512, 768, 1024, 1280, 1536, 1700), 1740, 384, True, 1536),  # hybrid: chunk end AND block end
    ((256, 512, 768, 1024, 1280, 1536, 1700), 1740, 384, False, 1536),
    ((256, 512, 600), 640, 384, True, 0),  # hybrid: no chunk end on a block boundary below the prompt
    ((256, 512, 600), 640, 128, True, 512),
    ((256, 512, 600), 640, 250, True, 0),  # attention-only loads 500 (a slice); a state exists at 256/512/600 only
    ((256, 512, 600), 640, 250, False, 500),
    ((256, 512, 600), 640, 200, True, 600),
    ((), 1000, 128, False, 0),
    ((256,), 200, 128, False, 128),  # a prompt shorter than the chain still loads what it shares
])
def test_load_end(ends, num_tokens, block, state, want):
    assert load_end(list(ends), num_tokens=num_tokens, block_size=block, needs_state=state) == want


def test_plan_skips_what_the_engine_holds_and_slices_the_straddling_chunk():
    plan = plan_load(chain(256, 512, 768, 1024, 1100), computed=384, num_tokens=1140, block_size=128,
                     needs_state=False)
    assert (plan.first, plan.end, plan.tokens) == (384, 1024, 640)
    assert [(p.start, lo, hi) for p, lo, hi in plan.spans()] == [(256, 384, 512), (512, 512, 768), (768, 768, 1024)]
    assert plan.last.end == 1024


def test_nothing_to_gain_is_none():
    assert plan_load(chain(256, 512), computed=512, num_tokens=600, block_size=128, needs_state=False) is None
    assert plan_load([], computed=0, num_tokens=600, block_size=128, needs_state=False) is None


def test_a_broken_chain_is_refused():
    a, b = chain(256, 512)
    with pytest.raises(ValueError, match="chain"):
        plan_load([a, Chunk(b.address, 300, 512, "zstd", "0" * 64, 1)], computed=0, num_tokens=600, block_size=16,
                  needs_state=False)
    with pytest.raises(ValueError, match="token 0"):
        plan_load([b], computed=0, num_tokens=600, block_size=16, needs_state=False)


def test_blocks_of():
    assert list(blocks_of(384, 1024, 128)) == [3, 4, 5, 6, 7]
    assert list(blocks_of(300, 1024, 128)) == [2, 3, 4, 5, 6, 7]  # a partly loaded block is a bad block too
