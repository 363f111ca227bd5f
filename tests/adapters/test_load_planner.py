"""The load planner inside agenerate: it loads what is faster to load, computes the rest, and a load that
stalls becomes a recompute within its deadline (sooner once its progress shows it would overrun that) --
with the same logits as computing (tiny-llama, fp32).

The source is a stand-in edge on loopback (``stand_in_edge.py``): lookup, records and objects from memory, and
objects from chunk ``stall_from`` on that never arrive.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from aiohttp.test_utils import TestServer

from kdn.adapters.hf import agenerate, continue_from_cache, load_model, prefill
from kdn.adapters.hf.generate import model_id
from kdn.adapters.hf.plan import speeds_of
from kdn.client import KDNClient
from kdn.planner import OVERRUN_AFTER

import stand_in_edge  # tests/adapters/stand_in_edge.py

CHUNK = 256
N_CHUNKS = 4
PARTIAL = 1000


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", dtype="float32")


def published(lm):
    ids = [int(x) for x in torch.randint(3, 200, (N_CHUNKS * CHUNK,), generator=torch.Generator().manual_seed(9))]
    mid = model_id(lm.model, lm.tokenizer)
    addrs, blobs, records = stand_in_edge.published(lm.model, mid, ids, CHUNK)
    return ids, mid, addrs, blobs, records


async def edge(addrs, blobs, records, stall_from: int | None = None) -> TestServer:
    return await stand_in_edge.serve(addrs, blobs, records, stall_from=stall_from, partial=PARTIAL)


def reference(lm, ids, suffix, loaded_chunks):
    """Logits of computing the prompt the way the loader does: chunks 0..k as chunked prefill, the rest at once."""
    with torch.inference_mode():
        n = loaded_chunks * CHUNK
        cache = prefill(lm.model, ids[:n], chunk_tokens=CHUNK) if n else None
        if cache is None:
            from kdn.adapters.hf.extract import new_cache

            cache = new_cache(lm.model)
        return continue_from_cache(lm.model, cache, n, ids[n:] + suffix, last=1)[-1]  # as agenerate computes it


def calibrate(lm, seconds_for_1024: float) -> None:
    """Tell the planner this engine prefills 1024 tokens in ``seconds_for_1024`` (as a timed forward would)."""
    sp = speeds_of(lm.model)
    sp.prefill.forget()
    sp.prefill.observe(1024, 0, seconds_for_1024)


async def test_a_fast_source_is_loaded_and_the_plan_says_so(lm):
    ids, mid, addrs, blobs, records = published(lm)
    server = await edge(addrs, blobs, records)
    try:
        calibrate(lm, 5.0)  # computing is slow: loading wins
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")]) as c:
            gen = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
    finally:
        await server.close()
    assert gen.report.tokens_reused == N_CHUNKS * CHUNK and gen.report.plan.startswith(f"load {N_CHUNKS} of {N_CHUNKS}")
    assert torch.equal(gen.first_logits, reference(lm, ids, [5, 6, 7], N_CHUNKS).float())


async def test_a_slow_link_is_not_loaded_the_prompt_is_computed(lm):
    ids, mid, addrs, blobs, records = published(lm)
    server = await edge(addrs, blobs, records)
    try:
        calibrate(lm, 0.001)  # computing is nearly free: no link can beat it
        url = str(server.make_url("")).rstrip("/")
        async with KDNClient(edges=[url]) as c:
            c.routing.estimates[url].set_prior(0.05, 1e6)  # and the link is measured slow (50 ms, 1 MB/s)
            gen = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
    finally:
        await server.close()
    assert gen.report.tokens_reused == 0 and gen.report.plan.startswith("compute: load")
    assert gen.report.sources == {}  # nothing was fetched
    assert torch.equal(gen.first_logits, reference(lm, ids, [5, 6, 7], 0).float())


async def test_a_stalled_source_becomes_a_recompute_within_the_deadline(lm):
    """Chunks 0-1 arrive, 2-3 never do: past the deadline the two that arrived are used and the rest
    computed; the logits are those of computing the same way, and the wait is bounded."""
    ids, mid, addrs, blobs, records = published(lm)
    server = await edge(addrs, blobs, records, stall_from=2)
    try:
        calibrate(lm, 2.0)
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")], max_hedges=0) as c:
            t0 = time.perf_counter()
            gen = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1, load_deadline=1.0)
            waited = time.perf_counter() - t0
    finally:
        server.release.set()
        await server.close()
    # Half the bytes landed, then none: at that speed the load would end past 1.5x its deadline once it has
    # run 3/4 of it (kdn.planner.overruns), so it is given up there, not at the deadline.
    assert "was given up after" in gen.report.plan and "2 of 4 chunks used" in gen.report.plan
    assert gen.report.tokens_reused == 2 * CHUNK
    assert waited < 1.0 + 10.0  # the deadline, then the computed rest (tiny model): never the 30 s timeout
    assert torch.equal(gen.first_logits, reference(lm, ids, [5, 6, 7], 2).float())


async def test_a_link_gone_slow_spoils_one_load_then_the_prompt_is_computed(lm):
    """Warm reads measure the link fast; then it sends only a trickle. The next load is given up at its
    deadline and reports the bytes that landed by then (not the bytes it was meant to move), so the
    request after it computes at once instead of trying again with a doubled deadline."""
    ids, mid, addrs, blobs, records = published(lm)
    server = await edge(addrs, blobs, records)
    try:
        calibrate(lm, 2.0)
        sp = speeds_of(lm.model)
        sp.load_bps, sp.loads, sp.last_load = None, 0, None
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")], max_hedges=0) as c:
            for _ in range(2):  # reads from the edge's memory: they measure the link (fast)
                gen = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
                assert gen.report.tokens_reused == N_CHUNKS * CHUNK
            fast = sp.loads
            assert fast >= 1 and sp.load_bps > 1e6
            server.slow["on"] = True
            spoiled = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
            after = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
    finally:
        server.release.set()
        await server.close()
    # Given up by its progress once an eighth of its deadline had passed (a trickle would take minutes), not at
    # the deadline (kdn.planner.overruns); what landed by then is the speed learnt.
    assert "was given up after" in spoiled.report.plan and spoiled.report.tokens_reused == 0
    deadline = 0.25 * 2.0 * (N_CHUNKS * CHUNK + 3) / 1024  # a quarter of the prefill (kdn.planner._deadline)
    gave_up_ms = float(spoiled.report.plan.split("was given up after ")[1].split(" ms")[0])
    # (an eighth, or half if its first bytes were late: kdn.planner.STALL_AFTER; plus a poll's step)
    assert OVERRUN_AFTER * deadline * 1e3 <= gave_up_ms < 0.75 * deadline * 1e3
    assert sp.loads == fast + 1 and sp.load_bps <= N_CHUNKS * PARTIAL / (0.9 * OVERRUN_AFTER * deadline)
    assert after.report.plan.startswith("compute: load") and after.report.tokens_reused == 0
    assert torch.equal(after.first_logits, reference(lm, ids, [5, 6, 7], 0).float())


async def test_a_stale_speed_is_probed_beside_the_request_which_computes(lm):
    """Once the last measured load is stale, a plan that computes fetches chunk 0 *beside* the request: over a
    link still slow the request computes at a prefill's cost and returns with the probe still on the wire
    (which then teaches the slow speed); over a link that recovered the probe teaches the fast one, and the
    next request loads everything again."""
    from kdn.adapters.hf.plan import PROBES
    from kdn.planner import PROBE_AFTER_S

    ids, mid, addrs, blobs, records = published(lm)
    server = await edge(addrs, blobs, records)
    sp = speeds_of(lm.model)

    def stale() -> None:
        sp.last_load, sp.last_probe = time.monotonic() - PROBE_AFTER_S - 1, None

    try:
        calibrate(lm, 2.0)
        sp.load_bps, sp.loads = 1000.0, 1  # measured slow, long ago
        stale()
        server.slow["on"] = True
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")], max_hedges=0) as c:
            probing = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
            in_flight = len(PROBES)  # the request did not wait for it
            await asyncio.wait_for(asyncio.gather(*PROBES), 10)
            slow_bps, loads = sp.load_bps, sp.loads
            server.slow["on"] = False
            stale()
            recovering = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
            await asyncio.wait_for(asyncio.gather(*PROBES), 10)
            fast_bps = sp.load_bps
            # The two computed requests taught the tiny model's real prefill (ms): the engine this test
            # stands for prefills as dearly as calibrated.
            calibrate(lm, 2.0)
            back = await agenerate(lm.model, lm.tokenizer, ids + [5, 6, 7], c, max_new_tokens=1)
    finally:
        server.release.set()
        await server.close()
    assert probing.report.plan.startswith("probe: compute") and probing.report.tokens_reused == 0
    assert probing.report.sources == {}  # nothing of the request's own was fetched
    assert in_flight == 1 and not PROBES
    assert loads == 2 and slow_bps <= PARTIAL / 0.1  # the trickle that landed by the probe's deadline
    assert torch.equal(probing.first_logits, reference(lm, ids, [5, 6, 7], 0).float())
    assert recovering.report.plan.startswith("probe: compute") and recovering.report.tokens_reused == 0
    assert fast_bps > 1e6  # the probe replaced the stale slow speed, not blended with it
    assert back.report.plan.startswith(f"load {N_CHUNKS} of {N_CHUNKS}") and back.report.tokens_reused == N_CHUNKS * CHUNK
    assert torch.equal(back.first_logits, reference(lm, ids, [5, 6, 7], N_CHUNKS).float())


async def test_a_probe_whose_record_cannot_be_read_measures_nothing_and_ends_without_an_error(lm):
    """The probe runs beside the request, with no one awaiting it: a record that cannot be read (the edge
    gone) must end it quietly (not as a task whose exception is never retrieved) and teach no speed."""
    import socket
    from types import SimpleNamespace

    from kdn.adapters.hf.plan import start_probe

    _, _, addrs, _, _ = published(lm)
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sp = speeds_of(lm.model)
    before = (sp.load_bps, sp.loads)
    async with KDNClient(edges=[f"http://127.0.0.1:{port}"], max_hedges=0, timeout=5.0) as c:
        task = start_probe(SimpleNamespace(addresses=addrs[:1], records=[]), c, sp, 1.0)
        await asyncio.wait_for(asyncio.shield(task), 30)
    assert task.exception() is None
    assert (sp.load_bps, sp.loads) == before
