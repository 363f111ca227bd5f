"""What the policies in force on an edge hand its tiers: one rule function (pins, TTLs) and the quotas.

What "apply" means: after every change the policy engine (``edge/policies.py``) builds one rule function
(``rules_for``) and hands it to each tier (``GovernedTier.apply_policy``), which re-rules *every
entry already cached* at once (pins and unpins take effect immediately; a TTL
is measured from each entry's ``inserted_at``, so an entry older than a new
TTL is expired at once, dropped first under pressure or at the next
``GovernedTier.expire()``) and rules every later insert with it. Quotas replace the
tiers' quotas as a whole (``set_quotas``): the engine owns them. Rules that
did not change are not re-applied (``Rules`` compare by value), so a policy event that changes nothing
costs no walk over the tiers.

Scheduled policies (``Policy.schedule``) hold only part of the time (``phase``): a pin inside each window; a
warm or push from its lead before each window (when its run starts: ``edge/policy_warms.py``) to the window's
end, and while it holds it pins its manifest too, so what it filled ahead stays until the window is over. The
engine hands ``rules_for`` only the policies that hold now, and asks again when the next one changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kdn.format.address import Address
from kdn.edge.tiers import EntryMeta, Key, PolicyState
from kdn.registry.records import Manifest, Policy
from kdn.registry.schedule import Window

__all__ = ["Phase", "Rules", "Ttl", "manifest_addresses", "phase", "rules_for"]


@dataclass(frozen=True)
class Ttl:
    """One ttl policy as the tiers apply it: its time, its scope, and its manifest's addresses."""

    seconds: float
    namespace: str | None
    manifest: str | None
    addresses: frozenset[Address]  # the manifest's, when it is resolved

    def matches(self, key: Key, meta: EntryMeta) -> bool:
        if self.namespace is not None and meta.namespace != self.namespace:
            return False
        if self.manifest is not None and not (key[0] in self.addresses or meta.manifest == self.manifest):
            return False
        return True


@dataclass(frozen=True)
class Rules:
    """The rule function handed to the tiers; equal rules are not re-applied."""

    pinned: frozenset[Address] = frozenset()
    ttls: tuple[Ttl, ...] = ()

    def __call__(self, key: Key, meta: EntryMeta) -> PolicyState:
        ttl = min((t.seconds for t in self.ttls if t.matches(key, meta)), default=None)
        return PolicyState(
            pinned=key[0] in self.pinned,
            expires_at=None if ttl is None else meta.inserted_at + ttl,
        )


def manifest_addresses(m: Manifest) -> tuple[Address, ...]:
    """Every object a manifest names: its prefix chain, then its standalone chunks."""
    return tuple(dict.fromkeys([*m.addresses, *m.standalone]))  # order kept, duplicates dropped


@dataclass(frozen=True)
class Phase:
    """Where a scheduled policy stands at one instant: the window open then, else the next; whether the policy
    holds (``held``); when that changes next (``until``, seconds since the epoch); and the lead it was given."""

    window: Window
    held: bool
    until: float
    lead_s: float = 0.0


def phase(p: Policy, now: float, lead_s: float = 0.0) -> Phase:
    """``p``'s phase at ``now``: a pin holds inside its windows; a warm or push from ``lead_s`` before each
    window opens (its run's start) until the window ends. Pure: the caller's clock gives ``now``."""
    assert p.schedule is not None
    w = p.schedule.window(now)
    opens = w.start - (lead_s if p.kind in ("warm", "push") else 0.0)
    if now < opens:
        return Phase(w, False, opens, lead_s)
    return Phase(w, True, w.end, lead_s)


def rules_for(policies: Iterable[Policy], resolved: Mapping[str, Manifest]) -> tuple[Rules, dict[str, int]]:
    """The rules and the quotas (bytes by namespace) of ``policies``, the ones in force here now; ``resolved``:
    the published manifests they name, by ``ns/name``. A pin of a manifest not published pins nothing yet; a
    scheduled warm or push pins its manifest (it is handed here only while it holds); a ttl scoped to one
    matches by the entries' own manifest meanwhile; several quotas for a namespace: the smallest."""
    pinned: set[Address] = set()
    ttls: list[Ttl] = []
    quotas: dict[str, int] = {}
    for p in policies:
        m = resolved.get(p.manifest) if p.manifest is not None else None
        if (p.kind == "pin" or p.schedule is not None) and m is not None:
            pinned.update(manifest_addresses(m))
        elif p.kind == "ttl" and p.ttl_s is not None:  # (a parsed ttl policy always has one)
            addrs = frozenset(manifest_addresses(m)) if m is not None else frozenset()
            ttls.append(Ttl(float(p.ttl_s), p.namespace, p.manifest, addrs))
        elif p.kind == "quota" and p.namespace is not None and p.quota_bytes is not None:
            quotas[p.namespace] = min(quotas.get(p.namespace, p.quota_bytes), p.quota_bytes)
    ttls.sort(key=lambda t: (t.seconds, t.namespace or "", t.manifest or ""))
    return Rules(frozenset(pinned), tuple(ttls)), quotas
