"""A full host arena (``kdn.wire.arena``): the arena's contract is that a load which does not fit is a
recompute, never an error. ``agenerate`` computes what it could not load, with the tokens of a plain prefill,
and counts it (``Report.arena_full``), whether the arena has no room for the loaded cache itself (its budget
held by another lease) or room for the cache and none for the receive buffers of compressed objects.

Real parts: etcd, an origin that computes and publishes the document (tiny-llama, zstd only), a real edge.
"""

from __future__ import annotations

import pytest

from edge_helpers import cluster, publish  # bench/lib/edge_helpers.py

from kdn.adapters.hf import agenerate, load_model
from kdn.adapters.hf.plan import kv_bytes_per_token
from kdn.client import KDNClient
from kdn.wire.arena import Arena, size_class

DOC = ("The keeper's log for the night of the storm records wind from the north-east, "
       "two ships sighted, and the lamp relit twice after the glass cracked. ") * 8
QUESTION = " What did the keeper record?"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


@pytest.mark.parametrize("full", ["held_by_another_lease", "room_for_the_cache_only"])
async def test_a_full_arena_computes_instead_of_raising(tmp_path, etcd_url, lm, full):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, DOC, encodings=["zstd"])
        ids = m["prefix_tokens"] + lm.tokenizer.encode(QUESTION)
        if full == "held_by_another_lease":
            arena = Arena(64 << 20, name="test arena")
            held = arena.take(64 << 20)
        else:  # exactly the loaded cache's K/V: the cache is made, then no object's receive buffer fits
            arena = Arena(size_class(kv_bytes_per_token(lm.model) * len(m["prefix_tokens"])), name="test arena")
        async with KDNClient(edges=[("e1", c.edge_url("e1"))]) as client:
            plain = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8, use_cache=False)
            # plan=False: load whatever the lookup found (the planner cannot choose to compute instead)
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=8, arena=arena, plan=False)
        if full == "held_by_another_lease":
            held.release()
    r = gen.report
    assert arena.stats.refused >= 1, "the arena was asked for memory it did not have"
    assert gen.ids == plain.ids and r.tokens_reused == 0 and r.arena_full == 1
    assert "the host arena is full" in r.plan and "test arena" in r.plan, r.plan
    if full == "room_for_the_cache_only":
        assert "the load was refused memory" in r.plan and r.plan.endswith("0 of 5 chunks used, the rest computed")
