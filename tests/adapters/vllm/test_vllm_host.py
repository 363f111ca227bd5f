"""vLLM loads from the machine's host tier (#53): the connector's ``host`` setting names a ``kdn host serve``
socket; a chunk the host holds is leased and, on the CPU, either copied from its shared memory into the load's
staging by one region copy (``host_write: "staged"``, the default: its lease ended after the copy, one cache
write per layer), or written from the mapping straight into vLLM's paged blocks (``"in_place"``: no staging
copy; its lease held until the forward has written every layer); the rest fetched from the edge as ever.

Real processes: a transformers origin that signs (tiny Llama, head_dim 64, fp32), its edge, a host tier filled
from that edge, and a vLLM engine with the connector. Each request carries a fresh vLLM cache salt, so vLLM's
own prefix cache never answers for the KDN.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from vllm_harness import Cluster, Engine, Proc, document, kv_config, question, salt, wait_http

from kdn.registry.signing import Signer

DOC_TOKENS = 1100
LOADED = 1024  # whole 128-token blocks below the document's tail


def host_up(sock: str, proc: Proc, timeout: float = 60.0):
    """Wait for the host tier's socket, then a connected HostClient (run in its own event loop)."""
    from kdn.client.host import HostClient
    from kdn.wire.host import HostError

    async def connect():
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            assert proc.p.poll() is None, proc.tail()
            try:
                return await HostClient(sock).connect()
            except HostError:
                assert asyncio.get_running_loop().time() < deadline, proc.tail()
                await asyncio.sleep(0.2)

    return connect


@pytest.fixture(scope="module")
def world(module_tmp):
    from kdn.adapters.hf.models import model_folder

    folder = str(model_folder("tiny-llama64", "float32"))
    c = Cluster(module_tmp)
    key = Signer.generate(module_tmp / "origin.key")
    (module_tmp / "trusted").write_text(key.public + "\n")
    sock, seg = str(module_tmp / "h.sock"), f"/dev/shm/kdn-test-vllm-host-{os.getpid()}.seg"
    engines: list[Engine] = []
    host = None
    try:
        p, url = c.origin("hf", "tiny-llama64", dtype="float32", signing_key=str(module_tmp / "origin.key"))
        ev = Engine("ev", module_tmp, model=folder, dtype="float32", blocks=20, max_model_len=2048,
                    # written by two threads ahead of the forward: the leases must outlive their writes
                    kv=kv_config(edges=[c.edge_url], trusted_keys=str(module_tmp / "trusted"), host=sock,
                                 load_timeout=10, plan=False, write_threads=2, host_write="in_place"))
        engines.append(ev)
        es = Engine("es", module_tmp, model=folder, dtype="float32", blocks=20, max_model_len=2048,
                    kv=kv_config(edges=[c.edge_url], trusted_keys=str(module_tmp / "trusted"), host=sock,
                                 load_timeout=10, plan=False, host_write="staged"))
        engines.append(es)
        wait_http(p, url + "/healthz")
        c.edge(url)
        host = Proc("host", ["kdn", "host", "serve", "--edge", c.edge_url, "--trusted-keys",
                             str(module_tmp / "trusted"), "--socket", sock, "--segment", seg, "--segment-bytes",
                             "128MiB", "--token-file", str(module_tmp / "tokens"), "--upstream-token-file",
                             str(module_tmp / "edge-token")], module_tmp / "host.log")
        c.procs.append(host)
        docs = {"held": c.publish("hf", document(1, DOC_TOKENS), "held", encodings=["raw"]),
                "edge": c.publish("hf", document(2, DOC_TOKENS), "edge", encodings=["raw"])}

        async def fill():
            client = await host_up(sock, host)()
            try:
                assert set(await client.warm(docs["held"]["addresses"], "raw")) == {"filled"}
            finally:
                await client.close()

        asyncio.run(fill())  # before the engine's first load: its connection to the host opens at start
        ev.wait_ready()
        es.wait_ready()
        yield {"c": c, "ev": ev, "es": es, "docs": docs, "host": host}
    finally:
        for e in engines:
            e.close()
        c.stop()
        assert not os.path.exists(seg), "the host tier left its segment behind"


def reference(engine: Engine, doc: dict, q: list[int], max_tokens: int = 24) -> dict:
    s = salt()
    engine.generate([doc["prefix_tokens"] + question(99)], load=False, salt=s, max_tokens=1)
    out = engine.generate([doc["prefix_tokens"] + q], load=False, salt=s, max_tokens=max_tokens)[0]
    assert out["cached"] == LOADED, out["cached"]
    return out


def by_source(engine: Engine) -> dict[str, int]:
    return dict(engine.stats()["totals"]["tokens"])


def by_path(engine: Engine) -> dict[str, int]:
    return dict(engine.stats()["totals"].get("paths", {}))


def test_a_prefix_the_host_holds_loads_from_its_shared_memory(world):
    """Held before the engine asked: every block from the host's mapping, the tokens the engine's own prefill
    gives (transformers made the states: vLLM's kernels agree to float rounding, not bit for bit)."""
    ev, doc = world["ev"], world["docs"]["held"]
    q = question(3)
    ref = reference(ev, doc, q)
    before, paths = by_source(ev), by_path(ev)
    got = ev.generate([doc["prefix_tokens"] + q], salt=salt(), max_tokens=24)[0]
    assert got["cached"] == LOADED and got["tokens"] == ref["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])) < 1e-3
    after = by_source(ev)
    assert after.get("host", 0) - before.get("host", 0) == LOADED, (before, after)
    # On the CPU every one of them was written from the mapping into the paged blocks: no staging copy
    assert by_path(ev).get("in_place", 0) - paths.get("in_place", 0) == LOADED, (paths, by_path(ev))
    # ... and their leases ended with the load (released once the forward had written every layer)
    assert asyncio.run(leases_when_idle(world["c"].tmp / "h.sock")) == 0


def test_a_held_prefix_staged_by_one_copy_per_chunk_continues_as_the_one_written_in_place(world):
    """``host_write: "staged"``: each held chunk copied from the mapping into the staging in one region copy (its
    lease ended once copied), each layer one cache write: the same greedy tokens and logprobs, bit for bit, as
    the engine that writes every chunk from the mapping in place (the same bytes in the cache)."""
    ev, es, doc = world["ev"], world["es"], world["docs"]["held"]
    q = question(5)
    ref = reference(es, doc, q)
    before, paths = by_source(es), by_path(es)
    staged = es.generate([doc["prefix_tokens"] + q], salt=salt(), max_tokens=24)[0]
    in_place = ev.generate([doc["prefix_tokens"] + q], salt=salt(), max_tokens=24)[0]
    assert staged["cached"] == in_place["cached"] == LOADED
    assert staged["tokens"] == in_place["tokens"] == ref["tokens"]
    assert staged["logprobs"] == in_place["logprobs"]
    assert max(abs(a - b) for a, b in zip(staged["logprobs"], ref["logprobs"])) < 1e-3
    after = by_source(es)
    assert after.get("host", 0) - before.get("host", 0) == LOADED, (before, after)
    # every one of them through the staging, none read in place
    assert by_path(es).get("staging", 0) - paths.get("staging", 0) == LOADED, (paths, by_path(es))
    assert by_path(es).get("in_place", 0) == paths.get("in_place", 0)
    assert asyncio.run(leases_when_idle(world["c"].tmp / "h.sock")) == 0


async def leases_when_idle(sock, within: float = 10.0) -> int:
    """The host's open leases, once none is left (or after ``within`` s: what is still open then)."""
    from kdn.client.host import HostClient

    async with HostClient(str(sock)) as h:
        deadline = asyncio.get_running_loop().time() + within
        while (n := (await h.stats())["leases"]) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return n


def test_what_the_host_lacks_comes_from_the_edge_then_from_the_host_the_same_bytes(world):
    """Not held: the edge serves it, and the host is asked for it behind the load; the next load comes from the
    host and is bit for bit the edge-loaded one (the same signed bytes, copied from shared memory)."""
    ev, doc = world["ev"], world["docs"]["edge"]
    q = question(4)
    before = by_source(ev)
    edge = ev.generate([doc["prefix_tokens"] + q], salt=salt(), max_tokens=24)[0]
    mid = by_source(ev)
    assert edge["cached"] == LOADED and mid.get("host", 0) == before.get("host", 0), (before, mid)

    async def filled() -> int:
        from kdn.client.host import HostClient

        async with HostClient(str(world["c"].tmp / "h.sock")) as h:
            for _ in range(100):  # the warms behind the load: bounded wait for them to land
                found = await h.lookup(doc["addresses"])
                if found.prefix >= LOADED // 256:  # the loaded chunks (the document's tail is not a whole block)
                    return found.prefix
                await asyncio.sleep(0.1)
            return found.prefix

    assert asyncio.run(filled()) == LOADED // 256
    hosted = ev.generate([doc["prefix_tokens"] + q], salt=salt(), max_tokens=24)[0]
    after = by_source(ev)
    assert after.get("host", 0) - mid.get("host", 0) == LOADED, (mid, after)
    assert hosted["tokens"] == edge["tokens"] and hosted["logprobs"] == edge["logprobs"]
