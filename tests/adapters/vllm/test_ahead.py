"""The CPU's write-ahead threads (``adapters/vllm/ahead.py``): a layer's wait returns only once every writer has
written its share of that layer; a writer's error is raised at the wait of the layer it failed on (and every
later one); ``end`` waits for writes the forward never asked for; inference tensors are written in place."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kdn.adapters.vllm.ahead import WriteAhead

LAYERS = 6


def test_a_layer_wait_returns_once_every_writer_wrote_its_share():
    ahead = WriteAhead(workers=2)
    written: set[tuple[int, int, int]] = set()
    lock = threading.Lock()
    gate = threading.Event()

    def write(run, layer, w, k):
        assert k == 2 and w in (0, 1)
        if layer == 3 and w == 1:
            gate.wait(10)  # writer 1 holds layer 3 back
        with lock:
            written.add((run, layer, w))

    try:
        ahead.start([0, 1], list(range(LAYERS)), lambda run: None, write)
        assert ahead.active
        ahead.wait(2)
        assert {(r, layer, w) for r in (0, 1) for layer in range(3) for w in (0, 1)} <= written
        waiter = threading.Thread(target=ahead.wait, args=(3,))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive(), "layer 3's wait returned before writer 1 wrote its share"
        gate.set()
        waiter.join(10)
        assert not waiter.is_alive()
        ahead.end()
        assert not ahead.active
        assert len(written) == 2 * LAYERS * 2  # every run, layer and writer, the ones never waited for too
    finally:
        gate.set()
        ahead.close()


def test_loads_are_collected_before_any_layer_is_written():
    ahead = WriteAhead(workers=2)
    order: list[str] = []

    def collect(run):
        time.sleep(0.05)
        order.append(f"collect {run}")

    def write(run, layer, w, k):
        order.append("write")

    try:
        ahead.start(["a", "b"], list(range(LAYERS)), collect, write)
        ahead.wait(LAYERS - 1)
        ahead.end()
        assert order[:2] == ["collect a", "collect b"] and order[2:] == ["write"] * (2 * LAYERS * 2)
    finally:
        ahead.close()


def test_a_writers_error_is_raised_at_the_layer_that_needed_it():
    ahead = WriteAhead(workers=2)

    def write(run, layer, w, k):
        if layer == 2 and w == 1:
            raise RuntimeError("cache write failed")

    try:
        ahead.start([0], list(range(LAYERS)), lambda run: None, write)
        ahead.wait(1)
        for j in range(2, LAYERS):
            with pytest.raises(RuntimeError, match="cache write failed"):
                ahead.wait(j)
        ahead.end()
        # The next step starts clean.
        ahead.start([0], list(range(LAYERS)), lambda run: None, lambda *a: None)
        ahead.wait(LAYERS - 1)
        ahead.end()
    finally:
        ahead.close()


def test_writers_run_their_kernels_on_their_own_thread_count_and_write_inference_tensors():
    with torch.inference_mode():
        cache = torch.zeros(LAYERS, 4)  # an inference tensor, as vLLM's cache may be
    seen: list[int] = []
    main_threads = torch.get_num_threads()
    ahead = WriteAhead(workers=1, threads=1)

    def write(run, layer, w, k):
        seen.append(torch.get_num_threads())
        cache[layer].add_(layer + 1)

    try:
        ahead.start([0], list(range(LAYERS)), lambda run: None, write)
        ahead.wait(LAYERS - 1)
        ahead.end()
    finally:
        ahead.close()
    assert set(seen) == {1} and torch.get_num_threads() == main_threads
    # ... and torch's process-wide default is what it was: a thread started after the writers takes it (a prefill
    # on it must not round differently from the same prefill before)
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [main_threads]
    assert cache[:, 0].tolist() == [float(j + 1) for j in range(LAYERS)]


def test_a_failed_collect_writes_no_layer_and_every_wait_raises():
    ahead = WriteAhead(workers=2)
    wrote: list[int] = []

    def collect(run):
        raise ValueError("no pieces")

    try:
        ahead.start([0], list(range(LAYERS)), collect, lambda run, layer, w, k: wrote.append(layer))
        for j in range(LAYERS):
            with pytest.raises(ValueError, match="no pieces"):
                ahead.wait(j)
        ahead.end()
    finally:
        ahead.close()
    assert wrote == []
