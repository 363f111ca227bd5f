"""Records: dict and msgpack round trips, forward-compatible reads, strict required fields."""

from __future__ import annotations

import msgpack
import pytest

from kdn.errors import InvalidAddress, InvalidInput
from kdn.registry import Encoding, Manifest, ModelRecord, NodeRecord, ObjectRecord, Policy
from registry_helpers import addr, chain, enc, manifest, model, node, obj, policy

ALL = [model(), enc(), obj("a").with_tail(5, addr("t")).with_encoding(enc("int8")), manifest("m", chain("m", 2)), node(), policy()]


@pytest.mark.parametrize("rec", ALL, ids=lambda r: type(r).__name__)
def test_round_trips(rec):
    cls = type(rec)
    assert cls.from_dict(rec.to_dict()) == rec
    assert cls.unpack(rec.pack()) == rec
    # Plain data only: a JSON/msgpack reader in any language can use it.
    assert msgpack.unpackb(rec.pack()) == rec.to_dict()


@pytest.mark.parametrize("rec", ALL, ids=lambda r: type(r).__name__)
def test_unknown_fields_are_ignored(rec):
    d = {**rec.to_dict(), "added_in_v9": {"x": 1}}
    assert type(rec).unpack(msgpack.packb(d)) == rec


@pytest.mark.parametrize("rec", ALL, ids=lambda r: type(r).__name__)
def test_missing_required_field_is_named(rec):
    d = rec.to_dict()
    first = next(iter(d))
    del d[first]
    with pytest.raises(InvalidInput, match=f"lacks required field.*{first}"):
        type(rec).from_dict(d)


def test_undecodable_bytes():
    with pytest.raises(InvalidInput, match="not valid msgpack"):
        Policy.unpack(b"\xc1\xc1")
    with pytest.raises(InvalidInput, match="must be a map"):
        Policy.unpack(msgpack.packb([1, 2]))


def test_object_tails_survive_msgpack_and_json_shapes():
    rec = obj("a").with_tail(17, addr("t17"))
    assert rec.to_dict()["tails"] == {"17": addr("t17")}
    assert ObjectRecord.from_dict({**rec.to_dict(), "tails": {17: addr("t17")}}) == rec


def test_with_helpers_return_new_records():
    rec = obj("a")
    new = rec.with_encoding(enc("zstd")).with_tail(3, addr("t3"))
    assert set(rec.encodings) == {"raw"} and rec.tails == {}
    assert set(new.encodings) == {"raw", "zstd"} and new.tails == {3: addr("t3")}


def test_merged_keeps_both_sides_and_the_newer_digest():
    old = obj("a").with_tail(3, addr("t3"))
    new = obj("a", encs=("zstd",))
    m = old.merged(new)
    assert set(m.encodings) == {"raw", "zstd"} and m.tails == {3: addr("t3")}
    changed = obj("a", encs=("raw",))
    changed = changed.with_encoding(Encoding("raw", 9, addr("other")))
    assert old.merged(changed).encodings["raw"] == changed.encodings["raw"]  # what the writer holds now wins


@pytest.mark.parametrize(
    "make, err",
    [
        (lambda: obj("a").__class__(**{**obj("a").__dict__, "address": "x" * 64}), InvalidAddress),
        (lambda: obj("a").__class__(**{**obj("a").__dict__, "kind": "lora"}), InvalidInput),
        (lambda: obj("a").__class__(**{**obj("a").__dict__, "start": 5, "end": 5}), InvalidInput),
        (lambda: obj("a").__class__(**{**obj("a").__dict__, "parent": "nope"}), InvalidAddress),
        (lambda: obj("a").with_tail(0, addr("t")), InvalidInput),
        (lambda: obj("a").__class__(**{**obj("a").__dict__, "encodings": {"raw": enc("zstd")}}), InvalidInput),
        (lambda: Encoding("raw", -1, addr("d")), InvalidInput),
        (lambda: Encoding("raw", 1, "d"), InvalidAddress),
        (lambda: ModelRecord(addr("m"), "n", "a", "bf16", 0, {}), InvalidInput),
        (lambda: Manifest("Public", "m", addr("m"), [], 0, 256, []), InvalidInput),
        (lambda: Manifest("public", "a/b", addr("m"), [], 0, 256, []), InvalidInput),
        (lambda: Manifest("public", "m", addr("m"), ["zz"], 0, 256, []), InvalidAddress),
        (lambda: Manifest("public", "m", addr("m"), [], 1, 256, [-1]), InvalidInput),
        (lambda: NodeRecord("edge", "eu/west", "n1", "http://x"), InvalidInput),
        (lambda: Policy("p", "evict"), InvalidInput),
        (lambda: Policy("p", "pin", manifest="docs"), InvalidInput),
        (lambda: Policy("p", "quota", quota_bytes=1.5), InvalidInput),
    ],
)
def test_invalid_records_cannot_be_built(make, err):
    with pytest.raises(err):
        make()
