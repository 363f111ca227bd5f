"""The attack (#51 item 5): a fine-tune relation rolled back to a superseded one, validly signed.

A registry writer keeps the publisher's signed ``BaseRelation`` and, once the publisher has put a better one
(or withdrawn it), writes the old one back: ``find_relation`` returned it, ``check_relation`` passed it and
``kdn relation show`` said verified. Relations now carry what manifests carry: a signed per-variant version
and time (``kdn relation sign``/``put --signing-key`` issue it), a consumer's high-water mark per variant (in
the same per-user state file as the manifests': ``kdn.client.versions``), signed tombstones (``kdn relation
rm``) and pins (``kdn.registry.signing.relation_pin``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from registry_helpers import addr, relation

from kdn.cli import main
from kdn.client.trust import Trust
from kdn.registry import EmbeddedRegistry, find_relation
from kdn.registry.signing import Signer, SignatureError, Verifier

VARIANT = addr("variant")


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A registry file, a publisher's key, and a consumer's per-user state under tmp_path."""
    monkeypatch.setenv("KDN_REGISTRY", f"file:{tmp_path / 'registry.sqlite3'}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("KDN_MANIFEST_STATE", raising=False)
    monkeypatch.chdir(tmp_path)
    key = tmp_path / "pub.key"
    signer = Signer.generate(key)
    return dict(dir=tmp_path, reg=tmp_path / "registry.sqlite3", key=str(key), pub=f"{key}.pub", signer=signer)


def kdn(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def stored(w):
    async def go():
        async with EmbeddedRegistry(w["reg"]) as reg:
            return await reg.get_relation(VARIANT)
    return asyncio.run(go())


def write_back(w, rel) -> None:
    """What a registry writer does: put a record as it is."""
    async def go():
        async with EmbeddedRegistry(w["reg"]) as reg:
            await reg.put_relation(rel)
    asyncio.run(go())


def found(w, trusted, **kw):
    async def go():
        async with EmbeddedRegistry(w["reg"]) as reg:
            return await find_relation(reg, VARIANT, trusted, **kw)
    return asyncio.run(go())


def publish(w, capsys, **kw) -> None:
    (w["dir"] / "rel.msgpack").write_bytes(relation(VARIANT, **kw).pack())
    code, out, err = kdn(capsys, "relation", "put", "rel.msgpack", "--signing-key", w["key"])
    assert code == 0, err


def show(w, capsys) -> dict:
    code, out, err = kdn(capsys, "relation", "show", VARIANT, "--trusted-keys", w["pub"])
    assert code == 0, err
    return json.loads(out)


def test_a_superseded_relation_written_back_is_refused(world, capsys):
    w = world
    publish(w, capsys, recompute=[0, 1])
    stale = stored(w)  # the attacker keeps the signed relation
    publish(w, capsys, recompute=[0, 1, 2, 3])  # the publisher measures again: a deeper plan
    newer = stored(w)
    assert show(w, capsys)["verified"] is True  # a consumer (kdn relation show) takes the newer one
    assert found(w, Trust([w["signer"].public])) == newer
    write_back(w, stale)  # the rollback
    verdict = show(w, capsys)
    assert verdict["verified"] is False and "older" in verdict["why"], verdict
    fresh = Trust([w["signer"].public])  # another process: the mark is in the per-user state file
    assert found(w, fresh) is None and fresh.rejected == 1
    with pytest.raises(SignatureError, match="older"):
        fresh.relation(stale)
    # a relation signed before versions reads as the lowest: refused once a versioned one was taken
    legacy = w["signer"].sign(relation(VARIANT))
    assert legacy.version == 0 and Verifier([w["signer"].public]).ok(legacy)
    with pytest.raises(SignatureError, match="older"):
        fresh.relation(legacy)
    assert Trust([w["signer"].public], manifest_state="memory").relation(legacy) == legacy


def test_a_superseded_relation_does_not_pass_check_relation(world, capsys):
    pytest.importorskip("torch")
    from kdn.adapters.hf.variants import check_relation

    w = world
    publish(w, capsys, recompute=[0, 1])
    stale = stored(w)
    publish(w, capsys, recompute=[0, 1, 2, 3])
    consumer = Trust([w["signer"].public])
    assert found(w, consumer) == stored(w)
    with pytest.raises(SignatureError, match="older"):  # refused before the model is looked at
        check_relation(stale, None, None, consumer)


def test_a_relation_tombstone_is_signed_and_honoured(world, capsys):
    w = world
    publish(w, capsys)
    live = stored(w)
    consumer = Trust([w["signer"].public])
    assert found(w, consumer) == live
    code, out, err = kdn(capsys, "relation", "rm", VARIANT, "--signing-key", w["key"])
    assert code == 0 and "withdrawn" in out, err
    tomb = stored(w)
    assert tomb.deleted and tomb.version > live.version and tomb.recompute == list(range(tomb.layers))
    assert Verifier([w["signer"].public]).ok(tomb)  # the publisher's key signed the withdrawal...
    assert not Verifier([w["signer"].public]).ok(dataclasses.replace(tomb, deleted=False))  # ...and the flag
    assert found(w, consumer) is None and consumer.rejected == 0  # withdrawn: absent, not refused
    assert show(w, capsys)["withdrawn"] is True
    write_back(w, live)  # the withdrawn relation written back
    assert found(w, consumer) is None and consumer.rejected == 1
    assert found(w, Trust([w["signer"].public])) is None  # a fresh process too (the state file)
    assert show(w, capsys)["verified"] is False
    # a tombstone no key here signed withdraws nothing
    other = Signer.generate(w["dir"] / "other.key")
    write_back(w, other.sign(dataclasses.replace(tomb, version=tomb.version + 1, sig={})))
    assert found(w, consumer) is None and consumer.rejected == 2
    code, _, err = kdn(capsys, "relation", "rm", addr("absent"), "--signing-key", w["key"])
    assert code == 1 and "no relation" in err


def test_a_relation_pinned_by_hash_refuses_another(world, capsys):
    from kdn.registry.signing import relation_pin

    w = world
    publish(w, capsys, recompute=[0, 1])
    pinned = stored(w)
    pin = relation_pin(pinned)
    publish(w, capsys, recompute=[0, 1, 2])  # a newer one: not the pinned one either
    keys = Verifier([w["signer"].public])
    assert found(w, keys, pin=pin) is None
    write_back(w, pinned)
    assert found(w, keys, pin=pin) == pinned  # no memory needed: the pin names it
    forged = dataclasses.replace(pinned, budget=99.0)  # another payload, the pinned one's signature
    write_back(w, forged)
    assert found(w, keys, pin=pin) is None
    resigned = w["signer"].sign(dataclasses.replace(pinned, budget=99.0, sig={}))  # validly signed, not pinned
    write_back(w, resigned)
    t = Trust([w["signer"].public], manifest_state="memory")
    assert found(w, t, pin=pin) is None and t.rejected == 1
    assert found(w, t) == resigned  # unpinned, the same record is taken
