"""Policy records as operators write them: what each kind needs, made from ``kdn policy set``'s options,
removed (a signed tombstone where policies are signed), and shown as ``kdn policy ls`` lists them.

The CLI (``edge/cli.py``) and the operator console (``origin/console/``) set, remove and list policies
through these functions, so both refuse the same input with the same words; every edge's policy engine
(``edge/policies.py``, where what each kind does is described) checks the records it reads with
``validate_policy``. Nothing here imports the edge's tiers or its HTTP stack.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from kdn.format.address import validate_name
from kdn.errors import InvalidInput, KDNError
from kdn.registry.records import Policy
from kdn.registry.schedule import Schedule
from kdn.units import format_duration, format_size

__all__ = ["KINDS_SET", "MAX_PUSH_REGIONS", "POLICIES", "Removal", "SCHEDULED_KINDS", "is_tombstone",
           "policy_from_options", "policy_row", "policy_scope", "remove_policy", "set_at", "tombstone",
           "validate_policy"]

POLICIES = "policies/"  # the registry prefix policy records live under

MAX_PUSH_REGIONS = 1000


def set_at(p: Policy) -> float:
    """When ``kdn policy set`` (or ``rm``) made ``p``: its ``extra.set_at``, signed with the rest; 0 if none."""
    at = p.extra.get("set_at")
    return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at) else 0.0


def is_tombstone(p: Policy) -> bool:
    """A signed removal (``kdn policy rm --operator-key``): the policy's fields, ``extra.deleted`` set."""
    return p.extra.get("deleted") is True


def tombstone(name: str, at: float) -> Policy:
    """What removing the policy ``name`` writes where policies are signed (sign it): the name, ``deleted``
    and ``set_at``, nothing taken from the record it removes. Built from what the registry holds, it signed
    whatever a registry writer had put there (another policy's name, a record no edge would take)."""
    return Policy(name=name, kind="ttl", extra={"deleted": True, "set_at": at})


def validate_policy(p: Policy) -> Policy:
    """The fields each kind needs, beyond what the record itself checks. Used by the CLI too."""
    if p.schedule is not None and p.kind not in SCHEDULED_KINDS:
        raise InvalidInput(f"policy {p.name!r}: a schedule goes with pin, warm or push, not {p.kind}")
    if p.kind in ("pin", "warm", "push"):
        if p.manifest is None:
            raise InvalidInput(f"policy {p.name!r}: a {p.kind} policy needs a manifest (namespace/name)")
        if p.kind == "push":
            regions, rate = p.extra.get("regions", []), p.extra.get("rate_bytes")
            if p.region is not None:
                raise InvalidInput(f"policy {p.name!r}: a push names its regions in extra.regions, not region")
            if not isinstance(regions, list) or len(regions) > MAX_PUSH_REGIONS:
                raise InvalidInput(f"policy {p.name!r}: extra.regions must be a list of at most "
                                   f"{MAX_PUSH_REGIONS} region names")
            for r in regions:
                validate_name(r)
            if rate is not None and not (isinstance(rate, int) and not isinstance(rate, bool) and rate > 0):
                raise InvalidInput(f"policy {p.name!r}: extra.rate_bytes must be a positive int (bytes a second)")
    elif p.kind == "ttl":
        if p.ttl_s is None:
            raise InvalidInput(f"policy {p.name!r}: a ttl policy needs ttl_s")
    elif p.kind == "quota":
        if p.namespace is None or p.quota_bytes is None:
            raise InvalidInput(f"policy {p.name!r}: a quota policy needs a namespace and quota_bytes")
    elif p.kind == "upper":
        if p.region is None:
            raise InvalidInput(f"policy {p.name!r}: an upper policy names the upper tier's region")
        if p.manifest is not None or p.namespace is not None or p.ttl_s is not None or p.quota_bytes is not None:
            raise InvalidInput(f"policy {p.name!r}: an upper policy takes a region only (it holds for every object)")
    return p


KINDS_SET = ("pin", "warm", "push", "ttl", "quota", "upper")  # what `kdn policy set` and the console set
SCHEDULED_KINDS = ("pin", "warm", "push")  # the kinds that may hold on a schedule (--at --tz --for)


def policy_from_options(name: str, *, pin: str | None = None, warm: str | None = None, push: str | None = None,
                        ttl: str | None = None, quota: str | None = None, upper: bool = False, to: str | None = None,
                        rate: str | None = None, namespace: str | None = None, manifest: str | None = None,
                        region: str | None = None, at: str | None = None, tz: str | None = None,
                        window: str | None = None, now: float | None = None) -> Policy:
    """The policy ``kdn policy set`` writes for these options (exactly one of pin, warm, push, ttl, quota,
    upper; a pin, warm or push on a schedule with ``at``, ``tz`` and ``window``: --at, --tz, --for), checked:
    the one place options become a record, so the CLI and the operator console (origin/console/forms.py)
    refuse the same input with the same words. ``now`` stamps ``extra.set_at`` (the time by default): every
    set is a new record, so setting a warm again warms again."""
    from kdn.units import parse_duration, parse_size

    chosen = [k for k, v in (("pin", pin), ("warm", warm), ("push", push), ("ttl", ttl), ("quota", quota))
              if v is not None] + (["upper"] if upper else [])
    if len(chosen) != 1:
        raise InvalidInput(f"exactly one of --pin, --warm, --push, --ttl, --quota, --upper (got {len(chosen)})")
    fields: dict[str, Any] = {"name": name, "region": region}
    extra: dict[str, Any] = {}
    if (to is not None or rate is not None) and push is None:
        raise InvalidInput("--to and --rate go with --push")
    if push is not None:
        if region is not None or namespace is not None or manifest is not None:
            raise InvalidInput("--push names its manifest and its regions (--to), not --region, --namespace or --manifest")
        fields.update(kind="push", manifest=push)
        if to is not None:
            extra["regions"] = sorted({validate_name(r.strip()) for r in to.split(",") if r.strip()})
            if not extra["regions"]:
                raise InvalidInput("--to names no region")
        if rate is not None:
            bytes_a_second = parse_size(rate.removesuffix("/s"))
            if bytes_a_second <= 0:
                raise InvalidInput("--rate must be more than zero")
            extra["rate_bytes"] = bytes_a_second
    elif pin is not None or warm is not None:
        if namespace is not None or manifest is not None:
            raise InvalidInput("--namespace and --manifest go with --ttl or --quota; --pin and --warm name their manifest")
        fields.update(kind="pin" if pin is not None else "warm", manifest=pin if pin is not None else warm)
    elif upper:
        if region is None:
            raise InvalidInput("--upper needs --region REGION: the region the others fill through")
        if namespace is not None or manifest is not None:
            raise InvalidInput("--upper holds for every object; it takes no --namespace or --manifest")
        fields.update(kind="upper")
    elif ttl is not None:
        fields.update(kind="ttl", ttl_s=parse_duration(ttl), namespace=namespace, manifest=manifest)
    else:
        assert quota is not None
        if namespace is None:
            raise InvalidInput("--quota needs --namespace NS")
        if manifest is not None:
            raise InvalidInput("--quota caps a namespace; it takes no --manifest")
        fields.update(kind="quota", quota_bytes=parse_size(quota), namespace=namespace)
    fields["schedule"] = _schedule(at, tz, window, fields["kind"])
    return validate_policy(Policy(**fields, extra={**extra, "set_at": time.time() if now is None else now}))


def _schedule(at: str | None, tz: str | None, window: str | None, kind: str) -> Schedule | None:
    """The schedule --at, --tz and --for give (None without them), for a policy of ``kind``."""
    from kdn.units import parse_duration

    if at is None:
        if tz is not None or window is not None:
            raise InvalidInput("--tz and --for go with --at: a schedule (like --at '0 8 * * 1-5' --tz Europe/Berlin "
                               "--for 2h)")
        return None
    if kind not in SCHEDULED_KINDS:
        raise InvalidInput(f"--at goes with --pin, --warm or --push (a schedule says when they hold), not --{kind}")
    if tz is None:
        raise InvalidInput("--at needs --tz: a schedule's time zone is explicit, an IANA name like Europe/Berlin "
                           "or UTC")
    if window is None:
        raise InvalidInput("--at needs --for: how long each window lasts, like 2h")
    try:
        for_s = parse_duration(window)
    except InvalidInput as e:
        raise InvalidInput(f"--for: {e}") from None
    return Schedule(at=at, tz=tz, for_s=for_s)


@dataclass(frozen=True)
class Removal:
    """What ``remove_policy`` did: ``done`` (False: nothing was removed), the outcome line, and a note to show
    before it (``kdn policy rm`` prints the note and a failure on stderr)."""

    done: bool
    message: str
    note: str | None = None


async def remove_policy(reg: Any, name: str, signer: Any = None) -> Removal:
    """Remove the policy ``name`` as ``kdn policy rm`` does: with a ``signer`` (a ``kdn.registry.signing.Signer``), a
    signed tombstone (edges with --operator-keys ignore a bare delete of a signed policy); without one, delete
    the record. Shared by the CLI and the operator console."""
    name = validate_name(name)
    if signer is None:
        if not await reg.delete_policy(name):
            return Removal(False, f"kdn: no policy named {name}")
        return Removal(True, f"policy {name} removed")
    from kdn.registry.signing import Verifier

    # The tombstone is built from the name alone (a registry writer controls what is stored there). The stored
    # record only orders it: one this key signed, set on a machine whose clock ran ahead, must not outlive its
    # removal.
    at, note = time.time(), None
    raw = dict(await reg.list_keys(f"{POLICIES}{name}")).get(f"{POLICIES}{name}")
    old = None
    if raw is not None:
        try:
            old = Policy.unpack(raw)
        except KDNError:
            old = None
    if old is not None and old.name == name and Verifier([signer.public]).ok(old):
        if is_tombstone(old):
            return Removal(False, f"kdn: policy {name} is removed already")
        at = max(at, set_at(old) + 0.001)
    elif raw is None:
        note = (f"kdn: note: no policy named {name} in the registry; a signed tombstone is written anyway "
                "(edges that still apply one under that name drop it)")
    await reg.put_policy(signer.sign(tombstone(name, at)))
    return Removal(True, f"policy {name} removed (a signed tombstone: edges with --operator-keys drop it)", note)


def policy_row(p: Policy) -> tuple[str, str, str, str, str, str]:
    """The columns ``kdn policy ls`` prints for a policy an edge would apply (``validate_policy``) or a signed
    tombstone: name, kind, region (``*``: every one; a push's: the regions it goes to), scope, schedule
    (``always``, or ``0 8 * * 1-5 Europe/Berlin for 2h``) and setting. The operator console shows the same
    (origin/console/policies.py, manifest.py)."""
    if is_tombstone(p):
        return p.name, "-", "-", "-", "-", "removed (a signed tombstone)"
    when = p.schedule.describe() if p.schedule is not None else "always"
    if p.kind == "push":
        rate = p.extra.get("rate_bytes")
        return (p.name, p.kind, ",".join(p.extra.get("regions") or []) or "*", str(p.manifest), when,
                f"at most {format_size(rate)}/s per edge" if rate else "-")
    if p.kind in ("pin", "warm"):
        scope, setting = str(p.manifest), "-"
    elif p.kind == "ttl":
        assert p.ttl_s is not None  # (validate_policy: a ttl policy has its time)
        scope, setting = policy_scope(p), format_duration(p.ttl_s)
    elif p.kind == "upper":
        scope, setting = "every object", "the upper tier: other regions fill through it"
    else:
        assert p.quota_bytes is not None  # (validate_policy: a quota policy has its bytes)
        scope, setting = f"namespace {p.namespace}", format_size(p.quota_bytes)
    return p.name, p.kind, p.region or "*", scope, when, setting


def policy_scope(p: Policy) -> str:
    """What a ttl policy is about, in words: its namespace and/or manifest, or everything."""
    parts = [f"namespace {p.namespace}"] if p.namespace else []
    if p.manifest:
        parts.append(f"manifest {p.manifest}")
    return " and ".join(parts) or "everything"
