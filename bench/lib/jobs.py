"""Publish through an origin and wait for its job: the one poll loop benches and tests share.

``POST /v1/publish`` answers 202 with a job id; the job runs the model and ends ``done`` (with the
manifest) or ``failed``. Every loop here has a deadline: a job that never ends is an error after
``timeout`` seconds, not a hang.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp


class JobError(RuntimeError):
    """The origin refused the publish, its job failed, or it did not end in time."""


async def wait_job(session: aiohttp.ClientSession, job_id: str, *, url: str = "", timeout: float = 300.0,
                   poll: float = 0.05) -> dict[str, Any]:
    """Poll ``GET {url}/v1/jobs/{job_id}`` until the job is ``done``: its last state. ``JobError`` when it
    failed or ``timeout`` passed (the last state seen is in the message)."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(f"{url}/v1/jobs/{job_id}") as r:
            job = await r.json()
            if r.status != 200:
                raise JobError(f"job {job_id}: HTTP {r.status} {job}")
        if job["state"] == "done":
            return job
        if job["state"] == "failed":
            raise JobError(f"publish job {job_id} failed: {job.get('error')}")
        if time.monotonic() > deadline:
            raise JobError(f"publish job {job_id} did not end in {timeout:.0f} s: {job}")
        await asyncio.sleep(poll)


async def publish_and_wait(session: aiohttp.ClientSession, body: dict[str, Any], *, url: str = "",
                           timeout: float = 300.0, poll: float = 0.05) -> dict[str, Any]:
    """``POST {url}/v1/publish`` with ``body``, then wait for its job: the published manifest (as JSON)."""
    async with session.post(f"{url}/v1/publish", json=body) as r:
        answer = await r.json()
        if r.status != 202:
            raise JobError(f"publish {body.get('namespace', 'public')}/{body.get('name')}: HTTP {r.status} {answer}")
    job = await wait_job(session, answer["job"], url=url, timeout=timeout, poll=poll)
    return job["manifest"]
