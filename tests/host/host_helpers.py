"""What the host tier's tests share: real objects, ``Shelf`` (a stand-in upstream whose fills a test can hold
open), and a host started in-process on a short temp socket and segment."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from kdn.format.objects import RawTensor, encode_object
from kdn.host.config import HostConfig
from kdn.host.tier import HostTier
from kdn.registry.records import Encoding, ObjectRecord
from kdn.wire.fetch import Buffer, Want

MODEL = "b" * 64


def object_record(address: str, namespace: str = "public", size: int = 1, digest: str = "0" * 64) -> ObjectRecord:
    """An (unsigned) record of a one-chunk kv object in ``raw`` of ``size`` bytes: what the host keeps with it."""
    return ObjectRecord(address=address, model_id=MODEL, namespace=namespace, kind="kv", start=0, end=256,
                        parent=None, standalone=False, encodings={"raw": Encoding("raw", size, digest)},
                        origin="shelf", created=0.0)


def make_object(i: int, nbytes: int = 64 << 10, namespace: str = "public") -> tuple[str, bytes, ObjectRecord]:
    """A real raw KDN object of about ``nbytes`` (one U8 tensor of seeded noise): address, blob, record."""
    address = blake3(f"object {i} {namespace}".encode()).hexdigest()
    data = np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
    blob = encode_object(kind="kv", address=address, model_id=MODEL, namespace=namespace, start=0, end=256,
                         position=0, parent=None, encoding="raw",
                         tensors={"L0.k": RawTensor("L0.k", "U8", (nbytes,), memoryview(data.tobytes()))})
    return address, blob, object_record(address, namespace, len(blob), blake3(blob).hexdigest())


class Shelf:
    """An upstream of real objects (``kdn.host.fill.Upstream``). ``gate``: when set to an unset Event, every fill
    waits on it after taking its block, so a test holds fills in flight; ``taken`` hears each block taken."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, ObjectRecord]] = {}
        self.gate: asyncio.Event | None = None
        self.taken: asyncio.Queue[str] = asyncio.Queue()
        self.on_take: Callable[[], None] = lambda: None  # called as each block is taken (the budget is checked)
        self.fetched = 0

    def add(self, i: int, nbytes: int = 64 << 10, namespace: str = "public") -> tuple[str, bytes]:
        address, blob, record = make_object(i, nbytes, namespace)
        self.objects[address] = (blob, record)
        return address, blob

    async def record(self, address: str) -> ObjectRecord | None:
        got = self.objects.get(address)
        return got[1] if got else None

    async def fetch_into(self, want: Want, alloc: Callable[[int], Buffer]) -> None:
        blob = self.objects[want.address][0]
        buf = alloc(want.size)
        try:
            self.on_take()
            self.taken.put_nowait(want.address)
            if self.gate is not None:
                await self.gate.wait()
            buf.view[:] = blob
            self.fetched += 1
        finally:
            buf.release()


def host_config(d: Path, **kw: Any) -> HostConfig:
    kw.setdefault("edges", ("http://127.0.0.1:9",))  # (unused where a test gives the upstream)
    kw.setdefault("trusted_keys", str(d / "unused-keys"))
    kw.setdefault("segment_bytes", 64 << 20)
    return HostConfig(socket=str(d / "h.sock"), segment=str(d / "h.seg"), **kw)


@contextlib.asynccontextmanager
async def running(config: HostConfig, upstream: Any = None):
    tier = await HostTier.start(config, upstream=upstream)
    try:
        yield tier
    finally:
        await tier.close()
