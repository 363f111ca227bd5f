"""KDNHiCacheStorage against real KDN edges on loopback, loaded by SGLang's own StorageBackendFactory.

Pages set from one backend instance (talking to edge e1) are got by another (talking to edge e2), bit-exact,
in each host layout and across layouts, written either way (``ingest``: the origin's authenticated ingest;
``store`` + ``registry``: its folder and registry); exists; a missing key is a clean miss; another tenant's
namespace sees nothing; an ingest the origin refuses (a token without ``publish`` on the namespace) is a failed
write, never an exception, and its pages stay misses. SGLang calls a backend from plain threads, so the tests do too (``asyncio.to_thread``): the
cluster runs on the test's loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "lib"))

from edge_helpers import EDGE_TOKEN, TENANT_A, TENANT_B, cluster  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kdn.origin.app import CONFIG  # noqa: E402
from kdn.registry.signing import Signer, Verifier  # noqa: E402
from kdn.service import METRICS  # noqa: E402

PAGE = 4
KEYS = [f"{i:064x}" for i in (0xA1, 0xB2, 0xC3)]


def backend(c, tmp_path, edge: str, pool, *, token: str = TENANT_A, namespace: str = "acme",
            via: str | None = "store", mla: bool = False):
    """A backend built as SGLang builds one: ``StorageBackendFactory.create_backend("dynamic", ...)``; it writes
    ``via`` the origin's ingest, its store folder and registry, or (None) not at all."""
    tok = tmp_path / f"token-{token[:8]}-{edge}-{namespace}"
    tok.write_text(token + "\n")
    extra = {"backend_name": "kdn", "module_path": "kdn.adapters.sglang", "class_name": "KDNHiCacheStorage",
             "interface_v1": 1, "edges": [c.edge_url(edge)], "namespace": namespace, "token_file": str(tok),
             "timeout": 20}
    if via == "store":
        extra |= {"store": c.origin.app[CONFIG].store, "registry": c.registry, "node_id": "sglang-test"}
    elif via == "ingest":
        extra |= {"ingest": c.origin_url()}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=mla, enable_storage_metrics=False,
                               is_page_first_layout=pool.layout == "page_first", model_name="org/tiny-model",
                               extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(b, HiCacheStorage) and type(b).__name__ == "KDNHiCacheStorage"
    b.register_mem_pool_host(pool)  # as SGLang's cache controller does, right after create_backend
    return b


def indices(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def same_tokens(a, a_tok: int, b, b_tok: int, mla: bool = False) -> bool:
    for layer in range(a.layer_num):
        for j in range(PAGE):
            if not torch.equal(a.k(layer, a_tok + j), b.k(layer, b_tok + j)):
                return False
            if not mla and not torch.equal(a.v(layer, a_tok + j), b.v(layer, b_tok + j)):
                return False
    return True


@pytest.mark.parametrize("src_layout,dst_layout,mla,via", [
    ("layer_first", "layer_first", False, "store"),
    ("page_first", "page_first", False, "store"),
    ("page_first", "layer_first", False, "store"),
    ("page_first_direct", "page_first", False, "store"),
    ("layer_first", "page_first", True, "store"),
    ("layer_first", "layer_first", False, "ingest"),
    ("page_first", "layer_first", False, "ingest"),
    ("page_first_direct", "page_first", False, "ingest"),
    ("layer_first", "page_first", True, "ingest"),
])
async def test_set_on_one_edge_get_from_another(tmp_path, etcd_url, host_pool, src_layout, dst_layout, mla, via):
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2")) as c:
        src = host_pool(src_layout, mla=mla, page_size=PAGE, seed=1)
        dst = host_pool(dst_layout, mla=mla, page_size=PAGE, seed=2)
        writer = backend(c, tmp_path, "e1", src, mla=mla, via=via)
        reader = backend(c, tmp_path, "e2", dst, via=None, mla=mla)
        try:
            # SGLang's zero-copy write of host pages 2, 5, 7 under three keys
            assert await asyncio.to_thread(writer.batch_set_v1, KEYS, indices(2, 5, 7)) == [True] * 3
            assert await asyncio.to_thread(reader.exists, KEYS[1])
            assert await asyncio.to_thread(reader.batch_exists, KEYS + ["ff" * 32]) == 3
            # read into other host pages of another pool, through another edge
            assert not same_tokens(src, 5 * PAGE, dst, 9 * PAGE, mla)
            assert await asyncio.to_thread(reader.batch_get_v1, KEYS, indices(1, 9, 3)) == [True] * 3
            for s, d in ((2, 1), (5, 9), (7, 3)):
                assert same_tokens(src, s * PAGE, dst, d * PAGE, mla), (s, d)
            assert reader.counts["hits"] == 3 and not reader.counts["refused"]
            assert writer.counts["written"] == 3 and not writer.counts["write_errors"]
            if via == "ingest":
                assert writer.counts["stored"] == 3
        finally:
            writer.close()
            reader.close()


async def test_copying_path_and_clean_misses(tmp_path, etcd_url, host_pool):
    """SGLang's non-zero-copy path (no ``interface_v1``): flat pages from ``get_data_page``, back through
    ``set_from_flat_data_page``; a key never set is a miss everywhere; another tenant sees nothing."""
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2")) as c:
        src, dst = host_pool("page_first", page_size=PAGE, seed=3), host_pool("layer_first", page_size=PAGE, seed=4)
        writer = backend(c, tmp_path, "e1", src)
        reader = backend(c, tmp_path, "e2", dst, via=None)
        other = backend(c, tmp_path, "e2", host_pool("layer_first", page_size=PAGE), token=TENANT_B,
                        namespace="beta", via=None)
        try:
            assert await asyncio.to_thread(writer.batch_set, KEYS[:2], [src.get_data_page(4), src.get_data_page(8)])
            got = await asyncio.to_thread(reader.batch_get, KEYS[:2] + ["ee" * 32],
                                          [dst.get_dummy_flat_data_page() for _ in range(3)])
            assert got[2] is None and got[0] is not None and got[1] is not None
            dst.set_from_flat_data_page(0, got[0])
            dst.set_from_flat_data_page(12, got[1])
            assert same_tokens(src, 4, dst, 0) and same_tokens(src, 8, dst, 12)
            # a missing key: a clean miss, on every call
            missing = "dd" * 32
            assert not await asyncio.to_thread(reader.exists, missing)
            assert await asyncio.to_thread(reader.get, missing, dst.get_dummy_flat_data_page()) is None
            assert await asyncio.to_thread(reader.batch_get_v1, [missing], indices(6)) == [False]
            # another tenant, same keys: other addresses, nothing there
            assert not await asyncio.to_thread(other.exists, KEYS[0])
            assert await asyncio.to_thread(other.batch_get_v1, KEYS[:1], indices(2)) == [False]
        finally:
            for b in (writer, reader, other):
                b.close()


async def test_ingest_writes_signed_records_and_refusals_are_clean_failures(tmp_path, etcd_url, host_pool):
    """Through the origin's ingest: SGLang's copying path (``batch_set``, ``set``) from e1, read bit-exact from e2;
    the record says the origin took it from tenant A's token; the same page again is kept, other bytes under a
    stored key are not written over (the stored page stays, the write counts as kept). A token without
    ``publish`` on the namespace (tenant A in beta; the edges' read-only token in acme): every write returns
    False, counted, nothing raised into SGLang, and the pages stay misses."""
    key = tmp_path / "origin.key"
    Signer.generate(str(key))
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2"), origin_kw={"signing_key": str(key)}) as c:
        src, dst = host_pool("page_first", page_size=PAGE, seed=5), host_pool("layer_first", page_size=PAGE, seed=6)
        writer = backend(c, tmp_path, "e1", src, via="ingest")
        reader = backend(c, tmp_path, "e2", dst, via=None)
        beta = backend(c, tmp_path, "e1", src, namespace="beta", via="ingest")  # tenant A's token, B's namespace
        read_only = backend(c, tmp_path, "e1", src, token=EDGE_TOKEN, via="ingest")  # read *, no publish
        beta_reader = backend(c, tmp_path, "e2", host_pool("layer_first", page_size=PAGE), token=TENANT_B,
                              namespace="beta", via=None)
        try:
            assert await asyncio.to_thread(writer.batch_set, KEYS[:2], [src.get_data_page(4), src.get_data_page(8)])
            assert await asyncio.to_thread(writer.set, KEYS[2], src.get_data_page(16))
            got = await asyncio.to_thread(reader.batch_get, KEYS, [dst.get_dummy_flat_data_page() for _ in range(3)])
            assert all(g is not None for g in got)
            for at, flat in zip((0, 12, 20), got):
                dst.set_from_flat_data_page(at, flat)
            assert same_tokens(src, 4, dst, 0) and same_tokens(src, 8, dst, 12) and same_tokens(src, 16, dst, 20)
            # the record: stored and signed by the origin, saying from whose token and what engine
            records = c.open_records()
            try:
                rec = await records.get_object(writer._address(KEYS[0]))
            finally:
                await records.close()
            assert rec is not None and rec.namespace == "acme" and rec.kind == "kv"
            fp = "sha256:" + hashlib.sha256(TENANT_A.encode()).hexdigest()[:16]
            assert rec.origin == f"origin-1 ingest {fp}" and rec.engine.startswith("sglang ")
            Verifier.from_file(str(key) + ".pub").check(rec)
            # the same page again: kept (200); other bytes under a stored key: the stored page stays (409)
            assert await asyncio.to_thread(writer.batch_set_v1, KEYS[:1], indices(1)) == [True]
            assert await asyncio.to_thread(writer.batch_set_v1, KEYS[1:2], indices(5)) == [True]
            assert (writer.counts["stored"], writer.counts["stored_already"], writer.counts["store_conflict"]) == \
                (3, 1, 1)
            assert await asyncio.to_thread(reader.batch_get_v1, KEYS[1:2], indices(7)) == [True]
            assert same_tokens(src, 8, dst, 7 * PAGE)

            # refused by the origin: False from every write call, nothing raised, the pages stay misses
            fresh = ["ab" * 32, "cd" * 32]
            for b in (beta, read_only):
                assert await asyncio.to_thread(b.batch_set_v1, fresh, indices(3, 4)) == [False, False]
                assert not await asyncio.to_thread(b.batch_set, fresh, [src.get_data_page(12), src.get_data_page(0)])
                assert not await asyncio.to_thread(b.set, fresh[0], src.get_data_page(12))
                assert b.counts["store_refused"] == 5 and not b.counts["written"] and b.counts["write_errors"] == 5
            assert await asyncio.to_thread(reader.batch_exists, fresh) == 0
            assert await asyncio.to_thread(reader.batch_get_v1, fresh, indices(3, 4)) == [False, False]
            assert await asyncio.to_thread(beta_reader.batch_exists, fresh) == 0
            assert await asyncio.to_thread(beta_reader.batch_get_v1, fresh, indices(3, 4)) == [False, False]
            counted = c.origin.app[METRICS].get_sample_value
            assert counted("kdn_origin_ingested_total", {"outcome": "refused"}) == 10
            assert counted("kdn_origin_ingested_total", {"outcome": "stored"}) == 3
            # a backend with no way to write: SGLang's writes fail, counted
            assert await asyncio.to_thread(reader.batch_set_v1, fresh, indices(3, 4)) == [False, False]
            assert reader.counts["read_only"] == 2
        finally:
            for b in (writer, reader, beta, read_only, beta_reader):
                b.close()
