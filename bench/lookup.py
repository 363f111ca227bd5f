"""A hit's first step: the lookup and the chain's signed records, against one round trip.

    python -P bench/lookup.py [--model smollm2-135m] [--lengths 2048,7936] [--repeat 15]

Before any byte of K/V moves, a hit must know how much of the prompt is published and, for each chunk, the
digest to verify its bytes against (from a record the origin signed). An origin (signing its records, an
embedded ``file:`` registry) and one edge run as processes on 127.0.0.1; a context is published (``zstd`` and
``raw``, as ``bench/vllm_ttft.py`` does) and looked up once (the edge's record cache warms). Then, in rotating
order per repeat, with the origin's public key trusted by the client:

- ``bound``: one ``POST /v1/lookup`` of the chain's addresses, the answer read, nothing verified: the round
  trip any lookup pays, the edge's own record reads included;
- ``per-record``: the lookup as the client did it before (that round trip, then one ``GET
  /v1/registry/objects/A`` per matched chunk, in parallel, each signature verified), and what vLLM's
  scheduler then added (``adapters/vllm/scheduler.py`` read every record again);
- ``inline``: ``KDNClient.lookup`` now: the records come with the lookup's answer (``"records": true``) and
  the scheduler takes them from the lookup; each is checked against the publisher keys, or recognised as the
  exact bytes this client verified before (``kdn/client/trust.py``: a hot chain, read by every request);
  ``inline-first`` is the same with nothing remembered (the first reader of a chain).

Times are per lookup, ms, median (worst) of the repeats; the ratio is to the bound of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import results as R  # noqa: E402
import ttft as T  # noqa: E402  (server processes, publish, model helpers)

PATHS = ("bound", "per-record", "per-record-vllm", "inline-first", "inline")


async def per_record(client, full: list[str], twice: bool) -> int:
    """The lookup as the client did it before this change (kdn/client/client.py at 26935e4), and, with ``twice``, the
    vLLM scheduler's second reading of every record. Chunks whose record verified."""
    client.trust._verified.clear()  # no record was remembered before (kdn/client/trust.py's memo came after)
    body = await client._json("POST", "/v1/lookup", {"addresses": full})
    n = int(body["length"]) if body else 0
    recs = await asyncio.gather(*(client.record(a) for a in full[:n]))
    if twice:
        client.trust._verified.clear()
        recs = await asyncio.gather(*(client.record(a) for a in full[:n]))
    return sum(r is not None for r in recs)


async def run(args) -> list[dict]:
    import aiohttp

    from kdn.format import address as A
    from kdn.adapters.hf import load_model
    from kdn.adapters.hf.generate import model_id as engine_model_id
    from kdn.client import KDNClient
    from kdn.registry.signing import Signer

    spec = T.model_spec(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-lookup-"))
    procs = []
    rows = []
    try:
        (tmp / "tokens").write_text(T.PUBLISH_TOKEN + " admin *\n")
        key = Signer.generate(tmp / "origin.key")
        registry = f"file:{tmp / 'registry.sqlite3'}"
        origin = T.start("origin", "origin", dict(model=spec, registry=registry, store=str(tmp / "store"),
                                                  host="127.0.0.1", port=T.free_port(), token_file=str(tmp / "tokens"),
                                                  node_id="origin-1", fsync=False,
                                                  signing_key=str(tmp / "origin.key")), tmp)
        procs.append(origin)
        edge = T.start("edge", "edge", dict(region="eu", registry=registry, origin=origin.url, mem_budget=1 << 30,
                                            host="127.0.0.1", port=T.free_port(), node_id="edge-1", prefetch=0,
                                            lease_ttl=10.0, fsync=False), tmp)
        procs.append(edge)
        lm = load_model(spec)
        mid = engine_model_id(lm.model, lm.tokenizer)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            await T.wait_healthy(s, origin, 600)
            await T.wait_healthy(s, edge, 120, ready=lambda b: "edge-1" in (b.get("ring") or []))
            doc, _ = T.token_stream(args.model, lm, max(args.lengths), 16)
            for L in args.lengths:
                man = await T.publish(s, origin.url, f"lookup-{L}", doc[:L], encodings=["zstd", "raw"])
                if man["model_id"] != mid:
                    raise RuntimeError("the origin's model id is not the bench's")
                full = A.prefix_addresses(mid, "public", doc[:L], A.DEFAULT_CHUNK_TOKENS, full_chunks_only=True)
                async with KDNClient(edges=[edge.url], max_hedges=0, trusted_keys=[key.public]) as client:
                    hit = await client.lookup(doc[:L], mid)  # warms the edge's record cache and the connections
                    if hit.tokens != L or len(hit.records) != len(full):
                        raise RuntimeError(f"the lookup found {hit.tokens} of {L} tokens")
                    answer = await client._json("POST", "/v1/lookup", {"addresses": full, "records": True})
                    inline_bytes = len(str(answer))

                    async def bound() -> int:
                        body = await client._json("POST", "/v1/lookup", {"addresses": full})
                        return int(body["length"]) if body else 0

                    async def inline() -> int:
                        return len((await client.lookup(doc[:L], mid)).records)

                    async def inline_first() -> int:  # records this client has not verified before
                        client.trust._verified.clear()
                        return await inline()

                    runs = {"bound": bound, "per-record": lambda: per_record(client, full, False),
                            "per-record-vllm": lambda: per_record(client, full, True), "inline-first": inline_first,
                            "inline": inline}
                    times: dict[str, list[float]] = {p: [] for p in PATHS}
                    for r in range(args.repeat + 1):
                        order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
                        for p in order:
                            t0 = time.perf_counter()
                            got = await runs[p]()
                            dt = time.perf_counter() - t0
                            if got != len(full):
                                raise RuntimeError(f"{p}: {got} of {len(full)} chunks")
                            if r:  # the first round warms
                                times[p].append(dt)
                    rejected = client.rejected_records
                rows.append({"tokens": L, "chunks": len(full), "times": times, "answer_bytes": inline_bytes,
                             "rejected": rejected})
                med = {p: statistics.median(ts) * 1e3 for p, ts in times.items()}
                print(f"[L={L}] " + ", ".join(f"{p} {v:.1f} ms" for p, v in med.items()), flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.1f} ({max(ts) * 1e3:.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="2048,7936", help="context lengths, whole chunks of 256 tokens")
    ap.add_argument("--repeat", type=int, default=15)
    R.add_arg(ap)
    args = ap.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    if any(L % 256 for L in args.lengths):
        ap.error("--lengths must be whole chunks (multiples of 256)")
    res = R.Results("lookup", args)
    t_start = time.perf_counter()
    rows = asyncio.run(run(args))
    print(f"\n{args.model}, {os.cpu_count()} cores; ms per lookup, median (worst) of {args.repeat}\n")
    t = res.start_table("main", "lookup + the chain's verified records")
    t.line("| model | context | chunks | bound: one lookup round trip, ms | per-record (before): client, ms | vs bound "
           "| per-record (before): client + vLLM scheduler, ms | vs bound | inline, first read: ms | vs bound "
           "| inline, records verified before: ms | vs bound | now vs before (vLLM; first read) |")
    t.line("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        med = {p: statistics.median(ts) for p, ts in row["times"].items()}
        gain = med["per-record-vllm"] / med["inline"]
        first = med["per-record-vllm"] / med["inline-first"]
        t.line(f"| {args.model} | {row['tokens']:,} | {row['chunks']} | {_ms(row['times']['bound'])} "
               f"| {_ms(row['times']['per-record'])} | {med['per-record'] / med['bound']:.1f}x "
               f"| {_ms(row['times']['per-record-vllm'])} | {med['per-record-vllm'] / med['bound']:.1f}x "
               f"| {_ms(row['times']['inline-first'])} | {med['inline-first'] / med['bound']:.2f}x "
               f"| {_ms(row['times']['inline'])} | {med['inline'] / med['bound']:.2f}x | {gain:.1f}x ({first:.1f}x) |")
    res.end_table(t)
    print(f"\n({time.perf_counter() - t_start:.1f} s)")
    res.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
