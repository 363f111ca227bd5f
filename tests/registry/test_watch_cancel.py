"""A follower cancelled while its watch is being created must end: the teardown hang behind the bounded waits.

aetcd 1.0.0 creates a watch under ``asyncio.wait_for`` (the wait for etcd's "created" answer, and our bounded
request put). On Python 3.11 a wait_for whose inner wait has just finished when its task is cancelled returns
the result and drops the cancel: the follower got its watch and kept watching, and a shutdown that waited for it
hung (the policy engine's teardown in CI; about one edge teardown in 15). Against a real etcd, ~1% of cancels
landing while followers started were lost (14 of 2,028); here the stream answers at once, so the window is a
fixed number of event-loop steps and every step is tried."""

from __future__ import annotations

import asyncio

import aetcd
import aetcd.rpc
import pytest

from kdn.registry.etcd_client import Watcher

pytestmark = pytest.mark.timeout(60)


class _InstantStub:
    """A Watch stream that answers every create at once (etcd on loopback, in no time)."""

    def Watch(self, requests, metadata=None):  # noqa: N802 - gRPC's name
        async def answers():
            n = 0
            async for req in requests:
                if req.HasField("create_request"):
                    n += 1
                    yield aetcd.rpc.WatchResponse(created=True, watch_id=n)

        return answers()


class _StuckStub:
    """A Watch stream that never reads a request (a wedged or SIGSTOPped etcd)."""

    def Watch(self, requests, metadata=None):  # noqa: N802 - gRPC's name
        async def never():
            await asyncio.Event().wait()
            yield

        return never()


async def _on_event(ev) -> None:
    pass


async def test_a_cancel_while_a_watch_is_created_is_never_lost():
    lost, tried = [], 0
    for steps in range(24):  # cancel after 0, 1, 2, ... event-loop steps of the creation
        w = Watcher(_InstantStub(), timeout=2)
        task = asyncio.create_task(w.add_callback(b"k", _on_event))
        for _ in range(steps):
            await asyncio.sleep(0)
        if not task.done():
            tried += 1
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5)
            if not (done and task.cancelled()):  # unfixed: add_callback returned the watch (steps 1-3 and 6-8)
                lost.append(steps)
            # a watch etcd created before the cancel landed is forgotten, not left feeding a queue nobody reads
            assert not w._callbacks, (steps, w._callbacks)  # noqa: SLF001
        await asyncio.wait_for(w.shutdown(), 5)
    assert tried >= 3  # the creation took several steps, and a cancel came in each
    assert lost == [], f"the cancel was dropped when it came {lost} loop steps into the creation"


async def test_a_watch_whose_create_request_timed_out_does_not_wedge_the_next_ones():
    """aetcd put the create request before the try that clears its pending-create slot: once a put timed out (a
    full queue), every later watch creation on that client waited for the slot for ever."""
    w = Watcher(_StuckStub(), timeout=0.2)
    outcomes = []
    for i in range(13):  # 10 fill the queue; the 11th put times out; unfixed, the 12th waits for ever
        task = asyncio.create_task(w.add_callback(b"k%d" % i, _on_event))
        done, _ = await asyncio.wait({task}, timeout=5)
        if not done:
            task.cancel()
            outcomes.append("stuck")
        else:
            outcomes.append(type(task.exception()).__name__)
    assert outcomes == ["WatchTimeoutError"] * 13
    await asyncio.wait_for(w.shutdown(), 5)
