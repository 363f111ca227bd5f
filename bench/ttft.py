"""Time to first token: full prefill against loading the prefix KV from an edge (memory / disk tier, a cold
edge, a far region, the disk device).

    python -P bench/ttft.py [--models smollm2-135m,qwen2-0.5b-shape] [--lengths 512,2048,8192]
                            [--repeat 3] [--suffix 16] [--quick] [--plot docs/img/ttft.png]
                            [--paths prefill,prefill-lean,memory,disk,disk-cold,remote,cold] [--no-headline]

For each model the bench starts, on 127.0.0.1 only and in their own
processes, an origin (embedded ``file:`` registry, temp store) and two edges:

- ``edge-mem``  (region ``mem``):  1 GiB memory tier, no disk tier;
- ``edge-disk`` (region ``disk``): a 4 KiB memory tier (no KV object fits)
  over a disk tier, so every hit is served from disk (``X-KDN-Source: disk``).

Each edge is alone in its region, so it owns (and keeps) every address. For
each context length L it publishes L tokens once through ``POST /v1/publish``
(not timed), warms both edges, then times, in rotating order within each
repeat, the first token of the prompt ``published + suffix``:

- ``prefill``: ``agenerate(use_cache=False)``: one forward pass over the whole
  prompt (one-shot, not chunked). agenerate computes the logits of every
  prompt position, as it does for the hit paths' suffix;
- ``prefill-lean``: the same one-shot forward with ``logits_to_keep=1`` (what
  an engine does): the fair lower bound of recomputing;
- ``memory`` / ``disk``: ``agenerate(use_cache=True)`` with a ``KDNClient``
  on that edge: lookup, fetch + verify, decode, build the cache, prefill the
  suffix only;
- ``disk-cold``: ``disk`` after ``fsync`` + ``posix_fadvise(DONTNEED)`` on every file of that edge's disk
  folder (page-cache residency checked with ``mincore`` before and after, reported);
- ``remote``: a memory hit on ``edge-far`` (region ``far``), reached through ``bench/lib/linkemu.py`` in its own
  process (``FAR_DELAY_MS`` one way, ``FAR_MBIT`` per direction per connection);
- ``cold``: a fresh edge process per repeat (empty tiers; started, not timed, on a copy of the registry
  without the other edges, so every chunk fills from the origin), with a new client.

After the repeats of each length, a memory table: VmRSS / VmHWM of the bench process (the engine) and of
every server process (``edge-cold-N``: right after its fetch).

Models: ``smollm2-135m`` (real weights, bf16; real text: the shipped docs
concatenated) and ``qwen2-0.5b-shape`` (a Qwen2-0.5B-shaped random-init bf16
model built once with a fixed seed into ``bench/work/``; random token ids with
a fixed seed). Prints a markdown table (medians, min-max over repeats),
writes a PNG plot and ``bench/work/ttft.json``. Everything it starts it stops;
its temp folders are removed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Before torch loads (here and in the server processes, which inherit it): on a shared 2-core
# machine, OpenMP threads that spin-wait for a descheduled sibling made a 16-token forward
# 5-30x slower (measured: 4.9 s vs 0.19 s); passive waiting removes that pathology.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work"
sys.path.insert(0, str(ROOT / "bench"))  # python -P leaves it out
import results as R  # noqa: E402

sys.path.insert(0, str(ROOT / "bench" / "lib"))
from ports import free_port  # noqa: E402  (bench/lib/ports.py: ports the kernel will not hand out)
DOCS = ROOT / "kdn" / "data" / "docs"
QWEN = "qwen2-0.5b-shape"
SMOL = "smollm2-135m"
PUBLISH_TOKEN = "bench-publisher-" + "p" * 24
QWEN_SEED = 0
IDS_SEED = 1234
QUESTION = "\n\nQuestion: according to the documents above, what should a first-time visitor check before leaving?\n"


# --- server processes (the bench re-runs itself with --serve) -----------------------


def _serve(role: str, cfg_json: str) -> None:
    import logging

    from aiohttp import web

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = json.loads(cfg_json)
    if role == "link":
        asyncio.run(_serve_link(cfg))
        return
    if role == "origin":
        from kdn.origin.app import OriginConfig, create_app

        app = create_app(OriginConfig(**cfg))
    else:
        from kdn.edge.app import EdgeConfig, create_app

        app = create_app(EdgeConfig(**cfg))
    web.run_app(app, host=cfg["host"], port=cfg["port"], print=None)  # SIGTERM/SIGINT: graceful stop


async def _serve_link(cfg: dict) -> None:
    """bench/lib/linkemu.py in its own process (its pacing does not share the bench's event loop or GIL)."""
    from linkemu import LinkEmulator

    link = LinkEmulator(cfg["port"], "127.0.0.1", cfg["target_port"], delay_ms=cfg["delay_ms"], mbit=cfg["mbit"])
    await link.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await link.stop()


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen
    log: Path

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def origin_and_memory_edge(tmp: Path, model: str, dtype: str, procs: list) -> tuple[Proc, Proc]:
    """A token file and a file registry under ``tmp``, an origin of ``model`` and one edge whose memory tier
    holds everything (1 GiB), as processes on 127.0.0.1; each is appended to ``procs`` once started (the
    caller stops them). What bench/blend.py and bench/edits.py read their chunks through."""
    (tmp / "tokens").write_text(PUBLISH_TOKEN + " admin *\n")
    registry = f"file:{tmp / 'registry.sqlite3'}"
    origin = start("origin", "origin", dict(model=model, dtype=dtype, registry=registry,
                                            store=str(tmp / "origin-store"), host="127.0.0.1", port=free_port(),
                                            token_file=str(tmp / "tokens"), node_id="origin-1", fsync=False), tmp)
    procs.append(origin)
    edge = start("edge-mem", "edge", dict(region="mem", registry=registry, origin=origin.url, mem_budget=1 << 30,
                                          disk=None, host="127.0.0.1", port=free_port(), node_id="edge-mem",
                                          prefetch=0, lease_ttl=10.0, fsync=False), tmp)
    procs.append(edge)
    return origin, edge


def start(name: str, role: str, cfg: dict, tmp: Path) -> Proc:
    log = tmp / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-P", str(Path(__file__).resolve()), "--serve", role, json.dumps(cfg)],
                             stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(tmp))
    return Proc(name, f"http://127.0.0.1:{cfg['port']}", p, log)


async def wait_healthy(session, proc: Proc, timeout: float, ready=lambda body: True) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            async with session.get(f"{proc.url}/healthz") as r:
                if r.status == 200:
                    body = await r.json()
                    if ready(body):
                        return body
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{proc.name} not healthy after {timeout:.0f} s:\n{proc.tail()}")


# --- models and prompts ----------------------------------------------------------


def qwen_folder() -> Path:
    """A Qwen2-0.5B-shaped random-init bf16 checkpoint, built once (fixed seed) under bench/work/."""
    dest = WORK / QWEN
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists():
        return dest
    import torch
    import transformers as T

    print(f"building {dest} (random init, seed {QWEN_SEED}) ...", flush=True)
    cfg = T.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
    state = torch.random.get_rng_state()
    torch.manual_seed(QWEN_SEED)
    try:
        model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(torch.bfloat16)
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{QWEN}.", dir=WORK))
    try:
        model.save_pretrained(tmp)
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    del model
    gc.collect()
    return dest


def model_spec(name: str) -> str:
    return str(qwen_folder()) if name == QWEN else name


def token_stream(name: str, lm, n: int, suffix: int) -> tuple[list[int], list[int]]:
    """(n document tokens, `suffix` question tokens) for a model."""
    if name == QWEN:
        import numpy as np

        rng = np.random.default_rng(IDS_SEED)
        vocab = lm.model.config.vocab_size
        return rng.integers(0, vocab, n).tolist(), rng.integers(0, vocab, suffix).tolist()
    tok = lm.tokenizer
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    ids = list(tok.encode(text, add_special_tokens=False))
    doc = (ids * (n // len(ids) + 1))[:n]  # repeated if the docs are shorter than n
    q = list(tok.encode(QUESTION, add_special_tokens=False))
    q = (q * (suffix // len(q) + 1))[:suffix]
    return doc, q


# --- measuring -------------------------------------------------------------------


def _client_class():
    from kdn.client import KDNClient

    class TimedClient(KDNClient):
        """Keeps the last ``fetch_prefix`` result: its codec decode time and blob sizes are not in ``Report``."""

        last = None

        async def fetch_prefix(self, hit, **kw):
            st = await super().fetch_prefix(hit, **kw)
            self.last, self.records = st, dict(zip(hit.addresses, hit.records))
            return st

        def wire_bytes(self) -> int:
            """The last prefix's bytes on the wire: a body received straight into the cache keeps no blob, so
            its size is its record's."""
            out = 0
            for f in self.last.fetched if self.last else ():
                rec = self.records.get(f.address)
                out += len(f.blob) or (rec.encodings[f.encoding].size if rec else 0)
            return out

    return TimedClient


@dataclass
class Sample:
    ttft_ms: float
    lookup_ms: float = 0.0
    fetch_ms: float = 0.0
    codec_ms: float = 0.0  # zstd byte-plane decode + header checks (client)
    build_ms: float = 0.0  # finishing the cache (Report.decode_ms less the codec decode after the last byte)
    prefill_ms: float = 0.0
    tokens_reused: int = 0
    sources: dict = field(default_factory=dict)
    wire_bytes: int = 0
    encodings: list = field(default_factory=list)
    first_token: int = -1
    plan: str = ""  # the load planner's choice and reason (Report.plan)


async def run_hit(lm, ids, client) -> Sample:
    from kdn.adapters.hf import agenerate

    client.last = None
    g = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1)
    r = g.report
    st = client.last
    return Sample(ttft_ms=r.ttft_ms, lookup_ms=r.lookup_ms, fetch_ms=r.fetch_ms,
                  codec_ms=st.decode_s * 1e3 if st else 0.0,
                  build_ms=r.decode_ms - (st.decode_s * 1e3 if st else 0.0), prefill_ms=r.prefill_ms,
                  tokens_reused=r.tokens_reused, sources=dict(r.sources),
                  wire_bytes=client.wire_bytes(),
                  encodings=sorted({f.encoding for f in st.fetched}) if st else [], first_token=g.ids[0],
                  plan=r.plan)


async def run_prefill(lm, ids, client) -> Sample:
    from kdn.adapters.hf import agenerate

    g = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=1, use_cache=False)
    return Sample(ttft_ms=g.report.ttft_ms, prefill_ms=g.report.prefill_ms, first_token=g.ids[0])


def _lean(lm, ids) -> Sample:
    import torch

    from kdn.adapters.hf.extract import _forward, new_cache

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = _forward(lm.model, new_cache(lm.model), torch.tensor(ids, dtype=torch.long), 0, logits=False)
        tok = int(torch.argmax(out.logits[0, -1].float()))
    ms = (time.perf_counter() - t0) * 1e3
    return Sample(ttft_ms=ms, prefill_ms=ms, first_token=tok)


async def run_lean(lm, ids, client) -> Sample:
    return await asyncio.get_running_loop().run_in_executor(None, _lean, lm, ids)


PATHS = ("prefill", "prefill-lean", "memory", "disk", "disk-cold", "remote", "cold")
HITS = ("memory", "disk", "disk-cold", "remote", "cold")
# The far region's link (bench/lib/linkemu.py, each direction, per TCP connection): 20 ms one way (a 40 ms round
# trip, e.g. two regions of one continent) at 1000 Mbit/s.
FAR_DELAY_MS, FAR_MBIT = 20.0, 1000.0


# --- page cache, memory, registry snapshot -----------------------------------------


def _resident(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages) by ``mincore(2)`` on a shared read-only mapping."""
    import ctypes

    size = path.stat().st_size
    if size == 0:
        return 0, 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page = os.sysconf("SC_PAGE_SIZE")
    n = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(b & 1 for b in vec), n
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_page_cache(folder: Path) -> dict:
    """fsync, then ``posix_fadvise(DONTNEED)`` every file under ``folder``; page-cache residency (mincore)
    before and after: what a working set larger than RAM leaves of these files in memory."""
    files = [f for f in folder.rglob("*") if f.is_file()]
    before = after = pages = 0
    for f in files:
        r, n = _resident(f)
        before += r
        pages += n
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        after += _resident(f)[0]
    return {"files": len(files), "pages": pages, "resident_before": before, "resident_after": after}


def proc_mem(pid: int | None = None) -> dict:
    """VmRSS and VmHWM (peak RSS) in MiB, from /proc/PID/status (this process when ``pid`` is None)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    return out


def cold_registry(src: Path, dest: Path) -> None:
    """A copy of the registry with the records but no edge: an edge started on it has no other region to ask,
    so each of its misses fills from the origin (the plan is owner peer -> other regions -> origin)."""
    import sqlite3

    a, b = sqlite3.connect(src), sqlite3.connect(dest)
    try:
        a.backup(b)
        b.execute("DELETE FROM kv WHERE key LIKE '%nodes/edge/%'")
        b.commit()
    finally:
        a.close()
        b.close()


async def publish(session, origin: str, name: str, tokens: list[int], timeout: float = 3600,
                  encodings: list[str] | None = None) -> dict:
    headers = {"Authorization": f"Bearer {PUBLISH_TOKEN}"}
    body = {"name": name, "tokens": tokens, **({"encodings": encodings} if encodings else {})}
    async with session.post(f"{origin}/v1/publish", json=body, headers=headers) as r:
        body = await r.json()
        if r.status != 202:
            raise RuntimeError(f"publish {name}: HTTP {r.status} {body}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with session.get(f"{origin}{body['url']}", headers=headers) as r:
            job = await r.json()
        if job["state"] == "done":
            return job["manifest"]
        if job["state"] == "failed":
            raise RuntimeError(f"publish {name} failed: {job.get('error')}")
        await asyncio.sleep(0.1)
    raise RuntimeError(f"publish {name} did not finish in {timeout:.0f} s")


async def bench_model(name: str, lengths: list[int], repeat: int, suffix: int, log,
                      paths: tuple[str, ...] = PATHS) -> list[dict]:
    import aiohttp
    import torch

    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.generate import model_id as engine_model_id

    spec = model_spec(name)
    # On the disk, not in a tmpfs (/dev/shm): the disk tier's files must be able to leave the page cache.
    tmp = Path(tempfile.mkdtemp(prefix="kdn-ttft-", dir=os.environ.get("KDN_TTFT_TMP") or None))
    procs: list[Proc] = []
    rows = []
    try:
        (tmp / "tokens").write_text(PUBLISH_TOKEN + " admin *\n")
        registry = f"file:{tmp / 'registry.sqlite3'}"
        o_port = free_port()
        origin = start("origin", "origin", dict(model=spec, registry=registry, store=str(tmp / "origin-store"),
                                                host="127.0.0.1", port=o_port, token_file=str(tmp / "tokens"),
                                                node_id="origin-1", fsync=False), tmp)
        procs.append(origin)
        t0 = time.perf_counter()
        lm = load_model(spec)  # meanwhile, in this process
        lm.model.eval()
        log(f"[{name}] loaded in {time.perf_counter() - t0:.1f} s ({lm.dtype}, {lm.architecture}), "
            f"torch threads {torch.get_num_threads()}")
        edges = {}

        def edge_cfg(nid: str, region: str, mem: int, reg: str) -> dict:
            return dict(region=region, registry=reg, origin=origin.url, mem_budget=mem,
                        disk=str(tmp / f"disk-{nid}") if region == "disk" else None, disk_budget=8 << 30,
                        host="127.0.0.1", port=free_port(), node_id=nid, prefetch=0, lease_ttl=10.0, fsync=False)

        for nid, region, mem in (("edge-mem", "mem", 1 << 30), ("edge-disk", "disk", 4 << 10),
                                 ("edge-far", "far", 1 << 30)):
            if region == "far" and "remote" not in paths:
                continue
            edges[region] = start(nid, "edge", edge_cfg(nid, region, mem, registry), tmp)
            procs.append(edges[region])
        link = None
        if "far" in edges:
            lport = free_port()
            link = start("link-far", "link", dict(port=lport, target_port=int(edges["far"].url.rsplit(":", 1)[1]),
                                                  delay_ms=FAR_DELAY_MS, mbit=FAR_MBIT), tmp)
            procs.append(link)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await wait_healthy(s, origin, 600)
            for region, p in edges.items():
                await wait_healthy(s, p, 120, ready=lambda b, nid=p.name: nid in (b.get("ring") or []))
            log(f"[{name}] origin {origin.url}, edges {edges['mem'].url} (memory), {edges['disk'].url} (disk)"
                + (f", {edges['far'].url} (far region, reached via link {link.url}: {FAR_DELAY_MS:g} ms one way, "
                   f"{FAR_MBIT:g} Mbit/s)" if link else ""))

            TimedClient = _client_class()
            clients = {"memory": TimedClient(edges=[edges["mem"].url]), "disk": TimedClient(edges=[edges["disk"].url])}
            if link:
                clients["remote"] = TimedClient(edges=[link.url])
            drops: list[dict] = []
            cold_mem: list[dict] = []

            async def run_disk_cold(lm, ids, c) -> Sample:
                d = await asyncio.to_thread(drop_page_cache, tmp / "disk-edge-disk")
                drops.append(d)
                return await run_hit(lm, ids, c)

            async def run_cold(lm, ids, c) -> Sample:
                """A fresh edge (empty tiers, no other region in its registry): every chunk fills from the
                origin. Starting it is not timed; its client is new too (its first connections are timed)."""
                n = len(cold_mem)
                reg = tmp / f"cold-{n}.sqlite3"
                await asyncio.to_thread(shutil.copyfile, tmp / "cold-registry.sqlite3", reg)
                nid = f"edge-cold-{n}"
                p = start(nid, "edge", edge_cfg(nid, "cold", 1 << 30, f"file:{reg}"), tmp)
                cc = TimedClient(edges=[p.url])
                try:
                    await wait_healthy(s, p, 120, ready=lambda b: nid in (b.get("ring") or []))
                    gc.collect()
                    smp = await run_hit(lm, ids, cc)
                    cold_mem.append(proc_mem(p.popen.pid))
                    return smp
                finally:
                    await cc.close()
                    p.stop()
            try:
                doc, q = token_stream(name, lm, max(lengths), suffix)
                # Warm torch (first forward pays one-off costs) and compute the model id (hashes the weights).
                await run_lean(lm, doc[:256], None)
                await run_prefill(lm, doc[:256], clients["memory"])
                for L in lengths:
                    t0 = time.perf_counter()
                    man = await publish(s, origin.url, f"ttft-{L}", doc[:L])
                    pub_s = time.perf_counter() - t0
                    mid = engine_model_id(lm.model, lm.tokenizer)
                    if man["model_id"] != mid:
                        raise RuntimeError(f"origin model id {man['model_id'][:12]} != bench model id {mid[:12]}")
                    ids = doc[:L] + q
                    if "cold" in paths:  # before any edge of this bench holds the new objects
                        await asyncio.to_thread(cold_registry, tmp / "registry.sqlite3", tmp / "cold-registry.sqlite3")
                    # Warm: the first hit fills each edge; the second must come from its tier.
                    for path, c in clients.items():
                        first = await run_hit(lm, ids, c)
                        again = await run_hit(lm, ids, c)
                        log(f"[{name} L={L}] warm {path}: first from {first.sources} ({first.ttft_ms:.0f} ms; "
                            f"{first.plan[:120]}), then {again.sources} ({again.ttft_ms:.0f} ms; {again.plan[:120]})")
                    samples: dict[str, list[Sample]] = {p: [] for p in paths}
                    drops.clear()
                    cold_mem.clear()
                    runners = {"prefill": run_prefill, "prefill-lean": run_lean, "memory": run_hit, "disk": run_hit,
                               "disk-cold": run_disk_cold, "remote": run_hit, "cold": run_cold}
                    client_of = {"disk-cold": "disk"}
                    for r in range(repeat):
                        order = paths[r % len(paths):] + paths[:r % len(paths)]  # rotate: spread drift over paths
                        for path in order:
                            gc.collect()
                            c = clients.get(client_of.get(path, path), clients["memory"])
                            smp = await runners[path](lm, ids, c)
                            samples[path].append(smp)
                            log(f"[{name} L={L}] rep {r + 1}/{repeat} {path:12s} ttft {smp.ttft_ms:9.1f} ms"
                                + (f"  (lookup {smp.lookup_ms:.1f}, fetch {smp.fetch_ms:.1f}, codec {smp.codec_ms:.1f}, "
                                   f"build {smp.build_ms:.1f}, suffix prefill {smp.prefill_ms:.1f}; {smp.sources}; "
                                   f"plan: {smp.plan[:160]})" if path in HITS else "")
                                + (f"  page cache: {drops[-1]}" if path == "disk-cold" else ""))
                    row = summarize(name, lm, L, suffix, pub_s, samples)
                    row["page_cache_drops"] = list(drops)
                    mem = {"engine (bench process)": proc_mem()}
                    for p in procs:
                        mem[p.name] = proc_mem(p.popen.pid)
                    for i, m in enumerate(cold_mem):
                        mem[f"edge-cold-{i}"] = m
                    row["memory"] = mem
                    log(f"[{name} L={L}] memory (MiB): {mem}")
                    rows.append(row)
            finally:
                for c in clients.values():
                    await c.close()
        del lm
        gc.collect()
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def summarize(name, lm, L, suffix, pub_s, samples: dict[str, list[Sample]]) -> dict:
    cfg = lm.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = L * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2  # bf16 K and V
    row = {"model": name, "length": L, "suffix": suffix, "publish_s": pub_s, "kv_bytes": kv_bytes, "paths": {}}
    first_tokens = {p: sorted({s.first_token for s in v}) for p, v in samples.items()}
    row["first_tokens"] = first_tokens
    for p, v in samples.items():
        d = {"ttft": _stats([s.ttft_ms for s in v])}
        if p in HITS:
            for k in ("lookup_ms", "fetch_ms", "codec_ms", "build_ms", "prefill_ms"):
                d[k] = statistics.median(getattr(s, k) for s in v)
            d["other_ms"] = statistics.median(
                s.ttft_ms - s.lookup_ms - s.fetch_ms - s.codec_ms - s.build_ms - s.prefill_ms for s in v)
            srcs: dict[str, int] = {}
            for s in v:
                for k, n in s.sources.items():
                    srcs[k] = srcs.get(k, 0) + n
            d["sources"] = srcs
            d["tokens_reused"] = sorted({s.tokens_reused for s in v})
            d["wire_bytes"] = v[0].wire_bytes
            d["encodings"] = v[0].encodings
        row["paths"][p] = d
    base = row["paths"]["prefill"]["ttft"]["median"]
    lean = row["paths"]["prefill-lean"]["ttft"]["median"]
    for p in HITS:
        if p not in row["paths"]:
            continue
        t = row["paths"][p]["ttft"]["median"]
        row["paths"][p]["speedup"] = base / t
        row["paths"][p]["speedup_lean"] = lean / t
    return row


# --- output ----------------------------------------------------------------------


def fmt_ms(st: dict) -> str:
    def f(x: float) -> str:
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"

    return f"{f(st['median'])} ({f(st['min'])}-{f(st['max'])})"


def tables(rows: list[dict]) -> str:
    return (ttft_table(rows) + "\n\nBreakdown of the hit paths (medians, ms); KV = bf16 K+V of the context; "
            "wire = fetched blob bytes:\n\n" + breakdown_table(rows))


def ttft_table(rows: list[dict]) -> str:
    out = ["| model | context | path | TTFT ms median (min-max) | vs prefill-lean | vs prefill | source of the chunks |",
           "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        for p in PATHS:
            if p not in row["paths"]:
                continue
            d = row["paths"][p]
            if p in HITS:
                spl, sp = f"**{d['speedup_lean']:.1f}x**", f"{d['speedup']:.1f}x"
                src = ", ".join(f"{k.split('/', 1)[-1]} x{n}" for k, n in sorted(d["sources"].items()))
                src += f"; reused {'/'.join(map(str, d['tokens_reused']))} tok"
            else:
                sp = spl = src = ""
            out.append(f"| {row['model']} | {row['length']:,} | {p} | {fmt_ms(d['ttft'])} | {spl} | {sp} | {src} |")
    return "\n".join(out)


def breakdown_table(rows: list[dict]) -> str:
    out = ["| model | context | path | KV MiB | wire MiB | lookup | fetch + verify | codec decode | build cache "
            "| suffix prefill | other | TTFT |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        for p in HITS:
            if p not in row["paths"]:
                continue
            d = row["paths"][p]
            out.append(f"| {row['model']} | {row['length']:,} | {p} | {row['kv_bytes'] / 2**20:.1f} | "
                       f"{d['wire_bytes'] / 2**20:.1f} | {d['lookup_ms']:.1f} | {d['fetch_ms']:.1f} | "
                       f"{d['codec_ms']:.1f} | {d['build_ms']:.1f} | {d['prefill_ms']:.1f} | {d['other_ms']:.1f} | "
                       f"{d['ttft']['median']:.1f} |")
    return "\n".join(out)


def memory_table(rows: list[dict]) -> str:
    """Resident memory of each process after the repeats of one row (edge-cold-N: right after its one fetch)."""
    out = ["| model | context | process | RSS MiB | peak RSS MiB |", "| --- | ---: | --- | ---: | ---: |"]
    for row in rows:
        for proc, m in (row.get("memory") or {}).items():
            out.append(f"| {row['model']} | {row['length']:,} | {proc} | {m.get('VmRSS', float('nan')):,.0f} | "
                       f"{m.get('VmHWM', float('nan')):,.0f} |")
    return "\n".join(out)


def page_cache_line(rows: list[dict]) -> str:
    parts = []
    for row in rows:
        d = row.get("page_cache_drops") or []
        if d:
            parts.append(f"{row['model']}@{row['length']}: {len(d)} drops of {d[0]['files']} files "
                         f"({d[0]['pages']} pages); resident before "
                         + "/".join(f"{x['resident_before'] / max(x['pages'], 1):.0%}" for x in d)
                         + ", after " + "/".join(f"{x['resident_after'] / max(x['pages'], 1):.0%}" for x in d))
    return "; ".join(parts)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"prefill": "tab:red", "prefill-lean": "tab:orange", "memory": "tab:blue", "disk": "tab:green",
              "disk-cold": "tab:olive", "remote": "tab:purple", "cold": "tab:gray"}
    styles = {SMOL: ("-", "o"), QWEN: ("--", "s")}
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for model in dict.fromkeys(r["model"] for r in rows):
        mr = sorted((r for r in rows if r["model"] == model), key=lambda r: r["length"])
        ls, mk = styles.get(model, (":", "^"))
        for p in [p for p in PATHS if p in mr[0]["paths"]]:
            xs = [r["length"] for r in mr]
            med = [r["paths"][p]["ttft"]["median"] for r in mr]
            lo = [m - r["paths"][p]["ttft"]["min"] for m, r in zip(med, mr)]
            hi = [r["paths"][p]["ttft"]["max"] - m for m, r in zip(med, mr)]
            ax.errorbar(xs, med, yerr=[lo, hi], color=colors[p], linestyle=ls, marker=mk, capsize=3,
                        label=f"{model}: {p}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["length"] for r in rows})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens published; prompt = context + suffix)")
    ax.set_ylabel("time to first token (ms, median; bars: min-max)")
    ax.set_title("KDN: TTFT, full prefill vs KV loaded from an edge (2-core CPU, bf16)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch
    import transformers

    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, no GPU; Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), "
            f"transformers {transformers.__version__}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=f"{SMOL},{QWEN}", help=f"comma list of {SMOL}, {QWEN}")
    ap.add_argument("--lengths", default="512,2048,8192", help="context lengths, multiples of 256")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--suffix", type=int, default=16, help="prompt tokens after the published context")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, = cores)")
    ap.add_argument("--quick", action="store_true", help=f"{SMOL} only, 512 and 2048, repeat 2")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "ttft.png"), help="PNG to write ('' for none)")
    ap.add_argument("--json", default=str(WORK / "ttft.json"), help="raw results ('' for none)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    ap.add_argument("--no-headline", action="store_true", help="no README headline in --results")
    ap.add_argument("--serve", nargs=2, metavar=("ROLE", "CONFIG"), help=argparse.SUPPRESS)
    R.add_arg(ap)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(*args.serve)
        return 0
    res = R.Results("ttft", args)
    if args.quick:
        args.models, args.lengths, args.repeat = SMOL, "512,2048", 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    lengths = [int(x) for x in args.lengths.split(",")]
    for m in models:
        if m not in (SMOL, QWEN):
            ap.error(f"unknown model {m!r}")
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    for p in paths:
        if p not in PATHS:
            ap.error(f"unknown path {p!r}")
    if not {"prefill", "prefill-lean"} <= set(paths):
        ap.error("--paths needs prefill and prefill-lean (the baselines)")
    paths = tuple(p for p in PATHS if p in paths)
    for L in lengths:
        if L <= 0 or L % 256:
            ap.error(f"length {L} is not a positive multiple of the 256-token chunk")

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_all:7.1f}s {msg}", flush=True)

    rows = []
    for m in models:
        rows += asyncio.run(bench_model(m, lengths, args.repeat, args.suffix, log, paths))
    print()
    print(f"Machine: {machine()}")
    print(f"Command: python -P bench/ttft.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"Total {time.perf_counter() - t_all:.0f} s; publish times (s, not in TTFT): "
          + ", ".join(f"{r['model']}@{r['length']}: {r['publish_s']:.1f}" for r in rows))
    for r in rows:
        agree = {p: v for p, v in r["first_tokens"].items()}
        if len({t for v in agree.values() for t in v}) != 1:
            print(f"note: first tokens differ between paths for {r['model']}@{r['length']}: {agree}")
    print()
    res.table("main", ttft_table(rows), "TTFT, medians (min-max)")
    print("\nBreakdown of the hit paths (medians, ms); KV = bf16 K+V of the context; wire = fetched blob bytes:\n")
    res.table("breakdown", breakdown_table(rows), "Breakdown of the hit paths (medians, ms)")
    if any(r.get("memory") for r in rows):
        print("\nMemory (MiB, /proc/PID/status VmRSS and VmHWM after the repeats):\n")
        res.table("memory", memory_table(rows), "Engine and edge memory")
    drops = page_cache_line(rows)
    if drops:
        print(f"\nPage cache of the disk tier's files (mincore) before / after each posix_fadvise(DONTNEED): {drops}")
        res.extra["page_cache"] = drops
    if not args.no_headline and {"memory", "disk"} <= set(paths):
        headline(res, rows)
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    res.write()
    return 0


def headline(res: R.Results, rows: list[dict]) -> None:
    """The README row: hit vs the lean one-shot prefill (the fair baseline), per model at 2k (or the nearest
    length), and the range at the longest length."""
    lengths = sorted({r["length"] for r in rows})
    at = min(lengths, key=lambda n: abs(n - 2048))
    figs, parts = [], []
    for r in rows:
        if r["length"] != at:
            continue
        m, d = r["paths"]["memory"]["speedup_lean"], r["paths"]["disk"]["speedup_lean"]
        figs += [{"shown": f"{m:.1f}x", "cell": f"{m:.1f}x", "table": "main"},
                 {"shown": f"{d:.1f}x", "cell": f"{d:.1f}x", "table": "main"}]
        parts.append(f"{r['model']} **{m:.1f}x** (memory tier) / {d:.1f}x (disk)")
    text = f"at {at:,} tokens: " + "; ".join(parts)
    top = max(lengths)
    if top != at:
        sp = [r["paths"][p]["speedup_lean"] for r in rows if r["length"] == top for p in ("memory", "disk")]
        text += f"; at {top:,} tokens {min(sp):.1f}-{max(sp):.1f}x"
        figs += [{"shown": f"{min(sp):.1f}-", "cell": f"{min(sp):.1f}x", "table": "main"},
                 {"shown": f"-{max(sp):.1f}x", "cell": f"{max(sp):.1f}x", "table": "main"}]
    res.set_headline("time to first token, KDN hit over HTTP vs prefill", text,
                     "the lean one-shot prefill of the same model (`logits_to_keep=1`, what an engine runs), same "
                     "run", figs)


if __name__ == "__main__":
    sys.exit(main())
