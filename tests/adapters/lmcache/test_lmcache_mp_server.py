"""LMCache's real MP server, its L2 the KDN adapter, against real KDN servers on loopback.

One LMCache instance (writing through edge e1's region, to the origin's ingest) stores chunks of a real model's
KV (the origin's tiny Llama, computed here); another LMCache instance, with an empty L1 and edge e2, finds them
in its L2 and loads them, bit-exact. Another tenant finds nothing; a prompt never stored is a miss. The origin
signs each record and the reader only takes chunks its key signed (``trusted_keys``).
"""

from __future__ import annotations

import asyncio
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "lib"))
sys.path.insert(0, os.path.dirname(__file__))

from lmcache_mp import CHUNK, Engine, MPServer  # noqa: E402
from edge_helpers import TENANT_A, TENANT_B, cluster  # noqa: E402

from kdn.origin.app import LOADED  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402
from kdn.service import METRICS  # noqa: E402

MODEL = "org/tiny-llama"


def real_kv(loaded, tokens: list[int]) -> torch.Tensor:
    """The model's own K/V of ``tokens`` as LMCache's engine-driven chunks hold them: ``[2, L, T, H*D]``."""
    with torch.no_grad():
        cache = loaded.model(torch.tensor([tokens]), use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    T = len(tokens)
    k = torch.stack([lk[0].transpose(0, 1).reshape(T, -1) for lk, _ in layers])
    v = torch.stack([lv[0].transpose(0, 1).reshape(T, -1) for _, lv in layers])
    return torch.stack([k, v]).contiguous()


def ingested(c, outcome: str) -> float:
    return c.origin.app[METRICS].get_sample_value("kdn_origin_ingested_total", {"outcome": outcome}) or 0.0


async def test_one_lmcache_stores_another_loads_through_another_edge(tmp_path, etcd_url):
    key = tmp_path / "origin.key"
    Signer.generate(str(key))
    async with cluster(tmp_path, etcd_url, edges=("e1", "e2"), origin_kw={"signing_key": str(key)}) as c:
        loaded = c.origin.app[LOADED]
        cfg = loaded.model.config
        heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        dtype = next(loaded.model.parameters()).dtype
        tokens = [(7 * i + 3) % 200 + 1 for i in range(3 * CHUNK)]
        kv = real_kv(loaded, tokens)
        assert kv.shape == (2, cfg.num_hidden_layers, 3 * CHUNK, heads * head_dim)

        def tok(name: str, token: str) -> str:
            (tmp_path / name).write_text(token + "\n")
            return str(tmp_path / name)

        common = {"namespace": "acme", "model_id": loaded.model_id, "timeout": 20,
                  "trusted_keys": str(key) + ".pub"}
        writer = MPServer(tmp_path, "writer", {**common, "edges": [c.edge_url("e1")], "ingest": c.origin_url(),
                                                "token_file": tok("a1", TENANT_A)})
        reader = MPServer(tmp_path, "reader", {**common, "edges": [c.edge_url("e2")],
                                                "token_file": tok("a2", TENANT_A)})
        other = MPServer(tmp_path, "other", {**common, "namespace": "beta", "edges": [c.edge_url("e2")],
                                              "token_file": tok("b", TENANT_B)})
        servers, engines = [writer, reader, other], []
        try:
            await asyncio.gather(*(s.start() for s in servers))
            shape = dict(model=MODEL, layers=cfg.num_hidden_layers, heads=heads, head_dim=head_dim, dtype=dtype)
            w, r, o = [await asyncio.to_thread(Engine, s.url, **shape) for s in servers]
            engines = [w, r, o]

            # the writer's engine stores 3 chunks; LMCache's store controller sends them on to its L2 (KDN)
            assert await asyncio.to_thread(w.store, kv, tokens)
            for _ in range(300):
                if ingested(c, "stored") >= 3:
                    break
                await asyncio.sleep(0.05)
            assert ingested(c, "stored") == 3 and ingested(c, "refused") == 0, writer.text()[-3000:]

            # the reader's L1 is empty: LMCache looks the chunks up in its L2, prefetches and hands them over
            got = await asyncio.to_thread(r.retrieve, tokens)
            assert got is not None, reader.text()[-3000:]
            assert got.dtype == kv.dtype and torch.equal(got, kv)  # bit-exact, every layer, K and V
            assert "(0 L1, 3 L2)" in reader.text()  # LMCache's own account: all three from its L2
            # a prefix of them: the first two chunks
            part = await asyncio.to_thread(r.retrieve, tokens[: 2 * CHUNK] + [5] * CHUNK)
            assert part is not None and torch.equal(part, kv[:, :, : 2 * CHUNK])

            # a prompt never stored: a miss, and LMCache says so
            assert await asyncio.to_thread(r.retrieve, [11] * (2 * CHUNK)) is None
            # another tenant, the same tokens: other addresses, nothing there
            assert await asyncio.to_thread(o.retrieve, tokens) is None
            assert "(0 L1, 3 L2)" not in other.text()
        finally:
            for e in engines:
                await asyncio.to_thread(e.close)
            await asyncio.gather(*(s.stop() for s in servers))
