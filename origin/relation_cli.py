"""`kdn relation sign|put|show|list`: a publisher's base relations (issue #30) into the registry, and back.

    kdn relation sign rel.msgpack --signing-key origin.key        # the publisher's key (kdn origin keygen)
    kdn relation put rel.msgpack --registry URL                   # relations/{variant}; refused unsigned
    kdn relation show VARIANT_ID --trusted-keys keys.txt          # the record, and whether a trusted key signed it
    kdn relation list --trusted-keys keys.txt

A relation file is ``BaseRelation.pack()`` (``kdn.adapters.hf.variants.relation_for`` writes the record). The
registry stores a relation as its publisher signed it; a consumer takes it only through
``kdn.registry.find_relation`` (its trusted keys), then opts in with ``agenerate_variant(accept_base=...)``.
Imports nothing heavy until a command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kdn.errors import InvalidInput

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry import Registry
    from kdn.registry.records import BaseRelation


def register(sub: argparse._SubParsersAction) -> None:
    from kdn.registry.url import registry_arg

    rel = sub.add_parser("relation", help="a publisher's signed base relations (fine-tuned variants reading a "
                                          "base model's states)").add_subparsers(dest="relation_command",
                                                                                 required=True)
    p = rel.add_parser("sign", help="sign a relation file with the publisher's key")
    p.add_argument("file", metavar="FILE", help="a packed BaseRelation (BaseRelation.pack())")
    p.add_argument("--signing-key", required=True, metavar="FILE", help="the publisher's key (kdn origin keygen)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the signed relation here (default: FILE)")
    p.set_defaults(func=cmd_sign)
    p = rel.add_parser("put", help="put a signed relation in the registry (relations/{variant})")
    p.add_argument("file", metavar="FILE", help="a packed BaseRelation, signed (kdn relation sign)")
    p.add_argument("--signing-key", default=None, metavar="FILE", help="sign it with this key first")
    p.add_argument("--trusted-keys", default=None, metavar="FILE",
                   help="refuse it unless one of these keys (ed25519:HEX per line) signed it")
    registry_arg(p)
    p.set_defaults(func=cmd_put)
    for name, what in (("show", "show the relation of a variant model id"), ("list", "list the relations")):
        p = rel.add_parser(name, help=what)
        if name == "show":
            p.add_argument("variant", metavar="VARIANT_MODEL_ID")
        p.add_argument("--trusted-keys", default=None, metavar="FILE",
                       help="publisher keys (ed25519:HEX per line): say whether one of them signed it")
        registry_arg(p)
        p.set_defaults(func=cmd_show if name == "show" else cmd_list)


def _read(path: str) -> BaseRelation:
    from kdn.registry.records import BaseRelation

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidInput(f"cannot read relation {path!r}: {e.strerror}") from None
    return BaseRelation.unpack(data)  # InvalidInput: not a relation


def cmd_sign(args: argparse.Namespace) -> int:
    from kdn.registry.signing import Signer

    signer = Signer.load(args.signing_key)
    rel = signer.sign(_read(args.file))
    out = args.out or args.file
    Path(out).write_bytes(rel.pack())
    print(f"{out}: relation {rel.variant} -> base {rel.base} signed by {signer.key_id}")
    return 0


def cmd_put(args: argparse.Namespace) -> int:
    from kdn.registry.url import run_registry
    from kdn.registry.signing import Signer, Verifier

    rel = _read(args.file)
    if args.signing_key:
        rel = Signer.load(args.signing_key).sign(rel)
    if not rel.sig:
        raise InvalidInput(f"{args.file} is unsigned, and no consumer takes an unsigned relation: "
                           "kdn relation sign it, or pass --signing-key")
    if args.trusted_keys:
        Verifier.from_file(args.trusted_keys).check(rel)  # SignatureError (a KDNError): one line, exit 2

    async def go(reg: Registry) -> int:
        await reg.put_relation(rel)
        print(f"relations/{rel.variant}: base {rel.base}, {_plan(rel)}, signed by {rel.sig.get('key')}")
        return 0

    return run_registry(args, go)


def _plan(rel: BaseRelation) -> str:
    k = rel.depth
    return (f"recomputes layers [0, {k}) of {rel.layers}" if k is not None
            else f"recomputes layers {rel.recompute} of {rel.layers} (not a first-k plan: nothing loads it)")


def _verdict(args: argparse.Namespace, rel: BaseRelation) -> dict[str, object]:
    if not args.trusted_keys:
        return {}
    from kdn.registry.signing import SignatureError, Verifier

    try:
        Verifier.from_file(args.trusted_keys).check(rel)
    except SignatureError as e:
        return {"verified": False, "why": str(e)}
    return {"verified": True, "key": rel.sig.get("key")}


def cmd_show(args: argparse.Namespace) -> int:
    import sys

    from kdn.format.address import validate_model_id
    from kdn.registry.url import run_registry

    variant = validate_model_id(args.variant)

    async def go(reg: Registry) -> int:
        rel = await reg.get_relation(variant)
        if rel is None:
            print(f"kdn: no relation for variant {variant} in the registry", file=sys.stderr)
            return 1
        print(json.dumps({"type": "relation", "record": rel.to_dict(), **_verdict(args, rel)}, indent=2))
        return 0

    return run_registry(args, go)


def cmd_list(args: argparse.Namespace) -> int:
    from kdn.registry.url import run_registry

    async def go(reg: Registry) -> int:
        for rel in await reg.list_relations():
            v = _verdict(args, rel)
            mark = "" if not v else "\tverified" if v["verified"] else "\tNOT VERIFIED"
            print(f"{rel.variant}\tbase {rel.base}\t{_plan(rel)}\t{rel.metric} <= {rel.budget:g}\t{rel.name}{mark}")
        return 0

    return run_registry(args, go)
