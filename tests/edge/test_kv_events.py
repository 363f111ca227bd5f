"""Routers see the KDN (#54): an edge publishes what it holds as vLLM's KV-cache events (edge/kv_events.py).

A real origin publishes real chunks, a real edge fills them; a router's side is a real ZMQ SUB socket on
loopback whose batches are decoded with vLLM's own msgspec classes (and re-encoded by them byte for byte), and
a DEALER that asks the replay socket for what it missed. The router's view (stored minus removed) must end equal
to what the edge holds."""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import pytest

from edge_helpers import PUBLISH, TENANT_A, cluster, get, metric, publish, wait_until
from ports import free_port

from kdn.edge.config import EdgeConfig
from kdn.errors import InvalidInput

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
kv = pytest.importorskip("vllm.distributed.kv_events")  # the decoder a router runs: vLLM's own

pytestmark = pytest.mark.timeout(180)

TEXT = ("The lighthouse keeper wrote down the weather, the passing ships, the oil burned and the wicks trimmed, "
        "every night for forty years, in a hand that never changed. ") * 9
SHORT = ("A harbour log: tides, cargo, the names of the boats that came in before the storm. ") * 4
DECODE = None


def _decoder():
    global DECODE
    if DECODE is None:
        DECODE = msgspec.msgpack.Decoder(kv.KVEventBatch)
    return DECODE


class Router:
    """What a router keeps of one edge: a SUB socket bound on loopback (the edge connects to it, as vLLM's
    publisher connects to llm-d's indexer), per topic the next sequence it expects, the gaps it saw, and the
    blocks it believes the edge holds."""

    def __init__(self, *, subscribe: bool = True, replay_port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.port = free_port()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(f"tcp://127.0.0.1:{self.port}")
        if subscribe:
            self.subscribe()
        self.next: dict[str, int] = {}
        self.gaps: list[tuple[str, int, int]] = []  # (topic, expected, got)
        self.batches: list[tuple[str, int, object]] = []  # (topic, seq, KVEventBatch) in arrival order
        self.blocks: dict[str, dict[bytes, object]] = {}  # topic -> block hash -> its BlockStored
        self.stored_ever: dict[bytes, object] = {}
        # With a replay port, it fills each gap it sees from the edge's replay socket, as a router would (the
        # first batches can pass a subscriber by while its subscription is on its way: ZMQ's slow joiner).
        self.replay_port = replay_port
        self.filled = 0  # gaps filled so far
        # A router reads its socket all the time, as this task does: a SUB attaches an incoming connection (and
        # sends its subscriptions over it) only when its own thread calls into the socket.
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            self.poll()
            if self.replay_port is not None and len(self.gaps) > self.filled:
                for topic, want, got in self.gaps[self.filled:]:
                    for t, s, payload in await replay(self.replay_endpoint, want, topic.encode()):
                        if s < got:
                            self.apply(t, s, payload, replayed=True)
                self.filled = len(self.gaps)
                self.rebuild()
            await asyncio.sleep(0.01)

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def seqs(self, topic: str) -> list[int]:
        return sorted({s for t, s, _ in self.batches if t == topic})

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def subscribe(self, prefix: bytes = b"kv@") -> None:
        self.sub.setsockopt(zmq.SUBSCRIBE, prefix)

    def apply(self, topic: str, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        batch = _decoder().decode(payload)
        assert msgspec.msgpack.Encoder().encode(batch) == payload, "not vLLM's encoding byte for byte"
        if not replayed:
            want = self.next.get(topic, 0)
            if seq != want:
                self.gaps.append((topic, want, seq))
            self.next[topic] = seq + 1
        self.batches.append((topic, seq, batch))
        self._events(topic, batch)

    def rebuild(self) -> None:
        """The view again from every batch seen, in sequence order: what a router does once a replay filled
        its gap (the batches it missed come before the ones it holds)."""
        self.blocks.clear()
        for (topic, _), batch in sorted({(t, s): b for t, s, b in self.batches}.items()):
            self._events(topic, batch)

    def _events(self, topic: str, batch) -> None:
        view = self.blocks.setdefault(topic, {})
        for e in batch.events:
            if isinstance(e, kv.AllBlocksCleared):
                view.clear()
            elif isinstance(e, kv.BlockStored):
                for h in e.block_hashes:
                    view[h] = e
                    self.stored_ever[h] = e
            elif isinstance(e, kv.BlockRemoved):
                for h in e.block_hashes:
                    assert view.pop(h, None) is not None, "removed a block never stored"

    def poll(self) -> bool:
        """Take every message waiting now; True if there was one."""
        took = False
        while self.sub.poll(0):
            topic, seq, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            self.apply(topic.decode(), int.from_bytes(seq, "big"), payload)
            took = True
        return took

    async def until(self, pred, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if pred():
                return
            assert time.monotonic() < deadline, "the router did not see it in time"
            await asyncio.sleep(0.02)

    def held(self) -> set[str]:
        return {h.hex() for view in self.blocks.values() for h in view}

    def close(self) -> None:
        self.reader.cancel()
        self.sub.close(linger=0)
        self.ctx.term()


async def replay(endpoint: str, start: int, topic: bytes | None = None, timeout: float = 10.0):
    """vLLM's replay protocol from a DEALER (a REQ's envelope: an empty frame, then the 8-byte start): the
    ``[topic, seq, payload]`` batches until the end marker ``[b"", -1, b""]``."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big"), *([topic] if topic is not None else [])])
        out = []
        deadline = time.monotonic() + timeout
        for _ in range(100_000):
            while not s.poll(0):
                assert time.monotonic() < deadline, "no end marker from the replay socket"
                await asyncio.sleep(0.01)
            empty, t, seq, payload = s.recv_multipart(zmq.NOBLOCK)
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert t == b"" and payload == b""
                return out
            out.append((t.decode(), int.from_bytes(seq, "big"), payload))
        raise AssertionError("an endless replay")
    finally:
        s.close(linger=0)
        ctx.term()


def full_chunks(m: dict) -> list[str]:
    return m["addresses"][: m["tokens"] // m["chunk_tokens"]]


async def sizes(origin: str, addresses: list[str]) -> list[int]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
        out = []
        for a in addresses:
            async with s.head(f"{origin}/v1/objects/{a}", params={"encoding": "zstd"}) as r:
                assert r.status == 200
                out.append(int(r.headers["Content-Length"]))
        return out


async def test_a_router_sees_what_the_edge_holds_stored_and_evicted(tmp_path, etcd_url):
    router = Router(replay_port=free_port())
    try:
        async with cluster(tmp_path, etcd_url, edges=()) as c:
            m = await publish(c, TEXT)
            a, ct, toks = m["addresses"], m["chunk_tokens"], m["prefix_tokens"]
            full = full_chunks(m)
            assert len(full) >= 4 and len(a) == len(full) + 1, "the text should end in a partial tail"
            big = max(await sizes(c.origin_url(), full))
            # Memory for two and a half chunks, none on disk: reading them all evicts the early ones.
            await c.start_edge("e1", mem_budget=2 * big + big // 2, disk_budget=1, kv_events=router.endpoint,
                               kv_events_replay=router.replay_endpoint)
            edge = c.edge("e1")
            await wait_until(lambda: edge.chains.position(a[0]) is not None)
            for x in a:  # (the partial tail too: it is no block, and is not announced)
                assert (await get(c.edge_url("e1"), x))[0] == 200
                if x in full:  # announced before the next read evicts it (events gather ~20 ms before a batch)
                    await router.until(lambda: bytes.fromhex(x) in router.stored_ever)  # noqa: B023
            held = {x for x in full if edge.holds((x, "zstd"))}
            assert 0 < len(held) < len(full)
            await router.until(lambda: router.held() == held)
            ever = [x for x in full if bytes.fromhex(x) in router.stored_ever]
            assert ever == full
            topic = f"kv@eu/e1@public/{m['model_id']}"
            assert set(router.blocks) == {topic} and router.seqs(topic) == list(range(router.next[topic]))
            first = next(b for t, s, b in router.batches if s == 0)
            assert isinstance(first.events[0], kv.AllBlocksCleared)
            for i, x in enumerate(full):
                e = router.stored_ever[bytes.fromhex(x)]
                assert e.block_hashes == [bytes.fromhex(x)]
                assert e.parent_block_hash == (None if i == 0 else bytes.fromhex(full[i - 1]))
                assert e.token_ids == toks[i * ct:(i + 1) * ct]
                assert (e.block_size, e.medium, e.locality, e.ownership) == (ct, "STORAGE", "REMOTE", "kdn")
            assert bytes.fromhex(a[-1]) not in router.stored_ever
            removed = sum(len(e.block_hashes) for _, _, b in router.batches for e in b.events
                          if isinstance(e, kv.BlockRemoved))
            assert removed == len(ever) - len(held)
            server = c.edges["e1"]
            assert metric(server, "kdn_edge_kv_events", type="BlockStored") == len(ever)
            assert metric(server, "kdn_edge_kv_events", type="BlockRemoved") == removed
            assert metric(server, "kdn_edge_kv_events_dropped", reason="not_a_block") >= 1
            assert metric(server, "kdn_edge_kv_event_blocks") == len(held)
            await c.stop_edge("e1")  # a clean stop voids what the router knew of this edge
            await router.until(lambda: router.held() == set())
            assert isinstance(router.batches[-1][2].events[-1], kv.AllBlocksCleared)
    finally:
        router.close()


async def test_a_late_router_fills_its_gap_from_the_replay_socket(tmp_path, etcd_url):
    router = Router(subscribe=False)  # connected, subscribed to nothing: the first batches pass it by
    replay_port = free_port()
    try:
        async with cluster(tmp_path, etcd_url, edges=()) as c:
            await c.start_edge("e1", kv_events=router.endpoint, kv_events_replay=f"tcp://127.0.0.1:{replay_port}",
                               disk_budget=1)
            m = await publish(c, TEXT)
            full = full_chunks(m)
            edge, server = c.edge("e1"), c.edges["e1"]
            await wait_until(lambda: edge.chains.position(full[0]) is not None)
            for x in full[:2]:
                assert (await get(c.edge_url("e1"), x))[0] == 200
            await wait_until(lambda: metric(server, "kdn_edge_kv_events", type="BlockStored") == 2)
            router.subscribe()
            for x in full[2:]:  # the subscription reaches the edge within a read or two
                assert (await get(c.edge_url("e1"), x))[0] == 200
                await asyncio.sleep(0.2)
                if router.batches:
                    break
            await router.until(lambda: bool(router.batches))
            topic, seq, _ = router.batches[0]
            assert seq > 0 and router.gaps == [(topic, 0, seq)], "the router should see its gap"
            missed = await replay(f"tcp://127.0.0.1:{replay_port}", 0)
            assert [s for _, s, _ in missed][:seq] == list(range(seq))
            for t, s, payload in missed[:seq]:
                router.apply(t, s, payload, replayed=True)
            router.rebuild()
            assert {bytes.fromhex(x) for x in full[:2]} <= set(router.stored_ever)
            # the same from a start in the middle, for this topic only (a fourth frame)
            tail = await replay(f"tcp://127.0.0.1:{replay_port}", 1, topic.encode())
            assert [s for _, s, _ in tail] == [s for _, s, _ in missed if s >= 1]
            await router.until(lambda: router.held() == {x for x in full if edge.holds((x, "zstd"))})
            assert metric(server, "kdn_edge_kv_event_replays", outcome="served") == 2
    finally:
        router.close()


async def test_a_tenants_namespace_is_published_only_when_the_operator_names_it(tmp_path, etcd_url):
    plain, named = Router(replay_port=free_port()), Router(replay_port=free_port())
    try:
        async with cluster(tmp_path, etcd_url, edges=()) as c:
            await c.start_edge("e1", region="eu", kv_events=plain.endpoint, kv_events_replay=plain.replay_endpoint)
            await c.start_edge("e2", region="us", kv_events=named.endpoint, kv_events_replay=named.replay_endpoint,
                               kv_events_namespaces=("acme",))
            pub = full_chunks(await publish(c, SHORT, name="pub"))
            priv = full_chunks(await publish(c, SHORT, name="priv", namespace="acme", token=TENANT_A))
            assert pub and priv and not set(pub) & set(priv)
            for nid in ("e1", "e2"):
                edge = c.edge(nid)
                await wait_until(lambda: edge.chains.position(priv[0]) and edge.chains.position(pub[0]))
                # acme's first: it is left out as it enters a tier, so once public's events are in, none can follow
                for x in priv:
                    assert (await get(c.edge_url(nid), x, token=TENANT_A))[0] == 200
                for x in pub:
                    assert (await get(c.edge_url(nid), x))[0] == 200
            await plain.until(lambda: plain.held() == set(pub))
            await named.until(lambda: named.held() == set(pub) | set(priv))
            assert all("@acme/" not in t for t, _, _ in plain.batches)
            assert any(t.startswith("kv@us/e2@acme/") for t, _, _ in named.batches)
            assert c.edge("e1").holds((priv[0], "zstd"))  # held, just not told
    finally:
        plain.close()
        named.close()


def test_the_settings_go_from_the_flags_to_the_config():
    from kdn.edge.cli import register, _serve_kwargs

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    args = p.parse_args(["edge", "serve", "--kv-events", "tcp://127.0.0.1:5557", "--kv-events-replay",
                         "tcp://127.0.0.1:5558", "--kv-events-namespace", "acme", "--kv-events-buffer", "8MiB",
                         "--kv-events-int-hashes"])
    cfg = EdgeConfig(**_serve_kwargs(args))
    assert (cfg.kv_events, cfg.kv_events_replay, cfg.kv_events_namespaces, cfg.kv_events_buffer,
            cfg.kv_events_int_hashes) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", ("acme",), 8 << 20, True)
    assert EdgeConfig().kv_events is None  # off by default
    with pytest.raises(InvalidInput, match="need kv_events"):
        EdgeConfig(kv_events_namespaces=("acme",))
    with pytest.raises(InvalidInput, match="ZMQ endpoint"):
        EdgeConfig(kv_events="http://127.0.0.1:5557")
    with pytest.raises(InvalidInput, match="invalid namespace"):
        EdgeConfig(kv_events="tcp://127.0.0.1:5557", kv_events_namespaces=("Not A Namespace",))


def test_integer_hashes_are_vllms_low_64_bits():
    from kdn.edge.kv_events import block_hash, block_stored, encode_batch

    a = "0123456789abcdef" * 4
    assert block_hash(a, False) == bytes.fromhex(a)
    assert block_hash(a, True) == int.from_bytes(bytes.fromhex(a), "big") & ((1 << 64) - 1) == 0x0123456789abcdef
    payload = encode_batch(1.0, [block_stored([block_hash(a, True)], None, [1, 2], 256)])
    batch = _decoder().decode(payload)
    assert batch.events[0].block_hashes == [0x0123456789abcdef] and batch.data_parallel_rank == 0
    assert msgspec.msgpack.Encoder().encode(batch) == payload
