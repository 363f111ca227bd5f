"""KDNL2Adapter as LMCache's own plugin factory builds it, driven through LMCache's L2 interface in this process.

Beside the MP server test (``test_lmcache_mp_server.py``) these are the edges of the contract: a task's
results and event fds, a chunk stored by one adapter (edge e1, the origin's ingest) and loaded by another
(edge e2), bit-exact; a miss is a 0 bit; a destination of another shape is refused; bad keys and bad settings
are refused with errors that say why; a store the origin refuses (another tenant's namespace, a read-only
token) and a store with no ingest fail the task; ``delete`` is refused and the chunks stay.
"""

from __future__ import annotations

import asyncio
import os
import select
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "lib"))

from edge_helpers import EDGE_TOKEN, TENANT_A, cluster  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from kdn.adapters.lmcache.keys import chunk_address, derived_model_id  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402
from kdn.service import METRICS  # noqa: E402

MODEL = "org/tiny-model"
SHAPE = (2, 3, 32, 16)  # [2, layers, tokens, heads * head_dim]: LMCache's KV_2LTD


def adapter(params: dict):
    """Built as ``--l2-adapter '{"type": "plugin", ...}'`` builds it: LMCache's config registry and factory."""
    cfg = get_l2_adapter_config_class("plugin").from_dict(
        {"type": "plugin", "module_path": "kdn.adapters.lmcache", "class_name": "KDNL2Adapter",
         "adapter_params": params})
    a = create_l2_adapter(cfg)
    assert isinstance(a, L2AdapterInterface) and type(a).__name__ == "KDNL2Adapter"
    return a


def memobj(t: torch.Tensor) -> TensorMemoryObj:
    raw = t.contiguous().view(torch.uint8).flatten().clone()
    meta = MemoryObjMetadata(shape=torch.Size(t.shape), dtype=t.dtype, address=0, phy_size=raw.numel(),
                             ref_count=1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def okey(i: int, **kw) -> ObjectKey:
    return ObjectKey(chunk_hash=bytes([i]) * 32, model_name=MODEL, kv_rank=0, **kw)


async def result(query, task_id: int, fd: int | None = None, timeout: float = 30.0):
    """Poll ``query(task_id)`` (the event fd, where given, must be readable once it is done)."""
    for _ in range(int(timeout / 0.02)):
        got = query(task_id)
        if got is not None:
            if fd is not None:
                assert select.select([fd], [], [], 0)[0], "the task's event fd was not signalled"
            return got
        await asyncio.sleep(0.02)
    raise AssertionError("an L2 task did not finish")


async def stored(a, keys, objs):
    task = a.submit_store_task(keys, objs)
    for _ in range(1500):
        done = a.pop_completed_store_tasks()
        if task in done:
            return done[task]
        await asyncio.sleep(0.02)
    raise AssertionError("a store task did not finish")


def bits(bitmap, n: int) -> list[bool]:
    return [bitmap.test(i) for i in range(n)]


async def test_store_lookup_load_miss_refuse_delete(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2")) as c:
        tok = tmp_path / "tenant-a"
        tok.write_text(TENANT_A + "\n")
        base = {"namespace": "acme", "token_file": str(tok), "timeout": 20}
        writer = adapter({**base, "edges": [c.edge_url("e1")], "ingest": c.origin_url()})
        reader = adapter({**base, "edges": [c.edge_url("e2")]})
        g = torch.Generator().manual_seed(1)
        src = [torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(3)]
        keys = [okey(1), okey(2), okey(3, cache_salt="user-7")]
        try:
            r = await stored(writer, keys, [memobj(t) for t in src])
            assert r.is_successful() and r.bytes_transferred() == 3 * src[0].numel() * 2
            assert writer.counts["stored"] == 3 and writer.get_usage().total_bytes_used == r.bytes_transferred()

            # lookup through another edge: the three, not a key never stored
            missing = okey(9)
            found = await result(reader.query_lookup_and_lock_result,
                                 reader.submit_lookup_and_lock_task(keys + [missing], {}),
                                 reader.get_lookup_and_lock_event_fd())
            assert bits(found, 4) == [True, True, True, False]
            reader.submit_unlock(keys)

            # load into fresh memory objects, bit-exact; the missing key is a 0 bit and its buffer untouched
            dst = [memobj(torch.zeros(SHAPE, dtype=torch.bfloat16)) for _ in range(4)]
            loaded = await result(reader.query_load_result, reader.submit_load_task(keys + [missing], dst),
                                  reader.get_load_event_fd())
            assert bits(loaded, 4) == [True, True, True, False]
            for s, d in zip(src, dst):
                assert torch.equal(d.tensor, s)
            assert not dst[3].tensor.any()
            assert reader.counts["hits"] == 3 and reader.counts["misses"] == 1 and not reader.counts["refused"]

            # the same key with another salt, or another rank: other addresses, misses
            other = [okey(3, cache_salt="user-8"), ObjectKey(chunk_hash=bytes([1]) * 32, model_name=MODEL, kv_rank=1)]
            found = await result(reader.query_lookup_and_lock_result, reader.submit_lookup_and_lock_task(other, {}))
            assert bits(found, 2) == [False, False]

            # a destination of another shape (or format): refused, never a partial copy
            wrong = memobj(torch.zeros((2, 3, 16, 32), dtype=torch.bfloat16))
            loaded = await result(reader.query_load_result, reader.submit_load_task(keys[:1], [wrong]))
            assert bits(loaded, 1) == [False] and reader.counts["refused"] == 1 and not wrong.tensor.any()

            # delete: refused, counted; the chunks stay loadable
            writer.delete(keys[:1])
            assert writer.counts["delete_refused"] == 1
            again = memobj(torch.zeros(SHAPE, dtype=torch.bfloat16))
            loaded = await result(reader.query_load_result, reader.submit_load_task(keys[:1], [again]))
            assert bits(loaded, 1) == [True] and torch.equal(again.tensor, src[0])

            # an adapter without 'ingest' only reads: its store tasks fail
            r = await stored(reader, [okey(4)], [memobj(src[0])])
            assert not r.is_successful() and reader.counts["read_only"] == 1
        finally:
            writer.close()
            reader.close()


async def test_the_origin_refuses_other_namespaces_and_read_tokens(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        a_tok, edge_tok = tmp_path / "a", tmp_path / "edge"
        a_tok.write_text(TENANT_A + "\n")
        edge_tok.write_text(EDGE_TOKEN + "\n")  # read * only
        common = {"edges": [c.edge_url("e1")], "ingest": c.origin_url(), "timeout": 20}
        beta = adapter({**common, "namespace": "beta", "token_file": str(a_tok)})  # tenant A, B's namespace
        reader = adapter({**common, "namespace": "acme", "token_file": str(edge_tok)})
        obj = memobj(torch.ones(SHAPE, dtype=torch.bfloat16))
        try:
            for a in (beta, reader):
                r = await stored(a, [okey(5)], [obj])
                assert not r.is_successful() and a.counts["store_refused"] == 1 and not a.counts["stored"]
            assert c.origin.app[METRICS].get_sample_value("kdn_origin_ingested_total", {"outcome": "refused"}) == 2
            assert c.origin.app[METRICS].get_sample_value("kdn_origin_ingested_total", {"outcome": "stored"}) is None
        finally:
            beta.close()
            reader.close()


async def test_bad_keys_are_refused_with_a_reason(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        a = adapter({"edges": [c.edge_url("e1")], "namespace": "acme", "timeout": 5})
        try:
            with pytest.raises(InvalidInput, match="chunk hash"):
                a.address_of(ObjectKey(chunk_hash=b"", model_name=MODEL, kv_rank=0))
            with pytest.raises(InvalidInput, match="chunk hash"):
                a.address_of(ObjectKey(chunk_hash=b"x" * 300, model_name=MODEL, kv_rank=0))
            with pytest.raises(InvalidInput, match="model name"):
                a.address_of(ObjectKey(chunk_hash=b"x" * 32, model_name="", kv_rank=0))
            with pytest.raises(ValueError, match="cache_salt"):  # LMCache's own check, before ours
                okey(1, cache_salt="a@b")
            # a task holding a bad key: all misses, counted, the event fd signalled, no thread lost
            bad = [okey(1), ObjectKey(chunk_hash=b"", model_name=MODEL, kv_rank=0)]
            found = await result(a.query_lookup_and_lock_result, a.submit_lookup_and_lock_task(bad, {}),
                                 a.get_lookup_and_lock_event_fd())
            assert bits(found, 2) == [False, False] and a.counts["errors"] == 1
            # the mapping: this key's address, in this namespace, for this model
            assert a.address_of(okey(1)) == chunk_address(derived_model_id(MODEL), "acme", chunk_hash=bytes([1]) * 32,
                                                          kv_rank=0)
        finally:
            a.close()


def test_bad_settings_are_refused_by_name():
    with pytest.raises(InvalidInput, match="colour"):
        adapter({"edges": ["http://127.0.0.1:1"], "colour": "red"})
    with pytest.raises(InvalidInput, match="'edges' or 'origin'"):
        adapter({"namespace": "acme"})
    with pytest.raises(InvalidInput, match="encoding"):
        adapter({"edges": ["http://127.0.0.1:1"], "encoding": "int4"})
    with pytest.raises(InvalidInput, match="not an http"):
        adapter({"edges": ["http://127.0.0.1:1"], "ingest": "127.0.0.1:8000"})
    with pytest.raises(InvalidInput, match="namespace"):
        adapter({"edges": ["http://127.0.0.1:1"], "namespace": "Not A Namespace!"})
