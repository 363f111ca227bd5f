"""A client remembers object records that verified, by their exact content, and checks nothing else less.

The memo exists for speed (a hot chain's records are checked on every lookup: bench/lookup.py); these tests
hold the safety: a changed byte, another address, or a key no longer trusted all get the full check."""

from __future__ import annotations

import secrets

import pytest

from kdn.client import trust as trust_mod
from kdn.registry.records import Encoding, ObjectRecord
from kdn.registry.signing import Signer
from kdn.client.trust import Trust


def _record(signer: Signer, start: int = 0) -> dict:
    enc = Encoding("raw", 3 << 20, secrets.token_hex(32), 1 << 20, tuple(secrets.token_hex(32) for _ in range(3)))
    rec = ObjectRecord(address=secrets.token_hex(32), model_id=secrets.token_hex(32), namespace="public", kind="kv",
                       start=start, end=start + 256, parent=None, standalone=False, encodings={"raw": enc},
                       origin="http://127.0.0.1:1", tails={}, created=0.0, engine="transformers")
    return signer.sign(rec).to_dict()


@pytest.fixture
def signer(tmp_path):
    return Signer.generate(tmp_path / "origin.key")


def test_a_record_verified_once_is_taken_again_and_a_changed_copy_is_still_refused(signer):
    t = Trust([signer.public])
    d = _record(signer)
    first = t.record(d, d["address"])
    assert first == ObjectRecord.from_dict(d) and t.record(dict(d), d["address"]) is first
    forged = {**d, "encodings": {"raw": {**d["encodings"]["raw"], "digest": "0" * 64}}}
    assert t.record(forged, d["address"]) is None and t.rejected == 1  # the signature no longer covers it
    assert t.record(d, "f" * 64) is None and t.rejected == 2  # the same record offered for another address


def test_a_key_no_longer_trusted_unverifies_what_it_signed(signer, tmp_path):
    t = Trust([signer.public])
    d = _record(signer)
    assert t.record(d, d["address"]) is not None
    t.verifier.keys.clear()  # the key dropped from the trusted set (a revocation)
    assert t.record(d, d["address"]) is None and t.rejected == 1
    other = Signer.generate(tmp_path / "other.key")
    t.verifier.keys.update(Trust([other.public]).verifier.keys)
    assert t.record(d, d["address"]) is None and t.rejected == 2


def test_the_memo_is_bounded(signer, monkeypatch):
    monkeypatch.setattr(trust_mod, "VERIFIED_MEMO", 4)
    t = Trust([signer.public])
    recs = [_record(signer, 256 * i) for i in range(10)]
    for d in recs:
        assert t.record(d, d["address"]) is not None
    assert len(t._verified) == 4
    assert all(t.record(d, d["address"]) is not None for d in recs) and t.rejected == 0


def test_without_keys_nothing_is_remembered(signer):
    t = Trust()
    d = _record(signer)
    assert t.record(d, d["address"]) == ObjectRecord.from_dict(d) and not t._verified
