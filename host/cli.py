"""``kdn host serve``: run the host tier of this machine; ``kdn host stats``: ask a running one its numbers.
Imports nothing heavy until it runs."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kdn.edge.eviction import DEFAULT_POLICY, POLICIES


def register(sub: argparse._SubParsersAction[Any]) -> None:
    host = sub.add_parser("host", help="run the host tier: objects in shared memory for this machine's engines")
    verbs = host.add_subparsers(dest="host_command", required=True)
    p = verbs.add_parser("serve", help="serve local engines over a Unix socket from a shared-memory segment")
    from kdn.host.config import default_path

    p.add_argument("--edge", action="append", default=[], metavar="URL",
                   help="an edge of this region to fill from (repeatable; the entry edge first)")
    p.add_argument("--origin", default=None, metavar="URL", help="the origin, the last source of a fill")
    p.add_argument("--trusted-keys", required=True, metavar="FILE",
                   help="publisher keys (ed25519:HEX per line): only objects whose records one of them signed "
                        "are held")
    p.add_argument("--socket", default=default_path("sock"), metavar="PATH",
                   help="the Unix socket engines connect to (default: %(default)s)")
    p.add_argument("--segment", default=default_path("seg"), metavar="PATH",
                   help="the shared-memory segment engines map (default: %(default)s)")
    p.add_argument("--segment-bytes", default="1GiB", metavar="SIZE", help="its size (default: 1GiB)")
    p.add_argument("--budget", default=None, metavar="SIZE", help="bytes held at most (default: the segment)")
    p.add_argument("--group", default=None, metavar="GROUP",
                   help="the engines' group: socket 0660 and segment 0640 theirs (default: 0600, this user only)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="grants file: the namespaces each engine's token reads (without: public only)")
    p.add_argument("--upstream-token-file", default=None, metavar="FILE", help="the token this host shows its edges")
    p.add_argument("--ca", default=None, metavar="FILE", help="CA bundle to verify the edges over HTTPS")
    p.add_argument("--eviction", choices=tuple(POLICIES), default=DEFAULT_POLICY,
                   help="eviction policy (default: %(default)s, the edge's)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on 127.0.0.1:PORT (default: off; the stats op always answers)")
    p.add_argument("--region", default=None, metavar="REGION",
                   help="follow this region's policies: its pushes and warms fill the host, its pins keep objects "
                        "(default: none followed)")
    p.add_argument("--registry", default=None, metavar="URL",
                   help="with --region: the registry the policies are read from (default: $KDN_REGISTRY, else the "
                        "embedded file); read only")
    p.add_argument("--operator-keys", default=None, metavar="FILE",
                   help="with --region: follow only policies one of these operator keys signed (as the edges do)")
    p.add_argument("--deny-floor-ms", type=float, default=2.0, metavar="MS",
                   help="the least time an 'absent' answer takes (or the last minute's p99 of them, if longer), "
                        "so that another tenant's object held here reads as one never published (default: 2)")
    p.set_defaults(func=cmd_host_serve)
    st = verbs.add_parser("stats", help="a running host tier's numbers as JSON (its stats op; no mapping taken)")
    st.add_argument("--socket", default=default_path("sock"), metavar="PATH",
                    help="the host's Unix socket (default: /dev/shm/kdn-host-UID.sock)")
    st.add_argument("--token-file", default=None, metavar="FILE",
                    help="a token its grants accept, if they ask one (default: $KDN_TOKEN)")
    st.set_defaults(func=cmd_host_stats)


def cmd_host_serve(args: argparse.Namespace) -> int:
    from kdn.host.config import HostConfig
    from kdn.host.tier import serve
    from kdn.units import parse_size

    config = HostConfig(
        trusted_keys=args.trusted_keys, edges=tuple(args.edge), origin=args.origin, socket=args.socket,
        segment=args.segment, segment_bytes=parse_size(args.segment_bytes),
        budget=parse_size(args.budget) if args.budget is not None else None, group=args.group,
        token_file=args.token_file, upstream_token_file=args.upstream_token_file, ca=args.ca,
        eviction=args.eviction, metrics_port=args.metrics_port, region=args.region, registry=args.registry,
        operator_keys=args.operator_keys, deny_floor_ms=args.deny_floor_ms)
    from kdn.registry.signing import Verifier

    Verifier.from_file(config.trusted_keys)  # a bad key file fails here, in one line
    if config.operator_keys is not None:
        Verifier.from_file(config.operator_keys)
    asyncio.run(serve(config))
    return 0


STATS_S = 10.0  # the most ``kdn host stats`` waits for its answer


def cmd_host_stats(args: argparse.Namespace) -> int:
    """One ``stats`` request over the socket, its answer printed as JSON: what an operator reads on a machine
    whose host serves no ``--metrics-port`` (the chart's and compose's default)."""
    import json

    from kdn.auth import read_token
    from kdn.errors import InvalidInput
    from kdn.wire.host import HostError, pack, read_frame, unpack

    token = read_token(args.token_file)  # (none given: $KDN_TOKEN, if set)

    async def ask() -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_unix_connection(args.socket)
        except OSError as e:
            raise InvalidInput(f"no host tier answers at {args.socket}: {e.strerror or e}") from None
        try:
            writer.write(pack({"id": 1, "op": "stats", "token": token}))
            async with asyncio.timeout(STATS_S):
                frame = await read_frame(reader)
        except TimeoutError:
            raise HostError("unavailable", f"the host tier at {args.socket} did not answer in {STATS_S:g} s") from None
        finally:
            writer.close()
        answer = unpack(frame) if frame is not None else {"ok": False, "message": "the connection was closed"}
        if not answer.get("ok"):
            raise HostError(str(answer.get("error", "unavailable")), str(answer.get("message"))[:200])
        return {k: v for k, v in answer.items() if k not in ("id", "ok")}

    print(json.dumps(asyncio.run(ask()), indent=2, sort_keys=True))
    return 0
