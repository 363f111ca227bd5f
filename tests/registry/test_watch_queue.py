"""aetcd's watch request queue (10 deep, blocking puts under its lock): a stream that sends nothing must not
hang a cancel, nor the shutdown after it. Reproduced against a real etcd: 9,000 watches, etcd SIGSTOPped,
cancel #5,395 (the stream's HTTP/2 window full, then the queue) never returned, and neither did close().
Here the stream is one that never takes a request, so the queue fills after 10."""

from __future__ import annotations

import asyncio

import aetcd
import pytest

from kdn.registry.etcd_client import Watcher

pytestmark = pytest.mark.timeout(30)


class _StuckStub:
    """A Watch stream that never reads a request and never answers (a wedged or SIGSTOPped etcd)."""

    def Watch(self, requests, metadata=None):  # noqa: N802 - gRPC's name
        return self._never()

    @staticmethod
    async def _never():
        await asyncio.Event().wait()
        yield


async def test_cancels_on_a_stuck_stream_time_out_and_shutdown_returns():
    w = Watcher(_StuckStub(), timeout=0.2)
    await w.setup()
    for i in range(1, 16):
        w._callbacks[i] = aetcd.watcher.WatcherCallback(lambda ev: None)  # noqa: SLF001 - live watches
    timed_out = 0
    for i in range(1, 16):
        try:
            await asyncio.wait_for(w.cancel(i), 5)  # unfixed: the 11th blocks for ever in the queue's put
        except aetcd.exceptions.WatchTimeoutError:
            timed_out += 1
    assert timed_out == 5  # 10 fit the queue; each later one gave up after the watch timeout
    await asyncio.wait_for(w.shutdown(), 5)  # unfixed: the end-of-stream marker waits for room for ever
    assert w._request_queue.qsize() == 0  # noqa: SLF001 - a fresh queue for the next stream
