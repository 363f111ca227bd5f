"""`kdn relation sign|put|rm|show|list`: a publisher's base relations (issue #30) into the registry, and back.

    kdn relation sign rel.msgpack --signing-key origin.key        # the publisher's key (kdn origin keygen)
    kdn relation put rel.msgpack --registry URL                   # relations/{variant}; refused unsigned
    kdn relation rm VARIANT_ID --signing-key origin.key           # withdraw it: a signed tombstone
    kdn relation show VARIANT_ID --trusted-keys keys.txt          # the record, and whether a consumer takes it
    kdn relation list --trusted-keys keys.txt

A relation file is ``BaseRelation.pack()`` (``kdn.adapters.hf.variants.relation_for`` writes the record). Signing
issues it: a per-variant version (the time in ms, above the stored one where this key signed that) and time,
signed with it, so a consumer refuses an older relation written back over it (issue #51); ``sign`` and ``put``
print its pin (``kdn.registry.signing.relation_pin``). The registry stores a relation as its publisher signed
it; a consumer takes it only through ``kdn.registry.find_relation`` (its trusted keys, its high-water marks),
then opts in with ``agenerate_variant(accept_base=...)``. ``show`` and ``list`` judge as a consumer does, with
the per-user marks (``kdn.client.versions.state_file``: ``$KDN_MANIFEST_STATE`` to share or move them), and
raise them. Imports nothing heavy until a command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kdn.errors import InvalidInput

if TYPE_CHECKING:  # pragma: no cover
    from kdn.client.trust import Trust
    from kdn.registry import Registry
    from kdn.registry.records import BaseRelation
    from kdn.registry.signing import Signer


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
    p = rel.add_parser("rm", help="withdraw a variant's relation: put a tombstone signed with the publisher's key")
    p.add_argument("variant", metavar="VARIANT_MODEL_ID")
    p.add_argument("--signing-key", required=True, metavar="FILE", help="the publisher's key (kdn origin keygen)")
    registry_arg(p)
    p.set_defaults(func=cmd_rm)
    for name, what in (("show", "show the relation of a variant model id"), ("list", "list the relations")):
        p = rel.add_parser(name, help=what)
        if name == "show":
            p.add_argument("variant", metavar="VARIANT_MODEL_ID")
        p.add_argument("--trusted-keys", default=None, metavar="FILE",
                       help="publisher keys (ed25519:HEX per line): say whether a consumer takes it (one of them "
                            "signed it, and it is not older than one taken before: $KDN_MANIFEST_STATE)")
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
    rel = signer.sign(_read(args.file).issued())
    out = args.out or args.file
    Path(out).write_bytes(rel.pack())
    print(f"{out}: relation {rel.variant} -> base {rel.base} signed by {signer.key_id}, {_issue(rel)}")
    return 0


def _issue(rel: BaseRelation) -> str:
    from kdn.registry.signing import relation_pin

    return f"version {rel.version}, pin {relation_pin(rel)}"


def _issued(rel: BaseRelation, signer: Signer, stored: BaseRelation | None) -> BaseRelation:
    """``rel`` issued and signed by ``signer``, above the stored relation's version where ``signer`` signed
    that one (anyone's planted version could otherwise push the publisher's anywhere)."""
    from kdn.registry.signing import Verifier

    above = stored.version if stored is not None and Verifier([signer.public]).ok(stored) else 0
    return signer.sign(rel.issued(above=above))


def cmd_put(args: argparse.Namespace) -> int:
    from kdn.registry.url import run_registry
    from kdn.registry.signing import Signer, Verifier

    rel = _read(args.file)
    signer = Signer.load(args.signing_key) if args.signing_key else None
    if signer is None and not rel.sig:
        raise InvalidInput(f"{args.file} is unsigned, and no consumer takes an unsigned relation: "
                           "kdn relation sign it, or pass --signing-key")
    trusted = Verifier.from_file(args.trusted_keys) if args.trusted_keys else None

    async def go(reg: Registry) -> int:
        stored = await reg.get_relation(rel.variant)
        new = rel if signer is None else _issued(rel, signer, stored)
        if trusted is not None:
            trusted.check(new)  # SignatureError (a KDNError): one line, exit 2
        judge = trusted or (Verifier([signer.public]) if signer is not None else None)
        if stored is not None and judge is not None and judge.ok(stored) and stored.version > new.version:
            raise InvalidInput(f"the registry holds version {stored.version} of relations/{rel.variant}, newer than "
                               f"{args.file}'s {new.version}: putting it would roll the relation back")
        await reg.put_relation(new)
        print(f"relations/{new.variant}: base {new.base}, {_plan(new)}, signed by {new.sig.get('key')}, "
              f"{_issue(new)}")
        return 0

    return run_registry(args, go)


def cmd_rm(args: argparse.Namespace) -> int:
    import sys

    from kdn.format.address import validate_model_id
    from kdn.registry.signing import Signer
    from kdn.registry.url import run_registry

    variant = validate_model_id(args.variant)
    signer = Signer.load(args.signing_key)

    async def go(reg: Registry) -> int:
        stored = await reg.get_relation(variant)
        if stored is None:
            print(f"kdn: no relation for variant {variant} in the registry", file=sys.stderr)
            return 1
        tomb = _issued(stored.tombstone(), signer, stored)
        await reg.put_relation(tomb)
        print(f"relations/{variant}: withdrawn (a tombstone signed by {signer.key_id}, {_issue(tomb)})")
        return 0

    return run_registry(args, go)


def _plan(rel: BaseRelation) -> str:
    if rel.deleted:
        return "withdrawn (a tombstone)"
    k = rel.depth
    return (f"recomputes layers [0, {k}) of {rel.layers}" if k is not None
            else f"recomputes layers {rel.recompute} of {rel.layers} (not a first-k plan: nothing loads it)")


def _verdict(trust: Trust | None, rel: BaseRelation) -> dict[str, object]:
    """What a consumer with these keys and marks makes of ``rel`` (its marks raised by what it takes)."""
    if trust is None:
        return {}
    from kdn.registry.signing import SignatureError

    try:
        trust.relation(rel)
    except SignatureError as e:
        return {"verified": False, "why": str(e)}
    return {"verified": True, "key": rel.sig.get("key"), "version": rel.version,
            **({"withdrawn": True} if rel.deleted else {})}


def _trust(args: argparse.Namespace) -> Trust | None:
    from kdn.client.trust import Trust

    return Trust(args.trusted_keys) if args.trusted_keys else None


def cmd_show(args: argparse.Namespace) -> int:
    import sys

    from kdn.format.address import validate_model_id
    from kdn.registry.url import run_registry

    variant = validate_model_id(args.variant)
    trust = _trust(args)

    async def go(reg: Registry) -> int:
        rel = await reg.get_relation(variant)
        if rel is None:
            print(f"kdn: no relation for variant {variant} in the registry", file=sys.stderr)
            return 1
        print(json.dumps({"type": "relation", "record": rel.to_dict(), **_verdict(trust, rel)}, indent=2))
        return 0

    return run_registry(args, go)


def cmd_list(args: argparse.Namespace) -> int:
    from kdn.registry.url import run_registry

    trust = _trust(args)

    async def go(reg: Registry) -> int:
        for rel in await reg.list_relations():
            v = _verdict(trust, rel)
            mark = "" if not v else "\tverified" if v["verified"] else "\tNOT VERIFIED"
            print(f"{rel.variant}\tbase {rel.base}\t{_plan(rel)}\t{rel.metric} <= {rel.budget:g}\t{rel.name}{mark}")
        return 0

    return run_registry(args, go)
