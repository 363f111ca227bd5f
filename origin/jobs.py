"""Publish jobs: a bounded queue, one worker, progress a client can poll.

A job is accepted (202 + id) only if the queue has room; past ``max_pending``
the origin answers 503 instead of queueing without bound. Jobs run one at a
time: the model is the bottleneck and is not safe to share between threads.
Finished jobs are kept (bounded, oldest dropped) so ``GET /v1/jobs/{id}`` can
report the manifest or the error after the fact.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kdn.errors import KDNError

log = logging.getLogger(__name__)


class QueueFull(KDNError):
    """Too many publish jobs are pending; retry later (503)."""


@dataclass
class Job:
    id: str
    name: str
    namespace: str
    state: str = "queued"  # queued -> running -> done | failed
    chunks_done: int = 0
    chunks_total: int = 0
    chunks_computed: int = 0  # chunks that needed the model (the rest were already stored)
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    manifest: dict | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "namespace": self.namespace,
            "state": self.state,
            "progress": {"done": self.chunks_done, "total": self.chunks_total, "computed": self.chunks_computed},
            "created": self.created,
            "started": self.started,
            "finished": self.finished,
            "manifest": self.manifest,
            "error": self.error,
        }


JobFn = Callable[[Job], Awaitable[dict]]


class JobQueue:
    def __init__(self, *, max_pending: int = 16, keep_finished: int = 256) -> None:
        self._queue: asyncio.Queue[tuple[Job, JobFn]] = asyncio.Queue(maxsize=max_pending)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._keep = keep_finished
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="kdn-publish-worker")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass

    def submit(self, name: str, namespace: str, fn: JobFn) -> Job:
        job = Job(id=secrets.token_hex(8), name=name, namespace=namespace)
        try:
            self._queue.put_nowait((job, fn))
        except asyncio.QueueFull:
            raise QueueFull(f"{self._queue.maxsize} publish jobs are pending; retry later") from None
        self._jobs[job.id] = job
        self._trim()
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def _trim(self) -> None:
        finished = [j for j in self._jobs.values() if j.state in ("done", "failed")]
        for j in finished[: max(0, len(finished) - self._keep)]:
            del self._jobs[j.id]

    async def _run(self) -> None:
        while True:
            job, fn = await self._queue.get()
            job.state, job.started = "running", time.time()
            try:
                job.manifest = await fn(job)
                job.state = "done"
            except asyncio.CancelledError:
                job.state, job.error = "failed", "origin shut down while the job ran"
                raise
            except KDNError as e:
                job.state, job.error = "failed", str(e)
                log.warning("publish job %s (%s/%s) failed: %s", job.id, job.namespace, job.name, e)
            except Exception as e:  # a bug or a model failure: record it, keep the worker alive
                job.state, job.error = "failed", f"internal error: {type(e).__name__}"
                log.exception("publish job %s failed", job.id)
            finally:
                job.finished = time.time()
                self._queue.task_done()
