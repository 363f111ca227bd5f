"""A publish job's steps, run by the job queue: each chunk produced on the model thread and its records
written (blobs first), then the manifest, the tail, and the push the publish asked for; registry writes
retried through an outage of up to ``REGISTRY_RETRY_S``. And, before a job starts, whether its push may be
asked for at all: the console's rule (#51 item 11), and the namespace's ``PushBudget``."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from aiohttp import web

from kdn.auth import Grant
from kdn.errors import RegistryUnavailable
from kdn.registry import KVRegistry, Manifest
from kdn.registry.split import RecordsBeside
from kdn.service import REGISTRY, json_error

from kdn.origin.config import EXECUTOR, M, PRODUCER, SPEED, STORE
from kdn.origin.console.policies import may_edit, policy_named
from kdn.origin.console.sessions import Viewer
from kdn.origin.jobs import Job
from kdn.origin.publish import PublishSpec, PushBudget, push_policy, push_policy_name

log = logging.getLogger(__name__)

PUSHES = web.AppKey("push_budget", PushBudget)  # the pushes each namespace's publishes may still set


def writer(app: web.Application) -> KVRegistry | RecordsBeside:
    """The origin's registry as the writer it is (``kdn.registry.open``'s, or split by ``--records store``):
    the one that signs what it writes."""
    reg = app[REGISTRY]
    if not isinstance(reg, (KVRegistry, RecordsBeside)):
        raise TypeError(f"an origin writes through a KVRegistry, not {type(reg).__name__}")
    return reg



async def run_publish(app: web.Application, spec, job: Job) -> dict:
    try:
        manifest = await _publish_steps(app, spec, job)
    except BaseException:
        app[M]["jobs"].labels("failed").inc()
        raise
    app[M]["jobs"].labels("done").inc()
    return manifest


async def _publish_steps(app: web.Application, spec, job: Job) -> dict:
    producer, reg, m = app[PRODUCER], app[REGISTRY], app[M]
    loop = asyncio.get_running_loop()
    plan = await loop.run_in_executor(app[EXECUTOR], producer.plan, spec)
    job.chunks_total = (len(plan.spans) if spec.prefix else 0) + (len(plan.spans) if spec.standalone else 0)
    steps = producer.produce(spec, plan)
    with m["publish_seconds"].time():
        while True:
            # Each step (one chunk's forward pass and fsynced blob) runs on the model thread, timed there.
            step, took = await loop.run_in_executor(app[EXECUTOR], _timed_next, steps)
            if step is None:
                break
            await _retrying(lambda: reg.put_objects(step.records), job)  # blobs first, then their records
            job.chunks_done += 1
            job.chunks_computed += step.computed
            if step.computed:  # the origin's prefill speed, for the console's time saved (speed.py)
                app[SPEED].observe(((r.start, r.end, r.standalone) for r in step.records), took)
            m["chunks_computed" if step.computed else "chunks_reused"].inc()
        emphasis = await loop.run_in_executor(app[EXECUTOR], producer.derive_emphasis, spec)  # probes: a forward each
        manifest = Manifest(namespace=spec.namespace, name=spec.name, model_id=producer.loaded.model_id,
                            addresses=[*plan.addresses], tokens=len(spec.tokens), chunk_tokens=producer.chunk_tokens,
                            prefix_tokens=spec.tokens, template=spec.template, standalone=[*plan.standalone],
                            head_tokens=spec.head_tokens,
                            emphasis=None if emphasis is None else emphasis.to_dict())
        manifest = await _retrying(lambda: reg.put_manifest(manifest), job)  # every object it names is recorded by now
        if plan.tail is not None:
            parent, length = plan.tail
            await _retrying(lambda: reg.add_tail(parent, length, plan.addresses[-1]), job)
        await _set_push(app, spec, job)
    m["store_objects"].set(len(app[STORE]))
    m["store_bytes"].set(app[STORE].total_bytes)
    return manifest.to_dict()


def _timed_next(steps) -> tuple[Any, float]:
    """The next step of a publish and the seconds it took, on the model thread (no wait for it counted)."""
    t0 = time.perf_counter()
    step = next(steps, None)
    return step, time.perf_counter() - t0


async def _set_push(app: web.Application, spec, job: Job) -> None:
    """The push a publish asked for (``push``), once its manifest is written: a push policy the edges of the
    named regions act on (edge/policies.py), signed with the origin's key where it has one (edges started with
    --operator-keys apply it only if that key is among theirs); ``push: false`` ends it."""
    if spec.push is None:
        return
    reg = writer(app)
    if spec.push is False:
        name = push_policy_name(spec.namespace, spec.name)
        if await _retrying(lambda: reg.delete_policy(name), job):
            log.info("publish %s/%s: push policy %s removed", spec.namespace, spec.name, name)
        return
    p = push_policy(spec)
    if reg.signer is not None:
        p = reg.signer.sign(p)
    await _retrying(lambda: reg.put_policy(p), job)
    log.info("publish %s/%s: push policy %s set (%s)", spec.namespace, spec.name, p.name,
             ", ".join(spec.push) if spec.push else "every region")


def may_push(grant: Grant, namespace: object) -> bool:
    """Whether ``grant`` may set or end a push of ``namespace``'s documents: admin there, the console's rule."""
    return not isinstance(namespace, str) or _pusher(grant).may_admin(namespace)  # (not a name: a 400 soon)


def push_forbidden(namespace: object) -> web.Response:
    return json_error(403, "forbidden", f"'push' sets (or ends) a fleet-wide push policy, which needs admin on "
                      f"namespace {namespace!r}, as the console's push form does; this token may publish there, "
                      "not push: publish without 'push', and ask an admin of the namespace to push it")


def _pusher(grant: Grant) -> Viewer:
    """The console's viewer for a publisher's grant: a push is the console's push form (origin/console/forms.py
    ``policies``), and who may set one is decided by the same functions (``Viewer.may_admin``, ``may_edit``)."""
    return Viewer(grant, csrf="", expires=math.inf)


async def push_refused(app: web.Application, grant: Grant, spec: PublishSpec) -> web.Response | None:
    """Why a publish may not set or end the push it asks for, past admin on its namespace (checked before the
    body was tokenized): a policy stored under the push's name that the token may not change (the console's
    ``may_edit``), or, for a push set, the namespace's ``PushBudget`` spent (a 429). None: it may go ahead."""
    if spec.push is None:
        return None
    name = push_policy_name(spec.namespace, spec.name)
    taken, old = await policy_named(app[REGISTRY], name)
    if taken and not may_edit(_pusher(grant), old):
        return json_error(403, "forbidden", f"policy {name} exists and is about namespaces this token may not change")
    if spec.push is False:
        return None  # (ending a push is not counted: it only lightens the fleet)
    wait = app[PUSHES].take(spec.namespace)
    if wait > 0:
        resp = json_error(429, "too_many_pushes", f"namespace {spec.namespace!r} has set {app[PUSHES].burst} pushes "
                          f"lately; its publishes may set one every {app[PUSHES].every:g} s: try again in "
                          f"{math.ceil(wait)} s, or publish without 'push'")
        resp.headers["Retry-After"] = str(math.ceil(wait))
        return resp
    return None


REGISTRY_RETRY_S = 60.0  # how long a publish job waits out a registry outage before it fails


async def _retrying(write, job: Job, limit: float = REGISTRY_RETRY_S):
    """A registry write, retried with backoff while the registry is unreachable (an etcd restart, a
    leader election): the job's computed chunks are not thrown away for an outage of seconds. Writes
    are idempotent (records merge, a manifest is replaced whole), so a retry after a lost answer is
    safe. Other errors, and an outage longer than ``limit``, fail the job."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + limit, 0.2
    while True:
        try:
            return await write()
        except RegistryUnavailable as e:
            if loop.time() + delay > deadline:
                raise
            log.warning("publish job %s: registry unavailable (%s); retrying in %.1f s", job.id, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
