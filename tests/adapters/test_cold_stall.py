"""A lying entry edge that labels every hit "cold" (the edge must fill it first) and then sends nothing: the
transformers adapter waits a bounded multiple of the prefill for it, never the 30 s cap, computes what did not
arrive (the same tokens as a plain prefill), and counts the give-up against that edge: its next cold load is
not waited on, and an edge whose cold loads keep stalling is no longer believed when it says "cold".

Real parts: etcd, an origin that computes and publishes the document (tiny-llama), a real edge behind the liar;
the liar is a server on 127.0.0.1 that passes lookups and records through from the real edge, rewrites every
hit's tier to ``origin`` and never answers an object request. The honest origin is the client's second source.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from edge_helpers import cluster, publish  # bench/lib/edge_helpers.py

from kdn.adapters.hf import agenerate, load_model
from kdn.adapters.hf.plan import cold_fills_of, speeds_of
from kdn.client import KDNClient
from kdn.planner import (COLD_DOUBTED_AFTER, COLD_FILL_S, COLD_OF_PREFILL, PROBE_AFTER_S, ColdFills,
                         cold_deadline)

DOC = ("The keeper's log for the night of the storm records wind from the north-east, "
       "two ships sighted, and the lamp relit twice after the glass cracked. ") * 12
QUESTION = " What did the keeper record?"
NEW = 8
GRACE_S = 3.0  # lookups, the decode steps and a loaded 2-core machine, on top of the bound under test


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


async def lying_edge(real: str) -> TestServer:
    """The liar, in front of the real edge at ``real``: ``server.asked`` counts object requests."""
    release, asked = asyncio.Event(), []
    session = aiohttp.ClientSession()

    async def lookup(request: web.Request) -> web.Response:
        async with session.post(f"{real}/v1/lookup", json=await request.json()) as r:
            body = await r.json()
        body["sources"] = ["origin"] * int(body.get("length") or 0)  # "cold: I must fill these first"
        return web.json_response(body)

    async def record(request: web.Request) -> web.Response:
        async with session.get(f"{real}/v1/registry/objects/{request.match_info['address']}") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def obj(request: web.Request) -> web.Response:
        asked.append(request.match_info["address"])
        await release.wait()  # the "fill" that never ends
        raise web.HTTPServiceUnavailable()

    async def close(_: web.Application) -> None:
        release.set()
        await session.close()

    app = web.Application()
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/v1/registry/objects/{address}", record)
    app.router.add_get("/v1/objects/{address}", obj)
    app.on_shutdown.append(close)
    server = TestServer(app, host="127.0.0.1")
    server.asked = asked  # type: ignore[attr-defined]
    server.release = release  # type: ignore[attr-defined]
    await server.start_server()
    return server


def url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def timed(lm, ids, client, bound: float, **kw):
    """``agenerate`` and its wall time; past ``bound`` s the test fails there (not after the 30 s cap)."""
    t0 = time.perf_counter()
    gen = await asyncio.wait_for(agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=NEW, **kw), bound)
    return gen, time.perf_counter() - t0


async def test_a_lying_cold_edge_costs_a_bounded_multiple_of_the_prefill(tmp_path, etcd_url, lm):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, DOC)
        ids = m["prefix_tokens"] + lm.tokenizer.encode(QUESTION)
        liar = await lying_edge(c.edge_url("e1"))
        try:
            async with KDNClient(edges=[url(liar)], origin=c.origin_url()) as client:
                # A plain prefill: the reference tokens, and the prefill time the planner learns from it.
                plain, plain_s = await timed(lm, ids, client, 120, use_cache=False)
                prefill_s = speeds_of(lm.model).prefill.seconds(len(ids))
                bound = COLD_OF_PREFILL * prefill_s + COLD_FILL_S
                gen, waited = await timed(lm, ids, client, bound + plain_s + GRACE_S)
        finally:
            await liar.close()
    r = gen.report
    assert liar.asked, "the lying edge was asked for the objects (the attack reached its target)"
    assert gen.ids == plain.ids and r.tokens_reused == 0
    assert "(cold, from edge:0): 0 of " in r.plan and r.plan.endswith("chunks used, the rest computed"), r.plan
    assert f"ran past its {cold_deadline(0.0, 30.0, prefill_s) * 1e3:.0f} ms deadline" in r.plan, r.plan
    # The wait is the cold deadline (k x the prefill + the fill allowance), then the prompt computed: not 30 s.
    assert bound <= waited < bound + plain_s + GRACE_S, (waited, bound, plain_s)


async def test_a_source_whose_cold_loads_stall_is_not_waited_on_again(tmp_path, etcd_url, lm):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, DOC)
        ids = m["prefix_tokens"] + lm.tokenizer.encode(QUESTION)
        liar = await lying_edge(c.edge_url("e1"))
        try:
            async with KDNClient(edges=[url(liar)], origin=c.origin_url()) as client:
                # The origin is far (so the liar stays the source a fetch asks first, and the one waited on).
                client.routing.estimates[c.origin_url()].set_prior(1.0)
                plain, plain_s = await timed(lm, ids, client, 120, use_cache=False)
                bound = cold_deadline(0.0, 30.0, speeds_of(lm.model).prefill.seconds(len(ids)))
                first, first_s = await timed(lm, ids, client, bound + plain_s + GRACE_S)
                asked = len(liar.asked)
                # At once: its last cold load was given up, so a cold load from it is expected to move as that
                # one did (nothing in 1.x prefills): the plan computes, and the liar is not asked.
                second, second_s = await timed(lm, ids, client, bound)
                asked_second = len(liar.asked) - asked
                # Later (that give-up is stale, and so is the failure the client's ranking counted for it): its
                # "cold" is believed once more, and the load waits again ...
                fills = cold_fills_of(client)
                fills.by["edge:0"].at -= PROBE_AFTER_S + 1
                client.routing.estimates[url(liar)].last_failure -= PROBE_AFTER_S + 1
                third, third_s = await timed(lm, ids, client, bound + plain_s + GRACE_S)
                # ... and, given up a second time running, it is not believed again: its hits are planned and
                # bounded as warm ones (the planner's own deadline, judged from its start).
                believed = fills.believed("edge:0")
                fourth, fourth_s = await timed(lm, ids, client, bound)
        finally:
            await liar.close()
    assert asked and "(cold, from edge:0)" in first.report.plan
    assert second.report.plan.startswith("compute:") and "from edge:0 was given up" in second.report.plan
    assert asked_second == 0 and second.report.sources == {} and second_s < first_s
    assert "(cold, from edge:0)" in third.report.plan and third_s >= bound
    assert not believed and COLD_DOUBTED_AFTER == 2
    assert "(cold, from" not in fourth.report.plan and "from edge:0 was given up" not in fourth.report.plan
    assert fourth_s < bound, (fourth_s, bound, fourth.report.plan)
    assert plain.ids == first.ids == second.ids == third.ids == fourth.ids


def test_cold_fills_count_give_ups_running_and_forget_them_when_the_source_serves():
    fills = ColdFills()
    assert fills.believed("edge:0") and fills.expected("edge:0", 1000, now=0.0) == 0.0
    fills.gave_up("edge:0", 0, 1.5, now=10.0)
    assert fills.believed("edge:0") and fills.expected("edge:0", 1000, now=11.0) == float("inf")
    assert fills.expected("edge:0", 1000, now=10.0 + PROBE_AFTER_S + 1) == 0.0  # stale: tried again
    fills.gave_up("edge:0", 500, 2.0, now=50.0)  # a trickle: 250 B/s
    assert not fills.believed("edge:0") and fills.expected("edge:0", 1000, now=51.0) == 4.0
    fills.served("edge:0")
    assert fills.believed("edge:0") and fills.expected("edge:0", 1000, now=52.0) == 0.0
