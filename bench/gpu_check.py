"""GPU checks, for a machine with CUDA: exact reuse with states loaded onto the GPU, time to first token on
the GPU against the lean prefill (from host memory, an edge, and the machine's host tier), the copy stream's
overlap with the forward, and host-to-device copy throughput. One short script, so a lent GPU is spent on
one run; ``--smoke`` first (about a minute), then the table.

    python -P bench/gpu_check.py --smoke [--device cuda]          # one small shape, one length: under a minute
    python -P bench/gpu_check.py [--device cuda] [--shapes qwen2-0.5b-shape,llama3-8b-shape]
                                 [--lengths 2048,8192,32768] [--repeat 3] [--results out.json]
    python -P bench/gpu_check.py --device cpu --quick      # the dry run the tests make (tiny shapes)
    python -P bench/gpu_check.py --device cpu --smoke      # the smoke mode's dry run (--quick's sizes)

On a lent machine, keep what a cut-off run measured: every row is printed and written to ``--json`` as it
is measured (the file is rewritten after each row), the tables and headline at the end (``--results``):

    python -P bench/gpu_check.py --smoke --json $OUT/smoke.json --results $OUT/smoke-results.json 2>&1 | tee $OUT/smoke.txt
    python -P bench/gpu_check.py --json $OUT/raw.json --results $OUT/gpu_check.json 2>&1 | tee $OUT/log.txt

1. **Exactness on the device.** For each tiny family (attention and hybrids) in fp32 and bf16, on the
   device: compute the chunk states (``extract_chunks``), write them as KDN objects (zstd and raw),
   load them with the engine's loader (``CacheBuilder`` onto the device) and continue; the logits must
   equal, bit for bit, those of the device's own chunked prefill.
2. **TTFT on the device**, random-init bf16 models of a real shape (Qwen2-0.5B: 24 layers, 2 KV heads
   x 64; Llama-3-8B: 32 layers, 8 KV heads x 128), a 16-token suffix:
   - ``prefill-lean``: the one-shot prefill (``logits_to_keep=1``, what an engine runs);
   - ``host-raw`` / ``host-zstd``: the context's KDN objects already in host memory (fetched and
     verified: what a client holds), in page-locked arena buffers; ``CacheBuilder`` onto the device, each
     chunk added as it would arrive (one host-to-device copy of its region on the copy stream and one
     device copy placing every layer, waited for before the next; zstd decoded on the host first), then
     the suffix;
   - ``host-held`` / ``host-serial``: the same raw objects added ``held`` (the bytes stay in host memory
     until the device has read them), so ``finish`` copies them layer after layer, an event per layer, and
     the suffix's forward waits for each decoder layer's copies just before that layer runs: on the
     device's copy stream (``held``: layer ``j`` computed while later layers cross), or every copy on the
     compute stream (``serial``: the forward starts after the last copy). Their ``h2d_gbps`` is the copies
     alone (bytes / time from issue to the last one done), their TTFT the overlap's worth; their
     ``vllm_h2d_gbps`` the vLLM connector's path the same two ways, without the engine (none on the lent
     GPU): the load's staging crossing layer by layer (``stage.Upload``), each layer reordered on the
     compute stream as ``wait_for_layer_load`` does before its cache write;
   - ``edge-raw``: the same objects through a real edge process on loopback (an origin serves them
     from its store; the edge's memory tier is warmed first): ``KDNClient.fetch_prefix`` into the
     device's ``CacheBuilder``, fetch and verification included;
   - ``tier-raw`` / ``tier-held``: from the machine's host tier (``kdn host serve`` beside the edge, a
     process of its own; its segment filled from the edge before timing, and mapped read-only here,
     page-locked with ``kdn.kernels.pinned.register_mapping`` where the driver allows): ``tier-raw``
     through ``KDNClient(host=...).fetch_prefix`` (a lease per object, each chunk copied while leased);
     ``tier-held`` leases every object, adds it ``held``, and lets the leases go once the device has
     read them (the copy stream's overlap, straight out of the mapping);
   - ``planner``: what ``kdn.planner`` picks for the edge path from this run's measured speeds (the
     lean prefill timed here, the edge path's bytes/s), and its time: the chosen path's. It is fed this
     run's own medians, so it shows the choice given exact speeds (whether the planner's model picks the
     faster path), not how well an engine's live estimates forecast them (``bench/vllm_plan.py`` does).
   The table gives each path's median (min-max), its speed against the lean prefill, the effective
   host-to-device GB/s of ``host-raw`` (copied bytes / time in the copies), and the planner's choice.
3. **Host-to-device copy** of pageable and pinned buffers, 64 MiB to 1 GiB: the bound.

``--smoke``: the Qwen2-0.5B shape at 2,048 tokens, two repeats, two attention families' exactness, copies of
64 and 256 MiB, no edge and no host tier (no server processes to start): that the device paths run, before
the full table spends the lent minutes. With ``--device cpu`` it takes ``--quick``'s sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kdn.format import address as A
from kdn.adapters.hf import CacheBuilder, build_cache, continue_from_cache, extract_chunks, load_model, prefill
from kdn.format.objects import ObjectView, decode_object, encode_object, from_torch, to_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as R  # noqa: E402

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-bamba", "tiny-falconh1", "tiny-zamba2", "tiny-granitemoehybrid",
            "tiny-qwen3next"]
ADDR = "ab" * 32
MID = "cd" * 32
CHUNK = 256
H2D_MIB = (64, 256, 1024)


class Sink:
    """Every row printed and kept as it is measured; with ``--json`` the file is rewritten after each row, so a
    run cut off by the lent machine's time keeps every row it measured."""

    def __init__(self, path: str, out: dict) -> None:
        self.path, self.out = path, out

    def __call__(self, section: str, row: dict) -> None:
        self.out.setdefault(section, []).append(row)
        print(json.dumps(row), flush=True)
        self.flush()

    def flush(self) -> None:
        if self.path:
            tmp = Path(self.path + ".tmp")
            tmp.write_text(json.dumps(self.out, indent=1))
            tmp.replace(self.path)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def blobs_of(chunks, encoding: str, addresses: list[str] | None = None) -> list[bytes]:
    out = []
    for c in chunks:
        tensors = from_torch({k: v.detach().to("cpu") for k, v in c.tensors.items()})
        a = addresses[c.index] if addresses else ADDR
        out.append(encode_object(kind=c.kind, address=a, model_id=MID, namespace="public", start=c.start,
                                 end=c.end, position=c.start, parent=None, tensors=tensors, encoding=encoding))
    return out


def exactness(device: str, emit: Callable[[str, dict], None], chunk: int = 32, families=FAMILIES) -> None:
    n = chunk * 3 + chunk // 2
    for spec in families:
        for dtype in (torch.float32, torch.bfloat16):
            t0 = time.perf_counter()
            try:
                model = load_model(spec, dtype=dtype).model.to(device)
                ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(1)).to(device)
                chunks = list(extract_chunks(model, ids, chunk_tokens=chunk))
                k = 3
                own = continue_from_cache(model, prefill(model, ids[:k * chunk], chunk_tokens=chunk), k * chunk,
                                          ids[k * chunk:])
                for encoding in ("zstd", "raw"):
                    blobs = blobs_of(chunks[:k], encoding)
                    # the engine's loader onto the device (one copy per chunk, then placed there)
                    builder = CacheBuilder(model, [c.end - c.start for c in chunks[:k]], device=device,
                                           staged=True)
                    for i, b in enumerate(blobs):
                        builder.add(i, ObjectView(bytearray(b)))
                    cache, n_cached = builder.finish()
                    got = continue_from_cache(model, cache, n_cached, ids[k * chunk:])
                    # held: copied by finish, layer after layer, each layer's forward waiting for its copies
                    views = [ObjectView(bytearray(b)) for b in blobs]
                    builder = CacheBuilder(model, [c.end - c.start for c in chunks[:k]], device=device,
                                           staged=True)
                    for i, v in enumerate(views):
                        builder.add(i, v, held=True)
                    cache, n_cached = builder.finish()
                    held = continue_from_cache(model, cache, n_cached, ids[k * chunk:])
                    builder.copied(wait=True)
                    # and the plain way, decoded on the host, for comparison
                    plain, _ = build_cache(model, [to_torch(decode_object(b), device=device) for b in blobs])
                    also = continue_from_cache(model, plain, n_cached, ids[k * chunk:])
                    same = all(bool(torch.equal(x, own)) for x in (got, held, also))
                    emit("exactness", {"model": spec, "dtype": str(dtype).split(".")[-1], "encoding": encoding,
                                       "bit_identical": same,
                                       "max_abs_diff": max(float((x.float() - own.float()).abs().max())
                                                           for x in (got, held)),
                                       "seconds": round(time.perf_counter() - t0, 2)})
            except Exception as e:  # noqa: BLE001 - report and go on: one family must not hide the others
                emit("exactness", {"model": spec, "dtype": str(dtype), "error": f"{type(e).__name__}: {str(e)[:300]}"})


def shaped_model(shape: str, device: str):
    """A random-init bf16 model of a real model's shape (the weights do not matter for timing)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if shape == "qwen2-0.5b-shape":  # 24 layers, 2 KV heads x 64: 12 KiB of KV per token
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)
    elif shape == "llama3-8b-shape":  # 32 layers, 8 KV heads x 128: 128 KiB of KV per token
        cls, cfg = LlamaForCausalLM, LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=40960, rope_theta=500000.0)
    elif shape == "tiny-shape":  # the CPU dry run: 2 layers, 2 KV heads x 64
        cls, cfg = LlamaForCausalLM, LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    return model


class EdgeWorld:
    """An origin serving the objects from its store and one edge in front of it, as processes on loopback; and,
    with ``tier``, the machine's host tier beside the edge (``kdn host serve``, filling from it)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        self.url = ""

    async def start(self, objects: dict[str, dict[str, bytes]], *, mem_budget: int) -> str:
        import aiohttp

        import ttft as T  # server processes and their health checks
        from kdn.origin.store import ObjectStore
        from kdn.registry import Encoding, ObjectRecord, open_registry
        from kdn.registry.signing import Signer

        registry = f"file:{self.tmp / 'registry.sqlite3'}"
        store = ObjectStore(self.tmp / "store", fsync=False)
        # Signed: a host tier holds only what a key it trusts signed (the origin's, as it publishes).
        signer = Signer.generate(self.tmp / "origin.key")
        (self.tmp / "trusted").write_text(signer.public + "\n")
        records = []
        for a, encs in objects.items():
            infos = {e: store.put(a, e, b) for e, b in encs.items()}
            h = ObjectView(next(iter(encs.values()))).header
            records.append(signer.sign(ObjectRecord(
                address=a, model_id=h.model_id, namespace="public", kind=h.kind, start=h.start, end=h.end,
                parent=None, standalone=False, origin="gpu-check",
                encodings={e: Encoding(e, i.size, i.digest) for e, i in infos.items()})))
        async with open_registry(registry) as reg:
            await reg.put_objects(records)
        (self.tmp / "tokens").write_text(T.PUBLISH_TOKEN + " admin *\n")
        origin = T.start("origin", "origin", dict(model="tiny-llama", registry=registry, store=str(self.tmp / "store"),
                                                  host="127.0.0.1", port=T.free_port(), token_file=str(self.tmp / "tokens"),
                                                  node_id="origin-1", fsync=False), self.tmp)
        self.procs.append(origin)
        edge = T.start("edge", "edge", dict(region="eu", registry=registry, origin=origin.url, mem_budget=mem_budget,
                                            host="127.0.0.1", port=T.free_port(), node_id="edge-1", prefetch=0,
                                            lease_ttl=10.0, fsync=False), self.tmp)
        self.procs.append(edge)
        async with aiohttp.ClientSession() as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-1" in (b.get("ring") or []))
        self.url = edge.url
        return edge.url

    async def start_tier(self, segment_bytes: int):
        """``kdn host serve`` beside the edge (as ``bench/datapath.py``'s ``start_host``, with a segment sized for
        this run), and a ``HostClient`` connected to it."""
        import ttft as T
        from datapath import connect_host

        log = self.tmp / "host.log"
        seg = f"/dev/shm/kdn-gpu-check-{os.getpid()}.seg"
        argv = [sys.executable, "-P", "-m", "kdn.cli", "host", "serve", "--edge", self.url, "--trusted-keys",
                str(self.tmp / "trusted"), "--socket", str(self.tmp / "host.sock"), "--segment", seg,
                "--segment-bytes", str(segment_bytes)]
        with open(log, "wb") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=str(self.tmp))
        self.procs.append(T.Proc("host", "unix:" + str(self.tmp / "host.sock"), p, log))
        return await connect_host(self.procs[-1], str(self.tmp / "host.sock"))

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []


class Paths:
    """One shape at one length: the context's objects, the model, and each path a request can take (a
    function running it to its first token's logits), timed side by side by ``ttft``."""

    def __init__(self, model, device: str, length: int, suffix: int, arena) -> None:
        self.model, self.device, self.length, self.suffix, self.arena = model, device, length, suffix, arena
        vocab = model.config.vocab_size
        self.ids = torch.randint(0, vocab, (length + suffix,),
                                 generator=torch.Generator().manual_seed(length)).to(device)
        self.tokens = [int(t) for t in self.ids[:length].tolist()]
        self.addrs = A.prefix_addresses(MID, "public", self.tokens, CHUNK)
        with torch.inference_mode():
            chunks = list(extract_chunks(model, self.ids[:length], chunk_tokens=CHUNK))
        self.blobs = {enc: blobs_of(chunks, enc, self.addrs) for enc in ("raw", "zstd")}
        self.counts = [c.end - c.start for c in chunks]
        del chunks
        # what a client holds after fetching and verifying: the bodies in page-locked arena buffers
        self.held = {}
        for enc, bs in self.blobs.items():
            self.held[enc] = []
            for b in bs:
                lease = arena.take(len(b))
                lease.view[:] = b
                self.held[enc].append(lease)
        self.copies = {"bytes": 0, "seconds": 0.0, "calls": 0, "chunks": 0}  # host-raw's copies onto and on the device
        self._staging = None  # vLLM's staging of the whole load (``stage_rate``)

    def close(self) -> None:
        for leases in self.held.values():
            for lease in leases:
                lease.release()
        if self._staging is not None:
            from kdn.adapters.vllm import stage

            self._staging.release()
            stage.reap(wait=True)

    def suffix_forward(self, cache, n_cached):
        with torch.inference_mode():
            return self.model(input_ids=self.ids[None, n_cached:], past_key_values=cache, logits_to_keep=1,
                              position_ids=torch.arange(n_cached, self.length + self.suffix,
                                                        device=self.device)[None]).logits

    def lean(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(input_ids=self.ids[None], logits_to_keep=1).logits

    def builder(self, counts=None, **kw) -> CacheBuilder:
        # room: the suffix is written after the prefix in place, not concatenated onto it
        return CacheBuilder(self.model, counts or self.counts, device=self.device, arena=self.arena, staged=True,
                            room=self.suffix, **kw)

    def host(self, encoding: str) -> torch.Tensor:
        """Each chunk added as it would arrive: copied onto the device, waited for, then the next."""
        builder = self.builder()
        for i, lease in enumerate(self.held[encoding]):
            builder.add(i, ObjectView(lease.view))
        cache, n_cached = builder.finish()
        if encoding == "raw":
            self.copies["bytes"] += builder.h2d_bytes
            self.copies["seconds"] += builder.h2d_seconds
            self.copies["calls"] += builder.device_copies
            self.copies["chunks"] += len(self.counts)
        return self.suffix_forward(cache, n_cached)

    def held_load(self, serial: bool, forward: bool = True) -> torch.Tensor | None:
        """The raw chunks added held: ``finish`` copies them layer after layer, on the copy stream (the forward
        waits per layer), or with ``serial`` every copy on the compute stream; without ``forward``, only the
        copies, waited for (the copy rate)."""
        from kdn.kernels.pinned import Inline

        builder = self.builder(copies=Inline(torch.device(self.device)) if serial else None)
        for i, lease in enumerate(self.held["raw"]):
            builder.add(i, ObjectView(lease.view), held=True)
        cache, n_cached = builder.finish()
        out = self.suffix_forward(cache, n_cached) if forward else None
        builder.copied(wait=True)  # the host bytes are free again (a lease could end here)
        return out

    def copy_rate(self, serial: bool, repeat: int) -> float:
        """GB/s of the held copies alone: bytes / time from ``finish`` issuing them to the last one done."""
        ts = []
        for _ in range(repeat):
            sync(self.device)
            t0 = time.perf_counter()
            self.held_load(serial, forward=False)
            sync(self.device)
            ts.append(time.perf_counter() - t0)
        return sum(map(len, self.blobs["raw"])) / statistics.median(ts) / 1e9


    def stage_rate(self, serial: bool, repeat: int) -> float:
        """GB/s of the vLLM connector's path onto the device, without the engine (no vLLM on the lent GPU): the
        load's staging (filled once from the raw objects) crossing as ``stage.Upload`` sends it, each layer then
        reordered on the compute stream as ``wait_for_layer_load`` does before its cache write. On the copy
        stream the reorder of layer j overlaps the copy of layer j + 1; ``serial``: all on the compute stream."""
        from kdn.adapters.hf.extract import layer_layout
        from kdn.adapters.vllm.stage import AHEAD_BYTES, Staging, Upload
        from kdn.kernels.pinned import Inline, copy_stream

        layout = [sp for sp in layer_layout(self.model) if sp.kv]
        if self._staging is None:
            st = Staging(self.arena, [sp.kv for sp in layout], 0, self.length, layout[0].kv_dtype)
            start = 0
            for lease, n in zip(self.held["raw"], self.counts):
                view = ObjectView(lease.view)
                for j, sp in enumerate(layout):
                    st.put(j, view, (f"L{sp.index}.k", f"L{sp.index}.v"), start, start + n, start)
                start += n
            self._staging = st
        device = torch.device(self.device)
        copies = Inline(device) if serial else copy_stream(device)
        ts = []
        for _ in range(repeat + 1):  # (the first warms the allocator up)
            sync(self.device)
            t0 = time.perf_counter()
            up = Upload(self._staging, device, copies, AHEAD_BYTES)
            for j in range(len(layout)):
                up.layer(j, layout[0].kv_dtype)
            sync(self.device)
            ts.append(time.perf_counter() - t0)
        return self._staging.nbytes_of(0, self.length) / statistics.median(ts[1:]) / 1e9


def tier_paths(p: Paths, loop, host, client, hit) -> dict[str, Callable[[], object]]:
    """The host tier's two paths: through ``KDNClient(host=...)`` (a lease per object, each chunk copied while
    leased), and every object leased and added held (copied layer after layer out of the mapping)."""

    def via_client() -> torch.Tensor:
        builder = p.builder(hit.token_counts())
        loop.run_until_complete(client.fetch_prefix(hit, encoding="raw", into=builder.add))
        cache, n_cached = builder.finish()
        return p.suffix_forward(cache, n_cached)

    async def leased_held() -> torch.Tensor:
        async with contextlib.AsyncExitStack() as stack:
            leased = await asyncio.gather(*(stack.enter_async_context(host.lease(a, "raw")) for a in p.addrs))
            builder = p.builder()
            for i, obj in enumerate(leased):
                builder.add(i, obj.object(), held=True)
            cache, n_cached = builder.finish()
            out = p.suffix_forward(cache, n_cached)
            builder.copied(wait=True)  # the leases end only once the device has read their bytes
            return out

    return {"tier-raw": via_client, "tier-held": lambda: loop.run_until_complete(leased_held())}


def ttft(device: str, lengths: list[int], repeat: int, emit: Callable[[str, dict], None], suffix: int = 16,
         shape: str = "qwen2-0.5b-shape", edge: bool = True, tier: bool = True) -> None:
    from kdn.client import KDNClient
    from kdn.kernels.pinned import host_arena, register_mapping

    model = shaped_model(shape, device)
    arena = host_arena(24 << 30)
    for length in lengths:
        p = Paths(model, device, length, suffix, arena)
        cases: dict[str, Callable[[], object]] = {
            "prefill-lean": p.lean, "host-raw": lambda: p.host("raw"), "host-zstd": lambda: p.host("zstd"),
            "host-held": lambda: p.held_load(serial=False), "host-serial": lambda: p.held_load(serial=True)}
        world = client = local = loop = host = pinned_map = None
        if edge or tier:  # (the host tier's start may fail, e.g. a /dev/shm too small: reported, the rest goes on)
            world = EdgeWorld(Path(tempfile.mkdtemp(prefix="kdn-gpu-check-")))
            loop = asyncio.new_event_loop()
            wire = sum(map(len, p.blobs["raw"]))
            loop.run_until_complete(world.start({a: {"raw": p.blobs["raw"][i]} for i, a in enumerate(p.addrs)},
                                                mem_budget=wire + (256 << 20)))
            client = KDNClient(edges=[world.url], max_hedges=0, arena=arena)
            hit = loop.run_until_complete(client.lookup(p.tokens, MID, chunk_tokens=CHUNK))
            assert hit.tokens == length, (hit.tokens, length)
            if edge:
                def from_edge() -> torch.Tensor:
                    builder = p.builder(hit.token_counts())
                    loop.run_until_complete(client.fetch_prefix(hit, encoding="raw", into=builder.add))
                    cache, n_cached = builder.finish()
                    return p.suffix_forward(cache, n_cached)

                cases["edge-raw"] = from_edge
            if tier:
                try:
                    host = loop.run_until_complete(world.start_tier(wire + wire // 8 + (64 << 20)))
                    outcomes = loop.run_until_complete(host.warm(p.addrs, "raw"))  # filled from the edge first
                    assert set(outcomes) <= {"filled", "held"}, outcomes
                    pinned_map = register_mapping(host._segment)  # (HostClient keeps its mapping private for now)
                    local = KDNClient(edges=[world.url], max_hedges=0, arena=arena, host=host)
                    cases.update(tier_paths(p, loop, host, local, hit))
                except Exception as e:  # noqa: BLE001
                    emit("errors", {"shape": shape, "length": length, "path": "tier", "error": _err(e)})
        try:
            first: dict[str, object] = {}  # each path's first logits: every load must give host-raw's, bit for bit
            for name in list(cases):  # warm up kernels, the allocator, the edge's memory tier
                try:
                    first[name] = cases[name]()
                except Exception as e:  # noqa: BLE001 - a new path that fails on the device is reported and
                    if name not in OPTIONAL:  # left out; the rows the table is built on are not optional
                        raise
                    emit("errors", {"shape": shape, "length": length, "path": name, "error": _err(e)})
                    del cases[name]
            sync(device)
            # The same bytes through another path (held, on the copy stream, out of the host tier's mapping...)
            # make the same cache: a copy the forward did not wait for would show here.
            same = {name: bool(torch.equal(first[name], first["host-raw"])) for name in cases if name != "prefill-lean"}
            del first
            times: dict[str, list[float]] = {k: [] for k in cases}
            p.copies.update(bytes=0, seconds=0.0, calls=0, chunks=0)
            for r in range(repeat):
                order = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]
                for name in order:
                    sync(device)
                    t0 = time.perf_counter()
                    cases[name]()
                    sync(device)
                    times[name].append(time.perf_counter() - t0)
            rates, vllm = {}, {}
            for name in ("host-held", "host-serial"):
                for got, measure in ((rates, p.copy_rate), (vllm, p.stage_rate)):
                    try:
                        got[name] = measure(name == "host-serial", max(repeat, 2))
                    except Exception as e:  # noqa: BLE001 - as above
                        got[name] = float("nan")
                        emit("errors", {"shape": shape, "length": length, "path": f"{name} {measure.__name__}",
                                        "error": _err(e)})
            if local is not None and local.host_stats.fallbacks:
                print(f"warning: {local.host_stats.fallbacks} host-tier reads fell back to the edge", flush=True)
        finally:
            if pinned_map is not None:
                pinned_map.close()  # before the mapping goes (HostClient.close unmaps it)
            for c in (client, local, host):
                if c is not None:
                    loop.run_until_complete(c.close())
            if world is not None:
                world.stop()
                shutil.rmtree(world.tmp, ignore_errors=True)
            if loop is not None:
                loop.close()
            p.close()
        for row in rows_of(p, model, shape, times, rates, vllm, same, pinned=pinned_map is not None if tier else None):
            emit("ttft", row)


def rows_of(p: Paths, model, shape: str, times: dict[str, list[float]], rates: dict[str, float],
            vllm: dict[str, float], same: dict[str, bool], pinned: bool | None) -> list[dict]:
    """The table's rows for one shape and length, the planner's choice among them."""
    from kdn.chunk import Chunk
    from kdn.format.address import blob_digest
    from kdn.planner import PrefillModel, Speeds, decide

    cfg = model.config
    length, suffix = p.length, p.suffix
    base = statistics.median(times["prefill-lean"])
    # The planner, on this run's measurements: the lean prefill (its model scaled by that timing) and
    # the edge path's bytes/s as the link; its time is that of the path it picks.
    heads = cfg.num_attention_heads
    pm = PrefillModel(params=sum(x.numel() for x in model.parameters()), layers=cfg.num_hidden_layers,
                      attn_width=heads * (cfg.hidden_size // heads))
    pm.observe(length + suffix, 0, base)
    via = "edge-raw" if "edge-raw" in times else "host-raw"
    wire = sum(map(len, p.blobs["raw"]))
    bps = wire / statistics.median(times[via])
    starts = [sum(p.counts[:i]) for i in range(len(p.counts))]
    chunks = [Chunk(a, s, s + n, "raw", blob_digest(b), len(b)) for a, s, n, b in
              zip(p.addrs, starts, p.counts, p.blobs["raw"])]
    decision = decide(chunks, length + suffix,
                      link=lambda nbytes: nbytes / bps, speeds=Speeds(pm))
    choice = "load" if decision.load == len(p.counts) else ("compute" if not decision.loads_anything
                                                            else f"load {decision.load} of {len(p.counts)}")
    times["planner"] = times[via] if decision.load == len(p.counts) else times["prefill-lean"]
    c = p.copies
    h2d_gbps = c["bytes"] / c["seconds"] / 1e9 if c["seconds"] else float("nan")
    rows = []
    for name, ts in times.items():
        enc = "zstd" if name.endswith("zstd") else "raw"
        rows.append({"shape": shape, "length": length, "path": name,
                     "median_ms": round(statistics.median(ts) * 1e3, 2),
                     "min_ms": round(min(ts) * 1e3, 2), "max_ms": round(max(ts) * 1e3, 2),
                     "speedup_vs_lean": round(base / statistics.median(ts), 2),
                     "worst_speedup": round(min(times["prefill-lean"]) / max(ts), 2),
                     "object_mib": round(sum(len(b) for b in p.blobs[enc]) / 2**20, 1) if name != "prefill-lean"
                     and name != "planner" else 0.0,
                     **({"h2d_gbps": round(h2d_gbps, 1), "copies_per_chunk": round(c["calls"] / max(c["chunks"], 1), 2)}
                        if name == "host-raw" else {}),
                     **({"h2d_gbps": round(rates[name], 1), "vllm_h2d_gbps": round(vllm[name], 1)}
                        if name in rates and name in times else {}),
                     **({"same_logits": same[name]} if name in same else {}),
                     **({"mapping_pinned": pinned} if name.startswith("tier-") else {}),
                     **({"choice": choice, "reason": decision.reason} if name == "planner" else {})})
    return rows


def h2d(device: str, emit: Callable[[str, dict], None], sizes=H2D_MIB) -> None:
    if not device.startswith("cuda"):
        return
    for mib in sizes:
        n = mib << 20
        for pinned in (False, True):
            src = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            src.fill_(1)
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            dst.copy_(src, non_blocking=pinned)
            sync(device)
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                sync(device)
                ts.append(time.perf_counter() - t0)
            emit("h2d", {"mib": mib, "pinned": pinned, "gb_per_s": round(n / statistics.median(ts) / 1e9, 2)})


OPTIONAL = {"host-held", "host-serial", "tier-raw", "tier-held"}  # paths whose failure leaves the others' rows


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


SHAPE_NAMES = {"qwen2-0.5b-shape": "Qwen2-0.5B", "llama3-8b-shape": "Llama-3-8B", "tiny-shape": "tiny"}


def _by(rows: list[dict]):
    for shape, length in dict.fromkeys((r["shape"], r["length"]) for r in rows):
        yield shape, length, {r["path"]: r for r in rows if r["shape"] == shape and r["length"] == length}


def _same(*rows: dict) -> str:
    """Whether these paths' first logits equal host-raw's, bit for bit."""
    return "same" if all(r.get("same_logits") for r in rows) else "**differ**"


def _ms(r: dict) -> str:
    return f"{r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})"


def ttft_table(rows: list[dict]) -> str:
    out = ["| model shape | context | lean prefill (ms) | KDN host raw (ms) | vs lean | H2D GB/s | device copies a chunk | "
           "KDN host zstd | KDN edge raw (ms) | vs lean | planner: choice, vs lean (worst) | objects (MiB, raw / zstd) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for shape, length, by in _by(rows):
        lean, raw, z, pl = by["prefill-lean"], by["host-raw"], by["host-zstd"], by["planner"]
        e = by.get("edge-raw")
        out.append(f"| {SHAPE_NAMES.get(shape, shape)} | {length:,} | {_ms(lean)} | {_ms(raw)} | "
                   f"{raw['speedup_vs_lean']:.2f}x (worst {raw['worst_speedup']:.2f}x) | {raw.get('h2d_gbps', float('nan')):.1f} | "
                   f"{raw.get('copies_per_chunk', '—')} | {z['median_ms']:.1f} ({z['speedup_vs_lean']:.2f}x) | "
                   + (f"{_ms(e)} | {e['speedup_vs_lean']:.2f}x | " if e else "— | — | ")
                   + f"{pl['choice']}, {pl['speedup_vs_lean']:.2f}x (worst {pl['worst_speedup']:.2f}x) | "
                   f"{raw['object_mib']:.0f} / {z['object_mib']:.0f} |")
    return "\n".join(out)


def overlap_table(rows: list[dict]) -> str:
    """The copy stream against copies on the compute stream: the same held raw chunks, layer after layer."""
    out = ["| model shape | context | lean prefill (ms) | copies on the compute stream: TTFT (ms), H2D GB/s | "
           "on the copy stream, a wait per layer: TTFT (ms), H2D GB/s | saved (ms) | vs lean (worst) | "
           "vLLM staging -> device GB/s: compute stream / copy stream | logits as host raw's |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for shape, length, by in _by(rows):
        if "host-held" not in by or "host-serial" not in by:
            continue
        lean, ser, held = by["prefill-lean"], by["host-serial"], by["host-held"]
        out.append(f"| {SHAPE_NAMES.get(shape, shape)} | {length:,} | {_ms(lean)} | {_ms(ser)}, {ser['h2d_gbps']:.1f} | "
                   f"{_ms(held)}, {held['h2d_gbps']:.1f} | {ser['median_ms'] - held['median_ms']:.1f} | "
                   f"{held['speedup_vs_lean']:.2f}x ({held['worst_speedup']:.2f}x) | "
                   f"{ser['vllm_h2d_gbps']:.1f} / {held['vllm_h2d_gbps']:.1f} | {_same(ser, held)} |")
    return "\n".join(out)


def tier_table(rows: list[dict]) -> str:
    """From the machine's host tier (shared memory) against the lean prefill."""
    out = ["| model shape | context | lean prefill (ms) | host tier via KDNClient (ms) | vs lean (worst) | "
           "host tier, leases held, copy stream (ms) | vs lean (worst) | mapping page-locked | logits as host raw's |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for shape, length, by in _by(rows):
        if "tier-raw" not in by or "tier-held" not in by:
            continue
        lean, via, held = by["prefill-lean"], by["tier-raw"], by["tier-held"]
        out.append(f"| {SHAPE_NAMES.get(shape, shape)} | {length:,} | {_ms(lean)} | {_ms(via)} | "
                   f"{via['speedup_vs_lean']:.2f}x ({via['worst_speedup']:.2f}x) | {_ms(held)} | "
                   f"{held['speedup_vs_lean']:.2f}x ({held['worst_speedup']:.2f}x) | "
                   f"{'yes' if held.get('mapping_pinned') else 'no'} | {_same(via, held)} |")
    return "\n".join(out)


def exactness_table(rows: list[dict]) -> str:
    out = ["| model | dtype | encoding | bit-identical logits | max abs difference |", "| --- | --- | --- | --- | ---: |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['dtype']} | | error: {r['error'][:120]} | |")
        else:
            out.append(f"| {r['model']} | {r['dtype']} | {r['encoding']} | {'yes' if r['bit_identical'] else '**no**'} "
                       f"| {r['max_abs_diff']:.3g} |")
    return "\n".join(out)


def h2d_table(rows: list[dict]) -> str:
    out = ["| buffer | pageable GB/s | pinned GB/s |", "| ---: | ---: | ---: |"]
    for mib in dict.fromkeys(r["mib"] for r in rows):
        by = {r["pinned"]: r["gb_per_s"] for r in rows if r["mib"] == mib}
        out.append(f"| {mib} MiB | {by.get(False, float('nan')):.1f} | {by.get(True, float('nan')):.1f} |")
    return "\n".join(out)


def headline(res: R.Results, out: dict) -> None:
    ex, rows = out.get("exactness"), out.get("ttft")
    if not ex or not rows:
        return
    same = sum(1 for r in ex if r.get("bit_identical"))
    raw = [r for r in rows if r["path"] == "host-raw"]
    pl = [r for r in rows if r["path"] == "planner"]
    lo, hi = min(raw, key=lambda r: r["speedup_vs_lean"]), max(raw, key=lambda r: r["speedup_vs_lean"])
    worst = min(r["speedup_vs_lean"] for r in pl)
    res.set_headline(
        f"on {out['info'].get('gpu') or out['info']['device']}: exact reuse with states loaded onto the GPU; TTFT from KDN objects in "
        "host memory and through an edge on loopback vs the lean one-shot GPU prefill (`bench/gpu_check.py`)",
        f"**{same}/{len(ex)}** bit-identical; host-memory loads {lo['speedup_vs_lean']:.2f}x-"
        f"{hi['speedup_vs_lean']:.2f}x the prefill's speed; with the planner no row below {worst:.2f}x",
        "the lean one-shot prefill on the same device (`logits_to_keep=1`), same run",
        [{"shown": f"{same}/{len(ex)}", "table": "exactness", "cell": "yes"},
         {"shown": f"{lo['speedup_vs_lean']:.2f}x-", "table": "ttft", "cell": f"{lo['speedup_vs_lean']:.2f}x"},
         {"shown": f"-{hi['speedup_vs_lean']:.2f}x", "table": "ttft", "cell": f"{hi['speedup_vs_lean']:.2f}x"},
         {"shown": f"{worst:.2f}x", "table": "ttft", "cell": f"{worst:.2f}x"}])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default="qwen2-0.5b-shape,llama3-8b-shape",
                    help="comma list: qwen2-0.5b-shape, llama3-8b-shape, tiny-shape")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: exactness,ttft,h2d,edge,tier")
    ap.add_argument("--quick", action="store_true", help="the CPU dry run: tiny shape, 512 tokens, two families, "
                    "one repeat")
    ap.add_argument("--smoke", action="store_true", help="first on a lent GPU, under a minute: the Qwen2-0.5B shape "
                    "at 2,048 tokens, two repeats, two families, copies of 64 and 256 MiB, no edge and no host "
                    "tier (on the CPU: --quick's sizes)")
    ap.add_argument("--json", default="", help="every row written here as it is measured")
    R.add_arg(ap)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    sizes, families = H2D_MIB, FAMILIES
    if args.smoke:
        args.shapes, args.lengths, args.repeat = "qwen2-0.5b-shape", "2048", 2
        skip |= {"edge", "tier"}
        sizes, families = (64, 256), FAMILIES[:2]
    if args.quick or (args.smoke and not args.device.startswith("cuda")):
        args.shapes, args.lengths, args.repeat = "tiny-shape", "512", 1
        families = FAMILIES[:2]
    res = R.Results("gpu_check", args)
    info = {"device": args.device, "torch": torch.__version__, "smoke": args.smoke}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info), flush=True)
    out: dict = {"info": info}
    emit = Sink(args.json, out)
    emit.flush()
    t0 = time.perf_counter()
    if "h2d" not in skip:
        h2d(args.device, emit, sizes)
    if "exactness" not in skip:
        exactness(args.device, emit, families=families)
    if "ttft" not in skip:
        for shape in args.shapes.split(","):
            ttft(args.device, [int(x) for x in args.lengths.split(",")], args.repeat, emit, shape=shape,
                 edge="edge" not in skip, tier="tier" not in skip)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    emit.flush()
    if out.get("ttft"):
        res.table("ttft", ttft_table(out["ttft"]))
        res.table("overlap", overlap_table(out["ttft"]))
        if any(r["path"] == "tier-held" for r in out["ttft"]) and any(r["path"] == "tier-raw" for r in out["ttft"]):
            res.table("tier", tier_table(out["ttft"]))
    if out.get("exactness"):
        res.table("exactness", exactness_table(out["exactness"]))
    if out.get("h2d"):
        res.table("h2d", h2d_table(out["h2d"]))
    headline(res, out)
    res.extra["raw"] = out
    res.write()
    bad = [r for r in out.get("exactness", []) if not r.get("bit_identical")]
    bad += [r for r in out.get("ttft", []) if r.get("same_logits") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
