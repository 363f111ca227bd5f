"""The console's forms, each a POST: sign-in (a token from the origin's token file, for a session cookie),
sign-out, and setting or removing a policy of a manifest or a namespace as ``kdn policy set`` and ``rm`` do
(``kdn.registry.policy_records.policy_from_options`` and ``remove_policy``). A form that changes something needs a session,
a same-site ``Origin`` and the session's CSRF token (``posted``), and admin on the namespaces it is about; a quota, a
fleet-level limit, needs ``admin *`` (``policies.may_edit``). A sign-in is counted against its address first
(``sessions.SignIns``).
"""

from __future__ import annotations

import hmac
import logging
import math
from typing import Any
from urllib.parse import quote

from aiohttp import web

from kdn.format.address import validate_name, validate_namespace
from kdn.errors import InvalidInput
from kdn.origin.console.pages import error_page, manifest_url, see_other, sign_in_page
from kdn.origin.console.policies import MANIFEST_KINDS, NAMESPACE_KINDS, may_edit, policy_named, refusal
from kdn.origin.console.sessions import (COOKIE, PREFIX, SESSION_SECONDS, SESSIONS, Viewer, read_form, same_site,
                                         viewer_of)
from kdn.registry import Registry
from kdn.service import GRANTS, REGISTRY

log = logging.getLogger("kdn.origin.console")


async def login(request: web.Request) -> web.Response:
    if not same_site(request):
        return error_page(None, 403, "a sign-in from another site")
    sessions = request.app[SESSIONS]
    # Counted before the body is read, right or wrong: a flood of sign-ins with a valid token is the attack too.
    wait = sessions.sign_ins.take(request.remote)
    if wait:
        resp = sign_in_page(request, 429, f"too many sign-ins from this address: try again in {math.ceil(wait)} s")
        resp.headers["Retry-After"] = str(math.ceil(wait))
        return resp
    form = await read_form(request)
    token = form.get("token", "")
    grants = request.app[GRANTS]
    if grants.empty:
        return sign_in_page(request, 401, "this origin has no token file: nothing to sign in with")
    if not token or len(token) > 512:
        return sign_in_page(request, 401, "give a token")
    from kdn.auth import AuthError

    try:
        grant = grants.lookup(f"Bearer {token}")
    except AuthError:
        grant = None
    if grant is None:
        return sign_in_page(request, 401, "unknown token")
    sid, _ = sessions.open(grant, token)
    log.info("console: signed in (%s on %s)", ",".join(sorted(grant.roles)), ",".join(sorted(grant.namespaces)))
    resp = see_other(PREFIX)
    resp.set_cookie(COOKIE, sid, max_age=SESSION_SECONDS, path=PREFIX, httponly=True, samesite="Strict",
                    secure=request.secure)
    return resp


async def posted(request: web.Request) -> tuple[Viewer, dict[str, str]] | web.Response:
    """A console POST that changes something: a session first (no body is read without one), then a same-site
    ``Origin``, then the form and its CSRF token."""
    viewer = viewer_of(request)
    if viewer is None:
        return sign_in_page(request)
    if viewer.open:
        return error_page(viewer, 403, "an origin without a token file: the console is read-only")
    if not same_site(request):
        return error_page(viewer, 403, "a form posted from another site")
    form = await read_form(request)
    if not hmac.compare_digest(form.get("csrf", "").encode(), viewer.csrf.encode()):
        return error_page(viewer, 403, "this form is stale or not this console's: reload the page")
    return viewer, form


async def logout(request: web.Request) -> web.Response:
    got = await posted(request)
    if isinstance(got, web.Response):
        return got
    request.app[SESSIONS].close(request.cookies.get(COOKIE))
    resp = see_other(PREFIX)
    resp.del_cookie(COOKIE, path=PREFIX, httponly=True, samesite="Strict", secure=request.secure)
    return resp


def _default_name(kind: str, scope: str) -> str:
    """``kind.namespace.name`` (a manifest's) or ``kind.namespace``: for a push the name a publish's ``push``
    sets too, so a publish with ``"push": false`` ends it; a digest past 128 characters, as there."""
    from kdn.format.address import blob_digest

    full = f"{kind}.{scope.replace('/', '.')}"
    return full if len(full) <= 128 else f"{kind}." + blob_digest(full.encode())[:40]


async def policies(request: web.Request) -> web.Response:
    """Set (``op=set``) or remove (``op=delete``) a policy of a manifest or a namespace, as ``kdn policy set``
    and ``rm`` do; then back to the page the form was on."""
    got = await posted(request)
    if isinstance(got, web.Response):
        return got
    viewer, form = got
    manifest, namespace = form.get("manifest") or None, form.get("namespace") or None
    try:
        if manifest is not None:
            ns, _, name = manifest.partition("/")
            ns, name = validate_namespace(ns), validate_name(name)
            back, scope_ns = manifest_url(ns, name), ns
        elif namespace is not None:
            scope_ns = validate_namespace(namespace)
            back = f"{PREFIX}#ns-{quote(scope_ns)}"
        else:
            raise InvalidInput("a console policy names a manifest or a namespace")
    except InvalidInput as err:
        return error_page(viewer, 400, str(err))
    op = form.get("op", "set")
    if op not in ("set", "delete"):
        return error_page(viewer, 400, "op is set or delete", back)
    if not viewer.may_admin(scope_ns):
        return error_page(viewer, 403, f"this token may not change policies of namespace {scope_ns}", back)
    reg = request.app[REGISTRY]
    signer = getattr(reg, "signer", None)
    try:
        if op == "set":
            done = await _set(reg, viewer, form, manifest, scope_ns, signer)
        else:
            done = await _remove(reg, viewer, form, signer)
    except PermissionError as err:
        return error_page(viewer, 403, str(err), back)
    except LookupError as err:
        return error_page(viewer, 404, str(err.args[0]), back)
    except InvalidInput as err:
        return error_page(viewer, 400, str(err), back)
    log.info("console: %s", done)
    request.app[SESSIONS].flash(request.cookies.get(COOKIE), done)
    return see_other(back)


async def _set(reg: Registry, viewer: Viewer, form: dict[str, str], manifest: str | None, scope_ns: str,
               signer: Any) -> str:
    from kdn.registry.policy_records import policy_from_options

    kind = form.get("kind", "")
    allowed = MANIFEST_KINDS if manifest is not None else NAMESPACE_KINDS
    if kind not in allowed:
        raise InvalidInput(f"kind must be one of {', '.join(allowed)}")
    scope = manifest if manifest is not None else scope_ns
    name = validate_name(form.get("name") or _default_name(kind, scope))
    options: dict[str, Any] = {"region": form.get("region") or None}
    if kind in ("pin", "warm", "push"):
        options[kind] = manifest
        if kind == "push":
            options.update(to=form.get("to") or None, rate=form.get("rate") or None)
        # A schedule (kdn policy set --at --tz --for): all empty, always; else checked as the CLI checks it.
        options.update(at=form.get("at") or None, tz=form.get("tz") or None, window=form.get("for") or None)
    elif kind == "ttl":
        options.update(ttl=form.get("ttl", ""), manifest=manifest, namespace=None if manifest else scope_ns)
    else:
        options.update(quota=form.get("quota", ""), namespace=scope_ns)
    p = policy_from_options(name, **options)
    if not may_edit(viewer, p):
        raise PermissionError(f"policy {name} would be {refusal(p)}")
    taken, old = await policy_named(reg, name)
    if taken and not may_edit(viewer, old):
        raise PermissionError(f"policy {name} exists and is {refusal(old)}")
    if signer is not None:
        p = signer.sign(p)
    await reg.put_policy(p)
    return (f"policy {p.name} set: {p.kind}" + (f" in region {p.region}" if p.region else "")
            + (f", {p.schedule.describe()}" if p.schedule is not None else ""))


async def _remove(reg: Registry, viewer: Viewer, form: dict[str, str], signer: Any) -> str:
    from kdn.registry.policy_records import remove_policy

    name = validate_name(form.get("name", ""))
    taken, old = await policy_named(reg, name)
    if not taken:
        raise LookupError(f"no policy named {name}")
    if not may_edit(viewer, old):
        raise PermissionError(f"policy {name} is {refusal(old)}")
    done = await remove_policy(reg, name, signer)
    if not done.done:
        raise LookupError(done.message.removeprefix("kdn: "))
    return done.message
