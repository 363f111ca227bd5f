"""Serving bench: GET throughput of the edge's tiers against Redis, nginx, LMCache's server and a dict-backed aiohttp server.

    python bench/serve.py                 # full matrix: 3 sizes x concurrency 1/4/16, every server x client
    python bench/serve.py --quick         # 4 MiB only, concurrency 1 and 4, fewer clients
    python bench/serve.py --profile       # also: py-spy profiles of the edge (memory, disk) and the dict server

Object sizes: 1 MiB, 4 MiB and a KV-typical chunk: 256 tokens of SmolLM2-135M
KV in bf16 (30 layers x 3 KV heads x 64 dims x K+V x 2 bytes x 256 tokens =
5,898,240 bytes, 5.6 MiB). Eight random blobs of each size; every client
cycles through them.

Servers, each started and stopped here, on 127.0.0.1, one at a time:
  edge-mem   ``kdn edge serve`` (own process) with every object in its memory tier
  edge-disk  the same with a 1-byte memory budget: every GET is a disk hit (sendfile)
  dict       the baseline: a minimal aiohttp server, bytes in a dict, headers sent alone and the
             body written as a memoryview (no copy: what the edge does)
  dict-copy  the same returning ``web.Response(body=blob)`` (aiohttp joins headers and body into a
             new ``bytes`` first): the naive server, kept as a row
  nginx-1w / nginx-2w   Debian's nginx, sendfile on, 1 / 2 workers, the same bytes as files
  redis      Debian's redis-server 7 (no persistence), read with redis-py + hiredis and with redis-raw
             (RESP on a socket, the value received into one preallocated buffer, as raw reads HTTP)
  lmcache    ``lmcache_server HOST PORT cpu`` from ``bench/work/lmcache-venv``, read with its client
Clients (separate processes, ``bench/serve_clients.py``): wrk, raw (recv_into a
preallocated buffer), aiohttp (``resp.read()``), kdn (``KDNClient.fetch``,
BLAKE3-verified) and kdn-recv (the same without the hash: the receive path).

Server CPU is /proc accounting (psutil) of the server's processes over the
measured window, in cores (1.00 = one core busy all along). Everything lives
under ``bench/work/serve/`` (gitignored). Missing tools are installed
(apt-get / pip) unless ``--no-install``; a server that cannot be had is
skipped and said so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # python -P leaves it out
import results as R  # noqa: E402

sys.path.insert(0, str(HERE / "lib"))
from ports import free_port  # noqa: E402  (bench/lib/ports.py: ports the kernel will not hand out)
WORK = HERE / "work" / "serve"
VENV = HERE / "work" / "lmcache-venv"
CLIENTS = HERE / "serve_clients.py"
PY = sys.executable

KV_CHUNK = 30 * 3 * 64 * 2 * 2 * 256  # SmolLM2-135M, 256 tokens, bf16 K and V
SIZES = {"1MiB": 1 << 20, "4MiB": 4 << 20, "kv256": KV_CHUNK}
SIZE_TITLE = {"1MiB": "1 MiB", "4MiB": "4 MiB", "kv256": "KV chunk (256 tokens of SmolLM2-135M, bf16: 5,898,240 B)"}
N_OBJECTS = 8
HTTP_SERVERS = ["edge-mem", "edge-disk", "dict", "dict-copy", "nginx-1w", "nginx-2w"]
ALL_SERVERS = HTTP_SERVERS + ["redis", "lmcache"]
HTTP_CLIENTS = ["wrk", "raw", "aiohttp"]
KDN_CLIENTS = ["kdn", "kdn-recv", "bufproto"]  # against edge-mem only


def log(msg: str) -> None:
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- installing what is missing ------------------------------------------------------


def ensure_tools(allow: bool) -> dict[str, str]:
    """Returns {tool: why it is missing} for what could not be had."""
    missing = {}
    need_apt = [pkg for tool, pkg in (("redis-server", "redis-server"), ("nginx", "nginx"), ("wrk", "wrk"))
                if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if need_apt and allow:
        log(f"apt-get install {' '.join(need_apt)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *need_apt], env=env, capture_output=True)
    for tool in ("redis-server", "nginx", "wrk"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            missing[tool] = "not installed (apt-get failed or --no-install)"
    try:
        import hiredis  # noqa: F401
        import redis  # noqa: F401
    except ImportError:
        if allow:
            log("pip install redis hiredis")
            subprocess.run([PY, "-m", "pip", "install", "-q", "redis", "hiredis"], capture_output=True)
    try:
        import hiredis  # noqa: F401
        import redis  # noqa: F401
    except ImportError:
        missing["redis-py"] = "redis/hiredis not importable"
    lm = VENV / "bin" / "lmcache_server"
    if not lm.exists() and allow:
        log(f"LMCache into {VENV} (torch 2.13.0 CPU first, then lmcache; ~2 GB, minutes)")
        logf = WORK / "lmcache-install.log"
        with open(logf, "w") as f:
            ok = subprocess.run([PY, "-m", "venv", str(VENV)], stdout=f, stderr=f).returncode == 0
            pip = [str(VENV / "bin" / "pip"), "install", "-q"]
            ok = ok and subprocess.run([*pip, "torch==2.13.0"], stdout=f, stderr=f).returncode == 0
            ok = ok and subprocess.run([*pip, "lmcache"], stdout=f, stderr=f).returncode == 0
        if not ok:
            missing["lmcache"] = f"install failed, see {logf}"
    if not lm.exists():
        missing.setdefault("lmcache", "not installed (--no-install)")
    return missing


# --- data ----------------------------------------------------------------------------


@dataclass
class Obj:
    address: str
    digest: str
    size: int
    label: str


def make_objects(sizes: list[str], seed: int = 7) -> dict[str, list[Obj]]:
    """Random blobs under WORK/blobs (named by address), their registry records, the disk tiers."""
    import random

    from blake3 import blake3

    blobs = WORK / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[Obj]] = {}
    for label in sizes:
        rng = random.Random(f"{seed}-{label}")  # addresses per size: a run of other sizes reuses none
        size = SIZES[label]
        objs = []
        for i in range(N_OBJECTS):
            address = "%064x" % rng.getrandbits(256)
            p = blobs / address
            if not p.exists() or p.stat().st_size != size:
                p.write_bytes(os.urandom(size))
            objs.append(Obj(address, blake3(p.read_bytes()).hexdigest(), size, label))
        out[label] = objs
    return out


async def _register(objs: list[Obj]) -> None:
    from kdn.registry import Encoding, ObjectRecord, open_registry
    from kdn.edge.disk import DiskTier
    from kdn.edge.tiers import EntryMeta

    model_id = "%064x" % 0x5E
    async with open_registry(f"file:{WORK / 'registry.sqlite3'}") as reg:
        await reg.put_objects([
            ObjectRecord(address=o.address, model_id=model_id, namespace="public", kind="kv", start=0, end=256,
                         parent=None, standalone=True, encodings={"raw": Encoding("raw", o.size, o.digest)},
                         origin="bench") for o in objs])
    for name in ("edge-mem-disk", "edge-disk-disk"):
        tier = DiskTier(WORK / name, 4 << 30, fsync=False)
        for o in objs:
            if not tier.contains((o.address, "raw")):
                await tier.put((o.address, "raw"), (WORK / "blobs" / o.address).read_bytes(),
                               EntryMeta(size=o.size, digest=o.digest, namespace="public"))


# --- servers -------------------------------------------------------------------------


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    t = time.time() + timeout
    while time.time() < t:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} not listening after {timeout:.0f} s")


class Server:
    def __init__(self, name: str, argv: list[str], port: int, *, env: dict | None = None) -> None:
        self.name, self.port = name, port
        self.logf = open(WORK / f"{name}.log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=WORK)
        wait_port(port, self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return total

    def pids(self) -> list[int]:
        import psutil

        root = psutil.Process(self.proc.pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # our own child, by pid
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def start_server(name: str, objs: list[Obj]) -> Server:
    port = free_port()
    if name in ("edge-mem", "edge-disk"):
        tier = name
        argv = [PY, "-m", "kdn.cli", "edge", "serve", "--registry", f"file:{WORK / 'registry.sqlite3'}",
                "--origin", "http://127.0.0.1:9", "--node-id", f"bench-{name}", "--port", str(port),
                "--disk", str(WORK / f"{tier}-disk"), "--disk-budget", "4GiB",
                "--mem-budget", "1GiB" if tier == "edge-mem" else "1"]
        srv = Server(name, argv, port, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            warm_edge(srv, objs, want="memory" if tier == "edge-mem" else "disk")
        except BaseException:
            srv.stop()
            raise
        return srv
    if name == "dict" or name.startswith("dict-"):  # dict (streaming), dict-copy, dict-sliced:N (an experiment)
        send = {"dict": "stream", "dict-copy": "response"}.get(name) or name.split("-", 1)[1]
        return Server(name.replace(":", "_"), [PY, str(CLIENTS), "dict-server", "--port", str(port), "--blobs",
                                               str(WORK / "blobs"), "--send", send], port)
    if name.startswith("nginx"):
        workers = int(name.split("-")[1][:-1])
        conf = WORK / f"{name}.conf"
        conf.write_text(f"""daemon off;
master_process on;
worker_processes {workers};
pid {WORK}/{name}.pid;
error_log {WORK}/{name}.error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        location /v1/objects/ {{ alias {WORK}/blobs/; }}
    }}
}}
""")
        return Server(name, [shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf), "-p", str(WORK)], port)
    if name == "redis":
        srv = Server(name, ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--protected-mode", "no", "--dir", str(WORK)], port)
        import redis

        try:
            r = redis.Redis(port=port)
            for o in objs:
                r.set(o.address, (WORK / "blobs" / o.address).read_bytes())
            r.close()
        except BaseException:
            srv.stop()
            raise
        return srv
    if name == "lmcache":
        return Server(name, [str(VENV / "bin" / "lmcache_server"), "127.0.0.1", str(port), "cpu"], port)
    raise ValueError(name)


def warm_edge(srv: Server, objs: list[Obj], want: str) -> None:
    """Read every object until it is served from the tier we measure (a disk hit promotes into memory)."""
    for o in objs:
        for attempt in range(50):
            with urllib.request.urlopen(f"{srv.url}/v1/objects/{o.address}", timeout=30) as r:
                body = r.read()
                source = r.headers.get("X-KDN-Source")
            assert len(body) == o.size, (len(body), o.size)
            if source == want:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{srv.name}: {o.address[:12]} still served from {source}, not {want}")


# --- running one cell ------------------------------------------------------------------


@dataclass
class Cell:
    server: str
    client: str
    size: str
    conc: int
    mbps: float | None = None
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu: float | None = None
    errors: int = 0
    note: str = ""


def run_client(srv: Server, client: str, objs: list[Obj], conc: int, args) -> Cell:
    cell = Cell(srv.name, client, objs[0].label, conc)
    objfile = WORK / f"objects-{objs[0].label}.json"
    objfile.write_text(json.dumps([asdict(o) for o in objs]))
    if client == "wrk":
        return run_wrk(srv, objs, conc, args, cell)
    py = str(VENV / "bin" / "python") if client == "lmcache" else PY
    argv = [py, str(CLIENTS), client, "--url", srv.url, "--objects", str(objfile), "--conc", str(conc),
            "--duration", str(args.duration), "--warmup", str(args.warmup), "--blobs", str(WORK / "blobs")]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}"}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=WORK)
    c0 = c1 = t0 = t1 = None
    result = None
    for line in p.stdout:
        line = line.strip()
        if line == "START":
            c0, t0 = srv.cpu_seconds(), time.perf_counter()
        elif line == "END":
            c1, t1 = srv.cpu_seconds(), time.perf_counter()
        elif line.startswith("{"):
            result = json.loads(line)
    err = p.stderr.read()
    p.wait()
    if result is None or c1 is None:
        cell.note = f"client failed: {err.strip().splitlines()[-1][:200] if err.strip() else p.returncode}"
        return cell
    secs = result["seconds"]
    cell.mbps = result["bytes"] / secs / 1e6
    cell.rps = result["requests"] / secs
    cell.p50_ms, cell.p99_ms = result["p50_ms"], result["p99_ms"]
    cell.cpu = (c1 - c0) / (t1 - t0)
    cell.errors = result["errors"]
    return cell


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def run_wrk(srv: Server, objs: list[Obj], conc: int, args, cell: Cell) -> Cell:
    lua = WORK / f"wrk-{cell.size}.lua"
    lua.write_text("local paths = {" + ", ".join(f'"/v1/objects/{o.address}"' for o in objs) + "}\n"
                   "local i = 0\n"
                   "request = function()\n  i = i + 1\n  return wrk.format(\"GET\", paths[(i % #paths) + 1])\nend\n")
    threads = min(conc, 2)
    dur = max(1, round(args.duration))
    argv = ["wrk", "-t", str(threads), "-c", str(conc), "-d", f"{dur}s", "--latency", "--timeout", "10s",
            "-s", str(lua), srv.url + "/"]
    # wrk has no warm-up of its own: a short run first opens the connections and the caches.
    subprocess.run(["wrk", "-t", str(threads), "-c", str(conc), "-d", "1s", "-s", str(lua), srv.url + "/"],
                   capture_output=True)
    c0, t0 = srv.cpu_seconds(), time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True)
    c1, t1 = srv.cpu_seconds(), time.perf_counter()
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m),", out.stdout)
    if not m:
        cell.note = f"wrk failed: {(out.stdout + out.stderr).strip()[-200:]}"
        return cell
    n, secs = int(m.group(1)), float(m.group(2)) * _UNITS[m.group(3)] / 1e3
    pct = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)", out.stdout, re.M))

    def ms(v: str | None) -> float | None:
        if v is None:
            return None
        mm = re.fullmatch(r"([\d.]+)(us|ms|s|m)", v)
        return float(mm.group(1)) * _UNITS[mm.group(2)] if mm else None

    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", out.stdout)
    sock_errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out.stdout)
    cell.errors = (int(errs.group(1)) if errs else 0) + (sum(map(int, sock_errs.groups())) if sock_errs else 0)
    cell.mbps = n * objs[0].size / secs / 1e6
    cell.rps = n / secs
    cell.p50_ms, cell.p99_ms = ms(pct.get("50")), ms(pct.get("99"))
    cell.cpu = (c1 - c0) / (t1 - t0)
    return cell


# --- profiling ---------------------------------------------------------------------------


def profile(srv: Server, objs: list[Obj], args, seconds: float = 8.0) -> str:
    """py-spy (raw collapsed stacks) of the server while the raw client reads at concurrency 4."""
    if shutil.which("py-spy") is None:
        subprocess.run([PY, "-m", "pip", "install", "-q", "py-spy"], capture_output=True)
    out = WORK / f"profile-{srv.name}-{objs[0].label}.txt"
    spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "-r", "250", "-d", str(int(seconds)), "--format", "raw",
                            "--threads", "-o", str(out), "-p", str(srv.proc.pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)

    class A:  # a longer window for the client than a table cell
        duration = seconds
        warmup = 0.2

    run_client(srv, "raw", objs, 4, A)
    spy.wait()
    return summarize_profile(out)


def profile_client(srv: Server, client: str, objs: list[Obj], seconds: float = 6.0) -> str:
    """py-spy of a client process (``kdn``: where its time goes against the raw client) at concurrency 1."""
    if shutil.which("py-spy") is None:
        subprocess.run([PY, "-m", "pip", "install", "-q", "py-spy"], capture_output=True)
    out = WORK / f"profile-client-{client}-{objs[0].label}.txt"
    objfile = WORK / f"objects-{objs[0].label}.json"
    objfile.write_text(json.dumps([asdict(o) for o in objs]))
    argv = ["py-spy", "record", "-r", "250", "--format", "raw", "--threads", "-o", str(out), "--",
            PY, str(CLIENTS), client, "--url", srv.url, "--objects", str(objfile), "--conc", "1",
            "--duration", str(seconds), "--warmup", "0.3", "--blobs", str(WORK / "blobs")]
    subprocess.run(argv, capture_output=True, env={**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}"}, cwd=WORK, timeout=120)
    return summarize_profile(out)


def summarize_profile(path: Path, top: int = 18) -> str:
    if not path.exists():
        return f"(no profile at {path})"
    self_t: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n_ = int(n)
        total += n_
        frames = stack.split(";")
        leaf = re.sub(r" \(/.*?/(site-packages|lib/python3\.\d+|work/main)/", " (", frames[-1])
        self_t[leaf] = self_t.get(leaf, 0) + n_
        for f in set(frames):
            f = re.sub(r" \(/.*?/(site-packages|lib/python3\.\d+|work/main)/", " (", f)
            incl[f] = incl.get(f, 0) + n_
    lines = [f"{path.name}: {total} samples", "self time:"]
    for f, n in sorted(self_t.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / total:5.1f}%  {f}")
    lines.append("inclusive (handler and middleware frames):")
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1]):
        if re.search(r"(get_object|_send_bytes|_send_file|_sendfile_body|_promote|metrics_middleware|error_middleware|"
                     r"_readable_record|acquire|object_headers|log|access|write_eof|prepare|sendfile|_handle_request|"
                     r"read_bytes|get \(|start \()", f):
            lines.append(f"  {100 * n / total:5.1f}%  {f}")
    return "\n".join(lines[: top + 40])


# --- output ----------------------------------------------------------------------------


def fmt_cell(c: Cell | None) -> str:
    if c is None:
        return "—"
    if c.mbps is None:
        return f"failed ({c.note[:60]})"
    s = f"**{c.mbps:,.0f}** · {c.rps:,.0f}/s · {c.p50_ms:.2f}/{c.p99_ms:.2f} ms · {c.cpu:.2f}"
    if c.errors:
        s += f" · {c.errors} err"
    return s


def size_table(cells: list[Cell], size: str, concs: list[int]) -> str:
    by = {(c.server, c.client, c.size, c.conc): c for c in cells}
    rows = []
    seen = set()
    for c in cells:
        if (c.server, c.client) not in seen:
            seen.add((c.server, c.client))
            rows.append((c.server, c.client))
    out = ["| server | client | " + " | ".join(f"c={k}" for k in concs) + " |",
           "| --- | --- | " + " | ".join("---:" for _ in concs) + " |"]
    for server, client in rows:
        if not any((server, client, size, k) in by for k in concs):
            continue
        out.append(f"| {server} | {client} | " + " | ".join(fmt_cell(by.get((server, client, size, k))) for k in concs) + " |")
    return "\n".join(out)


def tables(cells: list[Cell], sizes: list[str], concs: list[int], res: R.Results | None = None) -> str:
    out = []
    for size in sizes:
        out.append(f"#### {SIZE_TITLE[size]}\n")
        out.append("Each cell: **MB/s** · requests/s · p50/p99 latency · server CPU cores.\n")
        md = size_table(cells, size, concs)
        if res is not None:
            res.table(f"size-{size}", md, SIZE_TITLE[size], echo=False)
        out.append(md)
        out.append("")
    return "\n".join(out)


def headline(res: R.Results, ratio_md: str) -> None:
    """The README row: the edge's memory tier against each other server (best client each), over sizes and
    concurrencies, from the ratios table."""
    rows: dict[str, list[str]] = {}
    for line in ratio_md.splitlines()[2:]:
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.setdefault(cols[0], []).extend(v for v in cols[2:] if v != "—")
    parts, figs = [], []
    for key, label in (("edge-mem / dict (best client each)", "edge memory tier {} the streaming dict-backed aiohttp server"),
                       ("edge-mem / lmcache (best client each)", "{} LMCache's server"),
                       ("edge-mem / redis (best client each)", "{} Redis"),
                       ("edge-disk / nginx-1w (best client each)", "edge disk tier {} nginx (1 worker, sendfile)"),
                       ("kdn client / raw client (edge-mem)", "the BLAKE3-verified KDN client {} a raw recv_into client")):
        vals = rows.get(key)
        if not vals:
            continue
        lo, hi = min(vals, key=float), max(vals, key=float)
        parts.append(label.format(f"{lo}-{hi}x"))
        figs += [{"shown": f"{lo}-", "cell": lo, "table": "ratios"}, {"shown": f"-{hi}x", "cell": hi, "table": "ratios"}]
    if parts:
        res.set_headline("serving throughput (MB/s, same client per comparison, loopback, 2 shared cores)",
                         "; ".join(parts) + " (worst-best over sizes and concurrencies 1/4/16)",
                         "the streaming dict server (writes the body without a copy, as the edge does), LMCache's "
                         "server, Redis (redis-py or a preallocated-buffer reader, the better), nginx; the best client "
                         "for each server", figs)


def best_of_rounds(cells: list[Cell]) -> list[Cell]:
    """One cell per (server, client, size, concurrency): the round with the most MB/s."""
    best: dict[tuple, Cell] = {}
    for c in cells:
        k = (c.server, c.client, c.size, c.conc)
        if k not in best or (c.mbps or 0) > (best[k].mbps or 0):
            best[k] = c
    return list(best.values())


def ratio(a: Cell | None, b: Cell | None) -> str:
    if a is None or b is None or not a.mbps or not b.mbps:
        return "—"
    return f"{a.mbps / b.mbps:.2f}"


def ratios(cells: list[Cell], sizes: list[str], concs: list[int]) -> str:
    by = {(c.server, c.client, c.size, c.conc): c for c in cells}

    def best(server: str, size: str, k: int, clients=("wrk", "raw", "aiohttp", "redis", "redis-raw", "lmcache")) -> Cell | None:
        cs = [by.get((server, cl, size, k)) for cl in clients]
        cs = [c for c in cs if c is not None and c.mbps]
        return max(cs, key=lambda c: c.mbps) if cs else None

    lines = ["| comparison | size | " + " | ".join(f"c={k}" for k in concs) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in concs) + " |"]
    comps = []
    for cl in HTTP_CLIENTS:
        comps.append((f"edge-mem / dict ({cl})", lambda s, k, cl=cl: ratio(by.get(("edge-mem", cl, s, k)), by.get(("dict", cl, s, k)))))
    comps.append(("edge-mem / dict (best client each)", lambda s, k: ratio(best("edge-mem", s, k), best("dict", s, k))))
    comps.append(("edge-mem / dict-copy (best client each)", lambda s, k: ratio(best("edge-mem", s, k), best("dict-copy", s, k))))
    comps.append(("edge-mem / lmcache (best client each)", lambda s, k: ratio(best("edge-mem", s, k), best("lmcache", s, k))))
    comps.append(("edge-mem / redis (best client each)", lambda s, k: ratio(best("edge-mem", s, k), best("redis", s, k))))
    for cl in HTTP_CLIENTS:
        comps.append((f"edge-disk / nginx-1w ({cl})", lambda s, k, cl=cl: ratio(by.get(("edge-disk", cl, s, k)), by.get(("nginx-1w", cl, s, k)))))
    comps.append(("edge-disk / nginx-1w (best client each)", lambda s, k: ratio(best("edge-disk", s, k), best("nginx-1w", s, k))))
    comps.append(("edge-disk / nginx-2w (best client each)", lambda s, k: ratio(best("edge-disk", s, k), best("nginx-2w", s, k))))
    comps.append(("redis-raw client / redis-py client (redis)", lambda s, k: ratio(by.get(("redis", "redis-raw", s, k)), by.get(("redis", "redis", s, k)))))
    comps.append(("kdn client / raw client (edge-mem)", lambda s, k: ratio(by.get(("edge-mem", "kdn", s, k)), by.get(("edge-mem", "raw", s, k)))))
    comps.append(("kdn-recv client / raw client (edge-mem)", lambda s, k: ratio(by.get(("edge-mem", "kdn-recv", s, k)), by.get(("edge-mem", "raw", s, k)))))
    comps.append(("bufproto client / raw client (edge-mem)", lambda s, k: ratio(by.get(("edge-mem", "bufproto", s, k)), by.get(("edge-mem", "raw", s, k)))))
    comps.append(("kdn client / aiohttp client (edge-mem)", lambda s, k: ratio(by.get(("edge-mem", "kdn", s, k)), by.get(("edge-mem", "aiohttp", s, k)))))
    for name, fn in comps:
        for s in sizes:
            vals = [fn(s, k) for k in concs]
            if any(v != "—" for v in vals):
                lines.append(f"| {name} | {s} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def plot(cells: list[Cell], size: str, concs: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    lines = [(s, "raw") for s in HTTP_SERVERS] + [("redis", "redis-raw"), ("lmcache", "lmcache"),
                                                  ("edge-mem", "kdn"), ("edge-mem", "wrk"), ("dict", "wrk")]
    styles = {"kdn": "--", "wrk": ":"}
    colors = iter(plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2])
    for server, client in lines:
        pts = [(c.conc, c.mbps) for c in cells if c.server == server and c.client == client and c.size == size and c.mbps]
        if pts:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(client, "-"), marker="o",
                    color=next(colors), label=f"{server} ({client})")
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(k) for k in concs])
    ax.set_xlabel("concurrent connections")
    ax.set_ylabel("MB/s (10^6 bytes)")
    ax.set_title(f"GET throughput, {SIZE_TITLE[size].split(' (')[0]} objects, loopback, 2 cores shared by client and server")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --- main -------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 MiB only, concurrency 1 and 4, raw + wrk clients")
    p.add_argument("--sizes", default=None, help=f"comma list of {','.join(SIZES)}")
    p.add_argument("--conc", default=None, help="comma list (default 1,4,16)")
    p.add_argument("--servers", default=None, help=f"comma list of {','.join(ALL_SERVERS)}")
    p.add_argument("--clients", default=None, help="comma list of wrk,raw,aiohttp,kdn,kdn-recv (HTTP servers)")
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per cell")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the matrix this many times, server order reversed each round; each cell keeps its best")
    p.add_argument("--warmup", type=float, default=0.7, help="unmeasured seconds before each cell (Python clients)")
    p.add_argument("--profile", action="store_true", help="py-spy the edge (memory, disk) and the dict server")
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "serve.png"))
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="no run: tables, ratios and plot from a results.json this script wrote")
    R.add_arg(p)
    a = p.parse_args()
    res = R.Results("serve", a)
    if a.from_json:
        cells = [Cell(**d) for d in json.loads(Path(a.from_json).read_text())]
        sizes = [s for s in SIZES if any(c.size == s for c in cells)]
        concs = sorted({c.conc for c in cells})
        rmd = ratios(cells, sizes, concs)
        print(tables(cells, sizes, concs, res) + "\n#### Ratios (MB/s over MB/s, same run)\n\n" + rmd)
        res.table("ratios", rmd, "Ratios (MB/s over MB/s, same run)", echo=False)
        headline(res, rmd)
        res.extra["from_json"] = a.from_json
        if a.plot:
            plot(cells, "4MiB" if "4MiB" in sizes else sizes[0], concs, Path(a.plot))
        res.write()
        return
    sizes = a.sizes.split(",") if a.sizes else (["4MiB"] if a.quick else list(SIZES))
    concs = [int(x) for x in a.conc.split(",")] if a.conc else ([1, 4] if a.quick else [1, 4, 16])
    servers = a.servers.split(",") if a.servers else ALL_SERVERS
    clients = a.clients.split(",") if a.clients else (["wrk", "raw", "kdn"] if a.quick else HTTP_CLIENTS + KDN_CLIENTS)
    WORK.mkdir(parents=True, exist_ok=True)

    missing = ensure_tools(not a.no_install)
    for k, v in missing.items():
        log(f"missing {k}: {v}")
    objs = make_objects(sizes)
    allobjs = [o for s in sizes for o in objs[s]]
    for stale in ("registry.sqlite3", "edge-mem-disk", "edge-disk-disk"):  # fresh records and tiers every run
        path = WORK / stale
        if path.is_dir():
            shutil.rmtree(path)
        else:
            for f in WORK.glob(stale + "*"):
                f.unlink()
    asyncio.run(_register(allobjs))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (finally) on a kill

    needs = {"nginx-1w": "nginx", "nginx-2w": "nginx", "redis": "redis-server", "lmcache": "lmcache"}
    cells: list[Cell] = []
    skipped: dict[str, str] = {}
    profiles: list[str] = []
    load0 = open("/proc/loadavg").read().split()[:3]
    t_start = time.time()
    # Rounds alternate the server order, and each cell keeps its best round: a machine whose load drifts
    # during the run (a shared 2-core VM) then favours no server for where it stands in the order.
    for r in range(a.rounds):
        if a.rounds > 1:
            log(f"round {r + 1}/{a.rounds}")
        for server in (servers if r % 2 == 0 else servers[::-1]):
            if needs.get(server) in missing or (server == "redis" and "redis-py" in missing):
                skipped[server] = missing.get(needs.get(server), missing.get("redis-py", ""))
                continue
            if "wrk" in missing and "wrk" in clients:
                clients = [c for c in clients if c != "wrk"]
            log(f"starting {server}")
            try:
                srv = start_server(server, allobjs)
            except Exception as e:
                skipped[server] = f"did not start: {e}"
                log(f"{server} did not start: {e}")
                continue
            try:
                if server == "redis":
                    my_clients = ["redis", "redis-raw"]
                elif server == "lmcache":
                    my_clients = [server]
                elif server == "edge-mem":
                    my_clients = clients
                else:
                    my_clients = [c for c in clients if c not in KDN_CLIENTS]
                for size in sizes:
                    for client in my_clients:
                        for k in concs:
                            cell = run_client(srv, client, objs[size], k, a)
                            cells.append(cell)
                            log(f"{server:9} {client:8} {size:5} c={k:<2} {fmt_cell(cell)}")
                if a.profile and r == 0 and server in ("edge-mem", "edge-disk", "dict"):
                    size = "4MiB" if "4MiB" in sizes else sizes[0]
                    profiles.append(profile(srv, objs[size], a))
                    log(profiles[-1])
                    if server == "edge-mem" and "kdn" in my_clients:
                        profiles.append(profile_client(srv, "kdn", objs[size]))
                        log(profiles[-1])
            finally:
                srv.stop()
    load1 = open("/proc/loadavg").read().split()[:3]
    cells = best_of_rounds(cells)
    (WORK / "results.json").write_text(json.dumps([asdict(c) for c in cells], indent=1))

    rmd = ratios(cells, sizes, concs)
    md = [f"Run {time.strftime('%Y-%m-%d %H:%M')}, {time.time() - t_start:.0f} s, {a.rounds} round(s) (best per cell); load average before "
          f"{' '.join(load0)}, after {' '.join(load1)}; {os.cpu_count()} cores, Python {platform.python_version()}.",
          "", tables(cells, sizes, concs, res), "#### Ratios (MB/s over MB/s, same run)", "", rmd, ""]
    res.table("ratios", rmd, "Ratios (MB/s over MB/s, same run)", echo=False)
    headline(res, rmd)
    if skipped:
        md.append("Skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
        res.extra["skipped"] = skipped
    text = "\n".join(md)
    (WORK / "results.md").write_text(text + "\n")
    if profiles:
        (WORK / "profiles.txt").write_text("\n\n".join(profiles) + "\n")
        res.extra["profiles"] = profiles
    print(text)
    plot_size = "4MiB" if "4MiB" in sizes else sizes[0]
    if a.plot and cells:
        plot(cells, plot_size, concs, Path(a.plot))
        log(f"plot: {a.plot}")
    res.write()


if __name__ == "__main__":
    main()
