"""LMCache's object keys as addresses: published vectors, tenants apart, ranks, groups and salts apart."""

from __future__ import annotations

import pytest
from blake3 import blake3

from kdn.adapters.keyed import keyed_address
from kdn.adapters.lmcache.keys import chunk_address, derived_model_id, key_text, shard_of
from kdn.adapters.sglang.keys import page_address
from kdn.errors import InvalidInput

MID = "ab" * 32
HASH = bytes.fromhex("9f" * 32)

VECTORS = {
    "public": "7aa10590db3445c62d9ea7ad28cb8d9b623e0ad0bc5b3c96f1b43883413006fd",
    "acme": "f56d0b2905f356c067f2a6d249fe22f0e713f7f7e76ef92316b2670e0bf0e457",
}


def test_vectors():
    assert {ns: chunk_address(MID, ns, chunk_hash=HASH, kv_rank=0) for ns in VECTORS} == VECTORS


def test_encoding_as_documented():
    def s(x: str) -> bytes:
        return len(x.encode()).to_bytes(2, "little") + x.encode()

    want = blake3(b"kdn/lmcache-chunk/v1\0" + bytes.fromhex(MID) + s("acme") + s("kv_rank 1a group 2")
                  + s("9f" * 32 + "@user-7")).hexdigest()
    assert chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=0x1A, object_group_id=2, cache_salt="user-7") == want


def test_namespaces_ranks_groups_salts_apart():
    a = chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=0)
    others = [chunk_address(MID, "beta", chunk_hash=HASH, kv_rank=0),
              chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=1),
              chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=0, object_group_id=1),
              chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=0, cache_salt="u"),
              chunk_address("cd" * 32, "acme", chunk_hash=HASH, kv_rank=0)]
    assert len({a, *others}) == 6 and HASH.hex() not in a
    # the same key text under SGLang's scheme is another address: schemes never meet
    assert keyed_address("sglang-page", MID, "acme", shard_of(0, 0), key_text(HASH)) != a
    assert page_address(MID, "acme", shard_of(0, 0), key_text(HASH)) != a


def test_bad_keys_and_names():
    for bad in (b"", b"x" * 257, "9f" * 32):
        with pytest.raises(InvalidInput):
            chunk_address(MID, "acme", chunk_hash=bad, kv_rank=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=-1)
    with pytest.raises(InvalidInput):
        chunk_address(MID, "acme", chunk_hash=HASH, kv_rank=0, cache_salt="a@b")
    with pytest.raises(InvalidInput):
        keyed_address("kdn-prefix", MID, "acme", "", "k")  # only the known schemes: never a prefix tag
    with pytest.raises(InvalidInput):
        derived_model_id("")
    assert derived_model_id("org/a") != derived_model_id("org/b")
