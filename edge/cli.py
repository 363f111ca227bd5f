"""`kdn edge serve`, `kdn policy set|ls|rm` and `kdn ring show`. Imports nothing heavy until a command runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kdn.edge.eviction import DEFAULT_POLICY, POLICIES
from kdn.edge.prefetch import CHAIN_BUDGET
from kdn.errors import InvalidInput

if TYPE_CHECKING:
    from kdn.registry.records import Policy


def register(sub: argparse._SubParsersAction) -> None:
    _register_edge(sub)
    _register_policy(sub)
    _register_ring(sub)


def _register_edge(sub: argparse._SubParsersAction) -> None:
    edge = sub.add_parser("edge", help="run an edge node").add_subparsers(dest="edge_command", required=True)
    p = edge.add_parser("serve", help="cache and serve objects next to an inference server")
    _serve_node_args(p)
    _serve_connection_args(p)
    _serve_behaviour_args(p)
    _serve_events_args(p)
    p.set_defaults(func=cmd_edge_serve)


def _serve_node_args(p: argparse.ArgumentParser) -> None:
    """`kdn edge serve`: where the edge runs, what it caches, whose tokens it takes and shows, prefetch, lease."""
    from kdn.registry.url import registry_arg

    p.add_argument("--region", default="local", help="region this edge serves (default: local)")
    registry_arg(p)
    p.add_argument("--origin", default=None, metavar="URL", help="origin URL (default: the origins in the registry)")
    p.add_argument("--mem-budget", default=None, metavar="SIZE", help="memory tier budget, e.g. 2GiB (default: 1GiB)")
    p.add_argument("--disk", default=None, metavar="DIR", help="disk tier folder (default: memory only)")
    p.add_argument("--disk-budget", default=None, metavar="SIZE", help="disk tier budget, e.g. 50GiB (default: 10GiB)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--node-id", default=None, metavar="ID", help="default: edge-HOSTNAME")
    p.add_argument("--url", default=None, help="URL advertised to peers (default http://HOST:PORT)")
    p.add_argument("--token-file", default=None, metavar="F", help="grants file: who may read what from this edge")
    p.add_argument("--upstream-token-file", default=None, metavar="F", help="token this edge shows peers and the origin")
    p.add_argument("--token-hosts", default=None, metavar="PATTERNS",
                   help="hosts that token may reach (http and https), comma-separated names, globs matched "
                        "label by label, or CIDRs (e.g. 'origin,edge-*' or '**.kdn.svc.cluster.local'; "
                        "default: loopback and --origin's host)")
    p.add_argument("--prefetch", type=int, default=2, metavar="N", help="chunks fetched ahead of a read (0: off)")
    p.add_argument("--chain-index", type=int, default=CHAIN_BUDGET, metavar="ADDRESSES",
                   help="chunk addresses of published manifests kept for prefetch, at most (~170 B each; the "
                        f"least recently read chains go first; default {CHAIN_BUDGET:,})")
    p.add_argument("--lease-ttl", default="10s", metavar="DURATION", help="membership lease, e.g. 10s")


def _serve_connection_args(p: argparse.ArgumentParser) -> None:
    """`kdn edge serve`: TLS, connection caps, and the CA and keys it trusts."""
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections open at once (default: 3/4 of `ulimit -n`; docs/operations.md)")
    p.add_argument("--max-connections-per-peer", type=int, default=None, metavar="N",
                   help="of those, from one address (default: half of --max-connections)")
    p.add_argument("--ca", default=None, metavar="FILE", help="CA bundle to verify peers and the origin (default: system CAs, or $KDN_CA)")
    p.add_argument("--trusted-keys", default=None, metavar="FILE",
                   help="publisher keys (ed25519:HEX per line): records they did not sign are misses")
    p.add_argument("--operator-keys", default=None, metavar="FILE",
                   help="operator keys (ed25519:HEX per line): policies they did not sign are skipped "
                        "(`kdn policy set --operator-key`)")


def _serve_behaviour_args(p: argparse.ArgumentParser) -> None:
    """`kdn edge serve`: eviction, where it fills from, admissions, where records are read, the deny floor."""
    p.add_argument("--eviction", choices=tuple(POLICIES), default=DEFAULT_POLICY,
                   help="the tiers' eviction policy (default: arc, chosen on the Mooncake traces: docs/benchmarks.md)")
    p.add_argument("--region-probes", choices=("worth", "always"), default="worth",
                   help="ask other regions before the origin only when their recent hit rate pays for a miss's "
                        "round trip (worth, the default: lower latency), or always (less origin egress)")
    p.add_argument("--upper-tier", choices=("auto", "policy"), default="auto",
                   help="without an upper policy, fill through the region whose edges measured the shortest "
                        "round trip to the origins when it is clearly nearer than the rest (auto, the default), "
                        "or only through a region an upper policy names (policy)")
    p.add_argument("--admission", default=None, metavar="FILE",
                   help="this edge's admission (kdn node admit), carried in its node record for readers that "
                        "require admissions")
    p.add_argument("--require-admission", action="store_true",
                   help="leave out peers and origins listed in the registry without an admission signed by an "
                        "--operator-keys key (a registry writer cannot then point this edge at a server of its choice)")
    p.add_argument("--revoked-admissions", default=None, metavar="FILE",
                   help="with --require-admission: admission ids the operator revoked (kdn node revoke), one per "
                        "line; read again when it changes, within 30 s")
    p.add_argument("--records", choices=("auto", "origin", "registry"), default="auto",
                   help="where object records are read: 'auto' (the default): the origins' stores while any "
                        "origin is known, the registry for what none has; 'origin': the origins' stores only "
                        "(no registry read on a request's path); 'registry': the registry only")
    p.add_argument("--deny-floor-ms", type=float, default=2.0, metavar="MS",
                   help="answer a 'no' (an absent object, or another tenant's) no sooner than this, or than "
                        "recent record reads take if longer, so its timing does not tell which (default 2; 0: off)")


def _serve_events_args(p: argparse.ArgumentParser) -> None:
    """`kdn edge serve`: what it holds, as vLLM KV-cache events for a router (edge/kv_events.py; off by default)."""
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish what this edge holds as vLLM KV-cache events on this ZMQ endpoint (vLLM's rule: "
                        "tcp://*:PORT or ipc://PATH binds, tcp://HOST:PORT connects to a router's SUB; "
                        "default: off; needs pyzmq)")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help="with --kv-events: bind a ZMQ "
                   "ROUTER here that replays buffered batches from a sequence number (vLLM's replay protocol)")
    p.add_argument("--kv-events-namespace", action="append", default=None, metavar="NS", help="with --kv-events: "
                   "publish this namespace too, its token ids in plaintext (repeat for more; default: public only)")
    p.add_argument("--kv-events-buffer", default=None, metavar="SIZE", help="with --kv-events-replay: bytes of "
                   "batches kept for replays (default: 64MiB)")
    p.add_argument("--kv-events-int-hashes", action="store_true",
                   help="with --kv-events: block hashes as 64-bit integers (an address's low 8 bytes), as vLLM's "
                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES does, for indexers that read integer hashes")


def _register_policy(sub: argparse._SubParsersAction) -> None:
    from kdn.registry.url import registry_arg

    policy = sub.add_parser("policy", help="operator policies: pin, warm, push, ttl, quota, upper tier").add_subparsers(
        dest="policy_command", required=True
    )
    p = policy.add_parser(
        "set",
        help="create or replace a policy",
        description="Exactly one of --pin, --warm, --push, --ttl, --quota, --upper. Edges apply it live; --region "
                    "limits it to one region (for --upper it names the upper tier, which every region uses; a push "
                    "names its regions with --to).",
    )
    p.add_argument("name")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--pin", metavar="MANIFEST", help="never evict the objects of namespace/name")
    kind.add_argument("--warm", metavar="MANIFEST", help="fetch the objects of namespace/name now")
    kind.add_argument("--push", metavar="MANIFEST", help="send the objects of namespace/name to the regions --to "
                      "names (default: every region) ahead of their readers, at most --rate per edge")
    kind.add_argument("--ttl", metavar="DURATION", help="objects may be dropped this long after insertion, e.g. 2h")
    kind.add_argument("--quota", metavar="SIZE", help="byte cap of --namespace in each tier, e.g. 5GiB")
    kind.add_argument("--upper", action="store_true",
                      help="make --region the upper tier (origin shield): other regions' owner edges fill through "
                           "it, so the origin serves about one fill per object")
    p.add_argument("--to", default=None, metavar="REGIONS", help="with --push: comma-separated regions")
    p.add_argument("--rate", default=None, metavar="SIZE", help="with --push: bytes a second per edge, e.g. 50MiB")
    p.add_argument("--namespace", default=None, help="scope of --ttl; the namespace --quota caps")
    p.add_argument("--manifest", default=None, metavar="MANIFEST", help="scope of --ttl: namespace/name")
    p.add_argument("--region", default=None,
                   help="only edges of this region (default: every region); with --upper, the upper tier's region")
    p.add_argument("--at", default=None, metavar="CRON",
                   help="with --pin, --warm or --push: hold only in windows opening where these five fields "
                        "(minute hour day-of-month month day-of-week) match, e.g. '0 8 * * 1-5'; needs --tz and --for")
    p.add_argument("--tz", default=None, metavar="ZONE", help="with --at: the IANA time zone, e.g. Europe/Berlin")
    p.add_argument("--for", dest="window", default=None, metavar="DURATION",
                   help="with --at: how long each window lasts, e.g. 2h (a push or warm fills ahead of it)")
    p.add_argument("--operator-key", default=None, metavar="FILE",
                   help="sign the policy with this key (`kdn origin keygen` makes one): edges with --operator-keys "
                        "apply only signed policies")
    registry_arg(p)
    p.set_defaults(func=cmd_policy_set)
    p = policy.add_parser("ls", help="list policies")
    p.add_argument("--json", action="store_true")
    registry_arg(p)
    p.set_defaults(func=cmd_policy_ls)
    p = policy.add_parser("rm", help="remove a policy")
    p.add_argument("name")
    p.add_argument("--operator-key", default=None, metavar="FILE",
                   help="write a signed tombstone instead of deleting: edges with --operator-keys keep a signed "
                        "policy whose record is merely deleted (a registry writer could do that)")
    registry_arg(p)
    p.set_defaults(func=cmd_policy_rm)


def _register_ring(sub: argparse._SubParsersAction) -> None:
    from kdn.registry.url import registry_arg

    ring = sub.add_parser("ring", help="the consistent-hash ring of a region").add_subparsers(
        dest="ring_command", required=True
    )
    p = ring.add_parser("show", help="live edges of a region and their share of the addresses")
    p.add_argument("region")
    p.add_argument("--json", action="store_true")
    registry_arg(p)
    p.set_defaults(func=cmd_ring_show)


# --- edge serve ----------------------------------------------------------------


def cmd_edge_serve(args: argparse.Namespace) -> int:
    kw = _serve_kwargs(args)
    from kdn.edge.app import run  # aiohttp and the tiers: only when serving
    from kdn.edge.config import EdgeConfig

    config = EdgeConfig(**kw)
    config.connection_caps()  # bad caps fail here, in one line
    run(config)
    return 0


def _serve_kwargs(args: argparse.Namespace) -> dict:
    """``EdgeConfig``'s arguments from `kdn edge serve`'s, each checked: a bad one fails here, in one line."""
    from kdn.format.address import validate_name
    from kdn.units import parse_duration

    kw: dict = {
        "region": validate_name(args.region),
        "registry": args.registry,
        "host": args.host,
        "port": _port(args.port),
        "prefetch": _at_least(args.prefetch, 0, "--prefetch"),
        "chain_index": _at_least(args.chain_index, 0, "--chain-index"),
        "lease_ttl": _positive(parse_duration(args.lease_ttl), "--lease-ttl"),
        "token_file": _readable(args.token_file, "--token-file"),
        "upstream_token_file": _readable(args.upstream_token_file, "--upstream-token-file"),
        "token_hosts": args.token_hosts,
        "tls_cert": _readable(args.tls_cert, "--tls-cert"),
        "tls_key": _readable(args.tls_key, "--tls-key"),
        "ca": _readable(args.ca, "--ca"),
        "trusted_keys": _readable(args.trusted_keys, "--trusted-keys"),
        "operator_keys": _readable(args.operator_keys, "--operator-keys"),
        "region_probes": args.region_probes,
        "upper_tier": args.upper_tier,
        "records": args.records,
        "deny_floor_ms": _between(args.deny_floor_ms, 0, 1000, "--deny-floor-ms"),
        "admission": _readable(args.admission, "--admission"),
        "require_admission": args.require_admission,
        "revoked_admissions": _readable(args.revoked_admissions, "--revoked-admissions"),
        "eviction": args.eviction,
        "max_connections": args.max_connections,
        "max_connections_per_peer": args.max_connections_per_peer,
    }
    _check_keys_and_tls(args, kw)
    kw.update(_serve_options(args))
    return kw


def _check_keys_and_tls(args: argparse.Namespace, kw: dict) -> None:
    """The key files load, the token's host patterns parse, and TLS has both its files."""
    for flag in ("trusted_keys", "operator_keys"):
        if kw[flag]:
            from kdn.registry.signing import Verifier

            Verifier.from_file(kw[flag])  # a bad key file fails here, in one line
    if args.token_hosts is not None:
        from kdn.auth import TokenScope

        TokenScope(args.token_hosts)  # a bad pattern fails here, in one line
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidInput("--tls-cert and --tls-key go together")


def _serve_options(args: argparse.Namespace) -> dict:
    """The arguments given only where their flags are (else ``EdgeConfig``'s defaults), checked."""
    from kdn.format.address import validate_name
    from kdn.units import parse_size

    kw: dict = {}
    if args.origin is not None:
        kw["origin"] = _http_url(args.origin, "--origin")
    if args.url is not None:
        kw["url"] = _http_url(args.url, "--url")
    if args.node_id is not None:
        kw["node_id"] = validate_name(args.node_id)
    if args.mem_budget is not None:
        kw["mem_budget"] = _positive(parse_size(args.mem_budget), "--mem-budget")
    if args.disk is not None:
        kw["disk"] = args.disk
    if args.disk_budget is not None:
        if args.disk is None:
            raise InvalidInput("--disk-budget needs --disk DIR")
        kw["disk_budget"] = _positive(parse_size(args.disk_budget), "--disk-budget")
    kw.update(_events_options(args))
    return kw


def _events_options(args: argparse.Namespace) -> dict:
    """`--kv-events*`, given only where their flags are (``EdgeConfig`` checks them together)."""
    from kdn.units import parse_size

    if args.kv_events_int_hashes and args.kv_events is None:
        raise InvalidInput("--kv-events-int-hashes needs --kv-events ENDPOINT")
    given = {"kv_events": args.kv_events, "kv_events_replay": args.kv_events_replay,
             "kv_events_namespaces": tuple(args.kv_events_namespace or ()) or None,
             "kv_events_buffer": None if args.kv_events_buffer is None else
             _positive(parse_size(args.kv_events_buffer), "--kv-events-buffer"),
             "kv_events_int_hashes": args.kv_events_int_hashes or None}
    return {k: v for k, v in given.items() if v is not None}


def _port(n: int) -> int:
    if not 0 <= n <= 65535:
        raise InvalidInput(f"--port must be 0-65535, got {n}")
    return n


def _at_least(n: int, low: int, flag: str) -> int:
    if n < low:
        raise InvalidInput(f"{flag} must be >= {low}, got {n}")
    return n


def _between(x: float, low: float, high: float, flag: str) -> float:
    import math

    if not (math.isfinite(x) and low <= x <= high):
        raise InvalidInput(f"{flag} must be {low:g}-{high:g}, got {x:g}")
    return x


def _positive(x, flag: str):
    if not x > 0:
        raise InvalidInput(f"{flag} must be more than zero")
    return x


def _http_url(url: str, flag: str) -> str:
    from kdn.registry.records import validate_node_url

    try:
        return validate_node_url(url.rstrip("/"))
    except InvalidInput as e:
        raise InvalidInput(f"{flag}: {e}") from None


def _readable(path: str | None, flag: str) -> str | None:
    if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        raise InvalidInput(f"{flag} {path[:120]!r} is not a readable file")
    return path


# --- policies ------------------------------------------------------------------


def cmd_policy_set(args: argparse.Namespace) -> int:
    from kdn.registry.policy_records import policy_from_options, policy_scope
    from kdn.units import format_duration, format_size

    p = policy_from_options(args.name, pin=args.pin, warm=args.warm, push=args.push, ttl=args.ttl, quota=args.quota,
                            upper=args.upper, to=args.to, rate=args.rate, namespace=args.namespace,
                            manifest=args.manifest, region=args.region, at=args.at, tz=args.tz, window=args.window)
    if args.operator_key is not None:
        from kdn.registry.signing import Signer

        p = Signer.load(args.operator_key).sign(p)

    async def go(reg) -> int:
        await reg.put_policy(p)
        if p.manifest is not None:
            ns, name = p.manifest.split("/")
            m = await reg.get_manifest(ns, name)
            if m is None or m.deleted:
                print(f"kdn: note: manifest {p.manifest} is not published yet; edges apply {p.name} once it is", file=sys.stderr)
        if p.kind == "quota":
            assert p.quota_bytes is not None  # (a quota policy carries its bytes: Policy checks it)
            detail = f"{format_size(p.quota_bytes)} for namespace {p.namespace}"
        elif p.kind == "ttl":
            assert p.ttl_s is not None  # (likewise its time)
            detail = f"{format_duration(p.ttl_s)} for {policy_scope(p)}"
        elif p.kind == "upper":
            if not await reg.list_nodes("edge", p.region):
                print(f"kdn: note: no live edge in region {p.region}: until one starts, fills go to the origin",
                      file=sys.stderr)
            print(f"policy {p.name} set: region {p.region} is the upper tier; other regions fill through it")
            return 0
        elif p.kind == "push":
            regions = p.extra.get("regions") or []
            rate = p.extra.get("rate_bytes")
            print(f"policy {p.name} set: push {p.manifest} to "
                  f"{'regions ' + ', '.join(regions) if regions else 'every region'}"
                  + (f" at most {format_size(rate)}/s per edge" if rate else "") + _when(p))
            return 0
        else:
            detail = p.manifest or ""
        print(f"policy {p.name} set: {p.kind} {detail} in {_region(p)}{_when(p)}")
        return 0

    return _run(args, go)


def cmd_policy_ls(args: argparse.Namespace) -> int:
    async def go(reg) -> int:
        rows = await _read_policies(reg)
        if args.json:
            print(json.dumps([p.to_dict() if p is not None else {"name": name, "invalid": err} for name, p, err in rows],
                             indent=2))
            return 0
        if not rows:
            print("(no policies)", file=sys.stderr)
            return 0
        from kdn.registry.policy_records import policy_row

        table: list[tuple[str, ...]] = [("NAME", "KIND", "REGION", "SCOPE", "SCHEDULE", "SETTING")]
        for name, p, err in rows:
            table.append(policy_row(p) if p is not None else (name, "invalid", "-", "-", "-", (err or "")[:80]))
        if not any(p is not None and p.schedule is not None for _, p, _ in rows):
            table = [r[:4] + r[5:] for r in table]  # no schedule to show: the column is left out
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
        for r in table:
            print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
        return 0

    return _run(args, go)


def cmd_policy_rm(args: argparse.Namespace) -> int:
    from kdn.format.address import validate_name

    name = validate_name(args.name)
    signer = None
    if args.operator_key is not None:
        from kdn.registry.signing import Signer

        signer = Signer.load(args.operator_key)

    async def go(reg) -> int:
        from kdn.registry.policy_records import remove_policy

        # With a key, a signed tombstone: edges with --operator-keys ignore a bare delete of a signed policy.
        done = await remove_policy(reg, name, signer)
        if done.note:
            print(done.note, file=sys.stderr)
        print(done.message, file=sys.stdout if done.done else sys.stderr)
        return 0 if done.done else 1

    return _run(args, go)


async def _read_policies(reg) -> list[tuple[str, Policy | None, str | None]]:
    """``(name, policy, None)`` or ``(name, None, why)`` for a record no edge would apply."""
    from kdn.registry.policy_records import is_tombstone, validate_policy
    from kdn.errors import KDNError
    from kdn.registry.records import Policy

    rows: list[tuple[str, Policy | None, str | None]] = []
    for key, value in await reg.list_keys("policies/"):
        name = key.removeprefix("policies/")
        try:
            p = Policy.unpack(value)
            rows.append((name, p if is_tombstone(p) else validate_policy(p), None))  # (a removal has no setting)
        except KDNError as e:
            rows.append((name, None, str(e).splitlines()[0]))
    return rows


def _region(p) -> str:
    return f"region {p.region}" if p.region else "every region"


def _when(p) -> str:
    """``, 0 8 * * 1-5 Europe/Berlin for 2h (next window 2025-06-02 08:00 Europe/Berlin)`` for a scheduled one."""
    if p.schedule is None:
        return ""
    import time
    from datetime import datetime
    from zoneinfo import ZoneInfo

    now = time.time()
    w = p.schedule.window(now)
    opens = datetime.fromtimestamp(w.start, ZoneInfo(p.schedule.tz)).strftime("%Y-%m-%d %H:%M")
    return f", {p.schedule.describe()} ({'open now, since' if w.holds(now) else 'next window'} {opens} {p.schedule.tz})"


# --- ring ----------------------------------------------------------------------


def cmd_ring_show(args: argparse.Namespace) -> int:
    from kdn.format.address import validate_name

    region = validate_name(args.region)

    async def go(reg) -> int:
        from kdn.ring import Ring

        nodes = sorted(await reg.list_nodes(role="edge", region=region), key=lambda n: n.node_id)
        shares = Ring(n.node_id for n in nodes).shares()
        if args.json:
            print(json.dumps([{"node_id": n.node_id, "url": n.url, "share": shares[n.node_id]} for n in nodes], indent=2))
            return 0
        if not nodes:
            print(f"(no live edges in region {region})", file=sys.stderr)
            return 0
        w_id, w_url = max(len("NODE"), *(len(n.node_id) for n in nodes)), max(len("URL"), *(len(n.url) for n in nodes))
        print(f"{'NODE':<{w_id}}  {'URL':<{w_url}}  SHARE")
        for n in nodes:
            print(f"{n.node_id:<{w_id}}  {n.url:<{w_url}}  {shares[n.node_id] * 100:5.1f}%")
        return 0

    return _run(args, go)


def _run(args: argparse.Namespace, fn: Callable[[object], Awaitable[int]]) -> int:
    from kdn.registry.url import run_registry

    return run_registry(args, fn)
