"""Page keys as addresses: published vectors, tenants apart, shards apart, never the key itself."""

from __future__ import annotations

import pytest
from blake3 import blake3

from kdn.adapters.sglang.keys import derived_model_id, page_address, shard_of
from kdn.errors import InvalidInput

MID = "ab" * 32
KEY = "9f" * 32  # SGLang's page hashes are 64 hex characters


VECTORS = {
    "public": "bf969f8d330a511b327db1cd516e19d7d0fde2433aa9de106c15230087bb07e6",
    "acme": "a59d089469090005a92fcc1ebf314ce006ba86774a2f091c6c47b92ffa30e45d",
}


def test_vectors():
    assert {ns: page_address(MID, ns, "heads all", KEY) for ns in VECTORS} == VECTORS


def test_encoding_as_documented():
    def s(x: str) -> bytes:
        return len(x.encode()).to_bytes(2, "little") + x.encode()

    want = blake3(b"kdn/sglang-page/v1\0" + bytes.fromhex(MID) + s("acme") + s("heads 0/2") + s(KEY)).hexdigest()
    assert page_address(MID, "acme", "heads 0/2", KEY) == want


def test_namespaces_and_shards_apart():
    a = page_address(MID, "acme", "heads all", KEY)
    assert a != page_address(MID, "beta", "heads all", KEY)
    assert a != page_address(MID, "acme", "heads 0/2", KEY) != page_address(MID, "acme", "heads 1/2", KEY)
    assert a != KEY and KEY not in a


def test_shard_names():
    assert shard_of(mla=True, tp_rank=1, tp_size=4, pp_rank=0, pp_size=1) == "heads all"
    assert shard_of(mla=False, tp_rank=1, tp_size=4, pp_rank=0, pp_size=1) == "heads 1/4"
    assert shard_of(mla=False, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2) == "heads all layers 1/2"


def test_bad_keys_and_names():
    with pytest.raises(InvalidInput):
        page_address(MID, "acme", "heads all", "")
    with pytest.raises(InvalidInput):
        page_address(MID, "acme", "heads all", "x" * 2000)
    with pytest.raises(InvalidInput):
        derived_model_id(None, "bfloat16", {"layers": 2})
    assert derived_model_id("m", "bfloat16", {"layers": 2}) != derived_model_id("m", "bfloat16", {"layers": 3})
