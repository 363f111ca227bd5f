"""Origin-signed records: what a signature covers, who is trusted, rotation and revocation."""

from __future__ import annotations

import dataclasses

import pytest

from kdn.errors import InvalidInput
from kdn.registry import Encoding, Manifest, ObjectRecord
from kdn.registry.signing import SignatureError, Signer, Verifier

M = "ab" * 32
A1, A2, D1, D2 = "11" * 32, "22" * 32, "33" * 32, "44" * 32


def record(**kw) -> ObjectRecord:
    base = dict(address=A1, model_id=M, namespace="public", kind="kv", start=0, end=256, parent=None,
                standalone=False, encodings={"zstd": Encoding("zstd", 1000, D1)}, origin="o1", engine="vllm 0.32.0")
    return ObjectRecord(**{**base, **kw})


@pytest.fixture
def keys(tmp_path):
    return Signer.generate(tmp_path / "k1"), Signer.generate(tmp_path / "k2")


def test_a_signed_record_verifies_and_survives_the_registry_encoding(keys):
    k1, _ = keys
    rec = k1.sign(record())
    again = ObjectRecord.unpack(rec.pack())  # as the registry stores it and a client reads it back
    assert Verifier([k1.public]).check(again) == again


@pytest.mark.parametrize("change", [
    dict(encodings={"zstd": Encoding("zstd", 1000, D2)}),  # the digest: a forged blob
    dict(encodings={"zstd": Encoding("zstd", 999, D1)}),
    dict(encodings={"zstd": Encoding("zstd", 1000, D1), "raw": Encoding("raw", 5, D2)}),  # an extra encoding
    dict(namespace="acme"), dict(model_id="cd" * 32), dict(start=256, end=512), dict(parent=A2),
    dict(tails={17: A2}), dict(kind="hybrid"), dict(engine="transformers 5.19.0"), dict(origin="o2"),
])
def test_every_field_a_consumer_relies_on_is_covered(keys, change):
    k1, _ = keys
    forged = dataclasses.replace(k1.sign(record()), **change)
    with pytest.raises(SignatureError, match="does not match"):
        Verifier([k1.public]).check(forged)


def test_unsigned_and_untrusted_records_are_refused(keys):
    k1, k2 = keys
    v = Verifier([k1.public])
    with pytest.raises(SignatureError, match="unsigned"):
        v.check(record())
    with pytest.raises(SignatureError, match="untrusted"):
        v.check(k2.sign(record()))
    assert v.rejected == 2


def test_manifests_are_signed_over_their_tokens(keys):
    k1, _ = keys
    m = k1.sign(Manifest(namespace="public", name="doc", model_id=M, addresses=[A1], tokens=3, chunk_tokens=256,
                         prefix_tokens=[1, 2, 3]))
    v = Verifier([k1.public])
    assert v.ok(Manifest.unpack(m.pack()))
    assert not v.ok(dataclasses.replace(m, prefix_tokens=[1, 2, 4]))  # a prompt built from it would never hit


def test_a_manifests_version_and_time_are_signed(keys):
    k1, _ = keys
    m = k1.sign(Manifest(namespace="public", name="doc", model_id=M, addresses=[A1], tokens=3, chunk_tokens=256,
                         prefix_tokens=[1, 2, 3], version=7, created=1000.0))
    v = Verifier([k1.public])
    assert v.ok(Manifest.unpack(m.pack()))
    for change in (dict(version=8), dict(version=0), dict(created=2000.0)):
        assert not v.ok(dataclasses.replace(m, **change)), change  # a replay cannot pass as a newer one
    tomb = k1.sign(dataclasses.replace(m.tombstone(), version=8))
    assert v.ok(Manifest.unpack(tomb.pack())) and not v.ok(dataclasses.replace(tomb, deleted=False))
    with pytest.raises(InvalidInput, match="tombstone"):
        dataclasses.replace(m, deleted=True)  # a tombstone names nothing


async def test_manifest_versions_rise_and_a_planted_one_does_not_count(registry, keys):
    k1, _ = keys
    registry.signer = k1
    doc = Manifest(namespace="public", name="doc", model_id=M, addresses=[A1], tokens=3, chunk_tokens=256,
                   prefix_tokens=[1, 2, 3])
    await registry.put_manifest(doc)
    first = await registry.get_manifest("public", "doc")
    await registry.put_manifest(doc)
    second = await registry.get_manifest("public", "doc")
    assert Verifier([k1.public]).ok(second) and second.version > first.version > 0
    # A registry writer plants an unsigned manifest at a huge version: the origin's next one is not pushed
    # past it (its own, signed, versions stay the publish time in ms).
    signer, registry.signer = registry.signer, None
    try:
        await registry._put(registry._manifest_key("public", "doc"),
                            dataclasses.replace(second, version=(1 << 62), sig={}).pack())
    finally:
        registry.signer = signer
    await registry.put_manifest(doc)
    third = await registry.get_manifest("public", "doc")
    assert second.version < third.version < 1 << 50
    await registry.delete_manifest("public", "doc")
    await registry.put_manifest(doc)  # a re-publish after a delete still rises (the publish time)
    assert (await registry.get_manifest("public", "doc")).version > third.version


def test_rotation_and_revocation(keys):
    k1, k2 = keys
    old, new = k1.sign(record()), k2.sign(record(address=A2))
    both = Verifier([k1.public, k2.public])  # rotation: trust the new key beside the old one
    assert both.ok(old) and both.ok(new)
    revoked = Verifier([k2.public])  # revocation: drop the old key
    assert not revoked.ok(old) and revoked.ok(new)


def test_bad_keys_fail_in_one_line(tmp_path, keys):
    k1, _ = keys
    with pytest.raises(InvalidInput, match="never overwritten"):
        Signer.generate(tmp_path / "k1")
    (tmp_path / "k1").chmod(0o644)
    with pytest.raises(InvalidInput, match="readable by others"):
        Signer.load(tmp_path / "k1")
    with pytest.raises(InvalidInput, match="ed25519:"):
        Verifier(["not-a-key"])
    keyfile = tmp_path / "trusted"
    keyfile.write_text(f"# the origin's key\n{k1.public}\n\n")
    assert Verifier.from_file(keyfile).ok(k1.sign(record()))


async def test_the_registry_signs_what_it_stores_merged(registry, keys):
    """A re-publish merges encodings and a tail is added later: the stored record is signed as stored."""
    k1, _ = keys
    registry.signer = k1
    v = Verifier([k1.public])
    await registry.put_objects([record()])
    await registry.put_objects([record(encodings={"raw": Encoding("raw", 4000, D2)})])
    await registry.add_tail(A1, 17, A2)
    rec = await registry.get_object(A1)
    assert set(rec.encodings) == {"zstd", "raw"} and rec.tails == {17: A2}
    assert v.ok(rec)
    await registry.put_manifest(Manifest(namespace="public", name="doc", model_id=M, addresses=[A1], tokens=256,
                                         chunk_tokens=256, prefix_tokens=list(range(256))))
    assert v.ok(await registry.get_manifest("public", "doc"))


# --- a registry writer cannot get its digest signed (issue #28, item 1) ------------------------------------


async def _plant(registry, rec: ObjectRecord) -> None:
    """Write a record as a registry writer would: raw, under the origin's key prefix, no signer involved."""
    signer, registry.signer = registry.signer, None
    try:
        await registry._put(registry._object_key(rec.address), rec.pack())
    finally:
        registry.signer = signer


@pytest.mark.parametrize("sig", ["dropped", "kept"])
async def test_a_planted_digest_is_not_signed_by_a_republish(registry, keys, sig):
    """The attack: rewrite a signed record's digest (unsigned, or its signature kept), then wait for the
    origin's next ordinary re-publish. The origin once merged the stored record into its own and signed the
    forged digest."""
    k1, _ = keys
    registry.signer = k1
    v = Verifier([k1.public])
    await registry.put_objects([record()])
    stored = await registry.get_object(A1)
    await _plant(registry, dataclasses.replace(stored, encodings={"zstd": Encoding("zstd", 66, D2)},
                                               sig=stored.sig if sig == "kept" else {}))
    assert not v.ok(await registry.get_object(A1))  # consumers already refuse it as planted
    await registry.put_objects([record()])  # the re-publish (idempotent; also the key-rotation step)
    rec = await registry.get_object(A1)
    assert v.ok(rec) and rec.encodings == {"zstd": Encoding("zstd", 1000, D1)}


async def test_a_record_planted_before_the_first_publish_adds_nothing_signed(registry, keys):
    """A text known in advance: its address is computable, so a writer plants a record with an extra forged
    encoding (and a tail of its choosing) before the origin first publishes it."""
    k1, _ = keys
    registry.signer = k1
    v = Verifier([k1.public])
    await _plant(registry, record(encodings={"zstd": Encoding("zstd", 1000, D1), "raw": Encoding("raw", 5, D2)},
                                  tails={17: A2}))
    await registry.put_objects([record()])
    rec = await registry.get_object(A1)
    assert v.ok(rec) and set(rec.encodings) == {"zstd"} and rec.tails == {}


async def test_a_tail_on_a_planted_record_is_refused(registry, keys):
    """add_tail signs the parent record it changes: on a record this origin did not sign it signs nothing."""
    k1, k2 = keys
    registry.signer = k1
    await _plant(registry, k2.sign(record(encodings={"zstd": Encoding("zstd", 66, D2)})))
    assert await registry.add_tail(A1, 17, A2) is None
    rec = await registry.get_object(A1)
    assert rec.tails == {} and rec.sig["key"] == k2.key_id  # left as planted, not re-signed by k1


async def test_the_writer_s_own_digest_wins_over_a_stored_one(registry):
    """Without a signer too: where both name an encoding, the record written now is what the writer holds."""
    await registry.put_objects([record(encodings={"zstd": Encoding("zstd", 66, D2), "raw": Encoding("raw", 5, D2)})])
    await registry.put_objects([record()])
    rec = await registry.get_object(A1)
    assert rec.encodings == {"zstd": Encoding("zstd", 1000, D1), "raw": Encoding("raw", 5, D2)}
