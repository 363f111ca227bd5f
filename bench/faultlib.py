"""A KDN of real processes on 127.0.0.1, readers that check every byte, and faults injected by PID.

Used by ``bench/faults.py`` (every scenario, with figures) and ``tests/faults/`` (a fast
subset in CI). Nothing here is mocked: etcd is ``/usr/bin/etcd`` on free ports with its
own data directory (stopped and restarted on the same one), or three such members in one
cluster (``World(etcd_members=3)``: every node is given all three, the first first), the origin and the edges are
``python -m kdn.cli ... serve`` processes, and faults are signals to their PIDs, etcd
stopped and started, a size-limited tmpfs under a disk tier, or a kill in the middle of
writes.

    world = World(tmp, regions={"eu": 2, "us": 2})
    await world.start()
    manifest = await world.publish(text)              # digests recorded from the registry now
    readers = Readers(world, addresses, per_region=4)
    async with readers.running():
        await asyncio.sleep(1)
        world.edges["eu-1"].kill()                    # the fault
        ...
    print(readers.stats)                              # reads, failed, wrong bytes, latencies

Wrong bytes are checked against digests read from the registry right after publishing,
before any fault: a reader trusts neither the edge it reads nor the headers it gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
from etcd_cluster import EtcdCluster  # noqa: E402
from etcd_proc import ETCD_BIN, EtcdProcess  # noqa: E402
from jobs import publish_and_wait  # noqa: E402
from ports import free_port  # noqa: E402

PREFIX = "/kdn-faults/"


# --- etcd --------------------------------------------------------------------------------


class Etcd(EtcdProcess):
    """One etcd member whose data survives ``stop()``: stop and start it again on the same ports
    (``bench/lib/etcd_proc.py``, the one throwaway-etcd helper), under ``root/etcd``."""

    def __init__(self, root: Path) -> None:
        super().__init__(ETCD_BIN, root=root / "etcd", retry_ports=False)  # the nodes' arguments name its port

    @property
    def endpoint(self) -> str:
        return self.url

    @property
    def registry(self) -> str:
        return self.registry_url(PREFIX)


class Cluster(EtcdCluster):
    """Three etcd members under ``root/etcd`` (``bench/lib/etcd_cluster.py``); the nodes are given every
    member's address, ``a`` first, so ``a`` is the member they all use until it fails."""

    def __init__(self, root: Path, n: int = 3) -> None:
        super().__init__(root / "etcd", n)

    @property
    def registry(self) -> str:
        return self.registry_url(PREFIX)

    def registry_from(self, member) -> str:
        """The registry URL with ``member`` first (then the others in order): a client that starts elsewhere."""
        order = [member, *(m for m in self.members if m is not member)]
        return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in order) + PREFIX


# --- KDN processes -------------------------------------------------------------------------


class Node:
    """One ``kdn ... serve`` process: started, killed, stopped and restarted with the same arguments."""

    def __init__(self, name: str, args: list[str], port: int, log: Path) -> None:
        self.name, self.args, self.port, self.log = name, args, port, log
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # more environment for the process
        self.launcher: list[str] = ["-m", "kdn.cli"]  # how Python runs it (a test hook: bench/lib/clockhook.py)
        self.nofile: int | None = None  # its open-file limit (RLIMIT_NOFILE), if lower than ours

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def spawn(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **self.env}
        nofile = self.nofile

        def limits() -> None:  # in the child, before exec
            if nofile is not None:
                import resource

                _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

        self.proc = subprocess.Popen([sys.executable, "-P", *self.launcher, *self.args],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), env=env,
                                     preexec_fn=limits if nofile is not None else None)

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                if not self.alive:
                    raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with s.get(f"{self.url}/healthz") as r:
                        if r.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not healthy in {timeout} s: {self.log.read_text()[-2000:]}")
                await asyncio.sleep(0.1)

    async def start(self, timeout: float = 60.0) -> None:
        self.spawn()
        await self.wait_healthy(timeout)

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no lease revoke; the registry notices after the lease TTL."""
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus series on this node's /metrics (0 when absent)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(f"{self.url}/metrics") as r:
                text = await r.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            base, _, rest = series.partition("{")
            if base not in (name, name + "_total"):
                continue
            if all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += float(value)
        return total


PUBLISH = "pub-" + secrets.token_hex(14)
EDGE = "edge-" + secrets.token_hex(14)


@dataclass
class World:
    """etcd, one origin, and edges in regions; every process on 127.0.0.1 under ``root``."""

    root: Path
    regions: dict[str, int] = field(default_factory=lambda: {"eu": 2, "us": 2})
    model: str = "tiny-llama"
    mem_budget: str = "64MiB"
    disk_budget: str = "256MiB"
    lease_ttl: str = "2s"
    disks: dict[str, Path] = field(default_factory=dict)  # edge name -> its disk folder (default: under root)
    edge_args: list[str] = field(default_factory=list)  # more flags for every edge (e.g. --origin via a link)
    per_edge_args: dict[str, list[str]] = field(default_factory=dict)  # edge name -> flags after those (last wins)
    records: str = "store"  # the origin's --records: beside its blobs (its default), or "registry"
    etcd_members: int = 1  # 1: one etcd (stopped, restarted, restored by scenarios); 3: a Cluster
    etcd: Etcd | Cluster = field(init=False)
    origin: Node = field(init=False)
    edges: dict[str, Node] = field(init=False, default_factory=dict)
    digests: dict[str, tuple[str, str, int]] = field(init=False, default_factory=dict)  # address -> enc, digest, size

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.etcd = Etcd(self.root) if self.etcd_members == 1 else Cluster(self.root, self.etcd_members)
        (self.root / "tokens").write_text(f"{PUBLISH} publish,read *\n{EDGE} read *\n")
        (self.root / "edge.token").write_text(EDGE + "\n")
        (self.root / "tokens").chmod(0o600)
        port = free_port()
        self.origin = Node("origin", ["origin", "serve", "--model", self.model, "--registry", self.etcd.registry,
                                      "--store", str(self.root / "origin-store"), "--port", str(port),
                                      "--node-id", "origin-1", "--token-file", str(self.root / "tokens"),
                                      "--records", self.records, "--raw-copies", "always"],
                           port, self.root / "origin.log")
        for region, n in self.regions.items():
            for i in range(1, n + 1):
                name = f"{region}-{i}"
                port = free_port()
                disk = self.disks.get(name, self.root / f"disk-{name}")
                self.edges[name] = Node(name, [
                    "edge", "serve", "--region", region, "--registry", self.etcd.registry, "--port", str(port),
                    "--node-id", name, "--mem-budget", self.mem_budget, "--disk", str(disk),
                    "--disk-budget", self.disk_budget, "--lease-ttl", self.lease_ttl, "--prefetch", "0",
                    "--token-file", str(self.root / "tokens"), "--upstream-token-file", str(self.root / "edge.token"),
                    *self.edge_args, *self.per_edge_args.get(name, []),
                ], port, self.root / f"{name}.log")

    def open_records(self):
        """The origin's object records where it keeps them (``bench/lib/origin_records.py``)."""
        from origin_records import open_records

        return open_records(self.etcd.registry, self.root / "origin-store" if self.records == "store" else None)

    async def start(self) -> None:
        await asyncio.to_thread(self.etcd.start)
        await self.origin.start(timeout=120)
        for e in self.edges.values():
            e.spawn()
        for e in self.edges.values():
            await e.wait_healthy()
        await self.wait_rings()

    async def close(self) -> None:
        for n in [*self.edges.values(), self.origin]:
            n.stop()
        await asyncio.to_thread(self.etcd.stop)

    def region_of(self, edge: str) -> str:
        return edge.rsplit("-", 1)[0]

    def live_edges(self, region: str | None = None) -> list[Node]:
        return [e for n, e in self.edges.items() if e.alive and (region is None or self.region_of(n) == region)]

    async def ring(self, region: str) -> list[str]:
        from kdn.registry import open_registry

        async with open_registry(self.etcd.registry) as reg:
            return sorted(n.node_id for n in await reg.list_nodes("edge", region))

    async def wait_rings(self, timeout: float = 30.0) -> float:
        """Until every region's registered edges are exactly its live ones; the seconds it took."""
        t0 = time.monotonic()
        while True:
            ok = True
            for region in self.regions:
                want = sorted(e.name for e in self.live_edges(region))
                try:
                    ok = ok and await self.ring(region) == want
                except Exception:  # noqa: BLE001 - etcd may be down: not healed yet
                    ok = False
            if ok:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"rings did not settle in {timeout} s")
            await asyncio.sleep(0.1)

    async def publish(self, text: str, name: str, encodings: tuple[str, ...] = ("zstd",), timeout: float = 180) -> dict:
        """Publish through the origin, wait for the job, and record each address's digest from its record."""
        async with aiohttp.ClientSession(self.origin.url, headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
            manifest = await publish_and_wait(s, {"name": name, "text": text, "encodings": list(encodings)},
                                              timeout=timeout)
        missing = await self.record_digests(manifest["addresses"], encodings[0])
        assert not missing, f"the manifest names {len(missing)} addresses without a record"
        return manifest

    async def record_digests(self, addresses: list[str], enc: str = "zstd") -> list[str]:
        """Record each address's digest from its record, for the readers; the addresses that have no record."""
        missing = []
        async with self.open_records() as reg:
            for a in addresses:
                rec = await reg.get_object(a)
                if rec is None or enc not in rec.encodings:
                    missing.append(a)
                    continue
                self.digests[a] = (enc, rec.encodings[enc].digest, rec.encodings[enc].size)
        return missing


    async def ring_sizes(self) -> dict[str, float]:
        """Each live edge's own view: its ``kdn_edge_ring_members`` (the live edges of its region it sees)."""
        return {e.name: await e.metric("kdn_edge_ring_members") for e in self.live_edges()}

    async def rings_seen(self, timeout: float = 30.0) -> float:
        """Until every live edge sees exactly its region's live edges (by its own gauge); the seconds it took."""
        t0 = time.monotonic()
        while True:
            want = {e.name: float(len(self.live_edges(self.region_of(e.name)))) for e in self.live_edges()}
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                if await self.ring_sizes() == want:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"edges' rings did not settle in {timeout} s")
            await asyncio.sleep(0.05)


class RingWatch:
    """Who is in the registry's rings, second by second, as a watcher of ``nodes/edge/`` sees it: for each
    edge, the longest time its key was absent (deleted, then put again; or still absent at the end).

    It runs in this process on its own registry client (``url``: give it the members in another order than
    the nodes, so that it does not fail with theirs)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.known: set[str] = set()  # every edge seen registered
        self.absent_since: dict[str, float] = {}
        self.longest: dict[str, float] = {}
        self.deletes = 0
        self._task: asyncio.Task | None = None
        self._reg = None

    def _on(self, ev) -> None:
        now = time.monotonic()
        if ev.kind == "snapshot":  # the first, or a re-list after this watcher's own member failed
            present = {k.rsplit("/", 1)[-1] for k in ev.items}
            for name in self.known - present:  # gone while we were not watching: absent from now on, at least
                self.absent_since.setdefault(name, now)
            for name in present & set(self.absent_since):
                self._back(name, now)
            self.known |= present
            return
        name = ev.key.rsplit("/", 1)[-1]
        self.known.add(name)
        if ev.kind == "delete":
            self.deletes += 1
            self.absent_since.setdefault(name, now)
        elif name in self.absent_since:
            self._back(name, now)

    def _back(self, name: str, now: float) -> None:
        gone = now - self.absent_since.pop(name)
        self.longest[name] = max(self.longest.get(name, 0.0), gone)

    def longest_absence(self) -> float:
        now = time.monotonic()
        still = [now - t for t in self.absent_since.values()]
        return round(max([*self.longest.values(), *still, 0.0]), 2)

    async def __aenter__(self) -> RingWatch:
        from kdn.registry import open_registry
        from kdn.registry.follow import follow

        self._reg = open_registry(self.url)
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(follow(self._reg, "nodes/edge/", self._on, what="ring watch", ready=ready,
                                                backoff=(0.05, 0.5)))
        await asyncio.wait_for(ready, 30)
        return self

    async def __aexit__(self, *exc) -> None:
        from kdn.registry.follow import stop_tasks

        await stop_tasks([self._task], what="ring watch")
        await self._reg.close()


# --- readers ------------------------------------------------------------------------------


@dataclass
class Stats:
    reads: int = 0
    failed: int = 0  # no edge of the region answered 200
    wrong: int = 0  # a 200 whose bytes do not match the digest recorded at publish time
    retried: int = 0  # first edge failed, another answered
    latencies: list[float] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, why), first 200
    statuses: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failed += 1
        self.statuses[why] = self.statuses.get(why, 0) + 1
        if len(self.failures) < 200:
            self.failures.append((time.monotonic(), why))

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


class Readers:
    """Concurrent readers, each in a region, reading addresses at random through that region's live edges.

    A read tries one live edge of its region, and on a connection error or a 5xx one other
    (what a client with two edges configured does); it is *failed* if neither answers 200.
    Every 200 body is hashed and compared with the digest recorded at publish time.
    """

    def __init__(self, world: World, addresses: list[str], *, per_region: int = 4, pause: float = 0.0,
                 seed: int = 0, timeout: float = 10.0, token: str | None = None) -> None:
        self.world, self.addresses = world, list(addresses)
        self.per_region, self.pause, self.timeout = per_region, pause, timeout
        self.rng = random.Random(seed)
        self.stats = Stats()
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._stop = asyncio.Event()

    async def _read_once(self, s: aiohttp.ClientSession, region: str, address: str) -> None:
        enc, digest, size = self.world.digests[address]
        edges = self.world.live_edges(region)
        self.rng.shuffle(edges)
        t0 = time.monotonic()
        why = "no live edge"
        for attempt, edge in enumerate(edges[:2]):
            try:
                async with s.get(f"{edge.url}/v1/objects/{address}", params={"encoding": enc},
                                 headers=self.headers) as r:
                    body = await r.read()
                    if r.status == 200:
                        self.stats.reads += 1
                        if len(body) != size or blake3(body).hexdigest() != digest:
                            self.stats.wrong += 1
                        self.stats.latencies.append(time.monotonic() - t0)
                        self.stats.retried += attempt > 0
                        return
                    why = f"http {r.status}"
                    if r.status < 500:
                        break  # a 4xx is an answer, not a dead edge
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                why = type(e).__name__
        self.stats.reads += 1
        self.stats.fail(why)

    async def _reader(self, region: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout, sock_connect=2)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while not self._stop.is_set():
                await self._read_once(s, region, self.rng.choice(self.addresses))
                if self.pause:
                    await asyncio.sleep(self.pause)
                else:
                    await asyncio.sleep(0)

    @contextlib.asynccontextmanager
    async def running(self):
        self._stop.clear()
        tasks = [asyncio.create_task(self._reader(r)) for r in self.world.regions for _ in range(self.per_region)]
        try:
            yield self.stats
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def read_all(self, region: str) -> Stats:
        """Read every address once through ``region`` (warming, or a check after a fault)."""
        before = Stats(**{k: v for k, v in vars(self.stats).items()})
        self.stats = Stats()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as s:
            for a in self.addresses:
                await self._read_once(s, region, a)
        got, self.stats = self.stats, before
        return got


class ClientReaders:
    """Readers that fetch like an inference server does: ``kdn.client.KDNClient`` (sources ranked by
    measured time, a slow request hedged to the next source, failover on error), one client each.

    ``make_client()`` builds a reader's client. Every body is hashed again here and compared with the
    digest recorded at publish time. Latencies and where each read came from are kept per ``phase``
    (set it between the phases of a fault).
    """

    def __init__(self, world: World, addresses: list[str], make_client, *, n: int = 4, seed: int = 0) -> None:
        self.world, self.addresses, self.make_client, self.n = world, list(addresses), make_client, n
        self.rng = random.Random(seed)
        self.phase = "before"
        self.stats = Stats()
        self.by_phase: dict[str, Stats] = {}
        self.sources: dict[str, dict[str, int]] = {}  # phase -> where the winning body came from -> reads
        self.clients: list = []
        self._stop = asyncio.Event()

    @property
    def hedges(self) -> int:
        return sum(c.hedges for c in self.clients)

    @property
    def failovers(self) -> int:
        return sum(c.failovers for c in self.clients)

    async def _reader(self) -> None:
        from kdn.errors import DigestMismatch, SourceError

        client = self.make_client()
        self.clients.append(client)
        try:
            while not self._stop.is_set():
                address = self.rng.choice(self.addresses)
                enc, digest, size = self.world.digests[address]
                phase = self.phase
                ps = self.by_phase.setdefault(phase, Stats())
                t0 = time.monotonic()
                try:
                    f = await client.fetch(address, encoding=enc, digest=digest, size=size)
                except (SourceError, DigestMismatch) as e:
                    for st in (self.stats, ps):
                        st.reads += 1
                        st.fail(type(e).__name__)
                    continue
                dt = time.monotonic() - t0
                bad = len(f.blob) != size or blake3(f.blob).hexdigest() != digest
                for st in (self.stats, ps):
                    st.reads += 1
                    st.wrong += bad
                    st.latencies.append(dt)
                src = self.sources.setdefault(phase, {})
                label = f.source.split("/", 1)[0]
                src[label] = src.get(label, 0) + 1
                await asyncio.sleep(0)
        finally:
            await client.close()

    @contextlib.asynccontextmanager
    async def running(self):
        self._stop.clear()
        tasks = [asyncio.create_task(self._reader()) for _ in range(self.n)]
        try:
            yield self.stats
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)


# --- tmpfs --------------------------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (root only): a disk tier that runs out of space."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs at {path} (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def can_mount() -> bool:
    probe = Path(f"/tmp/kdn-mount-probe-{os.getpid()}")
    try:
        with small_filesystem(probe, "64k"):
            return True
    except PermissionError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
