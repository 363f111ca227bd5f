"""A hybrid model's recurrent state moves once: every loaded chunk but the last brings only its attention K/V
(verified range requests, ``kdn.client.parts.fetch_kept``), the last one whole (its conv/recurrent states are
the ones the cache keeps); on the transformers path (host and staged builders) and the vLLM worker's.

Real origin and edge on loopback (64 KiB pieces), two hybrid families in state-heavy random-init shapes (a
Bamba in bf16: its SSM states stay fp32, ahead of the bf16 K/V; a Qwen3-Next in fp32: names interleave): the
continuation is bit-identical to the model's own chunked prefill and to the whole-object path, and the bytes
moved shrink by at least the dead states less the pieces' rounding. A source that lies inside a range is
dropped for the next one; records without piece digests (an old origin, a source that answers no ranges) load
whole, as before.
"""

from __future__ import annotations

import math

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from edge_helpers import cluster, publish
from stand_in_edge import published, serve

from kdn.adapters.hf import CacheBuilder, build_cache, continue_from_cache, load_model, prefill
from kdn.adapters.hf.extract import layer_layout
from kdn.adapters.hf.generate import agenerate, decode_loop
from kdn.client import KDNClient
from kdn.client.parts import part_view, piece_runs
from kdn.errors import TensorMismatch
from kdn.format.objects import ObjectView, encode_object, from_torch, to_torch
from kdn.format.pieces import Pieces
from kdn.wire.bodyget import Tally

PIECE = 64 << 10
DOC = ("The keeper's log for the night of the storm records wind from the north-east, "
       "two ships sighted, and the lamp relit twice after the glass cracked. ") * 12


def heavy_config(family: str):
    """A hybrid whose states outweigh a chunk's K/V many times over (as Qwen3.5-A3B's do: ~62 MiB of states
    against ~5 MiB of K/V per 256-token chunk), small enough for the CPU."""
    import transformers as T

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "bamba":  # 4 Mamba2 layers (SSM [8, 16, 256] fp32 each) around one attention layer
        return T.BambaConfig(**common, num_hidden_layers=5, num_key_value_heads=2, attn_layer_indices=[2],
                             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=256, mamba_n_groups=1,
                             mamba_chunk_size=32)
    return T.Qwen3NextConfig(  # 3 gated-delta-net layers (state [8, 64, 64]) and one attention layer
        **common, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


FAMILIES = {"bamba": torch.bfloat16, "qwen3next": torch.float32}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for family, dtype in FAMILIES.items():
        folder = tmp_path_factory.mktemp(f"heavy-{family}")
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(heavy_config(family), dtype=torch.float32).to(dtype).save_pretrained(folder)
        out[family] = str(folder)
    return out


def state_bytes(model) -> int:
    return sum(math.prod(st.shape) * torch.empty(0, dtype=st.dtype).element_size()
               for spec in layer_layout(model) for st in spec.states)


def test_piece_runs_skip_what_is_held_and_join_only_what_touches():
    pb = 100
    assert piece_runs([(250, 420), (40, 60)], pb) == [(0, 1), (2, 5)]
    assert piece_runs([(250, 420), (40, 60)], pb, held=1) == [(2, 5)]
    assert piece_runs([(100, 200), (200, 350), (500, 510)], pb) == [(1, 4), (5, 6)]  # a gap stays a gap
    assert piece_runs([(10, 90), (0, 0)], pb, held=1) == []


def test_a_part_view_decodes_only_what_arrived():
    lm = load_model("tiny-bamba")
    ids = torch.arange(40) % 300
    with torch.inference_mode():
        (chunk,) = list(prefill_chunks(lm.model, ids))
    blob = encode_object(kind=chunk.kind, address="ab" * 32, model_id="cd" * 32, namespace="public", start=0,
                         end=40, position=0, parent=None, tensors=from_torch(chunk.tensors), encoding="raw")
    view = part_view(memoryview(blob), {"L1.k", "L1.v"})
    assert bytes(view.decode(["L1.k"])["L1.k"].data) == bytes(ObjectView(blob).decode(["L1.k"])["L1.k"].data)
    with pytest.raises(TensorMismatch, match="L0.ssm"):
        view.decode(["L0.ssm"])
    with pytest.raises(TensorMismatch):
        view.decode()  # all of it: the states never arrived
    with pytest.raises(TensorMismatch):
        view.decode_into("L2.conv", None)


def prefill_chunks(model, ids):
    from kdn.adapters.hf import extract_chunks

    return extract_chunks(model, ids, chunk_tokens=256)


async def whole_path(lm, client, ids: list[int], n: int, new: int):
    """Today's path, for comparison: every object fetched whole and decoded, the cache built from them."""
    hit = await client.lookup(ids, lm.model_id)
    tally = Tally()
    states = await client.fetch_prefix(hit.head(hit.chunks), tally=tally)
    assert states.lookup.tokens == n
    cache, got = build_cache(lm.model, [to_torch(o.tensors) for o in states.objects])
    assert got == n
    logits = continue_from_cache(lm.model, cache, n, ids[n:], last=1)[-1].float()
    with torch.inference_mode():
        out = decode_loop(lm.model, cache, int(torch.argmax(logits)), len(ids), new, None)
    return logits, out, tally.bytes


async def staged_path(lm, client, ids: list[int], n: int):
    """The device path's builder (``staged``: each chunk's K/V region copied, then placed), run on the CPU, fed
    the narrowed fetch: the next logits after it."""
    hit = await client.lookup(ids, lm.model_id)
    builder = CacheBuilder(lm.model, hit.token_counts(), staged=True)
    await client.fetch_prefix(hit, into=builder.add, scatter=builder, needs=builder.needs)
    cache, got = builder.finish(device="cpu")
    assert got == n
    return continue_from_cache(lm.model, cache, n, ids[n:], last=1)[-1].float()


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_hybrid_load_moves_its_states_once_and_continues_bit_identically(tmp_path, etcd_url, folders,
                                                                                  family):
    folder = folders[family]
    lm = load_model(folder)
    async with cluster(tmp_path, etcd_url, edges=("e1",), model=folder, origin_kw={"piece_bytes": PIECE}) as c:
        m = await publish(c, DOC[:1100], encodings=["raw"])
        ids = m["prefix_tokens"] + lm.tokenizer.encode(" What did the keeper record?")
        async with KDNClient(edges=[("e1", c.edge_url("e1"))]) as client:
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4, plan=False)
            r = gen.report
            assert (r.tokens_reused, r.chunks_reused) == (1100, 5), r.line()
            sizes = [rec.encodings["raw"].size for rec in
                     (await client.lookup(ids, lm.model_id)).records]
            assert all(rec_pieces > 1 for rec_pieces in (math.ceil(s / PIECE) for s in sizes))
            logits, out, whole = await whole_path(lm, client, ids, 1100, 4)
            staged = await staged_path(lm, client, ids, 1100)
    # Exact: as the model's own chunked prefill, and as the whole-object path, to the last generated token.
    cache = prefill(lm.model, ids[:1100], chunk_tokens=256)
    ref = continue_from_cache(lm.model, cache, 1100, ids[1100:], last=1)[-1].float()
    assert torch.equal(gen.first_logits, ref) and torch.equal(gen.first_logits, logits)
    assert torch.equal(gen.first_logits, staged)
    assert gen.ids == out
    # Moved: the whole path moved every object; this one all but the last without its states, less at most
    # three pieces each (the header's, and one at each end of the K/V's run).
    assert whole == sum(sizes)
    dead = state_bytes(lm.model)
    assert r.bytes_moved <= whole - 4 * (dead - 3 * PIECE), (r.bytes_moved, whole, dead)
    assert whole - r.bytes_moved >= 4 * dead // 2  # at least half the dead weight is gone at this piece size


async def liar(upstream: str) -> TestServer:
    """An edge that flips one byte of every ranged body it passes on (and passes everything else)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, upstream + str(request.rel_url), headers=request.headers,
                                 data=await request.read()) as r:
                body, status, headers = bytearray(await r.read()), r.status, r.headers
        if status == 206:
            body[len(body) // 2] ^= 1
        keep = ("content-range", "content-type", "x-kdn-encoding", "x-kdn-source")
        return web.Response(status=status, body=bytes(body), headers={k: v for k, v in headers.items()
                                                                       if k.lower() in keep})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_a_source_that_lies_inside_a_range_is_dropped_and_the_load_stays_exact(tmp_path, etcd_url, folders):
    folder = folders["bamba"]
    lm = load_model(folder)
    async with cluster(tmp_path, etcd_url, edges=("e1",), model=folder, origin_kw={"piece_bytes": PIECE}) as c:
        m = await publish(c, DOC[:1100], encodings=["raw"])
        ids = m["prefix_tokens"] + lm.tokenizer.encode(" And the glass?")
        fake = await liar(c.edge_url("e1"))
        try:
            async with KDNClient(edges=[str(fake.make_url("")).rstrip("/")], origin=c.origin_url(),
                                 max_hedges=0) as client:
                gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1, plan=False)
                assert client.failovers >= 1  # every lying range refused, the origin's verified
        finally:
            await fake.close()
    assert gen.report.tokens_reused == 1100, gen.report.line()
    ref = continue_from_cache(lm.model, prefill(lm.model, ids[:1100], chunk_tokens=256), 1100, ids[1100:],
                              last=1)[-1].float()
    assert torch.equal(gen.first_logits, ref)


async def test_records_without_piece_digests_load_whole(tmp_path):
    """An old record (no piece digests) from a source that answers no ranges: every object whole, exact."""
    lm = load_model("tiny-bamba")
    ids = [3 + i % 400 for i in range(600)]
    addrs, blobs, records = published(lm.model, lm.model_id, ids[:512], 256)
    server = await serve(addrs, blobs, records)
    try:
        async with KDNClient(edges=[str(server.make_url("")).rstrip("/")]) as client:
            gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1, plan=False)
    finally:
        server.release.set()
        await server.close()
    assert gen.report.tokens_reused == 512 and gen.report.bytes_moved == sum(len(b) for b in blobs.values())
    ref = continue_from_cache(lm.model, prefill(lm.model, ids[:512], chunk_tokens=256), 512, ids[512:],
                              last=1)[-1].float()
    assert torch.equal(gen.first_logits, ref)


class _StateModule:
    """What ``ChunkLoader.max_decoded`` reads of a vLLM state layer: its cache tensors (a batch dim first)."""

    def __init__(self, shapes) -> None:
        self.kv_cache = [torch.empty(1, *s) for s in shapes]


async def test_vllm_chunks_of_a_hybrid_load_move_their_kv_only_and_the_last_whole(tmp_path, etcd_url, folders):
    """The vLLM worker's chunk loader (``ChunkLoader``, no engine needed): the same K/V and last states staged
    as from whole objects, fewer bytes."""
    pytest.importorskip("vllm")
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from kdn.adapters.vllm.fetching import AttnLayer, ChunkLoader, StateLayer
    from kdn.adapters.vllm.meta import LoadJob
    from kdn.adapters.vllm.plan import LoadPlan
    from kdn.chunk import Chunk
    from kdn.adapters.vllm.stage import Staging
    from kdn.wire.arena import Arena

    lm = load_model(folders["bamba"])
    layout = layer_layout(lm.model)
    attn = [AttnLayer(f"attn{s.index}", s.index, None, *s.kv) for s in layout if s.kv]
    states = [StateLayer(f"mamba{s.index}", s.index, 0, _StateModule([st.shape for st in s.states]))
              for s in layout if s.states]
    kv_dtype = next(s.kv_dtype for s in layout if s.kv)
    async with cluster(tmp_path, etcd_url, edges=("e1",), model=folders["bamba"],
                       origin_kw={"piece_bytes": PIECE}) as c:
        m = await publish(c, DOC[:1100], encodings=["raw"])
        async with KDNClient(edges=[("e1", c.edge_url("e1"))]) as client:
            hit = await client.lookup(m["prefix_tokens"], lm.model_id)
            chunks = tuple(Chunk(a, 256 * i, 256 * (i + 1), "raw", rec.encodings["raw"].digest,
                                 rec.encodings["raw"].size,
                                 pieces=Pieces(rec.encodings["raw"].piece_bytes, rec.encodings["raw"].pieces))
                           for i, (a, rec) in enumerate(zip(hit.addresses[:4], hit.records)))
            job = LoadJob("r1", LoadPlan(0, 1024, chunks), ([],), background=False, host=False)
            run = SimpleNamespace(staging=Staging(Arena(64 << 20), [(a.kv_heads, a.head_dim) for a in attn], 0, 1024,
                                                  kv_dtype),
                                  tally=Tally(), job=job)
            loader = ChunkLoader(client=client, model_id=lm.model_id, namespace="public",
                                 stager=ThreadPoolExecutor(2), attn={a.name: a for a in attn}, order=attn,
                                 states=states)
            staged = [await loader.fetch_and_stage(run, i, p) for i, p in enumerate(chunks)]
            last = ObjectView((await client.fetch(chunks[-1].address, encoding="raw")).blob)
    ref = prefill(lm.model, m["prefix_tokens"][:1024], chunk_tokens=256)
    for j, a in enumerate(attn):
        k, v = run.staging.kv(j)  # [n, H, D]
        assert torch.equal(k, ref.layers[a.index].keys[0].transpose(0, 1))
        assert torch.equal(v, ref.layers[a.index].values[0].transpose(0, 1))
    want = to_torch(last.decode(sorted(staged[-1].states)))
    assert set(want) == {f"L{s.index}.{x}" for s in states for x in ("conv", "ssm")}
    assert all(torch.equal(staged[-1].states[n], want[n]) for n in want)
    assert not any(s.states for s in staged[:-1])
    whole, dead = sum(p.size for p in chunks), state_bytes(lm.model)
    assert run.tally.bytes == sum(s.nbytes for s in staged) <= whole - 3 * (dead - 3 * PIECE)


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_hybrid_loads_from_the_host_tier_bit_identically(tmp_path, etcd_url, folders, family):
    """#53: a hybrid's chunks read from the machine's host tier (``kdn host serve`` in-process, filled from the
    edge, signed records verified once) continue exactly as the model's own chunked prefill: every chunk from
    the mapping, its K/V into the cache, the last one's conv/recurrent states kept (copied out of the mapping)."""
    import secrets
    import tempfile

    from kdn.client.host import HostClient
    from kdn.host.config import HostConfig
    from kdn.host.tier import HostTier
    from kdn.registry.signing import Signer

    folder = folders[family]
    lm = load_model(folder)
    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    short = tempfile.mkdtemp(prefix="kh-", dir="/tmp")  # (a socket path has at most 107 bytes)
    async with cluster(tmp_path, etcd_url, edges=("e1",), model=folder,
                       origin_kw={"piece_bytes": PIECE, "signing_key": str(tmp_path / "origin.key")}) as c:
        m = await publish(c, DOC[:1100], encodings=["raw"])
        ids = m["prefix_tokens"] + lm.tokenizer.encode(" What did the keeper record?")
        cfg = HostConfig(trusted_keys=str(tmp_path / "trusted"), edges=(c.edge_url("e1"),),
                         socket=f"{short}/h.sock", segment=f"/dev/shm/kdn-test-{secrets.token_hex(4)}.seg",
                         segment_bytes=64 << 20)
        tier = await HostTier.start(cfg)
        try:
            async with HostClient(cfg.socket) as host:
                assert set(await host.warm(m["addresses"], "raw")) == {"filled"}
                async with KDNClient(edges=[c.edge_url("e1")], host=host) as client:
                    gen = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=4, plan=False)
        finally:
            await tier.close()
    r = gen.report
    assert set(r.sources) == {"host"} and (r.tokens_reused, r.chunks_reused) == (1100, 5), r.line()
    cache = prefill(lm.model, ids[:1100], chunk_tokens=256)
    ref = continue_from_cache(lm.model, cache, 1100, ids[1100:], last=1)[-1].float()
    assert torch.equal(gen.first_logits, ref)


async def test_vllm_hybrid_chunks_from_the_host_tier_are_read_in_place_and_the_last_keeps_its_states(
        tmp_path, etcd_url, folders):
    """The vLLM worker's chunk loader from the host tier (``ChunkLoader(in_place=True)``, as on the CPU): the load's
    chunks leased in one round trip, every one but the last read in place (its K/V as views of the mapping, the
    leases kept by the load until it ends), the last staged with its states; all of it equal to the model's own
    chunked prefill."""
    pytest.importorskip("vllm")
    import contextlib
    import secrets
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from kdn.adapters.vllm.fetching import AttnLayer, ChunkLoader, Holds, StateLayer
    from kdn.adapters.vllm.meta import LoadJob
    from kdn.adapters.vllm.plan import LoadPlan
    from kdn.chunk import Chunk
    from kdn.adapters.vllm.stage import Staging
    from kdn.client.host import HostClient
    from kdn.host.config import HostConfig
    from kdn.host.tier import HostTier
    from kdn.registry.signing import Signer
    from kdn.wire.arena import Arena

    lm = load_model(folders["bamba"])
    layout = layer_layout(lm.model)
    attn = [AttnLayer(f"attn{s.index}", s.index, None, *s.kv) for s in layout if s.kv]
    states = [StateLayer(f"mamba{s.index}", s.index, 0, _StateModule([st.shape for st in s.states]))
              for s in layout if s.states]
    kv_dtype = next(s.kv_dtype for s in layout if s.kv)
    key = Signer.generate(tmp_path / "origin.key")
    (tmp_path / "trusted").write_text(key.public + "\n")
    short = tempfile.mkdtemp(prefix="kh-", dir="/tmp")
    async with contextlib.AsyncExitStack() as stack:
        c = await stack.enter_async_context(cluster(tmp_path, etcd_url, edges=("e1",), model=folders["bamba"],
                                                    origin_kw={"piece_bytes": PIECE,
                                                               "signing_key": str(tmp_path / "origin.key")}))
        m = await publish(c, DOC[:1100], encodings=["raw"])
        cfg = HostConfig(trusted_keys=str(tmp_path / "trusted"), edges=(c.edge_url("e1"),),
                         socket=f"{short}/h.sock", segment=f"/dev/shm/kdn-test-{secrets.token_hex(4)}.seg",
                         segment_bytes=64 << 20)
        tier = await HostTier.start(cfg)
        stack.push_async_callback(tier.close)
        host = await stack.enter_async_context(HostClient(cfg.socket))
        client = await stack.enter_async_context(KDNClient(edges=[c.edge_url("e1")], host=host))
        hit = await client.lookup(m["prefix_tokens"], lm.model_id)
        assert set(await host.warm(hit.addresses[:4], "raw")) == {"filled"}
        chunks = tuple(Chunk(a, 256 * i, 256 * (i + 1), "raw", rec.encodings["raw"].digest,
                             rec.encodings["raw"].size, host=True)
                       for i, (a, rec) in enumerate(zip(hit.addresses[:4], hit.records)))
        job = LoadJob("r1", LoadPlan(0, 1024, chunks), ([],), background=True, host=True)
        arena = Arena(64 << 20)
        run = SimpleNamespace(staging=Staging(arena, [(a.kv_heads, a.head_dim) for a in attn], 0, 1024, kv_dtype,
                                              lazy=True), tally=Tally(), job=job, holds=Holds())
        loader = ChunkLoader(client=client, model_id=lm.model_id, namespace="public", stager=ThreadPoolExecutor(2),
                             attn={a.name: a for a in attn}, order=attn, states=states, in_place=True)
        staged = [await loader.fetch_and_stage(run, i, p) for i, p in enumerate(chunks)]
        assert [s.kv is not None for s in staged] == [True, True, True, False]
        # the four chunks leased in one round trip, kept by the load as one batch until it ends
        assert len(run.holds) == 1 and (await host.stats())["leases"] == 4
        assert client.host_stats.hits == 4 and run.tally.bytes == 0  # nothing over the socket's HTTP
        ref = prefill(lm.model, m["prefix_tokens"][:1024], chunk_tokens=256)
        for j, a in enumerate(attn):
            want_k, want_v = (t[0].transpose(0, 1) for t in (ref.layers[a.index].keys, ref.layers[a.index].values))
            for i, s in enumerate(staged[:3]):
                assert torch.equal(s.kv[j][0], want_k[256 * i:256 * (i + 1)])
                assert torch.equal(s.kv[j][1], want_v[256 * i:256 * (i + 1)])
            k, v = run.staging.kv(j, 1024, 768)
            assert torch.equal(k, want_k[768:]) and torch.equal(v, want_v[768:])
        assert set(staged[-1].states) == {f"L{s.index}.{x}" for s in states for x in ("conv", "ssm")}
        for lease in run.holds.close():  # the load ends: its leases go back
            await lease.aclose()
        assert (await host.stats())["leases"] == 0
        run.staging.release()
        assert arena.in_use == 0
