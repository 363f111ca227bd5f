"""On the CPU, a step's loads written into the paged cache by a thread of their own, ahead of the forward.

Where the cache is host memory there is no copy engine to hand the bytes to: every byte a load brings is
written by a CPU core through the backend's own ``do_kv_cache_update``. Done inside ``wait_for_layer_load``
(as it was), those writes sit on the forward's path, layer after layer: 37 ms of a 124 ms SmolLM2 hit at 8k
from the host tier, where a local prefix-cache hit takes 66. But the forward of a short suffix keeps the
cores only part of the time (its Python, its small kernels), and every byte a load needs is known when the
step starts. So the CPU does what a GPU's copy stream does (``stage.Upload``): one writer thread, started
with the step, collects each load's chunks and writes layer ``j`` of every load, then marks layer ``j``
done; the forward's wait for layer ``j`` waits for that mark only, and computes layer ``j`` while later
layers are written. The writer runs its kernels on ``threads`` OpenMP threads of its own (default 1: the
forward's team keeps the cores it has).

What stays the same: the bytes, the writes (the very backend call), a failed chunk lowering what is loaded
(``_collect`` runs first, in the writer), and a write that raises raising in the forward, at the layer that
needed it. A step's loads end (``end_step``) only once the writer is done with them: their leases and
staging are never handed back while it reads them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class WriteAhead:
    """The writer threads of one worker, and the current step's marks (one per attention layer and thread)."""

    def __init__(self, workers: int = 1, threads: int = 1) -> None:
        self.workers, self.threads = workers, threads
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kdn-write",
                                                           initializer=self._init)
        self._step: _Step | None = None
        # ``torch.set_num_threads`` sets the calling thread's OpenMP team *and* torch's process-wide default, which
        # every thread started later takes (a prefill on such a thread, with another team size, rounds bf16
        # differently). So the writers are started now, each setting its own team, and the default is put back
        # from a thread of its own: the forward's team and every later thread keep what they had.
        before = torch.get_num_threads()
        started = threading.Barrier(workers)
        for f in [self._pool.submit(started.wait, 30) for _ in range(workers)]:
            f.result()
        reset = threading.Thread(target=torch.set_num_threads, args=(before,), name="kdn-write-reset")
        reset.start()
        reset.join()

    def _init(self) -> None:
        # This writer's OpenMP team (see __init__ for the process default). Asked first: torch sets up a thread's
        # team lazily, from the process default, the first time the thread asks, and would undo the setting.
        torch.get_num_threads()
        torch.set_num_threads(self.threads)

    @property
    def active(self) -> bool:
        return self._step is not None

    def start(self, runs: Sequence[Any], layers: Sequence[Any], collect: Callable[[Any], None],
              write: Callable[[Any, Any, int, int], None]) -> None:
        """Collect each of ``runs`` (``collect(run)``), then per layer in ``layers`` order, on each writer ``w`` of
        ``k``, ``write(run, layer, w, k)`` for every run (its share of the layer), marking the layer done after."""
        assert self._step is None, "the previous step's writes were not ended"
        step = _Step(len(layers), self.workers)
        step.futures = [self._pool.submit(step.run, w, list(runs), list(layers), collect, write)
                        for w in range(self.workers)]
        self._step = step

    def wait(self, j: int) -> float:
        """Block until layer ``j`` of this step is written; the seconds waited. Raises what a writer raised."""
        step = self._step
        assert step is not None
        t0 = time.perf_counter()
        for marks in step.marks:
            marks[j].wait()
        if step.error is not None and j >= step.failed_at:
            raise step.error
        return time.perf_counter() - t0

    def end(self) -> None:
        """Wait for the step's writers to finish (they may still hold layers the forward did not ask for)."""
        step, self._step = self._step, None
        if step is not None:
            concurrent.futures.wait(step.futures)

    def close(self) -> None:
        self.end()
        self._pool.shutdown(wait=True, cancel_futures=False)


class _Step:
    def __init__(self, n: int, workers: int) -> None:
        self.marks = [[threading.Event() for _ in range(n)] for _ in range(workers)]
        self.collected = threading.Event()
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.failed_at = n  # the first layer some writer did not write (n: none)
        self.futures: list[concurrent.futures.Future[None]] = []

    def run(self, w: int, runs: list[Any], layers: list[Any], collect: Callable[[Any], None],
            write: Callable[[Any, Any, int, int], None]) -> None:
        k = len(self.marks)
        j = 0
        try:
            # The cache may be an inference tensor (made inside the engine's inference mode): in-place writes to
            # one are allowed only in inference mode, which is per thread.
            with torch.inference_mode():
                if w == 0:
                    try:
                        for run in runs:
                            collect(run)
                    except BaseException as e:  # noqa: BLE001 -- no layer is written: every wait raises it
                        self._failed(0, e)
                    finally:
                        self.collected.set()
                else:
                    self.collected.wait()
                for j, layer in enumerate(layers):
                    if j >= self.failed_at:
                        break
                    for run in runs:
                        write(run, layer, w, k)
                    self.marks[w][j].set()
        except BaseException as e:  # noqa: BLE001 -- raised again in the forward, at the layer that waits for it
            self._failed(j, e)
        finally:
            for m in self.marks[w]:
                m.set()

    def _failed(self, j: int, e: BaseException) -> None:
        with self.lock:
            if j < self.failed_at:
                self.error, self.failed_at = e, j
