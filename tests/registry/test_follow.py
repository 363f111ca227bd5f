"""``follow``: the one watch loop of every registry view -- retry with backoff until a handler succeeds."""

from __future__ import annotations

import asyncio

import pytest

from kdn.errors import RegistryError
from kdn.registry import Policy, follow


async def test_a_failing_handler_is_retried_until_it_succeeds(registry_factory):
    reg = registry_factory()
    await reg.put_policy(Policy(name="p1", kind="pin", manifest="public/doc"))
    seen, errors = [], []
    calls = {"n": 0}

    async def on_event(ev) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise ValueError("handler not ready")  # e.g. a view that depends on something still starting
        seen.append(ev)

    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(follow(reg, "policies/", on_event, what="test", backoff=(0.01, 0.05),
                                      on_error=errors.append))
    try:
        for _ in range(300):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert len(errors) == 2 and "handler not ready" in errors[0]
        assert seen[0].kind == "snapshot" and set(seen[0].items) == {"policies/p1"}  # the view re-listed
        await reg.put_policy(Policy(name="p2", kind="pin", manifest="public/doc"))
        for _ in range(300):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
        assert seen[1].kind == "put" and seen[1].key == "policies/p2"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not ready.done()  # not passed: only the caller's own future is resolved


async def test_ready_gets_the_first_failure_so_a_caller_can_refuse_to_start(registry_factory):
    reg = registry_factory()
    await reg.close()
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(follow(reg, "nodes/edge/", lambda ev: None, what="test", ready=ready))
    with pytest.raises(RegistryError):
        await asyncio.wait_for(ready, 10)
    await asyncio.wait_for(task, 10)  # and the follower ends: nothing to serve without a first view


async def test_stop_tasks_is_bounded_when_a_task_ignores_its_cancel(caplog):
    """A follower whose cancel was lost below it (seen on etcd: one edge teardown in ~15) once hung the
    edge's whole shutdown behind an unbounded wait; stop_tasks gives up after its timeout and says so."""
    import asyncio
    import time

    from kdn.registry.follow import stop_tasks

    release = asyncio.Event()

    async def deaf() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()  # what a lost cancel looks like from above: the task keeps going

    async def polite() -> None:
        await asyncio.sleep(3600)

    tasks = [asyncio.create_task(deaf(), name="deaf-watch"), asyncio.create_task(polite(), name="polite-watch")]
    await asyncio.sleep(0)
    t0 = time.monotonic()
    await stop_tasks(tasks, what="test", timeout=0.3)
    assert time.monotonic() - t0 < 2
    assert tasks[1].cancelled() and not tasks[0].done()
    assert "1 test task(s) still running" in caplog.text and "deaf-watch" in caplog.text
    release.set()
    await tasks[0]
