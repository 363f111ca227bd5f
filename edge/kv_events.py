"""What an edge holds, as vLLM's KV-cache events (``kdn edge serve --kv-events``): a router that ingests them
(llm-d's KV-cache indexer, or any subscriber of vLLM's ``ZmqEventPublisher``) can send a prompt to the region
whose edges hold its knowledge.

The wire is vLLM's own (``vllm.distributed.kv_events``, read from vLLM 0.32): a ZMQ PUB socket sends multipart
``[topic, 8-byte big-endian sequence, msgpack payload]``, the payload a ``KVEventBatch`` ``[ts, events,
data_parallel_rank]``, each event a map tagged ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) with msgspec's field order and its ``omit_defaults``; a ROUTER socket (``--kv-events-replay``)
answers a request of one 8-byte big-endian start sequence with every buffered batch from it
(``[topic, seq, payload]`` each), then the end marker ``[b"", seq -1, b""]``. Endpoints follow vLLM's rule: a
wildcard host (``tcp://*:5557``) or an ``ipc://`` path binds, any other address connects (to a router's SUB that
binds, as llm-d's indexer does); the replay socket always binds. Here it is encoded with ``msgpack`` (the edge
has no msgspec), and tests/edge/test_kv_events.py decodes it with vLLM's own classes and re-encodes it byte for byte.

What is a block. One KDN chunk (a prefix-chain object of ``chunk_tokens``, 256 by default) is one block:
``block_hashes`` its 32-byte address (``--kv-events-int-hashes``: its low 64 bits as an integer, as vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does), ``parent_block_hash`` its parent's, ``token_ids`` its tokens,
``block_size`` the chunk size, ``medium`` ``STORAGE``, ``locality`` ``REMOTE`` (engines reach it over the
network), ``ownership`` ``kdn``. A standalone chunk (non-prefix reuse) and a partial tail are not blocks and
are not announced. An address is announced once the first tier of this edge holds it (any encoding) and
removed once the last one let it go, so a copy moving from memory to disk says nothing.

Where the token ids come from. Objects and their records carry a span, not tokens; the manifest that published
a chain carries them (``Manifest.prefix_tokens``). The edge's chain index (``prefetch.py``, kept by its one
manifest watch) says which manifest and position name an address; the manifest is read (one read per chain,
a few kept, by token count) and the chunk's tokens are checked against its address (``a_i = H(a_{i-1},
tokens)``), so a wrong manifest cannot make this edge announce wrong tokens. A chunk no indexed manifest names
(its chain left the bounded index, or its manifest is not read yet) is not announced and is asked again every
``RETRY_S``; ``kdn_edge_kv_events_dropped{reason="no_tokens"}`` counts it.

Topics: ``kv@{region}/{node_id}@{namespace}/{model_id}`` (llm-d reads ``kv@<pod>@<model>``): one per tenant and
model, each with its own sequence from 0, whose first batch starts with ``AllBlocksCleared`` (what a router knew
of this edge before its start is void); a clean stop sends ``AllBlocksCleared`` on every topic. Only the
``public`` namespace is published unless the operator names others (``--kv-events-namespace``): token ids are
plaintext here (docs/security.md).

Bounds: the loop hands batches to the publisher thread through a queue of ``QUEUE_BATCHES``; a full queue drops
the batch, counts it, and resyncs (``AllBlocksCleared`` on every topic, then every held block again), so a
router's view converges instead of drifting. The replay buffer keeps at most ``REPLAY_BATCHES`` batches and
``--kv-events-buffer`` bytes; a subscriber more than ``PUB_HWM`` batches behind loses batches in ZMQ (a gap in
its sequence, which the replay socket fills). The thread owns the sockets; the event loop never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from kdn.errors import InvalidInput
from kdn.format.address import PUBLIC_NAMESPACE, Address, first_address, next_address

from kdn.edge.metrics import EdgeMetrics
from kdn.edge.tiers import EntryMeta, Key

log = logging.getLogger(__name__)

MEDIUM = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE
LOCALITY = "REMOTE"  # vllm.v1.kv_offload.base.Locality.REMOTE: engines reach an edge over the network
OWNERSHIP = "kdn"  # BlockStored.ownership: "secondary offloading tier identifier"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay end marker (ZmqEventPublisher.END_SEQ)
DP_RANK = 0  # KVEventBatch.data_parallel_rank, as vLLM's publisher of rank 0 fills it in

QUEUE_BATCHES = 1024  # batches the loop may hand the thread before it drops (and resyncs)
REPLAY_BATCHES = 10_000  # batches the replay buffer keeps at most (vLLM's buffer_steps default)
DEFAULT_BUFFER_BYTES = 64 << 20  # and bytes (--kv-events-buffer)
PUB_HWM = 1024  # batches ZMQ queues for one subscriber before it drops (a gap the replay fills)
MAX_EVENTS = 256  # events in one batch at most
RESOLVE_AT_ONCE = 256  # addresses resolved per round (one batched record read)
RETRY_S = 5.0  # chunks whose tokens or record could not be learnt are asked again this often
MANIFEST_TOKENS = 1 << 22  # token ids of read manifests kept (4 B each: 16 MiB)
POLL_S = 0.05  # the thread's longest wait between looking at its queue and at the replay socket
COALESCE_S = 0.02  # after a wake, events gather this long before a round sends them (a router hears them late by it)
CLOSE_S = 3.0  # how long a stop waits for the thread to send its last batches


# --- the wire: vLLM's events, as msgspec encodes them ---------------------------------------------------


def block_stored(hashes: list[Any], parent: Any, token_ids: list[int], block_size: int) -> dict[str, Any]:
    """A ``BlockStored`` as ``msgspec`` encodes vLLM's struct: the tag, then its fields in order, those at their
    default left out (``omit_defaults``; the required ones always present)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None,
            "locality": LOCALITY, "ownership": OWNERSHIP}


def block_removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "locality": LOCALITY,
            "ownership": OWNERSHIP}


ALL_BLOCKS_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """A ``KVEventBatch`` (``array_like``: ``[ts, events, data_parallel_rank]``) as msgpack."""
    return msgpack.packb([float(ts), events, DP_RANK], use_bin_type=True)


def block_hash(address: Address, as_int: bool) -> bytes | int:
    """The block hash of a chunk: its address's 32 bytes, or (``as_int``) their low 64 bits big-endian, as
    vLLM's ``maybe_convert_block_hash`` makes an integer hash."""
    raw = bytes.fromhex(address)
    return int.from_bytes(raw, "big") & ((1 << 64) - 1) if as_int else raw


def topic_of(region: str, node_id: str, namespace: str, model_id: str) -> str:
    return f"kv@{region}/{node_id}@{namespace}/{model_id}"


# --- the publisher thread -------------------------------------------------------------------------------


class ZmqPublisher:
    """vLLM's ``ZmqEventPublisher`` for several topics: a PUB socket, an optional ROUTER for replays, one thread
    that owns both. ``offer`` never blocks (False: the queue is full, the batch is dropped); each topic has its
    own sequence. pyzmq is imported here only: an edge without ``--kv-events`` needs none."""

    def __init__(self, endpoint: str, replay: str | None, metrics: EdgeMetrics, *,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        try:
            import zmq
        except ImportError:
            raise InvalidInput("--kv-events needs pyzmq (pip install pyzmq)") from None
        self._zmq = zmq
        self.m = metrics
        self.buffer_bytes = buffer_bytes
        self._queue: queue.Queue[tuple[str, bytes, dict[str, int]] | None] = queue.Queue(QUEUE_BATCHES)
        self._buffer: deque[tuple[bytes, int, bytes]] = deque()  # (topic, seq, payload), oldest first
        self._buffered = 0  # bytes of payloads in _buffer
        self._seq: dict[bytes, int] = {}
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe says so (EAGAIN): the replay is cut
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_BATCHES + 1)  # a whole buffer and its end marker fit
                self._replay.bind(replay)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidInput(f"--kv-events: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kdn-kv-events", daemon=True)
        self._thread.start()

    def offer(self, topic: str, payload: bytes, counts: dict[str, int]) -> bool:
        """Hand one encoded batch to the thread; False (nothing sent) when its queue is full."""
        try:
            self._queue.put_nowait((topic, payload, counts))
            return True
        except queue.Full:
            return False

    async def close(self) -> None:
        """Send what is queued, then stop: the thread gets ``CLOSE_S`` to take the stop, and as long to end
        (both waited for off the event loop; a thread that died takes no stop, and is not waited for)."""
        if self._thread.is_alive():
            try:
                await asyncio.to_thread(self._queue.put, None, True, CLOSE_S)
            except queue.Full:
                pass
        await asyncio.to_thread(self._thread.join, CLOSE_S)

    # (the thread's)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    # A PUB takes in its subscribers' subscriptions only when its own thread calls into it:
                    # idle, that is here, so a router that just connected hears the next batch, not the one after.
                    self._pub.getsockopt(self._zmq.EVENTS)
                    continue
                if item is None:
                    break
                self._send(*item)
        except Exception:  # noqa: BLE001 -- a bug here must not take the edge down: events stop, logged
            log.exception("kv events publisher stopped")
        finally:
            self._close_sockets(linger_ms=1000)

    def _send(self, topic: str, payload: bytes, counts: dict[str, int]) -> None:
        t = topic.encode()
        seq = self._seq.get(t, 0)
        self._seq[t] = seq + 1
        self._pub.send_multipart((t, seq.to_bytes(8, "big"), payload))  # PUB never blocks: past its HWM, ZMQ drops
        self._buffer.append((t, seq, payload))
        self._buffered += len(payload)
        while self._buffer and (len(self._buffer) > REPLAY_BATCHES or self._buffered > self.buffer_bytes):
            self._buffered -= len(self._buffer.popleft()[2])
        self.m.kv_event_batches.inc()
        for kind, n in counts.items():
            self.m.kv_events.labels(kind).inc(n)
        self.m.kv_event_replay_bytes.set(self._buffered)

    def _serve_replay(self) -> None:
        """vLLM's replay: ``[identity, b"", start_seq]`` in; every buffered batch from ``start_seq`` out, each
        ``[identity, b"", topic, seq, payload]``, then ``[identity, b"", b"", END_SEQ, b""]``. A fourth frame,
        a topic, replays that topic only (each topic has its own sequence)."""
        zmq = self._zmq
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
            self.m.kv_event_replays.labels("bad").inc()
            log.debug("kv events: a replay request of %d frames ignored", len(frames))
            return
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        only = frames[3] if len(frames) == 4 else None
        try:
            for t, seq, payload in list(self._buffer):
                if seq >= start and (only is None or t == only):
                    self._replay.send_multipart((ident, b"", t, seq.to_bytes(8, "big"), payload),
                                                zmq.NOBLOCK, copy=False)
            self._replay.send_multipart((ident, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            self.m.kv_event_replays.labels("served").inc()
        except zmq.ZMQError as e:  # EAGAIN: its pipe is full; EHOSTUNREACH: it went away
            self.m.kv_event_replays.labels("cut").inc()
            log.debug("kv events: a replay was cut: %s", e)

    def _close_sockets(self, linger_ms: int = 0) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=linger_ms)
        self._ctx.term()


def _binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``): a wildcard host or an ipc/inproc path binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# --- what the edge holds, as events (the event loop's side) ---------------------------------------------


class KVEvents:
    """Follows this edge's tiers (their ``on_held`` hook) and turns what enters and leaves them into batches for
    ``sink(topic, payload, counts) -> bool``. ``start`` hooks the tiers and announces what they hold already."""

    def __init__(self, edge: Any, *, region: str, node_id: str, namespaces: Iterable[str],
                 sink: Callable[[str, bytes, dict[str, int]], bool], metrics: EdgeMetrics,
                 int_hashes: bool = False) -> None:
        self.edge = edge
        self.namespaces = frozenset({PUBLIC_NAMESPACE, *namespaces})
        self.region, self.node_id = region, node_id
        self.m = metrics
        self.int_hashes = int_hashes
        self._sink = sink
        self._held: dict[Address, int] = {}  # tier entries (any tier, any encoding) per address held now
        self._announced: dict[Address, str] = {}  # address -> the topic its BlockStored went on
        self._todo: dict[Address, None] = {}  # held, not announced, to resolve (insertion order)
        self._parked: dict[Address, None] = {}  # no record or no tokens yet: asked again every RETRY_S
        self._removed: dict[str, list[Address]] = {}  # topic -> announced addresses that left, to send
        self._topics: set[str] = set()  # topics that began (with AllBlocksCleared)
        self._manifests: OrderedDict[str, tuple[list[str], array, int]] = OrderedDict()  # ref -> (addresses, tokens, chunk)
        self._manifest_tokens = 0
        self._resync = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._warned = 0.0

    def start(self) -> None:
        for tier in self.edge.tiers:
            tier.on_held = self.on_held
            for key, meta in tier.entries():
                self.on_held(key, meta, True)
        self._task = asyncio.create_task(self._loop(), name="kdn-kv-events")

    async def close(self) -> None:
        """Stop following the tiers; tell every topic this edge no longer holds anything (it stops serving)."""
        for tier in self.edge.tiers:
            tier.on_held = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for topic in sorted(self._topics):
            self._offer(topic, [ALL_BLOCKS_CLEARED])

    # the tiers' hook: synchronous, inside their bookkeeping, so it only notes what changed

    def on_held(self, key: Key, meta: EntryMeta, present: bool) -> None:
        if meta.namespace not in self.namespaces:
            return
        a = key[0]
        n = self._held.get(a, 0) + (1 if present else -1)
        if n > 0:
            self._held[a] = n
            if n == 1 and present and a not in self._announced:
                self._todo[a] = None
                self._wake.set()
            return
        self._held.pop(a, None)
        self._todo.pop(a, None)
        self._parked.pop(a, None)
        topic = self._announced.pop(a, None)
        if topic is not None:
            self._removed.setdefault(topic, []).append(a)
            self._wake.set()

    # the loop

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        retry_at = loop.time() + RETRY_S
        while True:
            if not (self._todo or self._removed or self._resync):
                try:
                    async with asyncio.timeout(max(0.0, retry_at - loop.time())):
                        await self._wake.wait()
                    # What else lands in the next few ms goes in the same batches: one fill after another woke
                    # this per object, ~1.8 events a batch, and each batch cost the edge its own encode, queue
                    # hand-off and send (bench/engines.py: 355 us of edge CPU per event)
                    await asyncio.sleep(COALESCE_S)
                except TimeoutError:
                    pass
            if loop.time() >= retry_at:  # ask again for what was not known, busy or not
                retry_at = loop.time() + RETRY_S
                self._todo.update(self._parked)
                self._parked.clear()
            self._wake.clear()
            try:
                await self._round()
            except Exception:  # noqa: BLE001 -- a bug costs this round's events, not the edge
                log.exception("kv events: a round failed")
                await asyncio.sleep(1.0)
            self.m.kv_event_blocks.set(len(self._announced))
            await asyncio.sleep(0)  # a round of cached records awaits nothing: let the requests in between

    async def _round(self) -> None:
        if self._resync:
            self._resync = False
            for topic in sorted(self._topics):
                self._offer(topic, [ALL_BLOCKS_CLEARED])
            if self._resync:
                await asyncio.sleep(1.0)  # the thread is still behind: try again in a while
                return
            self._announced.clear()
            self._removed.clear()
            self._todo = dict.fromkeys(self._held)
            self._parked.clear()
        removed, self._removed = self._removed, {}
        for topic, addrs in removed.items():
            for i in range(0, len(addrs), MAX_EVENTS):
                self._emit(topic, [block_removed([self._hash(a) for a in addrs[i:i + MAX_EVENTS]])])
        batch = list(self._todo)[:RESOLVE_AT_ONCE]
        for a in batch:
            del self._todo[a]
        if batch:
            stored = await self._resolve(batch)
            for topic, events in stored.items():
                for i in range(0, len(events), MAX_EVENTS):
                    self._emit(topic, [e for _, e in events[i:i + MAX_EVENTS]])

    def _hash(self, a: Address | None) -> bytes | int | None:
        return None if a is None else block_hash(a, self.int_hashes)

    async def _resolve(self, addrs: list[Address]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
        """The ``BlockStored`` of each address still held and not announced, by topic, in chain order; those
        whose record or tokens are not known yet are parked."""
        try:
            recs = await self.edge.records.get_many(addrs)
        except Exception as e:  # noqa: BLE001 -- the registry or the origins down: asked again later
            self._park(addrs, "no_record", e)
            return {}
        out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for a, rec in zip(addrs, recs):
            if rec is None:
                self._park([a], "no_record")
                continue
            if rec.namespace not in self.namespaces:  # (its entry said otherwise: the hook let it in)
                continue
            if rec.standalone:
                self.m.kv_events_dropped.labels("not_a_block").inc()
                continue
            try:
                got = await self._tokens(a, rec)
            except Exception as e:  # noqa: BLE001 -- its manifest could not be read now: asked again later
                self._park([a], "no_tokens", e)
                continue
            if got is None:
                self._park([a], "no_tokens")
                continue
            tokens, chunk = got
            if len(tokens) != chunk:  # a partial tail: vLLM announces whole blocks only
                self.m.kv_events_dropped.labels("not_a_block").inc()
                continue
            if a not in self._held or a in self._announced:
                continue  # it left (or was announced) while its record was read
            topic = topic_of(self.region, self.node_id, rec.namespace, rec.model_id)
            self._announced[a] = topic
            out.setdefault(topic, []).append(
                (rec.start, block_stored([self._hash(a)], self._hash(rec.parent), tokens, chunk)))
        for events in out.values():
            events.sort(key=lambda e: e[0])  # parents before children where both are here
        return out

    async def _tokens(self, a: Address, rec: Any) -> tuple[list[int], int] | None:
        """The token ids of ``a``'s chunk and its manifest's chunk size, from the manifest the chain index names
        for it, checked against the address; None when no manifest names it (or none that checks)."""
        where = self.edge.chains.position(a)
        if where is None:
            return None
        ref, i = where
        for fresh in (False, True):
            held = None if fresh else self._manifests.get(ref)
            if held is None:
                held = await self._read_manifest(ref)
                if held is None:
                    return None
            addresses, tokens, chunk = held
            if i < len(addresses) and addresses[i] == a:
                break
        else:
            return None  # (the manifest read again still does not name it there)
        self._manifests.move_to_end(ref)
        ids = tokens[rec.start:rec.end].tolist()
        want = (first_address(rec.model_id, rec.namespace, ids) if rec.parent is None
                else next_address(rec.parent, ids))
        if want != a or rec.end - rec.start > chunk:
            log.warning("kv events: manifest %s does not give the tokens of %s: not announced", ref, a[:16])
            return None
        return ids, chunk

    async def _read_manifest(self, ref: str) -> tuple[list[str], array, int] | None:
        ns, name = ref.split("/", 1)
        m = await self.edge.registry.get_manifest(ns, name)
        if m is not None and m.body is not None:  # a pointer: its body is beside the origin's records
            full = await self.edge.bodies.get_manifest_body(ns, name, m.body)
            m = full if full is not None and m.points_at(full) else None
        self._manifests.pop(ref, None)
        if m is None or m.deleted:
            return None
        held = (list(m.addresses), array("I", m.prefix_tokens), m.chunk_tokens)
        self._manifests[ref] = held
        self._manifest_tokens = sum(len(h[1]) for h in self._manifests.values())
        while len(self._manifests) > 1 and self._manifest_tokens > MANIFEST_TOKENS:
            self._manifest_tokens -= len(self._manifests.popitem(last=False)[1][1])
        return held

    def _park(self, addrs: list[Address], reason: str, error: Exception | None = None) -> None:
        for a in addrs:
            if a in self._held and a not in self._parked:
                self._parked[a] = None
                self.m.kv_events_dropped.labels(reason).inc()
        now = time.monotonic()
        if error is not None and now - self._warned > 60:
            self._warned = now
            log.warning("kv events: %d chunk(s) not announced yet (%s: %s); asking again every %.0f s",
                        len(addrs), reason, str(error).splitlines()[0][:200], RETRY_S)

    def _emit(self, topic: str, events: list[dict[str, Any]]) -> None:
        if topic not in self._topics:  # a topic's stream starts by voiding what a router knew of it
            self._topics.add(topic)
            events = [ALL_BLOCKS_CLEARED, *events]
        self._offer(topic, events)

    def _offer(self, topic: str, events: list[dict[str, Any]]) -> None:
        counts: dict[str, int] = {}
        for e in events:
            counts[e["type"]] = counts.get(e["type"], 0) + 1
        if not self._sink(topic, encode_batch(time.time(), events), counts):
            self.m.kv_events_dropped.labels("queue").inc(len(events))
            self._resync = True
            self._wake.set()


async def start(edge: Any, config: Any, metrics: EdgeMetrics) -> tuple[KVEvents, ZmqPublisher]:
    """The publisher of ``config`` (``EdgeConfig``'s ``kv_events*``) and the feed over ``edge``'s tiers."""
    pub = ZmqPublisher(config.kv_events, config.kv_events_replay, metrics, buffer_bytes=config.kv_events_buffer)
    feed = KVEvents(edge, region=config.region, node_id=config.node_id, namespaces=config.kv_events_namespaces,
                    sink=pub.offer, metrics=metrics, int_hashes=config.kv_events_int_hashes)
    feed.start()
    log.info("publishing KV-cache events on %s (replay: %s; namespaces: %s)", config.kv_events,
             config.kv_events_replay or "none", ", ".join(sorted(feed.namespaces)))
    return feed, pub
