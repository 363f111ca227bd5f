"""The policies a console page shows, and who may change them: the records an edge would apply, which of them
apply to a manifest, the namespaces each is about, and the badge the listing shows for one.
"""

from __future__ import annotations

from kdn.auth import ANY
from kdn.errors import KDNError
from kdn.origin.console.pages import e
from kdn.origin.console.sessions import Viewer
from kdn.registry import Policy, Registry

MANIFEST_KINDS = ("pin", "warm", "push", "ttl")  # what a manifest's form sets
NAMESPACE_KINDS = ("quota", "ttl")  # what a namespace's form sets
# Fleet-level limits: what one tenant may take of every edge's room. A quota caps a namespace's bytes in each
# tier, pinned ones included (the only cap on pins there is), so a tenant admin who could lift it could pin and warm
# until other tenants' objects went to the origin (#51 item 2). Such a policy is set, changed and removed only by
# `admin *`, whoever's namespace it is about. A TTL is not one: the smallest TTL that matches wins, so a tenant's
# can only shorten its own entries' lives, and without the operator's its entries get no room that eviction and
# the quota would not give them (a TTL bounds how long an entry stays, not how many bytes: a read refills it).
FLEET_KINDS = frozenset({"quota", "upper"})


async def read_policies(reg: Registry) -> list[Policy]:
    """The policies an edge would apply (tombstones and records that do not read left out)."""
    from kdn.registry.policy_records import is_tombstone, validate_policy

    out = []
    for _, value in await reg.list_keys("policies/"):
        try:
            p = Policy.unpack(value)
            if not is_tombstone(p):
                out.append(validate_policy(p))
        except KDNError:
            continue
    return sorted(out, key=lambda p: p.name)


def applies(p: Policy, namespace: str, name: str) -> bool:
    ref = f"{namespace}/{name}"
    if p.kind in ("pin", "warm", "push"):
        return p.manifest == ref
    if p.kind == "ttl":
        return p.namespace in (None, namespace) and p.manifest in (None, ref)
    return p.kind == "quota" and p.namespace == namespace


def scopes_of(p: Policy) -> set[str]:
    """The namespaces a policy is about (none: every namespace)."""
    return {s for s in (p.manifest.split("/")[0] if p.manifest else None, p.namespace) if s is not None}


def fleet_admin(viewer: Viewer) -> bool:
    """``admin *``: the grant that may set anything, fleet-level limits (``FLEET_KINDS``) included."""
    return not viewer.open and "admin" in viewer.grant.roles and ANY in viewer.grant.namespaces


def may_edit(viewer: Viewer, p: Policy | None) -> bool:
    """Whether ``viewer`` may write ``p``, or overwrite or remove it: admin on every namespace the policy is about;
    ``admin *`` for a fleet-level limit (a quota), one about every namespace, or a record that does not read
    (``None``). The console asks this of the stored record and of the one a form would write."""
    if viewer.open:
        return False
    scopes = scopes_of(p) if p is not None else set()
    if p is None or p.kind in FLEET_KINDS or not scopes:
        return fleet_admin(viewer)
    return all(viewer.may_admin(ns) for ns in scopes)


def refusal(p: Policy | None) -> str:
    """Why ``may_edit`` refuses ``p``, in words (after "policy NAME is")."""
    if p is not None and p.kind in FLEET_KINDS:
        return f"a {p.kind}, a fleet-level limit: only admin on every namespace (admin *) sets, changes or removes one"
    return "about namespaces this token may not change"


async def policy_named(reg: Registry, name: str) -> tuple[bool, Policy | None]:
    """Whether a record is stored under ``name``, and the policy it holds (None: a tombstone or unreadable)."""
    from kdn.registry.policy_records import is_tombstone

    raw = dict(await reg.list_keys(f"policies/{name}")).get(f"policies/{name}")
    if raw is None:
        return False, None
    try:
        p = Policy.unpack(raw)
    except KDNError:
        return True, None
    return not is_tombstone(p), (None if is_tombstone(p) else p)


def policy_badge(p: Policy) -> str:
    from kdn.registry.policy_records import policy_row  # the columns `kdn policy ls` prints

    _, kind, region, scope, when, setting = policy_row(p)
    where = "" if region == "*" else f" in {region}" if kind != "push" else f" to {region}"
    extra = "" if setting == "-" or kind in ("pin", "warm") else f" {setting}"
    timed = "" if p.schedule is None else f" at {when}"
    return (f'<span class="pol {e(kind)}" title="{e(p.name)}: {e(scope)}">{e(kind)}{e(extra)}{e(where)}{e(timed)}'
            "</span>")
