"""The `kdn` command line: the composition root.

Each part owns its commands (``kdn.origin.cli``, ``kdn.edge.cli``); this file
assembles them and owns the core ones (``address``, ``registry``). Parts are
imported lazily so ``kdn address`` never loads aiohttp or torch.

Bad input prints one line, ``kdn: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from kdn.errors import InvalidInput, KDNError
from kdn.registry.url import registry_arg, run_registry

if TYPE_CHECKING:  # pragma: no cover - the registry loads lazily: `kdn address` needs none of it
    from kdn.format.address import Address
    from kdn.registry import Manifest, ModelRecord, ObjectRecord, Registry

# Parts that contribute subcommands: module path -> its `register(subparsers)`.
# Each module must import nothing heavy at import time.
_PARTS = ("kdn.origin.cli", "kdn.edge.cli", "kdn.host.cli", "kdn.up")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"kdn: error: {message}\n")


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise KDNError(f"--tokens must be comma-separated integers, got {text[:40]!r}") from None


def cmd_address(args: argparse.Namespace) -> int:
    from kdn.format import address as A

    tokens = _parse_tokens(args.tokens)
    if not tokens:
        raise KDNError("--tokens is empty")
    if args.standalone:
        addrs = A.standalone_addresses(args.model_id, args.namespace, tokens, args.chunk_tokens)
    else:
        addrs = A.prefix_addresses(args.model_id, args.namespace, tokens, args.chunk_tokens)
    spans = A.chunk_spans(len(tokens), args.chunk_tokens)
    if args.json:
        print(json.dumps([{"start": s, "end": e, "address": a} for (s, e), a in zip(spans, addrs)], indent=2))
    else:
        for (s, e), a in zip(spans, addrs):
            print(f"{s:>8}-{e:<8} {a}")
    return 0


def cmd_registry_show(args: argparse.Namespace) -> int:
    from kdn.format.address import validate_address, validate_model_id, validate_name, validate_namespace

    if "/" in args.address:  # NAMESPACE/NAME: a manifest
        ns, _, name = args.address.partition("/")
        ns, name = validate_namespace(ns), validate_name(name)

        async def manifest(reg: Registry) -> int:
            m = await reg.get_manifest(ns, name)
            if m is None:
                print(f"kdn: no manifest {ns}/{name} in the registry", file=sys.stderr)
                return 1
            print(json.dumps({"type": "manifest", "record": m.to_dict(), **_verdict(args, m, f"{ns}/{name}")},
                             indent=2, default=str))
            return 0

        return run_registry(args, manifest)
    key = validate_address(args.address, what="address or model id")
    mid = validate_model_id(key)  # the same argument, read as a model id: it names either

    async def go(reg: Registry) -> int:
        rec: ObjectRecord | ModelRecord | None = await reg.get_object(key)
        kind, where = "object", "registry"
        if rec is None:
            rec, kind = await reg.get_model(mid), "model"
        if rec is None:  # an origin with --records store keeps object records beside its blobs: ask it
            rec, where = await _record_from_origins(reg, key), "origin"
            kind = "object"
        if rec is None:
            print(f"kdn: {key} is not in the registry, nor in an origin's store", file=sys.stderr)
            return 1
        out = {"type": kind, "record": rec.to_dict(), **_verdict(args, rec, key)}
        if where != "registry":
            out["from"] = where
        from kdn.registry import ObjectRecord

        if isinstance(rec, ObjectRecord):
            from kdn.auth import read_token
            from kdn.client.holding import regions_holding

            out["regions"] = await regions_holding(await reg.list_nodes(role="edge"), key,
                                                   read_token(args.token_file), args.token_hosts,
                                                   sorted(rec.encodings))
        print(json.dumps(out, indent=2, default=str))
        return 0

    return run_registry(args, go)


def _verdict(args: argparse.Namespace, rec: ObjectRecord | ModelRecord | Manifest, asked: str) -> dict[str, object]:
    """With ``--trusted-keys``: whether one of them signed ``rec`` (a registry writer can change any record;
    only a signed one is the origin's word), and whether it is the record of what was ``asked`` (a signed
    record of another address, model or name, put under this key, is signed but not this one's)."""
    if not args.trusted_keys:
        return {}
    from kdn.registry import Manifest, ModelRecord, ObjectRecord
    from kdn.registry.signing import SignatureError, Verifier

    about = (rec.address if isinstance(rec, ObjectRecord) else rec.model_id if isinstance(rec, ModelRecord)
             else rec.ref)
    if about != asked:
        return {"verified": False, "why": f"the record is {about[:80]}'s, not {asked[:80]}'s"}
    try:
        Verifier.from_file(args.trusted_keys).check(rec)
    except SignatureError as e:
        return {"verified": False, "why": str(e)}
    out: dict[str, object] = {"verified": True, "key": rec.sig.get("key")}
    if isinstance(rec, Manifest):
        out["version"] = rec.version  # (an older signed manifest verifies too: compare with what you expect)
    return out


async def _record_from_origins(reg: Registry, address: Address) -> ObjectRecord | None:
    """An object record from the first live origin (registered in ``reg``) that has it, read as anyone may."""
    import aiohttp

    from kdn.registry import ObjectRecord

    origins = await reg.list_nodes(role="origin")
    async with aiohttp.ClientSession() as session:
        for node in origins:
            try:
                async with session.get(f"{node.url}/v1/registry/objects/{address}",
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status == 200:
                        return ObjectRecord.from_dict(await r.json())
            except (aiohttp.ClientError, TimeoutError, ValueError, KDNError) as e:
                print(f"kdn: origin {node.node_id} at {node.url}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
    return None


def cmd_registry_migrate(args: argparse.Namespace) -> int:
    """Object records and whole manifests out of the registry, into an origin's store (``--records store``;
    kdn.registry.split): the records copied (then deleted with ``--delete``), each manifest moved behind a
    pointer. Exit 1 when a manifest had to be left whole (signed by another key, or changed meanwhile)."""
    from pathlib import Path

    from kdn.origin.s3records import open_records
    from kdn.registry import KVRegistry
    from kdn.registry.split import RECORDS_FILE, SHARDS, migrate_manifests, migrate_records

    s3 = str(args.store).startswith("s3://")
    store = Path(args.store)
    if s3:
        from kdn.origin.s3store import RECORDS, parse_s3_url

        where = f"{parse_s3_url(args.store).url}/{RECORDS}"  # a bad URL fails here, in one line
    elif not store.is_dir():
        raise InvalidInput(f"--store {str(args.store)[:80]!r} must be an origin's store folder (records go in "
                           f"{RECORDS_FILE} there) or s3://BUCKET/PREFIX")
    elif args.store_credentials is not None:
        raise InvalidInput("--store-credentials is for an s3:// store")
    else:
        where = str(store / RECORDS_FILE)

    signer = None
    if args.signing_key:
        from kdn.registry.signing import Signer

        signer = Signer.load(args.signing_key)  # a bad or world-readable key fails here, before any write

    async def go(reg: Registry) -> int:
        assert isinstance(reg, KVRegistry)
        records = open_records(args.store, credentials=args.store_credentials)
        try:
            def progress(shard: int, n: int) -> None:
                if shard % 512 == 511:
                    print(f"  {shard + 1}/{SHARDS} shards, {n} records", file=sys.stderr)

            copied, kept = await migrate_records(reg, records, delete=args.delete, progress=progress)
            if not args.objects_only:
                moved, already, left = await migrate_manifests(reg, records, signer=signer)
        finally:
            await records.close()
        print(f"{copied} object records copied into {where}"
              + (f", {kept} already there (kept)" if kept else "")
              + ("; removed from the registry" if args.delete else "; the registry still holds them (--delete)"))
        if args.objects_only:
            return 0
        print(f"{moved} manifests moved beside them (the registry keeps a pointer per name)"
              + (f", {already} pointers or tombstones already" if already else "")
              + (f"; {left} left whole (signed by another key, or changed meanwhile: see above)" if left else ""))
        return 0 if not left else 1

    return run_registry(args, go)


def cmd_node_admit(args: argparse.Namespace) -> int:
    """An operator's signed admission of one node (``--admission FILE`` on that node; kdn.registry.signing)."""
    import time
    from pathlib import Path

    from kdn.registry import Admission
    from kdn.registry.records import validate_node_url
    from kdn.registry.signing import Signer
    from kdn.units import parse_duration

    days = parse_duration(args.valid) / 86400
    if not 0 < days <= 3660:
        raise InvalidInput(f"--valid must be between a second and 10 years, got {args.valid!r}")
    adm = Admission(role=args.role, region=args.region, node_id=args.node_id,
                    url=validate_node_url(args.url.rstrip("/")), expires=round(time.time() + days * 86400))
    adm = Signer.load(args.operator_key).sign(adm)
    text = json.dumps(adm.to_dict(), indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"admission of {adm.role} {adm.region}/{adm.node_id} at {adm.url} until "
              f"{time.strftime('%Y-%m-%d', time.gmtime(adm.expires))}: {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_node_revoke(args: argparse.Namespace) -> int:
    """Add admissions to an operator's revocation list (readers' ``--revoked-admissions FILE``), atomically."""
    import os

    from kdn.registry import Admission
    from kdn.registry.signing import parse_admission_ids, admission_id

    ids = []
    for f in args.admission:
        try:
            adm = Admission.from_dict(json.loads(Path(f).read_text()))
        except OSError as e:
            raise InvalidInput(f"cannot read admission {f!r}: {e.strerror}") from None
        except (ValueError, TypeError) as e:
            raise InvalidInput(f"{f} is not an admission (kdn node admit): {e}") from None
        ids.append((admission_id(adm), f"{adm.role} {adm.region}/{adm.node_id} at {adm.url}"))
    ids += [(i, "by id") for i in parse_admission_ids(args.id, "--id")]
    if not ids:
        raise InvalidInput("name an admission to revoke: a file (kdn node admit --out) or --id")
    path = Path(args.list)
    import fcntl

    try:  # two revokes at once: each reads, adds and writes under the lock, so neither loses the other's
        lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise InvalidInput(f"cannot lock {str(path)!r}: {e.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _revoke_locked(path, ids)
    finally:
        os.close(lock)


def _revoke_locked(path: Path, ids: list[tuple[str, str]]) -> int:
    import contextlib
    import os
    import tempfile
    import time

    from kdn.registry.signing import parse_admission_ids

    try:
        old = path.read_text() if path.exists() else ""
    except OSError as e:
        raise InvalidInput(f"cannot read {str(path)!r}: {e.strerror}") from None
    have = set(parse_admission_ids(old.splitlines(), str(path)))
    new = [(i, what) for i, what in ids if i not in have]
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    text = old + ("" if not old or old.endswith("\n") else "\n")
    text += "".join(f"{i}  # {what}, revoked {stamp} UTC\n" for i, what in new)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    print(f"{len(new)} admission(s) revoked in {path} ({len(have) + len(new)} in all"
          + (f"; {len(ids) - len(new)} already there" if len(ids) > len(new) else "")
          + "); readers with --revoked-admissions read it again within 30 s", file=sys.stderr)
    return 0


def cmd_registry_ls(args: argparse.Namespace) -> int:
    async def go(reg: Registry) -> int:
        for key, value in await reg.list_keys(args.prefix):
            print(f"{key}\t{len(value)} B")
        return 0

    return run_registry(args, go)


def cmd_registry_nodes(args: argparse.Namespace) -> int:
    async def go(reg: Registry) -> int:
        nodes = await reg.list_nodes(role=args.role, region=args.region)
        for n in nodes:
            print(f"{n.role:<7} {n.region:<12} {n.node_id:<20} {n.url}")
        if not nodes:
            print("(no live nodes)", file=sys.stderr)
        return 0

    return run_registry(args, go)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kdn", description="KDN: a knowledge delivery network for model-native data.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("address", help="print the content addresses of a token sequence")
    p.add_argument("--model-id", required=True, help="64-hex model id")
    p.add_argument("--namespace", default="public")
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--standalone", action="store_true", help="position-independent chunk addresses")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_address)

    _add_registry(sub)
    _add_node(sub)

    for name in _PARTS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that part is not built yet
                continue
            raise
        mod.register(sub)
    return parser


def _add_registry(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``kdn registry show|migrate|ls|nodes``."""
    reg = sub.add_parser("registry", help="query the registry").add_subparsers(dest="registry_command", required=True)
    p = reg.add_parser("show", help="show the record of an object address, a model id, or a manifest NAMESPACE/NAME")
    p.add_argument("address", metavar="ADDRESS|MODEL_ID|NAMESPACE/NAME")
    p.add_argument("--trusted-keys", default=None, metavar="FILE",
                   help="publisher keys (ed25519:HEX per line): say whether one of them signed the record")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="a token that reads every namespace (an edge's or an admin's; else $KDN_TOKEN): each "
                        "region's owner edge then says whether it holds the object (a HEAD, never a fill)")
    p.add_argument("--token-hosts", default=None, metavar="PATTERNS",
                   help="hosts the token may be sent to (comma-separated names, globs or address blocks; "
                        "default loopback): edge URLs come from the registry")
    registry_arg(p)
    p.set_defaults(func=cmd_registry_show)
    p = reg.add_parser("migrate", help="move object records and whole manifests out of the registry into an "
                                       "origin's store (for origins run with --records store; docs/scale.md)")
    p.add_argument("--store", required=True, metavar="DIR|s3://BUCKET/PREFIX?endpoint=URL",
                   help="the origin's store: a folder, or its bucket")
    p.add_argument("--store-credentials", default=None, metavar="FILE",
                   help="an s3:// store's keys (INI: aws_access_key_id, aws_secret_access_key); else AWS_* "
                        "in the environment")
    p.add_argument("--delete", action="store_true", help="remove them from the registry once copied")
    p.add_argument("--objects-only", action="store_true",
                   help="move object records only; leave whole manifests in the registry (by default each is "
                        "moved beside the records, and the registry keeps a pointer per name)")
    p.add_argument("--signing-key", default=None, metavar="FILE",
                   help="the origin's key (kdn origin keygen): signs the pointers of the manifests it signed; "
                        "a manifest signed by another key is left whole")
    registry_arg(p)
    p.set_defaults(func=cmd_registry_migrate)
    p = reg.add_parser("ls", help="list registry keys")
    p.add_argument("--prefix", default="", help="relative key prefix, e.g. objects/ or manifests/public/")
    registry_arg(p)
    p.set_defaults(func=cmd_registry_ls)
    p = reg.add_parser("nodes", help="list live nodes")
    p.add_argument("--role", default=None)
    p.add_argument("--region", default=None)
    registry_arg(p)
    p.set_defaults(func=cmd_registry_nodes)


def _add_node(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``kdn node admit|revoke``: operator-signed node admissions."""
    node = sub.add_parser("node", help="node admissions (operator-signed)").add_subparsers(
        dest="node_command", required=True)
    p = node.add_parser("admit", help="sign a node's admission with an operator key: readers that require "
                                      "admissions (kdn edge serve --require-admission) leave out nodes without one")
    p.add_argument("--operator-key", required=True, metavar="FILE", help="the operator's key (kdn origin keygen)")
    p.add_argument("--role", required=True, choices=["edge", "origin"])
    p.add_argument("--region", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--url", required=True, help="the URL the node advertises (its --url)")
    p.add_argument("--valid", default="365d", help="how long it holds (default 365d; re-admit before it ends)")
    p.add_argument("--out", default=None, metavar="FILE", help="write it here (default: stdout)")
    p.set_defaults(func=cmd_node_admit)
    p = node.add_parser("revoke", help="add admissions to a revocation list: readers given it "
                                       "(--revoked-admissions) leave their nodes out though unexpired")
    p.add_argument("admission", nargs="*", help="admission files (kdn node admit --out)")
    p.add_argument("--id", action="append", default=[], help="an admission id (64 hex; repeatable)")
    p.add_argument("--list", required=True, metavar="FILE", help="the revocation list (created if absent)")
    p.set_defaults(func=cmd_node_revoke)


def main(argv: Sequence[str] | None = None) -> int:
    if not sys.stderr.isatty():
        # Progress bars redraw in place on a terminal; in a log each redraw is a new line.
        import os

        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KDNError as e:
        print(f"kdn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
