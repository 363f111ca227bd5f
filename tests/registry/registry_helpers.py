"""Record builders and watch helpers for the registry tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from blake3 import blake3

from kdn.registry import BaseRelation, Encoding, Event, Manifest, ModelRecord, NodeRecord, ObjectRecord, Policy


def addr(seed: str) -> str:
    return blake3(seed.encode()).hexdigest()


MID = addr("model")


def model(name: str = "tiny") -> ModelRecord:
    return ModelRecord(MID, name, "LlamaForCausalLM", "bfloat16", 256, {"layers": 2, "rope": {"theta": 1e4}}, {"note": "t"})


def relation(variant: str = MID, base: str | None = None, **kw) -> BaseRelation:
    """A variant ``variant`` reading base ``base``'s states, recomputing its first 2 of 8 layers."""
    d = dict(variant=variant, base=base or addr("base"), layers=8, recompute=[0, 1], metric="nll%", budget=5.0,
             measured={"nll%": [3.1, 1.2], "samples": 4}, name="tiny+sft", created=1700000000.0)
    d.update(kw)
    return BaseRelation(**d)


def enc(name: str = "raw", data: bytes = b"blob") -> Encoding:
    return Encoding(name, len(data), blake3(data).hexdigest())


def obj(seed: str, *, parent: str | None = None, start: int = 0, end: int = 256, encs=("raw",)) -> ObjectRecord:
    return ObjectRecord(
        address=addr(seed),
        model_id=MID,
        namespace="public",
        kind="kv",
        start=start,
        end=end,
        parent=parent,
        standalone=False,
        encodings={e: enc(e, seed.encode()) for e in encs},
        origin="origin-1",
        created=1700000000.0,
    )


def chain(seed: str, n: int) -> list[ObjectRecord]:
    out: list[ObjectRecord] = []
    for i in range(n):
        out.append(obj(f"{seed}/{i}", parent=out[-1].address if out else None, start=i * 256, end=(i + 1) * 256))
    return out


def manifest(name: str, objects: list[ObjectRecord], namespace: str = "public") -> Manifest:
    n = objects[-1].end if objects else 0
    return Manifest(namespace, name, MID, [o.address for o in objects], n, 256, list(range(n)), "chatml", [], 1700000000.0)


def node(node_id: str = "edge-1", role: str = "edge", region: str = "eu") -> NodeRecord:
    return NodeRecord(role, region, node_id, f"http://{node_id}.test:8080", {"capacity": 1 << 30})


def policy(name: str = "pin-docs", **kw) -> Policy:
    return Policy(name, kw.pop("kind", "pin"), **{"region": "eu", "manifest": "public/docs", **kw})


async def next_event(it: AsyncIterator[Event], timeout: float = 5.0) -> Event:
    return await asyncio.wait_for(it.__anext__(), timeout)


async def until(it: AsyncIterator[Event], pred: Callable[[Event], bool], timeout: float = 5.0) -> list[Event]:
    """Events up to and including the first that satisfies ``pred``."""
    seen: list[Event] = []

    async def run() -> None:
        async for ev in it:
            seen.append(ev)
            if pred(ev):
                return
        raise AssertionError(f"watch ended early; saw {seen}")

    await asyncio.wait_for(run(), timeout)
    return seen


async def eventually(check: Callable, timeout: float = 5.0, every: float = 0.05):
    """Poll the async ``check`` until it returns a truthy value; return it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await check()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {got!r})")
        await asyncio.sleep(every)
