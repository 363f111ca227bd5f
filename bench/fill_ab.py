"""A/B: the edge's upstream fill reader, aiohttp (what the edge used) vs ``kdn.wire.bodyget`` (what the client uses).

Issue #14 asked for one HTTP stack for edge fills and the client, decided by an A/B on the link emulator.
Both readers GET one object body and verify it against its BLAKE3 digest, as ``Filler.fetch`` does:

    aiohttp    the edge's reader until now: ``session.get``, the body read in pieces and joined, then
               hashed in a second pass (allow_redirects=False, bounded read)
    bodyget    the fetch client's reader: the body lands in a preallocated buffer and is hashed as it
               lands (one pass)

The server (an aiohttp app writing each body without copying, as the edge does) runs in its own process,
with the link emulator in front of it for the emulated rows, so the reader's process has one core to
itself. Rounds alternate A and B; each cell is the median throughput of its rounds, and the ratio is
B over A measured in the same run.

    python -P bench/fill_ab.py                      # loopback and two emulated links
    python -P bench/fill_ab.py --quick              # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from blake3 import blake3

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def blobs(sizes: list[int], seed: int = 7) -> dict[int, bytes]:
    rng = np.random.default_rng(seed)
    return {s: rng.integers(0, 256, s, dtype=np.uint8).tobytes() for s in sizes}


# --- the server process -----------------------------------------------------------------------------


async def _serve(sizes: list[int], portfile: str, delay_ms: float, mbit: float) -> None:
    from aiohttp import web

    data = blobs(sizes)

    async def get(request: web.Request) -> web.StreamResponse:
        body = data[int(request.match_info["size"])]
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(memoryview(body))
        return resp

    app = web.Application()
    app.router.add_get("/v1/objects/{size}", get)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
    ports = {"direct": port}
    if delay_ms or mbit:
        sys.path.insert(0, str(HERE / "lib"))
        from linkemu import LinkEmulator  # bench/lib/linkemu.py

        link = await LinkEmulator(0, "127.0.0.1", port, delay_ms=delay_ms, mbit=mbit).start()
        ports["link"] = link.port
    Path(portfile).write_text(json.dumps(ports))
    await asyncio.Event().wait()


# --- the two readers ------------------------------------------------------------------------------


async def read_aiohttp(session, url: str, size: int, digest: str) -> None:
    import aiohttp

    async with session.get(url, params={"encoding": "zstd"}, headers={"Authorization": "Bearer x"},
                           timeout=aiohttp.ClientTimeout(total=60), allow_redirects=False) as r:
        assert r.status == 200 and r.content_length == size
        body = await r.content.read(size + 1)
        while len(body) <= size and not r.content.at_eof():
            more = await r.content.read(size + 1 - len(body))
            if not more:
                break
            body += more
    assert len(body) == size and blake3(body).hexdigest() == digest


async def read_bodyget(getter, url: str, size: int, digest: str) -> None:
    buf = bytearray(size)
    hasher = blake3()
    resp = await getter.get(url + "?encoding=zstd", memoryview(buf), {"Authorization": "Bearer x"}, 60,
                            hasher=hasher)
    assert resp.status == 200 and resp.length == size and hasher.hexdigest() == digest


async def run_cell(base: str, size: int, digest: str, conc: int, n: int, rounds: int) -> dict[str, list[float]]:
    import aiohttp

    from kdn.wire.bodyget import BodyGetter

    url = f"{base}/v1/objects/{size}"
    out: dict[str, list[float]] = {"aiohttp": [], "bodyget": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, limit_per_host=64),
                                     auto_decompress=False) as session:
        getter = BodyGetter(ssl=None)
        try:
            readers = {"aiohttp": lambda: read_aiohttp(session, url, size, digest),
                       "bodyget": lambda: read_bodyget(getter, url, size, digest)}
            for name, read in readers.items():  # warm the pools (connections of the emulated link too)
                await asyncio.gather(*(read() for _ in range(conc)))
            for _ in range(rounds):
                for name, read in readers.items():
                    sem = asyncio.Semaphore(conc)

                    async def one(read=read) -> None:
                        async with sem:
                            await read()

                    t0 = time.perf_counter()
                    await asyncio.gather(*(one() for _ in range(n)))
                    out[name].append(n * size / (time.perf_counter() - t0) / MiB)
        finally:
            getter.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="1,4,16")
    ap.add_argument("--conc", default="1,8")
    ap.add_argument("--bytes-mib", type=float, default=64, help="bytes read per round per cell")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--links", default="loopback,20ms-1000mbit,40ms-200mbit",
                    help="loopback, or DELAYms-RATEmbit (one-way delay, per-connection rate)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--serve", nargs=4, metavar=("SIZES", "PORTFILE", "DELAY", "MBIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        sizes, portfile, delay, mbit = args.serve
        asyncio.run(_serve([int(s) for s in sizes.split(",")], portfile, float(delay), float(mbit)))
        return 0
    if args.quick:
        args.sizes_mib, args.conc, args.bytes_mib, args.rounds, args.links = "1,4", "1,4", 16, 2, "loopback,20ms-1000mbit"
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",")]
    concs = [int(c) for c in args.conc.split(",")]
    digests = {s: blake3(b).hexdigest() for s, b in blobs(sizes).items()}
    print(f"# fill reader A/B: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {args.rounds} rounds of "
          f"{args.bytes_mib:g} MiB per cell, alternating; MiB/s median (min-max)\n")
    print("| link | object | concurrency | aiohttp (edge, before) | bodyget (client's) | bodyget / aiohttp |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ratios = []
    for link in args.links.split(","):
        delay, mbit = 0.0, 0.0
        if link != "loopback":
            d, r = link.split("-")
            delay, mbit = float(d.removesuffix("ms")), float(r.removesuffix("mbit"))
        with tempfile.TemporaryDirectory() as tmp:
            portfile = os.path.join(tmp, "ports")
            server = subprocess.Popen([sys.executable, "-P", __file__, "--serve", ",".join(map(str, sizes)), portfile,
                                       str(delay), str(mbit)])
            try:
                deadline = time.monotonic() + 30
                while not os.path.exists(portfile):
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("fill_ab: the server did not start")
                    time.sleep(0.05)
                ports = json.loads(Path(portfile).read_text())
                base = f"http://127.0.0.1:{ports['link' if link != 'loopback' else 'direct']}"
                for size in sizes:
                    for conc in concs:
                        n = max(conc, int(args.bytes_mib * MiB // size))
                        got = asyncio.run(run_cell(base, size, digests[size], conc, n, args.rounds))
                        a, b = statistics.median(got["aiohttp"]), statistics.median(got["bodyget"])
                        ratios.append((link, size, conc, b / a))
                        print(f"| {link} | {size / MiB:g} MiB | {conc} | {a:.0f} ({min(got['aiohttp']):.0f}-"
                              f"{max(got['aiohttp']):.0f}) | {b:.0f} ({min(got['bodyget']):.0f}-"
                              f"{max(got['bodyget']):.0f}) | **{b / a:.2f}x** |", flush=True)
            finally:
                server.terminate()
                server.wait(10)
    worst = min(ratios, key=lambda r: r[3])
    print(f"\nbodyget / aiohttp: median {statistics.median(r[3] for r in ratios):.2f}x, worst {worst[3]:.2f}x "
          f"({worst[0]}, {worst[1] / MiB:g} MiB, concurrency {worst[2]}); load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
