"""Scale on paper, from unit costs measured here: where today's registry design breaks, and at what figure.

    python -P bench/scale.py [--records 4000] [--seed 7]

A model, not processes (issue #29 item 7). The target: 10^9 objects (256-token chunks), 10^7 manifests,
100 regions, 10^4 edges, 10^5 lookups/s and 10^3 publishes/s. What is measured on this machine, in this
run: the packed size of a signed object record (one and two encodings, with and without piece digests),
of a manifest per token and of a node record (``kdn/registry/records.py``); a real etcd's write rate for
object records through ``EtcdRegistry.put_objects`` (127 to a transaction, as publishes write them) and
its read rate through ``get_objects`` (one round trip per lookup miss); the edge ring's build time and
``owner()`` rate at 100 and 10,000 members (``kdn.ring``). What is taken from etcd's documentation, not
measured: the 2 GiB default and 8 GiB suggested database quota, 1.5 MiB per request. Everything else is
arithmetic on those, written out in the table so each figure can be checked by hand.

Tables: ``units`` (what was measured), ``limits`` (each resource at the target, today and in the design
of issue #29: per-chunk records beside their blobs in the origin's store, etcd holding nodes, policies,
models, keys and one small pointer per manifest name).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (python -P leaves it out)
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the one throwaway-etcd helper
import results as R  # noqa: E402
from etcd_proc import EtcdProcess  # noqa: E402

from kdn.format.pieces import PIECE_BYTES  # noqa: E402
from kdn.registry import Encoding, EtcdRegistry, Manifest, NodeRecord, ObjectRecord  # noqa: E402
from kdn.ring import Ring  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402

GiB = 1 << 30
TARGET = {"objects": 10**9, "manifests": 10**7, "regions": 100, "edges": 10**4, "lookups_s": 10**5,
          "publishes_s": 10**3}
CHUNKS_PER_PUBLISH = 32  # an 8k-token document
ETCD_QUOTA, ETCD_MAX, ETCD_REQUEST = 2 * GiB, 8 * GiB, 1_572_864  # etcd's documented defaults / suggestion
KEY_BYTES = len("/kdn/objects/") + 64
RAW, ZSTD = 5_898_240 + 2048, 4_073_000  # a SmolLM2-135M chunk's blobs (docs/operations.md)


def record(rng: random.Random, signer: Signer, encodings: int, pieces: bool) -> ObjectRecord:
    encs = {}
    for name, size in (("raw", RAW), ("zstd", ZSTD))[:encodings]:
        p = tuple(rng.randbytes(32).hex() for _ in range(-(-size // PIECE_BYTES))) if pieces else ()
        encs[name] = Encoding(name, size, rng.randbytes(32).hex(), PIECE_BYTES if p else 0, p)
    rec = ObjectRecord(address=rng.randbytes(32).hex(), model_id=rng.randbytes(32).hex(), namespace="public",
                       kind="kv", start=256, end=512, parent=rng.randbytes(32).hex(), standalone=False,
                       encodings=encs, origin="origin-1", engine="transformers 5.19.0")
    return signer.sign(rec)


async def etcd_rates(url: str, recs: list[ObjectRecord]) -> tuple[float, float, float]:
    """(records written per second, lookups (32 records) per second, ms per lookup) on a real etcd."""
    host, port = url.removeprefix("http://").split(":")
    reg = EtcdRegistry(host, int(port), "/scale/")
    try:
        t0 = time.perf_counter()
        for i in range(0, len(recs), 127 * 4):
            await reg.put_objects(recs[i:i + 127 * 4])
        write_s = len(recs) / (time.perf_counter() - t0)
        addrs = [r.address for r in recs]
        times = []
        for i in range(0, min(len(addrs), 32 * 60), 32):
            t = time.perf_counter()
            got = await reg.get_objects(addrs[i:i + 32])
            times.append(time.perf_counter() - t)
            assert all(g is not None for g in got)
        return write_s, 1 / statistics.median(times), statistics.median(times) * 1e3
    finally:
        await reg.close()


def one_by_one_ms(n: int) -> float:
    """How the ring was built before: each member added to uhashring in turn (each add re-sorts it all)."""
    from uhashring import HashRing

    from kdn.ring import _hash

    ring = HashRing([], hash_fn=_hash, vnodes=320)
    t0 = time.perf_counter()
    for i in range(n):
        ring.add_node(f"edge-{i}")
    return (time.perf_counter() - t0) * 1e3


def ring_costs(n: int, rng: random.Random) -> tuple[float, float]:
    """(ms to build a ring of n members, owner() lookups per second)."""
    nodes = [f"edge-{i}" for i in range(n)]
    t0 = time.perf_counter()
    ring = Ring(nodes)
    build = (time.perf_counter() - t0) * 1e3
    sample = [rng.randbytes(32).hex() for _ in range(20_000)]
    t0 = time.perf_counter()
    for a in sample:
        ring.owner(a)
    return build, len(sample) / (time.perf_counter() - t0)


def fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.1f}{unit}"
    return f"{n:,.0f}"


def gb(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n < 1024 * GiB else f"{n / (1024 * GiB):,.1f} TiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=4000, help="object records written to the real etcd")
    ap.add_argument("--seed", type=int, default=7)
    R.add_arg(ap)
    args = ap.parse_args()
    res = R.Results("scale", args)
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kdn-scale-") as tmp:
        signer = Signer.generate(Path(tmp) / "k")
        sizes = {(e, p): len(record(rng, signer, e, p).pack()) + KEY_BYTES for e in (1, 2) for p in (False, True)}
        tokens = [rng.randrange(49152) for _ in range(100_000)]
        man = Manifest(namespace="public", name="doc", model_id="ab" * 32, addresses=["cd" * 32] * 391,
                       tokens=len(tokens), chunk_tokens=256, prefix_tokens=tokens)
        man_per_token = len(man.pack()) / len(tokens)
        node = len(NodeRecord(role="edge", region="eu", node_id="edge-eu-0001", url="http://edge-eu-0001:8100")
                   .pack()) + 40
        pointer = 64 + 40 + 160  # a manifest pointer (name -> its record's digest and version), signed: estimate
        recs = [record(rng, signer, 2, True) for _ in range(args.records)]
        etcd = EtcdProcess()
        etcd.start()
        try:
            write_s, lookups_s, lookup_ms = asyncio.run(etcd_rates(etcd.url, recs))
        finally:
            etcd.stop()
    ring100, owner100 = ring_costs(100, rng)
    ring10k, owner10k = ring_costs(10_000, rng)
    old300 = one_by_one_ms(300)
    ring300, _ = ring_costs(300, rng)

    t = res.start_table("units", "unit costs measured in this run")
    t.line("| quantity | measured |")
    t.line("| --- | ---: |")
    for (e, p), v in sizes.items():
        t.line(f"| signed object record + key, {e} encoding{'s' if e > 1 else ''}, {'with' if p else 'no'} piece "
               f"digests | {v:,} B |")
    t.line(f"| manifest, per published token (100k tokens) | {man_per_token:.2f} B |")
    t.line(f"| node record + key | {node} B |")
    t.line(f"| etcd: object records written/s (put_objects, 127 a txn, {args.records:,} records) | {write_s:,.0f} |")
    t.line(f"| etcd: one lookup miss's records (32, one get) | {lookup_ms:.1f} ms ({lookups_s:,.0f}/s, one client) |")
    t.line(f"| ring of 100 edges: build / owner() | {ring100:.1f} ms / {owner100 / 1e3:,.0f}k/s |")
    t.line(f"| ring of 10,000 edges: build / owner() | {ring10k:.0f} ms / {owner10k / 1e3:,.0f}k/s |")
    t.line(f"| ring of 300 edges built one member at a time (before this run's fix) / at once | {old300:,.0f} ms / "
           f"{ring300:.0f} ms |")
    res.end_table(t)

    obj = TARGET["objects"]
    rec2p = sizes[(2, True)]
    today_db = obj * rec2p + TARGET["manifests"] * 8192 * man_per_token
    fits_quota = ETCD_QUOTA // rec2p
    fits_max = ETCD_MAX // rec2p
    manifests_fit = ETCD_MAX // (8192 * man_per_token)
    rec_writes = TARGET["publishes_s"] * CHUNKS_PER_PUBLISH
    per_region_edges = TARGET["edges"] // TARGET["regions"]
    new_db = TARGET["manifests"] * pointer + TARGET["edges"] * node
    t = res.start_table("limits", "at the target: today's design beside issue #29's")
    t.line("| resource | today (one record per chunk in etcd) | breaks at | #29 design (records beside blobs) | next limit |")
    t.line("| --- | --- | ---: | --- | --- |")
    t.line(f"| etcd database | 10^9 records x {rec2p:,} B + {fmt(TARGET['manifests'])} manifests of 8k tokens x "
           f"{8192 * man_per_token / 1024:.0f} KiB = **{gb(today_db)}** | {fmt(fits_quota)} objects (2 GiB quota), "
           f"{fmt(fits_max)} (8 GiB); {fmt(manifests_fit)} manifests alone fill 8 GiB | "
           f"{fmt(TARGET['manifests'])} pointers x ~{pointer} B + {fmt(TARGET['edges'])} nodes x {node} B = "
           f"**{gb(new_db)}** | past the 2 GiB default at {fmt(ETCD_QUOTA // pointer)} names: set the quota to 8 GiB "
           f"({fmt(ETCD_MAX // pointer)} names) |")
    t.line(f"| etcd writes | {fmt(TARGET['publishes_s'])} publishes/s x {CHUNKS_PER_PUBLISH} records = "
           f"**{fmt(rec_writes)}/s** (measured here: {fmt(write_s)}/s) | {fmt(write_s / CHUNKS_PER_PUBLISH)} "
           f"publishes/s | {fmt(TARGET['publishes_s'])} pointer writes/s | the store's PUT rate (S3: thousands "
           "per prefix per second) |")
    t.line(f"| registry reads on the request path | a lookup miss reads its records in etcd: {lookup_ms:.1f} ms on "
           f"loopback, one Raft leader's region away elsewhere (~50 ms across a continent, ~400 ms between "
           f"continents, etcd's own guide); {fmt(TARGET['lookups_s'])} lookups/s x miss ratio all land on one "
           f"cluster ({fmt(lookups_s)}/s per client here) | one etcd's read rate | none: entry edge -> owner -> "
           "upper tier -> origin store | the upper tier's fill rate |")
    t.line(f"| membership change | one watch event to each of {fmt(TARGET['edges'])} edges; each rebuilds its "
           f"region's ring ({per_region_edges} members: {ring100:.1f} ms) | a ring of 10^4 in one region: "
           f"{ring10k:,.0f} ms a rebuild (built one member at a time, as until this run: ~{old300 / 1e3:.0f} s at "
           f"300 members, quadratic) | unchanged (leases stay in etcd) | watch fan-out: 10^4 streams on one "
           "etcd; shard by region prefix |")
    t.line(f"| origin egress | each of {TARGET['regions']} regions fills from the origin on its own: "
           f"**{TARGET['regions']}x** the distinct bytes | origin link | upper tier: ~1x, then pushes ahead "
           "of readers | the upper tier's link |")
    res.end_table(t)
    res.set_headline(
        "scale, records in etcd",
        f"one record per chunk fills etcd's 8 GiB at {fmt(fits_max)} objects ({rec2p:,} B a signed record with "
        f"piece digests); the target's 10^9 needs {gb(obj * rec2p)}",
        "etcd's documented 8 GiB suggested maximum",
        [{"shown": fmt(fits_max), "cell": fmt(fits_max), "table": "limits"}],
    )
    print(f"\n({time.perf_counter() - t_start:.1f} s)")
    res.write()


if __name__ == "__main__":
    main()
