"""Content addresses: published test vectors pin the canonical encoding; properties pin the semantics."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdn.format import address as A
from kdn.errors import InvalidAddress, InvalidInput

M = A.ModelId("ab" * 32)
M2 = A.ModelId("cd" * 32)

# --- published test vectors (README "Content address"): changing any of these
# --- changes every address ever published, so they must never move.


def test_vector_model_id():
    mid = A.model_id(
        architecture="LlamaForCausalLM",
        dtype="bfloat16",
        config_fields={"num_hidden_layers": 2, "hidden_size": 64},
        weights_digest="00" * 32,
        tokenizer_digest="11" * 32,
    )
    assert mid == "e824968a54a7459f40db5259ffd377101213924b4ff9f44a2f7b56a79cf1ccee"


def test_vector_first_address():
    assert A.first_address(M, "public", [1, 2, 3]) == "f61ab95823e6712b3a7e6d752c2c0e4d1590bb732028644d9368bfe011a8d063"


def test_vector_prefix_chain_with_partial_tail():
    assert A.prefix_addresses(M, "public", list(range(10)), 4) == [
        "dbd7bfe38fb27508d91ab98af6c985d55efd64d00d50ae915dde1fda02379db0",
        "481b602b788325656567942225eba93b55d14fc4caff8c28740e8f3012e567a0",
        "6cfa56b516990a0bff19256d60eacceac80ec5ed698b2cd6cdb045853cd09669",
    ]


def test_vector_standalone():
    assert A.standalone_address(M, "public", [1, 2, 3]) == "8ae5f0bda5be2bb297ecb93e3af6a5936a1b893e4c8564b8b591e4d393f26f52"


def test_vector_blob_digest_of_empty_blob_is_blake3_of_nothing():
    assert A.blob_digest(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


# --- the chain is what the contract says it is


def test_chain_matches_first_and_next():
    toks = list(range(100, 110))
    chain = A.prefix_addresses(M, "public", toks, 4)
    a0 = A.first_address(M, "public", toks[0:4])
    a1 = A.next_address(a0, toks[4:8])
    a2 = A.next_address(a1, toks[8:10])
    assert chain == [a0, a1, a2]


def test_full_chunks_only_drops_partial_tail():
    assert len(A.prefix_addresses(M, "public", list(range(10)), 4, full_chunks_only=True)) == 2
    assert len(A.prefix_addresses(M, "public", list(range(8)), 4, full_chunks_only=True)) == 2


def test_numpy_torch_and_list_inputs_agree():
    torch = pytest.importorskip("torch")
    toks = list(range(1000, 1600))
    ref = A.prefix_addresses(M, "ns1", toks, 256)
    assert A.prefix_addresses(M, "ns1", np.array(toks, dtype=np.int64), 256) == ref
    assert A.prefix_addresses(M, "ns1", np.array(toks, dtype=np.uint32), 256) == ref
    assert A.prefix_addresses(M, "ns1", torch.tensor(toks), 256) == ref


def test_partial_chunk_differs_from_full_chunk_with_same_start():
    # "text" and "text + more" share no address for the chunk they both touch
    # unless the chunk's tokens are identical in full.
    a = A.prefix_addresses(M, "public", list(range(6)), 4)
    b = A.prefix_addresses(M, "public", list(range(8)), 4)
    assert a[0] == b[0] and a[1] != b[1]


# --- properties

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(tokens, tokens, st.integers(min_value=1, max_value=8))
def test_shared_prefix_iff_shared_address(x, y, c):
    ax = A.prefix_addresses(M, "public", x, c)
    ay = A.prefix_addresses(M, "public", y, c)
    for i in range(min(len(ax), len(ay))):
        same_tokens = x[: (i + 1) * c] == y[: (i + 1) * c]
        assert (ax[i] == ay[i]) == same_tokens


@settings(max_examples=100, deadline=None)
@given(tokens)
def test_namespace_or_model_change_changes_every_address(x):
    base = A.prefix_addresses(M, "public", x, 4)
    other_ns = A.prefix_addresses(M, "tenant-a", x, 4)
    other_model = A.prefix_addresses(M2, "public", x, 4)
    assert not set(base) & set(other_ns)
    assert not set(base) & set(other_model)
    assert A.standalone_address(M, "public", x) != A.standalone_address(M, "tenant-a", x)
    assert A.standalone_address(M, "public", x) != A.standalone_address(M2, "public", x)


@settings(max_examples=100, deadline=None)
@given(tokens)
def test_standalone_is_position_independent_and_distinct_from_prefix(x):
    assert A.standalone_address(M, "public", x) == A.standalone_address(M, "public", list(x))
    assert A.standalone_address(M, "public", x) != A.first_address(M, "public", x)


def test_model_id_changes_with_each_field():
    base = dict(architecture="X", dtype="bfloat16", config_fields={"a": 1}, weights_digest="w", tokenizer_digest="t")
    ref = A.model_id(**base)
    for k, v in [("architecture", "Y"), ("dtype", "float32"), ("config_fields", {"a": 2}), ("weights_digest", "w2"), ("tokenizer_digest", "t2")]:
        assert A.model_id(**{**base, k: v}) != ref, k
    # field order inside the config does not matter (canonical JSON)
    assert A.model_id(**{**base, "config_fields": {"b": 1, "a": 1}}) == A.model_id(**{**base, "config_fields": {"a": 1, "b": 1}})


# --- validation at the boundary


@pytest.mark.parametrize(
    "bad",
    ["", "AB" * 32, "ab" * 31, "ab" * 33, "../" + "a" * 61, "g" * 64, None, 42, "ab" * 32 + "\n", b"ab" * 32],
)
def test_invalid_addresses_are_rejected(bad):
    with pytest.raises(InvalidAddress):
        A.validate_address(bad)


def test_invalid_address_message_is_short_and_escaped():
    with pytest.raises(InvalidAddress) as e:
        A.validate_address("\x1b[31m" + "x" * 5000)
    assert len(str(e.value)) < 120 and "\x1b" not in str(e.value)


@pytest.mark.parametrize("bad", ["", "Public", "a/b", "..", "-x", "a" * 64, "a b", None])
def test_invalid_namespaces_are_rejected(bad):
    with pytest.raises(InvalidInput):
        A.validate_namespace(bad)


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "a" * 129, "x\x00"])
def test_invalid_names_are_rejected(bad):
    with pytest.raises(InvalidInput):
        A.validate_name(bad)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], np.array([[1, 2]]), np.array([-3])])
def test_invalid_token_ids_are_rejected(bad):
    with pytest.raises(InvalidInput):
        A.prefix_addresses(M, "public", bad)


def test_chunk_spans():
    assert A.chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert A.chunk_spans(0, 4) == []
    with pytest.raises(InvalidInput):
        A.chunk_spans(10, 0)
