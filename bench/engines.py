"""Engines on the KDN (issue #54): LMCache storing and loading through KDN against its own L2 backends, and the
router events an edge publishes while it fills.

    python -P bench/engines.py [--lengths 2048,8192] [--repeat 3] [--requests 150] [--events-repeat 2] [--quick]

Everything runs on 127.0.0.1, in processes of its own: an origin (``tiny-llama``, signing, embedded ``file:``
registry, temp store) and the edges below; LMCache's real multiprocess cache server (``python -m
lmcache.v1.multiprocess.server``, CPU, ``engine_driven`` transfer, DRAM L1, chunks of 256 tokens), its telemetry
off (``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``, here and in every process it starts).

**LMCache's L2** (``--lengths``, ``--repeat``). For each backend three LMCache servers share one L2: a writer and
two readers, each with its own L1. The backends:

- ``kdn``: LMCache's ``plugin`` L2 adapter loading ``kdn.adapters.lmcache.KDNL2Adapter``: the writer PUTs each
  chunk to the origin's authenticated ingest (tenant ``acme``; the origin checks, stores and signs it); the
  readers read through one edge (memory tier), verified (BLAKE3 against the signed record, ``trusted_keys``);
- ``fs``: LMCache's own file-system L2, ``fs_native`` (its C++ connector, 4 I/O threads; temp files in a
  sub-folder, renamed into place), one folder under the temp dir (the same disk as the origin's store); its
  Python ``fs`` adapter needs ``aiofiles``, which LMCache's ``--no-deps`` install here leaves out;
- LMCache's ``resp`` (Redis) adapter is left out where no ``redis-server`` binary is installed (the case here).

An engine's side of LMCache's MP protocol, as tests/adapters/lmcache/lmcache_mp.py does it on a CPU (LMCache's
own ``create_transfer_context`` and ``ContiguousTransferWrapper``; no engine model): random bf16 K/V of
SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64: 23,040 bytes a token), new token ids for every
context, so nothing is ever in a reader's L1. Per repeat, per context length, backends in rotating order:

- **store**: the engine's store into the writer's L1 until the L2 holds every chunk of it (``kdn``: the origin's
  ``kdn_origin_ingested_total{outcome="stored"}``; ``fs``: the files LMCache renames into place),
  polled every 10 ms;
- **load, first reader**: the reader's lookup, LMCache's prefetch from its L2 into its L1 and the copy out into
  the engine's tensor (``kdn``: the edge is cold, it fills from the origin on the way); bit-exact (checked);
- **load, second reader**: the same on the other reader (``kdn``: the edge's memory tier now holds the chunks);
- **LMCache alone**: the same load from the writer, whose L1 still holds the context (no L2 at all): what
  LMCache's own path between its L1 and the engine costs on this CPU;
- the **bound**: a memcpy of the same bytes (the faster of numpy's one thread and torch's threads).

**Router events** (``--requests``, ``--events-repeat``). The Mooncake conversation trace
(``bench/traces/mooncake_conversation_trace.jsonl``): its first ``--requests`` requests, each 512-token block
``h`` given fixed token ids (seeded by ``h``, so requests sharing a block share its tokens and chunk addresses),
each prompt cut to whole 256-token chunks and at most 4096 tokens (``tiny-llama``'s positions), published
(``raw``) before any edge starts. Then per repeat two fresh edges, each alone in its region, memory tier only, a
budget of ``--events-budget`` of the distinct chunks' bytes (so the edge evicts, as a full one does): one with
``--kv-events`` connecting to a router's SUB socket bound in this process (every message decoded with msgpack,
its sequence checked), one without (the **baseline**). Each is filled by replaying the requests in trace order
(8 at once, each request's chunks in chain order, ``GET /v1/objects``); a router's figures: block events
(``BlockStored`` blocks + ``BlockRemoved`` blocks) per second from the fill's start to the last message, the
wire bytes (topic, sequence and payload frames), bytes per block event; the edge's CPU (its process's
``utime + stime``, all threads) over the same window, with events and without.

Writes ``bench/work/engines.json``; ``--results`` for ``bench/run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # LMCache's telemetry off, before anything of it is imported
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import results as R  # noqa: E402
import ttft as T  # noqa: E402  (server processes, publish)

TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M"  # the name LMCache keys by (random K/V of its shape)
LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M's K/V: bf16
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 2
CHUNK = 256  # LMCache's --chunk-size (its production default)
BLOCK = 16  # the engine's paged-cache block
TENANT = "tenant-acme-" + "t" * 21
EDGE_TOKEN = "edge-reader-" + "r" * 21
TINY_VOCAB, TINY_POSITIONS = 512, 4096  # tiny-llama (adapters/hf/models.py)
TRACE_BLOCK = 512  # the trace's hash block, in tokens


# --- processes -----------------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (utime + stime, every thread)."""
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def http_get(url: str, token: str | None = None, timeout: float = 10.0) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 -- loopback only
        return r.read().decode()


def metric(url: str, name: str) -> float:
    """One sample of a server's /metrics (0 when absent)."""
    for line in http_get(f"{url}/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def healthy(proc: T.Proc, timeout: float, ready=lambda body: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if ready(json.loads(http_get(f"{proc.url}/healthz", timeout=2))):
                return
        except Exception:  # noqa: BLE001 -- not up yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not healthy after {timeout:.0f} s:\n{proc.tail()}")


def start_origin(tmp: Path, procs: list) -> tuple[T.Proc, str]:
    """A signing origin of tiny-llama (the ingest and the events' publisher); (its proc, the trusted-keys file)."""
    from kdn.registry.signing import Signer

    (tmp / "tokens").write_text(f"{T.PUBLISH_TOKEN} admin *\n{EDGE_TOKEN} read *\n{TENANT} publish,read acme\n")
    (tmp / "edge-token").write_text(EDGE_TOKEN + "\n")
    (tmp / "tenant-token").write_text(TENANT + "\n")
    signer = Signer.generate(tmp / "origin.key")
    (tmp / "trusted").write_text(signer.public + "\n")
    origin = T.start("origin", "origin", dict(model="tiny-llama", registry=f"file:{tmp / 'registry.sqlite3'}",
                                              store=str(tmp / "origin-store"), host="127.0.0.1", port=T.free_port(),
                                              token_file=str(tmp / "tokens"), node_id="origin-1", fsync=False,
                                              signing_key=str(tmp / "origin.key")), tmp)
    procs.append(origin)
    healthy(origin, 600)
    return origin, str(tmp / "trusted")


def start_edge(tmp: Path, origin: T.Proc, procs: list, *, name: str, region: str, mem_budget: int,
               tenant: bool = False, **kw) -> T.Proc:
    cfg = dict(region=region, registry=f"file:{tmp / 'registry.sqlite3'}", origin=origin.url, mem_budget=mem_budget,
               disk=None, host="127.0.0.1", port=T.free_port(), node_id=name, prefetch=0, lease_ttl=10.0,
               fsync=False, **kw)
    if tenant:  # reads of a tenant's namespace: clients' tokens checked, the origin read with the edge's own
        cfg.update(token_file=str(tmp / "tokens"), upstream_token_file=str(tmp / "edge-token"))
    edge = T.start(name, "edge", cfg, tmp)
    procs.append(edge)
    healthy(edge, 120, ready=lambda b: name in (b.get("ring") or []))
    return edge


# --- LMCache: its MP server and an engine's side of its protocol (tests/adapters/lmcache/lmcache_mp.py) --------


class MPServer:
    """One LMCache MP cache server process on 127.0.0.1 with the L2 adapter ``l2`` (LMCache's JSON spec)."""

    def __init__(self, tmp: Path, name: str, l2: dict, l1_gb: float) -> None:
        self.name, self.l2, self.l1_gb = name, l2, l1_gb
        self.port = T.free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.log = tmp / f"lmcache-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port",
                 str(self.port), "--chunk-size", str(CHUNK), "--supported-transfer-mode", "engine_driven",
                 "--l1-size-gb", f"{self.l1_gb:.2f}", "--eviction-policy", "LRU", "--l2-adapter",
                 json.dumps(self.l2), "--disable-observability"], stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while "cache server is running..." not in self.text():
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server {self.name} did not start:\n{self.text()[-3000:]}")
            time.sleep(0.2)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Engine:
    """A CPU engine's side of LMCache's MP protocol (what ``LMCacheSDKContext`` does, the layout given)."""

    def __init__(self, url: str) -> None:
        import torch
        import zmq
        from lmcache.sdk.wrapper.contiguous import ContiguousTransferWrapper
        from lmcache.v1.gpu_connector.utils import LayoutHints
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import create_transfer_context
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.zmq = zmq.Context()
        self.rc = RequestClientFactory.create(url, context=self.zmq)
        self.instance_id = uuid.uuid4().int & ((1 << 63) - 1)
        caches = {f"layer.{i}": torch.zeros((1, 2, HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16)
                  for i in range(LAYERS)}
        self.tc = create_transfer_context(caches, instance_id=self.instance_id, req_client=self.rc)
        self.tc.register(caches, MODEL_NAME, 1, CHUNK // BLOCK, 60.0,
                         layout_hints=LayoutHints(kv_layout="HND", num_kv_heads=HEADS, tokens_per_block=BLOCK,
                                                  head_dim=HEAD_DIM))
        self.wrapper = ContiguousTransferWrapper(self.tc.engine_driven_context, CHUNK)

    def _key(self, tokens, request_id: str, worker_id: int | None = 0):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name=MODEL_NAME, world_size=1, num_kv_readers=1, worker_id=worker_id,
                                 token_ids=tuple(tokens), start=0, end=len(tokens), request_id=request_id,
                                 cache_salt="", request_configs=None)

    def store(self, kv, tokens) -> bool:
        rid = f"store-{uuid.uuid4().hex}"
        try:
            return self.wrapper.store(self._key(tokens, rid), self.instance_id, kv)
        finally:
            self.rc.end_session(rid).result(timeout=60)

    def retrieve(self, tokens, timeout: float = 120.0):
        rid = f"retrieve-{uuid.uuid4().hex}"
        try:
            self.rc.lookup(self._key(tokens, rid, None).no_worker_id_version(), 1).result(timeout=60)
            deadline = time.monotonic() + timeout
            chunks = self.rc.query_prefetch_status(rid).result(timeout=60)
            while chunks is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("LMCache's prefetch did not finish")
                time.sleep(0.002)
                chunks = self.rc.query_prefetch_status(rid).result(timeout=60)
            if not chunks:
                return None
            return self.wrapper.retrieve(self._key(tokens[:chunks * CHUNK], rid, 0), self.instance_id)
        finally:
            self.rc.end_session(rid).result(timeout=60)

    def close(self) -> None:
        self.tc.close()
        self.rc.close()
        self.zmq.term()


class Backend:
    """One L2 for LMCache: a writer and two readers sharing it, and how many chunks it holds so far."""

    def __init__(self, name: str, tmp: Path, l2_writer: dict, l2_reader: dict, held, l1_gb: float) -> None:
        self.name, self.held = name, held
        self.servers = [MPServer(tmp, f"{name}-writer", l2_writer, l1_gb),
                        MPServer(tmp, f"{name}-reader-a", l2_reader, l1_gb),
                        MPServer(tmp, f"{name}-reader-b", l2_reader, l1_gb)]
        self.engines: list[Engine] = []

    def start(self) -> None:
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait()
        self.engines = [Engine(s.url) for s in self.servers]

    def stop(self) -> None:
        for e in self.engines:
            e.close()
        for s in self.servers:
            s.stop()


def memcpy_s(src, dst) -> float:
    """The faster of numpy's copyto (one thread) and torch's copy_ (its threads) of the same bytes."""
    import numpy as np
    import torch

    best = float("inf")
    a, b = src.view(torch.int16), dst.view(torch.int16)
    for copy in (lambda: np.copyto(b.numpy(), a.numpy()), lambda: b.copy_(a)):
        t0 = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - t0)
    return best


def lmcache_run(args, tmp: Path, origin: T.Proc, trusted: str, procs: list, log) -> dict:
    import torch

    edge = start_edge(tmp, origin, procs, name="edge-lmcache", region="lmcache", mem_budget=4 << 30, tenant=True,
                      trusted_keys=trusted)
    l1_gb = max(0.25, args.repeat * sum(args.lengths) * BYTES_PER_TOKEN * 1.3 / 1e9)
    kdn = {"type": "plugin", "module_path": "kdn.adapters.lmcache", "class_name": "KDNL2Adapter"}
    common = {"edges": [edge.url], "namespace": "acme", "token_file": str(tmp / "tenant-token"),
              "trusted_keys": trusted, "timeout": 120}
    fs_dir = tmp / "lmcache-fs"
    fs_dir.mkdir()
    fs = {"type": "fs_native", "base_path": str(fs_dir), "relative_tmp_dir": "tmp"}  # (its files appear whole)
    stored = 'kdn_origin_ingested_total{outcome="stored"}'
    backends = {
        "kdn": Backend("kdn", tmp, {**kdn, "adapter_params": {**common, "ingest": origin.url}},
                       {**kdn, "adapter_params": common}, lambda: metric(origin.url, stored), l1_gb),
        "fs": Backend("fs", tmp, fs, fs, lambda: sum(1 for f in fs_dir.iterdir() if f.is_file()), l1_gb),
    }
    chosen = [backends[b] for b in args.backends]
    rng = torch.Generator().manual_seed(7)
    times: dict[str, dict[int, dict[str, list[float]]]] = {
        b.name: {n: {"store": [], "load-a": [], "load-b": [], "l1": [], "load-l1": []} for n in args.lengths} for b in chosen}
    memcpy: dict[int, list[float]] = {n: [] for n in args.lengths}
    try:
        for b in chosen:
            b.start()
            log(f"LMCache servers up: {b.name}")
            warm = torch.randint(1, 50_000, (CHUNK,), generator=rng).tolist()  # first use, not timed
            w, ra, rb = b.engines
            before = b.held()
            kv = torch.randn((2, LAYERS, CHUNK, HEADS * HEAD_DIM), generator=rng).to(torch.bfloat16)
            assert w.store(kv, warm)
            deadline = time.monotonic() + 120
            while b.held() < before + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            for eng in (ra, rb):
                got = eng.retrieve(warm)
                assert got is not None and torch.equal(got, kv), f"{b.name}: the warm-up chunk did not load"
        for r in range(args.repeat):
            for li, n in enumerate(args.lengths):
                kv = torch.randn((2, LAYERS, n, HEADS * HEAD_DIM), generator=rng).to(torch.bfloat16)
                dst = torch.empty_like(kv).fill_(1)
                memcpy[n].append(memcpy_s(kv, dst))
                del dst
                k = (r + li) % len(chosen)
                for b in chosen[k:] + chosen[:k]:
                    tokens = torch.randint(1, 50_000, (n,), generator=rng).tolist()  # new: in no L1, no L2
                    w, ra, rb = b.engines
                    before = b.held()
                    t0 = time.perf_counter()
                    if not w.store(kv, tokens):
                        raise RuntimeError(f"{b.name}: LMCache's store failed")
                    t_l1 = time.perf_counter()
                    deadline = t0 + 300
                    while b.held() < before + n // CHUNK:
                        if time.perf_counter() > deadline:
                            raise RuntimeError(f"{b.name}: the L2 never held the context "
                                               f"({b.held() - before} of {n // CHUNK}):\n"
                                               f"{b.servers[0].text()[-3000:]}")
                        time.sleep(0.01)
                    t_l2 = time.perf_counter()
                    t = times[b.name][n]
                    t["l1"].append(t_l1 - t0)
                    t["store"].append(t_l2 - t0)
                    for which, eng in (("load-a", ra), ("load-b", rb), ("load-l1", w)):
                        t0 = time.perf_counter()
                        got = eng.retrieve(tokens)
                        dt = time.perf_counter() - t0
                        if got is None or not torch.equal(got, kv):
                            srv = b.servers[{"load-a": 1, "load-b": 2, "load-l1": 0}[which]]
                            raise RuntimeError(f"{b.name} {which}: not the stored K/V "
                                               f"({'nothing' if got is None else tuple(got.shape)}):\n"
                                               f"{srv.text()[-3000:]}")
                        t[which].append(dt)
                        del got
                    log(f"[{b.name} {n} tokens, repeat {r + 1}] store {t['store'][-1] * 1e3:.0f} ms "
                        f"(L1 {t['l1'][-1] * 1e3:.0f} ms), load {t['load-a'][-1] * 1e3:.0f} / "
                        f"{t['load-b'][-1] * 1e3:.0f} ms (from L1 {t['load-l1'][-1] * 1e3:.0f} ms), memcpy {memcpy[n][-1] * 1e3:.1f} ms")
                del kv
    finally:
        for b in chosen:
            b.stop()
        edge.stop()  # (the events' edges below fill from the origin, not from this one)
        procs.remove(edge)
    return {"times": times, "memcpy": memcpy, "l1_gb": l1_gb}


def lmcache_table(out: dict, lengths: list[int]) -> str:
    def col(ts: list[float], nbytes: int) -> str:
        med, worst = statistics.median(ts), max(ts)
        return f"{med * 1e3:.0f} ({worst * 1e3:.0f}) | {nbytes / med / 1e9:.2f} ({nbytes / worst / 1e9:.2f})"

    names = {"kdn": "KDN (`KDNL2Adapter`: origin ingest, one edge)", "fs": "LMCache `fs_native` (its own, temp dir)"}
    lines = ["| L2 | context tokens | KV MB | store ms, median (worst) | store GB/s, median (worst) | "
             "of which the engine's store into L1: ms | "
             "load, first reader: ms (worst) | GB/s (worst) | load, second reader: ms (worst) | GB/s (worst) | "
             "LMCache alone: load from the writer's L1 ms | bound: memcpy ms | memcpy GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in lengths:
        nbytes = n * BYTES_PER_TOKEN
        mc = statistics.median(out["memcpy"][n])
        for b, by_n in out["times"].items():
            t = by_n[n]
            lines.append(f"| {names[b]} | {n} | {nbytes / 1e6:.0f} | {col(t['store'], nbytes)} | "
                         f"{statistics.median(t['l1']) * 1e3:.0f} | "
                         f"{col(t['load-a'], nbytes)} | {col(t['load-b'], nbytes)} | {statistics.median(t['load-l1']) * 1e3:.0f} | "
                         f"{mc * 1e3:.1f} | "
                         f"{nbytes / mc / 1e9:.2f} |")
    return "\n".join(lines)


# --- router events -------------------------------------------------------------------------------------------


def trace_prompts(n: int) -> list[list[int]]:
    """The first ``n`` requests of the Mooncake conversation trace as token ids: block ``h`` is 512 ids seeded by
    ``h``; each prompt cut to whole chunks, at most TINY_POSITIONS tokens (requests under one chunk left out)."""
    import numpy as np

    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])  # stable: equal timestamps keep file order
    blocks: dict[int, list[int]] = {}
    out = []
    for r in rows:
        if len(out) >= n:
            break
        length = min(r["input_length"], TINY_POSITIONS, len(r["hash_ids"]) * TRACE_BLOCK) // 256 * 256
        if length < 256:
            continue
        ids: list[int] = []
        for h in r["hash_ids"][:-(-length // TRACE_BLOCK)]:
            if h not in blocks:
                blocks[h] = np.random.default_rng(1_000_003 + h).integers(0, TINY_VOCAB, TRACE_BLOCK).tolist()
            ids += blocks[h]
        out.append(ids[:length])
    return out


# A router's side, as a process of its own (its decoding does not share the fill client's interpreter): a SUB
# socket bound on loopback (the edge connects, as vLLM's publisher connects to llm-d's indexer), every batch decoded
# (msgpack), each topic's sequence checked, the blocks it believes the edge holds kept. A line on stdin asks for
# its figures (one JSON line back, times on the system's monotonic clock); end of input stops it.
ROUTER = r"""
import json, sys, threading, time
import msgpack, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.LINGER, 0)
sub.bind(f"tcp://127.0.0.1:{sys.argv[1]}")
sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
st = {"batches": 0, "wire": 0, "gaps": 0, "last": 0.0, "view": 0,
      "counts": {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}}
view, nxt, lock, stop = set(), {}, threading.Lock(), threading.Event()

def read():
    while not stop.is_set():
        if not sub.poll(50):
            continue
        while True:
            try:
                topic, seq, payload = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            _, events, _ = msgpack.unpackb(payload, raw=False)
            with lock:
                st["last"] = time.monotonic()
                s = int.from_bytes(seq, "big")
                st["gaps"] += s != nxt.get(topic, 0)
                nxt[topic] = s + 1
                st["batches"] += 1
                st["wire"] += len(topic) + len(seq) + len(payload)
                for e in events:
                    kind = e["type"]
                    if kind == "AllBlocksCleared":
                        st["counts"][kind] += 1
                        view.clear()
                        continue
                    st["counts"][kind] += len(e["block_hashes"])
                    (view.update if kind == "BlockStored" else view.difference_update)(e["block_hashes"])

t = threading.Thread(target=read, daemon=True)
t.start()
print("ready", flush=True)
for _ in sys.stdin:
    with lock:
        st["view"] = len(view)
        print(json.dumps(st), flush=True)
stop.set()
t.join(5)
sub.close(linger=0)
ctx.term()
"""


class Router:
    """The router process: ``stats()`` its figures so far, ``close()`` stops it."""

    def __init__(self) -> None:
        self.port = T.free_port()
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", ROUTER, str(self.port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the router process did not start")

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def fill(edge_url: str, prompts_addresses: list[list[str]], conc: int = 8) -> dict:
    """Replay the requests through the edge, ``conc`` at once, each request's chunks in chain order."""
    import aiohttp

    sem = asyncio.Semaphore(conc)
    got = {"gets": 0, "bytes": 0, "sources": {}}

    async def one(s, addrs: list[str]) -> None:
        async with sem:
            for a in addrs:
                async with s.get(f"{edge_url}/v1/objects/{a}", params={"encoding": "raw"}) as r:
                    body = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"GET {a[:16]} from {edge_url}: {r.status} {body[:200]!r}")
                got["gets"] += 1
                got["bytes"] += len(body)
                src = r.headers.get("X-KDN-Source", "?")
                got["sources"][src] = got["sources"].get(src, 0) + 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(one(s, addrs) for addrs in prompts_addresses))
    return got


def events_run(args, tmp: Path, origin: T.Proc, procs: list, log) -> dict:
    import aiohttp

    prompts = trace_prompts(args.requests)

    async def publish_all() -> list[list[str]]:
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            for i, ids in enumerate(prompts):
                m = await T.publish(s, origin.url, f"mooncake-{i:05d}", ids, encodings=["raw"])
                out.append(m["addresses"][: m["tokens"] // m["chunk_tokens"]])
        return out

    t0 = time.perf_counter()
    chains = asyncio.run(publish_all())
    distinct = {a for c in chains for a in c}
    publish_s = time.perf_counter() - t0
    req = urllib.request.Request(f"{origin.url}/v1/objects/{chains[0][0]}?encoding=raw", method="HEAD",
                                 headers={"Authorization": f"Bearer {T.PUBLISH_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 -- loopback only
        chunk_bytes = int(r.headers["Content-Length"])
    budget = int(args.events_budget * len(distinct) * chunk_bytes)
    log(f"published {len(prompts)} requests ({sum(map(len, chains))} chunks, {len(distinct)} distinct, "
        f"{chunk_bytes} B each) in {publish_s:.0f} s; edge budget {budget / 1e6:.1f} MB")
    runs: list[dict] = []
    for r in range(args.events_repeat):
        for kind in (("events", "plain") if r % 2 == 0 else ("plain", "events")):
            router = Router() if kind == "events" else None
            try:
                edge = start_edge(tmp, origin, procs, name=f"edge-{kind}-{r}", region=f"{kind}{r}",
                                  mem_budget=budget, **({"kv_events": router.endpoint} if router else {}))
                time.sleep(1.0)  # the edge's start settles (its CPU before the fill is not counted)
                pid = edge.popen.pid
                c0, t0 = cpu_s(pid), time.monotonic()
                got = asyncio.run(fill(edge.url, chains))
                t_fill = time.monotonic() - t0
                row = {"kind": kind, "fill_s": t_fill, **got}
                if router is not None:  # until the router heard everything: quiet for 1 s, its view the edge's
                    deadline = time.monotonic() + 30
                    while True:
                        st = router.stats()
                        held = metric(edge.url, "kdn_edge_kv_event_blocks")
                        if time.monotonic() - st["last"] > 1.0 and st["view"] == held or time.monotonic() > deadline:
                            break
                        time.sleep(0.1)
                    row.update(window_s=max(st["last"], t0 + t_fill) - t0, batches=st["batches"], wire=st["wire"],
                               gaps=st["gaps"], counts=st["counts"], view=st["view"], edge_held_blocks=held,
                               dropped=metric(edge.url, 'kdn_edge_kv_events_dropped_total{reason="queue"}'),
                               no_tokens=metric(edge.url, 'kdn_edge_kv_events_dropped_total{reason="no_tokens"}'))
                else:
                    time.sleep(1.0)  # the same quiet second as the events run
                    row["window_s"] = t_fill
                row["cpu_s"] = cpu_s(pid) - c0  # (the quiet second included, for both)
                row["cpu_wall_s"] = time.monotonic() - t0
                runs.append(row)
                log(f"[{kind} {r + 1}] fill {t_fill:.2f} s, {got['gets']} GETs, sources {got['sources']}, "
                    f"edge CPU {row['cpu_s']:.2f} s" + (f", {row['counts']} in {row['batches']} batches, "
                                                        f"{row['wire']} B, gaps {row['gaps']}" if router else ""))
                edge.stop()
                procs.remove(edge)
            finally:
                if router is not None:
                    router.close()
    return {"requests": len(prompts), "chunks": sum(map(len, chains)), "distinct": len(distinct),
            "chunk_bytes": chunk_bytes, "budget": budget, "publish_s": publish_s, "runs": runs}


def events_tables(out: dict) -> tuple[str, str]:
    ev = [r for r in out["runs"] if r["kind"] == "events"]
    plain = [r for r in out["runs"] if r["kind"] == "plain"]

    def med(xs: list[float], f: str = "{:.0f}") -> str:
        return f"{f.format(statistics.median(xs))} ({f.format(min(xs))}-{f.format(max(xs))})"

    blocks = [r["counts"]["BlockStored"] + r["counts"]["BlockRemoved"] for r in ev]
    rate = [b / r["window_s"] for b, r in zip(blocks, ev)]
    bps = [r["wire"] / r["window_s"] for r in ev]
    kv_bps = [r["bytes"] / r["fill_s"] for r in ev]
    size = ["| requests (chunks, distinct) | edge memory budget | BlockStored blocks | BlockRemoved blocks | batches "
            "| wire MB | bytes per block event | block events/s, median (min-max) | event MB/s | the fill's KV MB/s "
            "(the stream they describe) | events' bytes / KV bytes | sequence gaps | router's view = edge's "
            "held blocks |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    r0 = ev[0]
    size.append(f"| {out['requests']} ({out['chunks']:,}, {out['distinct']:,}) | {out['budget'] / 1e6:.0f} MB "
                f"({out['budget'] / (out['distinct'] * out['chunk_bytes']):.0%} of the distinct chunks) | "
                f"{med([r['counts']['BlockStored'] for r in ev])} | {med([r['counts']['BlockRemoved'] for r in ev])} | "
                f"{med([r['batches'] for r in ev])} | {med([r['wire'] / 1e6 for r in ev], '{:.2f}')} | "
                f"{med([r['wire'] / b for r, b in zip(ev, blocks)], '{:.0f}')} | {med(rate)} | "
                f"{med([x / 1e6 for x in bps], '{:.3f}')} | {med([x / 1e6 for x in kv_bps], '{:.0f}')} | "
                f"{statistics.median(r['wire'] / r['bytes'] for r in ev):.2%} | "
                f"{sum(r['gaps'] for r in ev)} | "
                f"{'yes' if all(r['view'] == r['edge_held_blocks'] for r in ev) else 'no'} "
                f"({r0['view']:,} blocks) |")
    cpu_ev = statistics.median(r["cpu_s"] for r in ev)
    cpu_plain = statistics.median(r["cpu_s"] for r in plain)
    extra_us = (cpu_ev - cpu_plain) / statistics.median(blocks) * 1e6
    cpu = ["| edge | fill s, median (min-max) | edge CPU s over the fill, median (min-max) | CPU % of one core | "
           "publisher's extra CPU: s | µs per block event | % of the edge's CPU | block events/s one core "
           "would publish at that cost |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rows in (("with `--kv-events`", ev), ("without (baseline)", plain)):
        extra = (f"{cpu_ev - cpu_plain:.2f} | {extra_us:.0f} | {(cpu_ev - cpu_plain) / cpu_plain:.0%} | "
                 f"{1e6 / extra_us:,.0f}" if rows is ev and extra_us > 0 else "- | - | - | -")
        cpu.append(f"| {name} | {med([r['fill_s'] for r in rows], '{:.2f}')} | "
                   f"{med([r['cpu_s'] for r in rows], '{:.2f}')} | "
                   f"{statistics.median(r['cpu_s'] / r['cpu_wall_s'] for r in rows):.0%} | {extra} |")
    return "\n".join(size), "\n".join(cpu)


# --- main ----------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192", help="context lengths in tokens (whole 256-token chunks)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backends", default="kdn,fs", help="LMCache L2s: kdn, fs (fs_native)")
    ap.add_argument("--requests", type=int, default=150, help="Mooncake requests published and replayed")
    ap.add_argument("--events-repeat", type=int, default=2)
    ap.add_argument("--events-budget", type=float, default=0.5, help="the events edge's memory budget, as a "
                    "fraction of the distinct chunks' bytes")
    ap.add_argument("--parts", default="lmcache,events")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 512 tokens, one repeat, 12 requests")
    ap.add_argument("--json", default=str(ROOT / "bench" / "work" / "engines.json"))
    R.add_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.repeat, args.requests, args.events_repeat = "512", 1, 12, 1
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.backends = [b for b in args.backends.split(",") if b]
    parts = set(args.parts.split(","))
    if any(n % CHUNK for n in args.lengths):
        ap.error(f"--lengths must be whole chunks of {CHUNK} tokens")
    if shutil.which("redis-server"):
        print("note: redis-server is installed, but this bench does not run LMCache's resp adapter yet",
              file=sys.stderr)
    res = R.Results("engines", args)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_start:7.1f}s {msg}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="kdn-engines-"))
    procs: list = []
    out: dict = {"kv": {"model": MODEL_NAME, "layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM,
                        "dtype": "bfloat16", "bytes_per_token": BYTES_PER_TOKEN, "random": True}}
    try:
        origin, trusted = start_origin(tmp, procs)
        log("origin up")
        if "lmcache" in parts:
            out["lmcache"] = lmcache_run(args, tmp, origin, trusted, procs, log)
        if "events" in parts:
            out["events"] = events_run(args, tmp, origin, procs, log)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if "lmcache" in out:
        res.table("lmcache", lmcache_table(out["lmcache"], args.lengths))
    if "events" in out:
        size, cpu = events_tables(out["events"])
        res.table("events", size)
        res.table("events_cpu", cpu)
    res.extra["raw"] = out
    res.write()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
