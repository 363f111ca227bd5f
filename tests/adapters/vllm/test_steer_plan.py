"""Steering requests on the vLLM connector's scheduler side: which plans are taken, which refused, what is saved.

(The engine itself, steering against the transformers adapter, is in ``test_vllm_dense.py``.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kdn.adapters.vllm.config import ConnectorConfig
from kdn.adapters.vllm.scheduler import SchedulerSide
from kdn.adapters.vllm.steer import request_params, spec_of
from kdn.errors import InvalidInput, ModelMismatch

MAP = {"spans": [[40, 48]], "region": [8, 96], "alpha": 0.05, "heads": [[1, 0], [1, 1], [0, 1]]}
N = 120  # prompt tokens: the map's 96, then a question


def spec_for(kdn: dict, salt: str | None, n_ids: int = N):
    return spec_of(kdn, n_layers=2, n_heads=2, n_ids=n_ids, cache_salt=salt)


def test_a_plan_needs_its_salt_and_the_salt_names_the_plan():
    kdn, salt = request_params(MAP)
    spec = spec_for(kdn, salt)
    assert spec.query_from == 96 and spec.heads == ((0, (1,)), (1, (0, 1))) and spec.alpha == 0.05
    assert spec.key_bias()[40:48].eq(0).all() and spec.key_bias()[8:40].lt(0).all() and not spec.key_bias()[:8].any()
    assert spec_for(kdn, "tenant-7:" + salt) == spec  # a salt the request carries anyway may come first
    for bad in (None, "", "kdn-steer-0123456789abcdef"):
        with pytest.raises(InvalidInput, match="cache_salt"):
            spec_for(kdn, bad)
    assert request_params(MAP)[1] == salt  # the same inputs, the same salt
    assert request_params(MAP, alpha=0.1)[1] != salt and request_params(MAP, heads=[[0, 0]])[1] != salt
    assert request_params({**MAP, "spans": [[40, 49]]})[1] != salt
    kdn2, salt2 = request_params(MAP, alpha=0.1, heads=[[0, 0]], query_from=100)
    spec2 = spec_for(kdn2, salt2)
    assert (spec2.alpha, spec2.heads, spec2.query_from) == (0.1, ((0, (0,)),), 100)


def test_steering_is_off_unless_asked_and_bad_plans_are_refused():
    off = request_params(MAP, steer=None)
    assert spec_for(*off) is None  # the map does not say default_on
    # A request that is not steered gets no plan salt: its K/V are plain, shared with plain requests.
    assert off[1] == "" and request_params(MAP, steer=False, salt_prefix="t1")[1] == "t1"
    assert request_params({**MAP, "default_on": True}, steer=None)[1].startswith("kdn-steer-")
    assert spec_for(*request_params({**MAP, "default_on": True}, steer=None)) is not None
    assert spec_for(*request_params({**MAP, "default_on": True}, steer=False)) is None
    assert spec_for({}, None) is None and spec_for({"load": True}, None) is None
    assert spec_for(*request_params(MAP, alpha=1.0)) is None  # alpha 1 is the unsteered model
    with pytest.raises(InvalidInput, match="emphasis map"):
        spec_for({"steer": True}, "x")
    with pytest.raises(InvalidInput, match="covers 96 tokens"):
        spec_for(*request_params(MAP), n_ids=90)
    with pytest.raises(ModelMismatch, match="not in this model"):
        spec_for(*request_params(MAP, heads=[[2, 0]]))
    kdn, salt = request_params(MAP)
    for bad in ({**kdn, "steer": "yes"}, {**kdn, "steer_heads": "all"}, {**kdn, "steer_alpha": 0.0},
                {**kdn, "emphasis": {**MAP, "spans": [[90, 100]]}}, {**kdn, "steer_query_from": -1}):
        with pytest.raises(InvalidInput):
            spec_for(bad, salt)


def request(rid: str, kdn: dict, salt: str | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params={"kdn": kdn}, prompt_token_ids=list(range(3, 3 + N)),
                           num_tokens=N, cache_salt=salt)


def side(**kw) -> SchedulerSide:
    cfg = ConnectorConfig(store="/nonexistent", save="all", chunk_tokens=32)
    blocks = SimpleNamespace(get_block_ids=lambda rid: ([7, 8, 9, 10, 11, 12, 13, 14],))
    return SchedulerSide(cfg=cfg, model_id="ab" * 32, block_size=16, hybrid=False, background=False,
                         kv_cache_manager=blocks, **{"steer": True, "n_layers": 2, "n_heads": 2, "consume": False,
                                                     "produce": True, **kw})


def step(rid: str, computed: int, n: int) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=computed)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           num_scheduled_tokens={rid: n}, kv_connector_block_state=None)


def test_steered_requests_get_jobs_past_query_from_and_never_save_past_it():
    s = side()
    kdn, salt = request_params(MAP)
    s.allocated(request("r", kdn, salt), SimpleNamespace(get_block_ids=lambda: ([7],)), 0)
    assert [c.end for c in s._saves["r"].chunks] == [32, 64, 96]  # not [96, 120): steered from 96 on
    assert s.build_meta(step("r", 0, 64)).steers == []  # the knowledge's own prefill
    meta = s.build_meta(step("r", 64, 56))
    (job,) = meta.steers
    assert (job.req_id, job.first, job.n, job.spec.query_from) == ("r", 64, 56, 96)
    assert job.block_ids == ((7, 8, 9, 10, 11, 12, 13, 14),)
    assert [c.end for j in meta.saves for c in j.chunks] == [96]
    s.finished(SimpleNamespace(request_id="r"))
    assert s.build_meta(step("r", 120, 1)).steers == []

    plain = side()
    plain.allocated(request("p", {}, None), SimpleNamespace(), 0)
    assert [c.end for c in plain._saves["p"].chunks] == [32, 64, 96, 120]


def test_an_engine_without_steering_refuses_and_counts():
    s = side(steer=False)
    kdn, salt = request_params(MAP)
    s.allocated(request("r", kdn, salt), SimpleNamespace(), 0)
    s.allocated(request("r", kdn, salt), SimpleNamespace(), 0)  # allocated again (preempted, resumed): counted once
    s.allocated(request("q", {**kdn, "steer": False}, salt), SimpleNamespace(), 0)  # asked for none: no refusal
    s.allocated(request("m", {**kdn, "steer": None}, salt), SimpleNamespace(), 0)  # a map that is not default_on
    assert s.steer_refused == 1 and s.build_meta(step("r", 96, 24)).steers == []


def test_a_steered_request_loads_from_the_kdn_only_up_to_the_question():
    """Published K/V past ``query_from`` were computed unsteered: a steered request recomputes them."""
    import concurrent.futures

    from kdn.chunk import Chunk
    from kdn.adapters.vllm.scheduler import _Lookup

    chunks = [Chunk(f"{i:064x}", s, e, "zstd", "0" * 64, 100) for i, (s, e) in
              enumerate(((0, 32), (32, 64), (64, 96), (96, 120)))]
    s = side(consume=True)
    kdn, salt = request_params(MAP)
    for rid, params, want in (("plain", {}, 112), ("steered", kdn, 96)):
        fut = concurrent.futures.Future()
        fut.set_result(chunks)
        s._lookups[rid] = _Lookup(fut, 0.0, chunks)
        assert s.matched(request(rid, params, salt), 0) == (want, False)


def test_the_steer_setting_is_a_bool():
    assert ConnectorConfig.from_extra({"origin": "http://x", "steer": True}, consumer=True, producer=False).steer
    with pytest.raises(InvalidInput, match="steer"):
        ConnectorConfig.from_extra({"origin": "http://x", "steer": "yes"}, consumer=True, producer=False)
