"""The edge's registry views: one watch of ``manifests/`` (the prefetch chain index and the policy engine
both read it), one of the live origins (without ``--origin``), and the TTL expiry pass."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from kdn.edge.node import Edge
from kdn.edge.prefetch import ChainIndex

from kdn.errors import KDNError
from kdn.registry import Manifest, NodeRecord, follow

log = logging.getLogger("kdn.edge.app")


async def watch_manifests(edge: Edge) -> None:
    """The edge's one view of ``manifests/``: keeps the chain index (for prefetch) current and hands
    each event on to the policy engine (pins and warms name manifests).

    Each record is unpacked once here (a snapshot at an edge's start holds every published name): the
    choice of pointers to read, the reads and the chain index all take that one ``Manifest``."""
    await follow(edge.registry, "manifests/", _ManifestView(edge).on_event, what="manifest")


class _ManifestView:
    """``watch_manifests``'s state: the unreadable records warned of, and the pointer bodies read at once."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.warned: set[str] = set()
        self.fetching = asyncio.Semaphore(16)

    def read(self, key: str, value: bytes) -> Manifest | None:
        # One unreadable manifest (a newer writer, a bad hand edit) hides itself only: once it failed
        # the whole snapshot, which left prefetch off and re-listed every manifest in a retry loop.
        try:
            return Manifest.unpack(value)
        except KDNError as e:
            self.edge.m.bad_records.labels("manifest").inc()
            if key not in self.warned and len(self.warned) < 1024:
                self.warned.add(key)
                log.warning("skipping unreadable manifest record %s: %s", key, str(e).splitlines()[0][:200])
            return None

    def put(self, m: Manifest | None) -> None:
        if m is None:
            return
        if m.body is None and not m.deleted:
            self.edge.chains.put(m)
        else:  # deleted, or a pointer whose body was not read (no room, or no origin had it): no chain
            self.edge.chains.remove(m.ref)

    async def whole(self, key: str, m: Manifest) -> Manifest | None:
        """A pointer's whole manifest (``Manifest.body``, read from the origins); None if it cannot be read
        now (no chain for prefetch; policies read it again)."""
        assert m.body is not None
        async with self.fetching:
            full = await self.edge.bodies.get_manifest_body(m.namespace, m.name, m.body)
        if full is None or not m.points_at(full):
            log.warning("manifest %s v%d: its body %s could not be read from the origins", key, m.version,
                        m.body[:16])
            return None
        return full

    async def snapshot(self, ev):
        """A new chain index from a snapshot; the event as the policy engine gets it: pointers replaced by
        the bodies read (the newest first, while the index has room)."""
        edge = self.edge
        parsed = {k: self.read(k, v) for k, v in ev.items.items()}
        pointers = [(k, m) for k in _to_read(parsed, edge.chains.budget) if (m := parsed[k]) is not None]
        fulls = await asyncio.gather(*(self.whole(k, m) for k, m in pointers))
        got = {k: f for (k, _), f in zip(pointers, fulls) if f is not None}
        parsed.update(got)
        ev = dataclasses.replace(ev, items={**ev.items, **{k: f.pack() for k, f in got.items()}})
        edge.chains = ChainIndex(edge.chains.budget)
        edge.prefetcher.index = edge.chains
        for m in parsed.values():
            self.put(m)
        return ev

    async def on_event(self, ev) -> None:
        if ev.kind == "snapshot":
            ev = await self.snapshot(ev)
        elif ev.kind == "put" and ev.value is not None:
            m = self.read(ev.key, ev.value)
            if m is not None and m.body is not None and (full := await self.whole(ev.key, m)) is not None:
                m = full
                ev = dataclasses.replace(ev, value=full.pack())
            self.put(m)
        elif ev.kind == "delete":
            self.edge.chains.remove(ev.key.split("/", 1)[1])
        await self.edge.policies.feed_manifests(ev)


def _to_read(items: dict[str, Manifest | None], budget: int) -> list[str]:
    """The pointers of a snapshot (unpacked; None for an unreadable record) whose bodies are read from the
    origins at start: the newest first, while the chain index has room for them (a pointer says how many
    tokens its body names). Reading all of them was one origin request per published name at every edge's
    start (10^7 at internet scale) for chains the index could not hold anyway; a pointer left unread has no
    chain (no prefetch for it until its next publish), and a policy that names it reads it itself."""
    pointers: list[tuple[int, str, int]] = []
    room = budget
    for key, m in items.items():
        if m is None:
            continue  # (read() counted and logged it)
        if m.body is not None:
            pointers.append((m.version, key, -(-m.tokens // max(m.chunk_tokens, 1))))
        elif not m.deleted:
            room -= len(m.addresses)
    out = []
    for _, key, n in sorted(pointers, reverse=True):
        if n > room:
            break
        out.append(key)
        room -= n
    return out


EXPIRY_PASS_S = 1.0


async def expire_loop(edge: Edge) -> None:
    """The expiry pass: every EXPIRY_PASS_S, drop the TTL-expired entries of every tier. Without it an expired
    entry went only under pressure, so with room to spare it was served for ever past its TTL."""
    while True:
        await asyncio.sleep(EXPIRY_PASS_S)
        for tier in edge.tiers:
            await tier.expire()


def _left_out(edge: Edge, node: NodeRecord, why: str | None) -> bool:
    """Whether an origin is left out (not admitted); counted and logged once per node and reason."""
    if why is None:
        return False
    key = (node.node_id, node.url, why)
    if key not in edge.left_out and len(edge.left_out) < 1024:
        edge.left_out.add(key)
        edge.m.unadmitted_nodes.inc()
        log.warning("leaving out %s %s at %s: %s", node.role, node.node_id, node.url[:80], why)
    return True


async def watch_origins(edge: Edge, ready: asyncio.Future[None] | None = None) -> None:
    """Without --origin, the origins are whatever the registry lists as live. ``ready`` resolves once the
    first list is in: until then the edge knows no origin, and under ``--records auto`` would take the
    registry's word on records that live in the origins' stores (a restarted edge answered 404 for
    published objects until its first list)."""

    async def on_event(ev) -> None:
        nodes = await edge.registry.list_nodes(role="origin")
        if edge.admitters is not None:
            from kdn.registry.signing import unadmitted

            nodes = [n for n in nodes if not _left_out(edge, n, unadmitted(n, edge.admitters))]
        edge._origins = [n.url.rstrip("/") for n in sorted(nodes, key=lambda n: n.node_id)]
        edge.origins_listed = edge.origins_listed or bool(edge._origins)

    async def recheck() -> None:  # admissions expire while their origins stay up: read the list again
        from kdn.edge.membership import ADMISSION_RECHECK_S

        while True:
            await asyncio.sleep(ADMISSION_RECHECK_S)
            if edge.admitters is not None:
                edge.admitters.refresh()  # a revocation takes effect here, as an expiry does
            with contextlib.suppress(KDNError):
                await on_event(None)

    task = asyncio.create_task(recheck()) if edge.admitters is not None else None
    try:
        await follow(edge.registry, "nodes/origin/", on_event, what="origin", ready=ready)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
