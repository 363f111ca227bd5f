"""Faults under load: each scenario runs a KDN of real processes while readers keep reading, injects one
fault, and measures reads failed, wrong bytes served, and the time to heal.

    python -P bench/faults.py                      # every scenario, full durations (a few minutes)
    python -P bench/faults.py --quick              # the durations CI uses (tests/faults/)
    python -P bench/faults.py --only etcd_down     # one scenario
    python -P bench/faults.py --json out.json

Every process is on 127.0.0.1 under a temp folder (faultlib.World); faults go to PIDs. A read
is *failed* when no live edge of the reader's region answers 200 (a reader tries two, as a
client with two edges does); *wrong* when a 200's bytes differ from the digest recorded at
publish time, before any fault. The disk-full scenario needs root (a size-limited tmpfs).
The results table is the one in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_here = Path(__file__).resolve().parent
for _p in (_here, _here / "lib"):  # bench/ and bench/lib/ (linkemu); run as a script bench/ is there already,
    if str(_p) not in sys.path:      # imported by tests/faults it is not
        sys.path.insert(0, str(_p))

import faultlib as F  # noqa: E402
from linkemu import LinkEmulator  # noqa: E402
import results as R  # noqa: E402

# Texts that fill tiny-llama's 4096-token context about 85%: 13 chunks each.
PARAGRAPH = ("The keeper's log for the north light: wind, weather, ships sighted, oil burned, the lens cleaned "
             "at dawn, and the fog signal sounded when the light could not be seen from the harbor wall. ")


def text(n: int) -> str:
    return f"Volume {n}. " + (PARAGRAPH * 20)[:3400]


@dataclass
class Row:
    scenario: str
    what: str  # what happened, in words
    reads: int = 0
    failed: int = 0
    wrong: int = 0
    heal_s: float | None = None  # fault cleared -> healed (see each scenario)
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    notes: dict = field(default_factory=dict)
    expect_failed: int | None = 0  # the goal for `failed`: 0 where a source stays alive
    failed_why: dict = field(default_factory=dict)  # failed reads by the last answer's reason (not in the table)

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and (self.expect_failed is None or self.failed <= self.expect_failed)


def _row(name: str, what: str, stats, **kw) -> Row:
    return Row(name, what, stats.reads, stats.failed, stats.wrong, p50_ms=stats.pct(0.5) * 1e3,
               p99_ms=stats.pct(0.99) * 1e3, failed_why=dict(stats.statuses), **kw)


async def _world(tmp: Path, **kw):
    w = F.World(tmp, **kw)
    await w.start()
    return w


# --- scenarios -------------------------------------------------------------------------------


async def owner_killed(tmp: Path, quick: bool) -> Row:
    """The owner of addresses SIGKILLed while readers fill through it: fills fall back, then the ring heals.

    The edges reach the origin over an emulated link (20 ms each way, 50 Mbit/s), so a fill takes tens of
    milliseconds and some are in flight through the victim when it dies."""
    link_port = F.free_port()
    w = F.World(tmp, regions={"eu": 3}, edge_args=["--origin", f"http://127.0.0.1:{link_port}"])
    link = LinkEmulator(link_port, "127.0.0.1", w.origin.port, delay_ms=20, mbit=50)
    await link.start()
    try:
        await w.start()
        m = await w.publish(text(1), "vol1")
        m2 = await w.publish(text(21), "vol21")
        r = F.Readers(w, m["addresses"] + m2["addresses"], per_region=6)
        async with r.running() as stats:
            await asyncio.sleep(0.15)  # cold: reads are filling through their owners now
            victim = w.edges["eu-2"]
            victim.kill()
            t_kill = time.monotonic()
            await w.wait_rings(timeout=30)
            heal = time.monotonic() - t_kill
            await asyncio.sleep(1.0 if quick else 5.0)
        peer_errors = sum([await e.metric("kdn_edge_source_errors", source="peer") for e in w.live_edges()])
        return _row("owner_killed", "owner SIGKILLed mid-fill (origin 20 ms away); its peers fall back to the origin, "
                    "then take its share when its lease expires (TTL 2 s; heal = kill to ring settled)", stats,
                    heal_s=heal, notes={"fills_from_dead_owner_failed": peer_errors,
                                        "reads_retried_on_2nd_edge": stats.retried})
    finally:
        await w.close()
        await link.stop()


async def lying_peer(tmp: Path, quick: bool) -> Row:
    """A registered 'edge' that serves flipped bytes for everything it owns: never passed on."""
    from aiohttp import web

    from kdn.registry import NodeRecord, open_registry

    w = await _world(tmp, regions={"eu": 2})
    reg = None
    runner = None
    try:
        m = await w.publish(text(2), "vol2")

        async def liar(request: web.Request) -> web.Response:
            import aiohttp

            async with aiohttp.ClientSession() as s:
                async with s.get(f"{w.origin.url}/v1/objects/{request.match_info['address']}", params=request.query,
                                 headers={"Authorization": f"Bearer {F.EDGE}"}) as up:
                    body = bytearray(await up.read())
            body[len(body) // 2] ^= 0x40
            return web.Response(body=bytes(body))

        app = web.Application()
        app.router.add_get("/v1/objects/{address}", liar)
        runner = web.AppRunner(app)
        await runner.setup()
        port = F.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        reg = open_registry(w.etcd.registry)
        lease = await reg.register_node(NodeRecord("edge", "eu", "liar", f"http://127.0.0.1:{port}"), ttl=10)
        await asyncio.sleep(1.0)  # the edges see the liar in their ring
        r = F.Readers(w, m["addresses"], per_region=4)
        async with r.running() as stats:
            await asyncio.sleep(2.0 if quick else 10.0)
        refused = sum([await e.metric("kdn_edge_digest_failures") for e in w.edges.values()])
        await lease.close()
        return _row("lying_peer", "a registered peer serves one flipped byte in every object it owns; edges "
                    "verify, count it and fill from the origin", stats, notes={"digest_failures": refused})
    finally:
        if reg is not None:
            await reg.close()
        if runner is not None:
            await runner.cleanup()
        await w.close()


async def etcd_down(tmp: Path, quick: bool) -> Row:
    """etcd stopped while readers read a warm working set; back after `down` s, compacted at once."""
    down = 5.0 if quick else 30.0
    w = await _world(tmp, regions={"eu": 2, "us": 2})
    try:
        m = await w.publish(text(3), "vol3")
        r = F.Readers(w, m["addresses"], per_region=4)
        for region in w.regions:  # warm: records and bytes at the edges
            warm = await r.read_all(region)
            assert warm.failed == 0 and warm.wrong == 0, vars(warm)
        async with r.running() as stats:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(w.etcd.stop)
            await asyncio.sleep(down)
            await asyncio.to_thread(w.etcd.start)
            t_back = time.monotonic()
            await asyncio.to_thread(w.etcd.compact_now)  # watches resuming from their revision must re-list
            m2 = await w.publish(text(4), "vol4")  # a write after the outage
            heal = await w.wait_rings(timeout=60)
            # the new manifest reaches readers through the edges (records watched and fetched again)
            r2 = F.Readers(w, m2["addresses"], per_region=1)
            after = await r2.read_all("us")
            healed = time.monotonic() - t_back
            await asyncio.sleep(0.5)
        stats.reads += after.reads
        stats.failed += after.failed
        stats.wrong += after.wrong
        return _row("etcd_down", f"etcd stopped {down:.0f} s under load, then back and compacted at once: "
                    "edges serve the warm set throughout; rings, writes and new records resume", stats,
                    heal_s=healed, notes={"rings_ok_after_s": round(heal, 2)})
    finally:
        await w.close()


async def etcd_restored(tmp: Path, quick: bool) -> Row:
    """etcd lost and restored from a snapshot taken before a later publish: the later records are gone,
    what the snapshot holds is served, and publishing again restores the rest."""
    w = await _world(tmp, regions={"eu": 2})
    try:
        m1 = await w.publish(text(5), "vol5")
        snap = tmp / "etcd.snap"
        await asyncio.to_thread(w.etcd.snapshot, snap)
        m2 = await w.publish(text(6), "vol6")
        r = F.Readers(w, m1["addresses"], per_region=4)
        async with r.running() as stats:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(w.etcd.stop)
            await asyncio.to_thread(w.etcd.restore, snap)
            await asyncio.to_thread(w.etcd.start, new=False)
            t_back = time.monotonic()
            heal = await w.wait_rings(timeout=60)
            await asyncio.sleep(1.0 if quick else 5.0)
        await w.publish(text(6), "vol6")  # the lost records, written again
        after = await F.Readers(w, m2["addresses"]).read_all("eu")
        return _row("etcd_restored", "etcd replaced by a snapshot older than the last publish: the snapshot's "
                    "objects keep serving; a re-publish brings the rest back", stats, heal_s=heal,
                    notes={"rings_ok_after_restore_s": round(time.monotonic() - t_back, 2),
                           "republished_reads_failed": after.failed, "republished_wrong": after.wrong})
    finally:
        await w.close()


async def origin_down(tmp: Path, quick: bool) -> Row:
    """The origin SIGKILLed: hot objects keep serving, cold ones answer a clear 503, publishes fail cleanly;
    the origin restarted, cold objects serve again."""
    import aiohttp

    w = await _world(tmp, regions={"eu": 2})
    try:
        m = await w.publish(text(7), "vol7")
        hot, cold = m["addresses"][::2], m["addresses"][1::2]
        r = F.Readers(w, hot, per_region=4)
        warm = await r.read_all("eu")
        assert warm.failed == 0, vars(warm)
        async with r.running() as stats:
            await asyncio.sleep(0.3)
            w.origin.kill()
            await asyncio.sleep(2.0 if quick else 10.0)
            cold_reads = await F.Readers(w, cold).read_all("eu")
            publish_error = None
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"{w.origin.url}/v1/publish", json={"name": "x", "text": "y"}) as resp:
                        publish_error = f"http {resp.status}"
            except aiohttp.ClientError as e:
                publish_error = type(e).__name__
            await w.origin.start(timeout=120)
            t_back = time.monotonic()
            while True:  # healed: a cold object serves again
                again = await F.Readers(w, cold[:1]).read_all("eu")
                if again.failed == 0:
                    break
                await asyncio.sleep(0.2)
            heal = time.monotonic() - t_back
        return _row("origin_down", "origin SIGKILLed: the hot half keeps serving from the edges; each cold read is "
                    "a 503 until the origin is back", stats, heal_s=heal,
                    notes={"cold_reads": cold_reads.reads, "cold_statuses": cold_reads.statuses,
                           "cold_wrong": cold_reads.wrong, "publish_while_down": publish_error})
    finally:
        await w.close()


async def disk_full(tmp: Path, quick: bool) -> Row:
    """The owner's disk tier on a 1 MiB tmpfs (budget 256 MiB): writes fail, memory keeps serving."""
    disk = tmp / "small-disk"
    with F.small_filesystem(disk, "1m"):
        w = await _world(tmp, regions={"eu": 1}, disks={"eu-1": disk})
        try:
            m1 = await w.publish(text(8), "vol8")
            m2 = await w.publish(text(9), "vol9")
            r = F.Readers(w, m1["addresses"] + m2["addresses"], per_region=4)
            async with r.running() as stats:
                await asyncio.sleep(2.0 if quick else 10.0)
            edge = w.edges["eu-1"]
            errors = await edge.metric("kdn_edge_disk_write_errors")
            alive = edge.alive
            leftovers = [p.name for p in disk.rglob("*.part")]
            edge.stop()  # and after a restart, only whole blobs are found and served
            await edge.start()
            after = await r.read_all("eu")
            return _row("disk_full", "the disk tier's file system fills (1 MiB tmpfs under a 256 MiB budget): "
                        "writes fail and are counted, memory and the origin keep serving", stats,
                        notes={"disk_write_errors": errors, "edge_alive": alive, "temp_files_left": len(leftovers),
                               "after_restart_failed": after.failed, "after_restart_wrong": after.wrong})
        finally:
            await w.close()


async def kill_during_write(tmp: Path, quick: bool) -> Row:
    """An edge SIGKILLed while it writes its disk tier, restarted on the same folder; the origin SIGKILLed
    in the middle of a publish, restarted, the publish repeated. Nothing half-written is ever served."""
    w = await _world(tmp, regions={"eu": 2})
    try:
        docs = [await w.publish(text(10 + i), f"vol{10 + i}") for i in range(2)]
        addrs = [a for d in docs for a in d["addresses"]]
        r = F.Readers(w, addrs, per_region=6)
        edge = w.edges["eu-1"]
        async with r.running() as stats:
            await asyncio.sleep(0.4)  # cold reads: the owner is writing blobs to disk
            edge.kill()
            await edge.start()
            t_back = time.monotonic()
            await asyncio.sleep(1.0 if quick else 5.0)
        heal = time.monotonic() - t_back
        leftovers = len(list((tmp / "disk-eu-1").rglob("*.part")))
        # the origin, killed mid-publish: as soon as its job has stored a first chunk
        interrupted = await _kill_mid_publish(w, text(20), "vol20")
        await w.origin.start(timeout=120)
        m = await w.publish(text(20), "vol20")
        after = await F.Readers(w, m["addresses"]).read_all("eu")
        stats.reads += after.reads
        stats.failed += after.failed
        stats.wrong += after.wrong
        return _row("kill_during_write", "edge SIGKILLed while writing its disk tier and restarted on it; origin "
                    "SIGKILLed mid-publish, restarted, publish repeated", stats, heal_s=heal,
                    notes={"edge_temp_files_after_restart": leftovers, "publish_interrupted": interrupted,
                           "reads_retried_on_2nd_edge": stats.retried})
    finally:
        await w.close()


async def _kill_mid_publish(w, body_text: str, name: str) -> bool:
    """Start a publish, SIGKILL the origin once the job has stored one chunk and not all; True if it was
    interrupted (the job seen running with chunks left)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {F.PUBLISH}"}
    async with aiohttp.ClientSession(w.origin.url, headers=headers) as s:
        async with s.post("/v1/publish", json={"name": name, "text": body_text, "encodings": ["zstd", "raw"]}) as r:
            job = (await r.json())["job"]
        for _ in range(24_000):  # 2 minutes at most (the poll's own time aside)
            async with s.get(f"/v1/jobs/{job}") as r:
                state = await r.json()
            progress = state["progress"]
            if state["state"] in ("done", "failed"):
                return False
            if progress["done"] >= 1 and progress["done"] < progress["total"]:
                w.origin.kill()
                return True
            await asyncio.sleep(0.005)
    raise RuntimeError(f"publish job {job} stored no chunk in 2 minutes: {state}")


async def _after(seconds: float, coro) -> None:
    await asyncio.sleep(seconds)
    await coro


async def slow_region_link(tmp: Path, quick: bool) -> Row:
    """Clients in region a read objects whose nearest copy is in region b, over an emulated inter-region
    link that is slowed, then stalled outright, then restored; the origin is farther but stays up.

    Topology: a-1 (region a) cannot keep the objects (its tiers are smaller than one object: a region
    whose working set far exceeds its cache), so every read in a crosses to b; b-1 holds them all in
    memory and advertises its URL through a link (10 ms each way, 400 Mbit/s), so a-1's cached-only
    probes and the clients' direct asks both pay it; the origin sits behind its own link (30 ms,
    100 Mbit/s). Clients are ``KDNClient``s with a-1 as their edge, b-1 as a remote edge and the origin:
    ranked, hedged at 2x the expected time, failing over on error (kdn/client/client.py)."""
    from kdn.client import KDNClient

    phase_s = 3.0 if quick else 10.0
    olink_port, blink_port = F.free_port(), F.free_port()
    w = F.World(tmp, regions={"a": 1, "b": 1}, edge_args=["--origin", f"http://127.0.0.1:{olink_port}"],
                per_edge_args={"a-1": ["--mem-budget", "16KiB", "--disk-budget", "16KiB"],
                               "b-1": ["--url", f"http://127.0.0.1:{blink_port}"]})
    olink = LinkEmulator(olink_port, "127.0.0.1", w.origin.port, delay_ms=30, mbit=100)
    blink = LinkEmulator(blink_port, "127.0.0.1", w.edges["b-1"].port, delay_ms=10, mbit=400)
    await olink.start()
    await blink.start()
    try:
        await w.start()
        m = await w.publish(text(30), "vol30")
        m2 = await w.publish(text(31), "vol31")
        addrs = m["addresses"] + m2["addresses"]
        warm = await F.Readers(w, addrs).read_all("b")  # b-1 holds every object
        assert warm.failed == 0 and warm.wrong == 0, vars(warm)
        a1 = w.edges["a-1"]
        r = F.ClientReaders(w, addrs, lambda: KDNClient(edges=[("a-1", a1.url)], remote_edges=[blink.url],
                                                       origin=olink.url, timeout=10.0), n=4)
        hedges = {}
        plain: dict[str, str] = {}

        async def plain_read(phase: str) -> None:
            """One read of a-1 with no hedging (curl, or a client given one edge): what the edge itself does."""
            import aiohttp

            enc = w.digests[addrs[0]][0]
            t0 = time.monotonic()
            try:
                # 10 s: well under the 30 s fill timeout a stalled probe once cost, and above the probe's
                # bound (2 s, or 4x the region's expected time, which the slowed phase raises).
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as s:
                    async with s.get(f"{a1.url}/v1/objects/{addrs[0]}", params={"encoding": enc}) as resp:
                        await resp.read()
                        plain[phase] = f"http {resp.status} in {(time.monotonic() - t0) * 1e3:.0f} ms"
            except asyncio.TimeoutError:
                plain[phase] = "no answer in 10 s"

        async with r.running() as stats:
            for phase, fault in (("normal", None), ("slowed", lambda: blink.set_profile(150, 8)),
                                 ("stalled", blink.stall), ("restored", lambda: (blink.set_profile(10, 400),
                                                                                  blink.resume()))):
                if fault is not None:
                    fault()
                r.phase = phase
                h0 = r.hedges
                await asyncio.gather(asyncio.sleep(phase_s), plain_read(phase),
                                     # mid-phase and late: after a few failed probes a stalled region rests (the
                                     # breaker); when its probes end depends on the machine's load, so twice
                                     _after(phase_s / 2, plain_read(f"{phase} (mid)")),
                                     _after(phase_s * 0.85, plain_read(f"{phase} (late)")))
                hedges[phase] = r.hedges - h0
        region_errors = await a1.metric("kdn_edge_source_errors", source="region")
        region_fills = await a1.metric("kdn_edge_fill_bytes", source="region")
        region_skipped = await a1.metric("kdn_edge_region_probes_skipped")
        not_worth = await a1.metric("kdn_edge_region_probes_not_worth")
        notes = {}
        for phase, st in r.by_phase.items():
            notes[f"{phase}_p50_p99_ms"] = f"{st.pct(0.5) * 1e3:.0f}/{st.pct(0.99) * 1e3:.0f}"
            notes[f"{phase}_max_ms"] = round(max(st.latencies, default=float("nan")) * 1e3)
            notes[f"{phase}_failed"] = st.failed
            notes[f"{phase}_sources"] = r.sources.get(phase, {})
            notes[f"{phase}_hedges"] = hedges.get(phase, 0)
        notes.update(a1_region_errors=region_errors, a1_region_fill_bytes=region_fills,
                     a1_region_probes_skipped=region_skipped, a1_region_probes_not_worth=not_worth,
                     failovers=r.failovers, plain_read_of_a1=plain)
        return _row("slow_region_link", "clients in region a read objects held in region b over an emulated link: "
                    "slowed (150 ms each way, 8 Mbit/s), then stalled, then restored; hedges and failover to "
                    "the origin (30 ms away) carry the reads", stats, notes=notes)
    finally:
        await w.close()
        await blink.stop()
        await olink.stop()


async def warm_disk_restart(tmp: Path, quick: bool) -> Row:
    """An edge whose disk tier holds every object SIGKILLed, one blob corrupted on its disk while it is down,
    restarted on the same folder: the warm objects serve from disk at once, the corrupted one is never served
    (its digest is checked at its first read after the restart) and is the only object fetched upstream again."""
    import aiohttp
    from blake3 import blake3

    w = await _world(tmp, regions={"eu": 1})
    try:
        docs = [await w.publish(text(40 + i), f"vol{40 + i}") for i in range(2)]
        addrs = [a for d in docs for a in d["addresses"]]
        r = F.Readers(w, addrs, per_region=4)
        warm = await r.read_all("eu")  # the only edge owns everything: each blob goes to its disk too
        assert warm.failed == 0 and warm.wrong == 0, vars(warm)
        edge, disk = w.edges["eu-1"], tmp / "disk-eu-1"
        enc = w.digests[addrs[0]][0]
        deadline = time.monotonic() + 30
        while len(list(disk.rglob(f"*.{enc}"))) < len(addrs):  # the disk copies are written off the response path
            assert time.monotonic() < deadline, "the disk tier never held every object"
            await asyncio.sleep(0.05)
        edge.kill()
        victim = addrs[len(addrs) // 2]
        path = next(disk.rglob(f"{victim}.{enc}"))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01  # bit rot while it was down: same size, other bytes
        path.write_bytes(bytes(data))
        t0 = time.monotonic()
        edge.spawn()
        await edge.wait_healthy()
        ready = time.monotonic() - t0
        first_ttfb = first_total = None
        passes: list[dict[str, int]] = []
        wrong = failed = reads = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for n in range(2):  # once through every object (disk), then again (memory: promoted)
                by_source: dict[str, int] = {}
                for a in addrs:
                    _, digest, size = w.digests[a]
                    t = time.monotonic()
                    async with s.get(f"{edge.url}/v1/objects/{a}", params={"encoding": enc}) as resp:
                        ttfb = time.monotonic() - t
                        body = await resp.read()
                        reads += 1
                        if resp.status != 200:
                            failed += 1
                            continue
                        wrong += len(body) != size or blake3(body).hexdigest() != digest
                        src = resp.headers.get("X-KDN-Source", "?").split(":", 1)[0]
                        by_source[src] = by_source.get(src, 0) + 1
                    if first_ttfb is None:
                        first_ttfb, first_total = ttfb, time.monotonic() - t0
                passes.append(by_source)
                if n == 0:
                    await asyncio.sleep(0.3)  # let the promotions to memory land
        async with r.running() as stats:  # then load, as before the kill
            await asyncio.sleep(1.0 if quick else 5.0)
        stats.reads += reads
        stats.failed += failed
        stats.wrong += wrong
        refetched = await edge.metric("kdn_edge_fill_bytes", source="origin")
        _, _, victim_size = w.digests[victim]
        return _row("warm_disk_restart", "an edge with every object on its disk tier SIGKILLed, one blob corrupted "
                    "while it is down, restarted on the same folder (heal = spawn to healthy)", stats, heal_s=ready,
                    notes={"objects": len(addrs), "first_pass_sources": passes[0], "second_pass_sources": passes[1],
                           "first_byte_ms": round(first_ttfb * 1e3, 1),
                           "spawn_to_first_body_s": round(first_total, 2),
                           "bytes_refetched_from_origin": int(refetched), "corrupted_blob_bytes": victim_size,
                           "disk_corrupt": await edge.metric("kdn_edge_disk_corrupt")})
    finally:
        await w.close()


async def _ttl_world(tmp: Path, ttl: float, offset: str, vol: int) -> tuple[F.World, Path, list[str]]:
    """One edge whose wall clock is offset by a file's value (bench/lib/clockhook.py; ``offset`` at start), one
    published document, and a TTL policy of ``ttl`` seconds on ``public`` that the edge has taken in."""
    from kdn.registry import Policy, open_registry

    path = tmp / "wall-offset"
    path.write_text(offset)
    w = F.World(tmp, regions={"eu": 1})
    w.edges["eu-1"].launcher = [str(Path(__file__).resolve().parent / "lib" / "clockhook.py"), str(path)]
    await w.start()
    try:
        m = await w.publish(text(vol), f"vol{vol}")
        reg = open_registry(w.etcd.registry)
        try:
            await reg.put_policy(Policy(name="short", kind="ttl", namespace="public", ttl_s=ttl))
        finally:
            await reg.close()
        await asyncio.sleep(1.0)  # the policy reaches the edge through its watch
    except BaseException:
        await w.close()
        raise
    return w, path, m["addresses"]


async def clock_jump(tmp: Path, quick: bool) -> Row:
    """The edge's wall clock stepped forward an hour, then back two hours (an hour behind), under a TTL policy,
    while readers keep reading: each object must still leave the cache about ``ttl`` after it came in --
    neither all at once at the forward step nor never after the backward one -- and no wrong byte.

    The step is a test hook the edge runs under (bench/lib/clockhook.py: ``time.time`` offset by a file's value in that
    process, what an NTP step does to it; ``time.monotonic`` untouched). A read that fills (X-KDN-Source
    origin) marks the object's insertion; a later hit (memory, disk) is *past its TTL* if it began more than
    ``ttl + 1 s`` (the expiry pass) + 0.5 s after the end of that fill, and a fill is *early* if it comes
    less than ``ttl - 0.5 s`` after the previous one."""
    import aiohttp
    from blake3 import blake3

    ttl, phase_s = (3.0, 4.0) if quick else (5.0, 20.0)
    w, offset, addrs = await _ttl_world(tmp, ttl, "0", 50)
    try:
        edge = w.edges["eu-1"]
        bound = ttl + 1.0 + 0.5
        last_fill: dict[str, float] = {}
        phase = "steady"
        out: dict[str, dict] = {}
        stats = F.Stats()
        stop = asyncio.Event()

        def note(key: str, n: int = 1) -> None:
            d = out.setdefault(phase, {"fills": 0, "hits": 0, "past_ttl": 0, "early_fills": 0, "max_hit_age_s": 0.0})
            d[key] += n

        async def reader(seed: int) -> None:
            import random

            rng = random.Random(seed)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                while not stop.is_set():
                    a = rng.choice(addrs)
                    enc, digest, size = w.digests[a]
                    t0 = time.monotonic()
                    try:
                        async with s.get(f"{edge.url}/v1/objects/{a}", params={"encoding": enc}) as resp:
                            body = await resp.read()
                            src = resp.headers.get("X-KDN-Source", "?").split(":", 1)[0]
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        stats.reads += 1
                        stats.fail(type(e).__name__)
                        continue
                    t1 = time.monotonic()
                    stats.reads += 1
                    if resp.status != 200:
                        stats.fail(f"http {resp.status}")
                        continue
                    stats.wrong += len(body) != size or blake3(body).hexdigest() != digest
                    stats.latencies.append(t1 - t0)
                    if src in ("memory", "disk"):
                        note("hits")
                        if a in last_fill:
                            age = t0 - last_fill[a]
                            d = out[phase]
                            d["max_hit_age_s"] = round(max(d["max_hit_age_s"], age), 2)
                            if age > bound:
                                note("past_ttl")
                    else:
                        note("fills")
                        # a fill that began before the previous one ended is the same fill (single flight)
                        if a in last_fill and 0 <= t0 - last_fill[a] < ttl - 0.5:
                            note("early_fills")
                        last_fill[a] = t1
                    await asyncio.sleep(0.005)

        async def one_s_after_a_fill_wave() -> None:
            """Every object is filled in one wave, each TTL: step the clock 1 s after one, when every entry is
            1 s old (a forward step that expired them would refill them all early)."""
            seen = max(last_fill.values(), default=0.0)
            deadline = time.monotonic() + 3 * ttl
            while max(last_fill.values(), default=0.0) == seen and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(reader(i)) for i in range(3)]
        try:
            await asyncio.sleep(phase_s)
            await one_s_after_a_fill_wave()
            phase = "forward_1h"
            offset.write_text("3600")
            await asyncio.sleep(phase_s)
            await one_s_after_a_fill_wave()
            phase = "back_to_minus_1h"
            offset.write_text("-3600")
            await asyncio.sleep(phase_s)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        notes = {f"{k}": v for k, v in out.items()}
        notes["ttl_evictions"] = await edge.metric("kdn_edge_evictions", reason="ttl")
        notes["ttl_s"] = ttl
        return _row("clock_jump", f"the edge's wall clock stepped +1 h, then to -1 h, under a {ttl:.0f} s TTL "
                    "policy: each object still leaves about ttl after it came in", stats, notes=notes)
    finally:
        await w.close()


async def clock_step_while_down(tmp: Path, quick: bool) -> Row:
    """The wall clock stepped while an edge was down, under a TTL policy, its disk tier warm.

    *Back*: the edge fills every object with its clock an hour ahead, is killed, and restarts with the right
    clock: its disk entries are stamped an hour in the future. Once more than ``ttl`` has passed since the
    fills, every object is read: an answer from the disk or memory tier is *past its TTL* (aged from the
    future stamp, it would live for the hour). *Forward*: filled with the right clock, restarted an hour
    ahead, read at once: the entries expire early (counted as refills; conservative, never stale)."""
    import aiohttp
    from blake3 import blake3

    ttl = 3.0 if quick else 5.0
    w, offset, addrs = await _ttl_world(tmp, ttl, "3600", 60)
    edge = w.edges["eu-1"]
    stats = F.Stats()
    notes: dict[str, object] = {"ttl_s": ttl}
    try:
        disk = tmp / "disk-eu-1"

        async def read_all(s) -> dict[str, int]:
            by_source: dict[str, int] = {}
            for a in addrs:
                enc, digest, size = w.digests[a]
                t0 = time.monotonic()
                stats.reads += 1
                try:
                    async with s.get(f"{edge.url}/v1/objects/{a}", params={"encoding": enc}) as resp:
                        body = await resp.read()
                        if resp.status != 200:
                            stats.fail(f"http {resp.status}")
                            continue
                        stats.wrong += len(body) != size or blake3(body).hexdigest() != digest
                        src = resp.headers.get("X-KDN-Source", "?").split(":", 1)[0]
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    stats.fail(type(e).__name__)
                    continue
                stats.latencies.append(time.monotonic() - t0)
                by_source[src] = by_source.get(src, 0) + 1
            return by_source

        async def on_disk() -> None:
            enc = w.digests[addrs[0]][0]
            deadline = time.monotonic() + 30
            while len(list(disk.rglob(f"*.{enc}"))) < len(addrs):  # written off the response path
                assert time.monotonic() < deadline, "the disk tier never held every object"
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for step, before, after in (("back", "3600", "0"), ("forward", "0", "3600")):
                offset.write_text(before)
                if step == "forward":
                    edge.kill()
                    edge.spawn()  # start clean-ish: the previous phase's entries are still on disk
                    await edge.wait_healthy()
                    await asyncio.sleep(ttl + 2.0)  # everything from the last phase has expired by now
                filled = await read_all(s)
                t_fill = time.monotonic()
                await on_disk()
                edge.kill()
                offset.write_text(after)
                edge.spawn()
                await edge.wait_healthy()
                if step == "back":
                    await asyncio.sleep(max(0.0, t_fill + ttl + 2.0 - time.monotonic()))  # truly past the TTL
                got = await read_all(s)
                cached = got.get("disk", 0) + got.get("memory", 0)
                notes[step] = {"fill": filled, "after_restart": got,
                               ("served_past_ttl" if step == "back" else "expired_early"):
                               cached if step == "back" else got.get("origin", 0)}
        notes["ttl_evictions"] = await edge.metric("kdn_edge_evictions", reason="ttl")
        return _row("clock_step_while_down",
                    f"the wall clock stepped -1 h, then +1 h, while the edge was down, its disk warm, under a "
                    f"{ttl:.0f} s TTL: no entry outlives its TTL", stats, notes=notes)
    finally:
        await w.close()


# --- a three-member etcd ---------------------------------------------------------------------
# Production runs etcd as three (or five) members; these scenarios run three. Every node is given all
# three, ``a`` first, and ``a`` is made the leader, so the fault lands on the member every node uses
# (the worst case for failover) and on the cluster's leader (an election follows).


async def _cluster_world(tmp: Path, **kw) -> F.World:
    """A World on a three-member etcd whose leader is ``a``, the member every node uses first."""
    w = F.World(tmp, etcd_members=3, **kw)
    await w.start()
    try:
        await asyncio.to_thread(w.etcd.make_leader, w.etcd.members[0])
    except BaseException:
        await w.close()
        raise
    return w


async def _elected(w: F.World, since: float) -> float:
    """Seconds from ``since`` until the members still running agree on a leader."""
    await asyncio.to_thread(w.etcd.leader, 30)
    return round(time.monotonic() - since, 2)


async def _put_policy(w: F.World, policy) -> int:
    """Write ``policy`` through a client that starts on member b, retrying while the cluster elects (bounded):
    what an operator re-running ``kdn policy set`` does. The attempts it took."""
    from kdn.errors import RegistryUnavailable
    from kdn.registry import open_registry

    reg = open_registry(w.etcd.registry_from(w.etcd.members[1]))
    try:
        for attempt in range(1, 31):
            try:
                await reg.put_policy(policy)
                return attempt
            except RegistryUnavailable:
                await asyncio.sleep(0.2)
        raise TimeoutError(f"policy {policy.name} not written in 30 attempts")
    finally:
        await reg.close()


async def _warmed_everywhere(w: F.World, since: float, edges: list[F.Node] | None = None,
                             timeout: float = 60.0) -> float:
    """Seconds from ``since`` until every one of ``edges`` (default: the live ones) has filled something for a
    warm policy: it got the policy."""
    deadline = time.monotonic() + timeout
    while True:
        counts = [await e.metric("kdn_edge_warmed") for e in (edges or w.live_edges())]
        if all(c > 0 for c in counts):
            return round(time.monotonic() - since, 2)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the warm policy did not reach every edge in {timeout} s: {counts}")
        await asyncio.sleep(0.05)


def _log_count(node: F.Node, needle: str) -> int:
    return node.log.read_text(errors="replace").count(needle)


async def _publish_with_fault(w: F.World, body_text: str, name: str, fault) -> tuple[str, float | None]:
    """Start a publish, call ``fault()`` once its job has stored one chunk and not all, and wait for the job's end:
    ("done" | "failed" | "finished first", seconds from the fault to the end)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {F.PUBLISH}"}
    async with aiohttp.ClientSession(w.origin.url, headers=headers) as s:
        async with s.post("/v1/publish", json={"name": name, "text": body_text, "encodings": ["zstd"]}) as r:
            job = (await r.json())["job"]
        t_fault = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            async with s.get(f"/v1/jobs/{job}") as r:
                state = await r.json()
            if state["state"] in ("done", "failed"):
                if t_fault is None:
                    return "finished first", None
                return state["state"], round(time.monotonic() - t_fault, 2)
            progress = state["progress"]
            if t_fault is None and 1 <= progress["done"] < progress["total"]:
                fault()
                t_fault = time.monotonic()
            await asyncio.sleep(0.005)
    raise TimeoutError(f"publish job {job} did not end in 180 s: {state}")


async def etcd_leader_killed_publish(tmp: Path, quick: bool) -> Row:
    """The etcd leader SIGKILLed in the middle of a publish whose object records go to etcd (``--records
    registry``): the job must land whole (every address its manifest names has its record, and reads back
    right) or fail with no manifest; readers of an earlier document never notice."""
    from kdn.registry import open_registry

    w = await _cluster_world(tmp, regions={"eu": 2}, records="registry")
    try:
        m = await w.publish(text(30), "vol30")
        r = F.Readers(w, m["addresses"], per_region=4)
        warm = await r.read_all("eu")
        assert warm.failed == 0 and warm.wrong == 0, vars(warm)
        leader = w.etcd.members[0]
        elect: list[asyncio.Task] = []

        def kill_leader() -> None:
            leader.kill()
            elect.append(asyncio.create_task(_elected(w, time.monotonic())))

        async with r.running() as stats:
            await asyncio.sleep(0.3)
            outcome, took = await _publish_with_fault(w, text(31), "vol31", kill_leader)
            elected = await elect[0] if elect else None
            await asyncio.to_thread(leader.start)  # back on its data: the cluster of three again
            await asyncio.sleep(0.5 if quick else 3.0)
        reg = open_registry(w.etcd.registry_from(w.etcd.members[1]))
        try:
            manifest = await reg.get_manifest("public", "vol31")
        finally:
            await reg.close()
        missing = await w.record_digests(manifest.addresses) if manifest is not None else []
        after = await F.Readers(w, manifest.addresses).read_all("eu") if manifest and not missing else F.Stats()
        stats.reads += after.reads
        stats.failed += after.failed
        stats.wrong += after.wrong
        whole = manifest is not None and not missing and after.failed == 0 and after.wrong == 0
        landed = ("landed whole" if outcome == "done" and whole else
                  "failed, no manifest" if outcome == "failed" and manifest is None else
                  f"BROKEN: job {outcome}, manifest {'absent' if manifest is None else 'present'}, "
                  f"{len(missing)} addresses without a record")
        return _row("etcd_leader_killed_publish", "3-member etcd: the leader (the member every node uses) "
                    "SIGKILLed mid-publish, object records in etcd; the job lands whole or fails, never half",
                    stats, heal_s=took, expect_failed=0,
                    notes={"publish": landed, "job_outcome": outcome, "leader_elected_s": elected,
                           "publish_retries": _log_count(w.origin, "registry unavailable"),
                           "objects_without_record": len(missing)})
    finally:
        await w.close()


async def etcd_leader_killed_watch(tmp: Path, quick: bool) -> Row:
    """The etcd leader SIGKILLed while every edge watches through it; at once, while the others elect, a warm
    policy written and an edge stopped (then started again): the policy reaches every edge, and every edge's
    ring drops the stopped edge and takes it back. Heal: the kill to the policy applied at every live edge."""
    from kdn.registry import Policy

    w = await _cluster_world(tmp, regions={"eu": 2, "us": 2})
    try:
        m = await w.publish(text(32), "vol32")
        await w.publish(text(33), "vol33")  # read by nobody: what the warm policy fills
        r = F.Readers(w, m["addresses"], per_region=4)
        for region in w.regions:
            warm = await r.read_all(region)
            assert warm.failed == 0 and warm.wrong == 0, vars(warm)
        leader, edge = w.etcd.members[0], w.edges["us-2"]

        async def policy(t0: float) -> tuple[int, float, float]:
            attempts = await _put_policy(w, Policy(name="warm33", kind="warm", manifest="public/vol33"))
            written = round(time.monotonic() - t0, 2)
            return attempts, written, await _warmed_everywhere(w, t0, [e for e in w.edges.values() if e is not edge])

        async def membership(t0: float) -> tuple[float, float]:
            await asyncio.to_thread(edge.stop)  # SIGTERM: it revokes its lease, or the lease expires
            await w.rings_seen(timeout=30)
            left = round(time.monotonic() - t0, 2)
            t_start = time.monotonic()
            await edge.start()
            await w.rings_seen(timeout=30)
            return left, round(time.monotonic() - t_start, 2)

        async with r.running() as stats:
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            leader.kill()
            elect = asyncio.create_task(_elected(w, t0))
            (attempts, written, policy_s), (left, joined) = await asyncio.gather(policy(t0), membership(t0))
            elected = await elect
            await asyncio.to_thread(leader.start)
            await asyncio.sleep(0.5 if quick else 3.0)
        return _row("etcd_leader_killed_watch", "3-member etcd: the leader SIGKILLed under every edge's watches; "
                    "during the election a warm policy written and an edge stopped (then started): policy and "
                    "membership reach every edge (heal = kill to policy applied everywhere)", stats,
                    heal_s=policy_s, notes={"leader_elected_s": elected, "policy_write_attempts": attempts,
                                            "policy_written_s": written, "edge_left_every_ring_s": left,
                                            "edge_joined_every_ring_s": joined,
                                            "watch_failures_logged": sum(_log_count(e, "watch on") for e in
                                                                         w.edges.values())})
    finally:
        await w.close()


async def etcd_leader_killed_leases(tmp: Path, quick: bool) -> Row:
    """The etcd leader SIGKILLed while every edge keeps its lease (TTL 2 s) alive through it: no edge's key may
    leave the registry for longer than its TTL (a watcher on another member times every absence)."""
    ttl = float(F.World.lease_ttl.rstrip("s"))
    w = await _cluster_world(tmp, regions={"eu": 3})
    try:
        m = await w.publish(text(34), "vol34")
        r = F.Readers(w, m["addresses"], per_region=6)
        elections = []
        async with F.RingWatch(w.etcd.registry_from(w.etcd.members[1])) as ring, r.running() as stats:
            for _ in range(1 if quick else 3):
                await asyncio.sleep(0.5)
                leader = await asyncio.to_thread(w.etcd.leader)
                t0 = time.monotonic()
                leader.kill()
                elections.append(await _elected(w, t0))
                await asyncio.sleep(2 * ttl)  # a lease that was not kept alive has expired by now
                await asyncio.to_thread(leader.start)
            await asyncio.sleep(0.5)
            rings_s = await w.rings_seen(timeout=10)
        return _row("etcd_leader_killed_leases", f"3-member etcd: the leader SIGKILLed while every edge renews its "
                    f"{ttl:.0f} s lease through it ({len(elections)}x): no edge leaves the ring for longer than its "
                    "lease", stats, notes={"longest_absence_s": ring.longest_absence(), "node_key_deletes": ring.deletes,
                                           "lease_ttl_s": ttl, "leader_elected_s": elections,
                                           "leases_registered_again": sum(_log_count(e, "registering again")
                                                                          for e in w.edges.values()),
                                           "rings_settled_s": round(rings_s, 2)})
    finally:
        await w.close()


async def etcd_member_stopped(tmp: Path, quick: bool) -> Row:
    """The member every node uses (the leader) frozen with SIGSTOP: its connections stay open and answer nothing,
    the closest one host comes to a member partitioned away. A warm policy written meanwhile must reach every
    edge, no edge may leave the ring for longer than its lease; then SIGCONT, and the member rejoins."""
    from kdn.registry import Policy

    ttl = float(F.World.lease_ttl.rstrip("s"))
    hold = 5.0 if quick else 20.0
    w = await _cluster_world(tmp, regions={"eu": 2, "us": 2})
    try:
        m = await w.publish(text(35), "vol35")
        await w.publish(text(36), "vol36")
        r = F.Readers(w, m["addresses"], per_region=4)
        stopped = w.etcd.members[0]
        async with F.RingWatch(w.etcd.registry_from(w.etcd.members[1])) as ring, r.running() as stats:
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            stopped.pause()
            try:
                elect = asyncio.create_task(_elected(w, t0))
                attempts = await _put_policy(w, Policy(name="warm36", kind="warm", manifest="public/vol36"))
                written = round(time.monotonic() - t0, 2)
                policy_s = await _warmed_everywhere(w, t0)
                elected = await elect
                await asyncio.sleep(max(0.0, t0 + hold - time.monotonic()))
            finally:
                stopped.resume()
            t_cont = time.monotonic()
            await asyncio.to_thread(w.etcd.start)  # until all three are healthy again
            await asyncio.to_thread(w.etcd.leader, 30)
            rejoined = round(time.monotonic() - t_cont, 2)
            await asyncio.sleep(0.5 if quick else 3.0)
        return _row("etcd_member_stopped", f"3-member etcd: the leader, every node's member, frozen (SIGSTOP) "
                    f"{hold:.0f} s, then SIGCONT: nodes move to the others; a warm policy written meanwhile reaches "
                    "every edge (heal = stop to policy applied everywhere)", stats, heal_s=policy_s,
                    notes={"longest_absence_s": ring.longest_absence(), "node_key_deletes": ring.deletes,
                           "lease_ttl_s": ttl, "leader_elected_s": elected, "policy_write_attempts": attempts,
                           "policy_written_s": written, "member_rejoined_s": rejoined})
    finally:
        await w.close()


SCENARIOS = {
    "owner_killed": owner_killed,
    "lying_peer": lying_peer,
    "etcd_down": etcd_down,
    "etcd_restored": etcd_restored,
    "origin_down": origin_down,
    "disk_full": disk_full,
    "kill_during_write": kill_during_write,
    "slow_region_link": slow_region_link,
    "warm_disk_restart": warm_disk_restart,
    "clock_jump": clock_jump,
    "clock_step_while_down": clock_step_while_down,
    "etcd_leader_killed_publish": etcd_leader_killed_publish,
    "etcd_leader_killed_watch": etcd_leader_killed_watch,
    "etcd_leader_killed_leases": etcd_leader_killed_leases,
    "etcd_member_stopped": etcd_member_stopped,
}


def table(rows: list[Row]) -> str:
    out = ["| scenario | what happens | reads | failed | wrong bytes | heal (s) | p50 / p99 (ms) | notes |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        heal = "—" if r.heal_s is None else f"{r.heal_s:.2f}"
        notes = ", ".join(f"{k} {v}" for k, v in r.notes.items())
        out.append(f"| {r.scenario} | {r.what} | {r.reads} | {r.failed} | {r.wrong} | {heal} | "
                   f"{r.p50_ms:.1f} / {r.p99_ms:.1f} | {notes} |")
    return "\n".join(out)


async def main(args) -> int:
    res = R.Results("faults", args)
    names = args.only or list(SCENARIOS)
    if "disk_full" in names and not F.can_mount():
        print("disk_full needs root (a size-limited tmpfs); left out", file=sys.stderr)
        names.remove("disk_full")
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"kdn-fault-{name}-") as tmp:
            t0 = time.monotonic()
            row = await SCENARIOS[name](Path(tmp), args.quick)
            row.notes["scenario_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(f"{name}: reads {row.reads} failed {row.failed} wrong {row.wrong} heal {row.heal_s}", flush=True)
    print()
    res.table("main", table(rows), "Fault scenarios under load")
    headline(res, rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=_here).stdout.strip()
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "command": " ".join(sys.argv), "quick": args.quick,
                                               "rows": [asdict(r) for r in rows]}, indent=1, default=str))
    res.write()
    bad = [r.scenario for r in rows if not r.ok]
    if bad:
        print(f"\nFAILED: {bad}", file=sys.stderr)
        return 1
    return 0


def headline(res: R.Results, rows: list[Row]) -> None:
    """The README row: failed reads and wrong bytes over every scenario (the bar is 0 and 0)."""
    failed, wrong = sum(r.failed for r in rows), sum(r.wrong for r in rows)
    text = (f"**{failed}** failed reads and **{wrong}** wrong bytes over {len(rows)} scenario"
            f"{'s' if len(rows) != 1 else ''} ({', '.join(r.scenario for r in rows)})")
    figs = []
    owner = next((r for r in rows if r.scenario == "owner_killed" and r.heal_s is not None), None)
    if owner:
        text += f"; ring healed {owner.heal_s:.2f} s after an owner's SIGKILL"
        figs.append({"shown": f"{owner.heal_s:.2f} s", "cell": f"{owner.heal_s:.2f}", "table": "main"})
    res.set_headline("faults under load", text, "0 failed reads and 0 wrong bytes in every scenario (the bar)", figs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short durations (what CI runs)")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only these (repeatable)")
    ap.add_argument("--json", help="write the rows here")
    R.add_arg(ap)
    sys.exit(asyncio.run(main(ap.parse_args())))
