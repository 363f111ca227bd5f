"""Emphasis maps: strict bounds on what arrives over the network, and the manifest signature covering them."""

from __future__ import annotations

import dataclasses

import pytest

from kdn.emphasis import MAX_HEADS, MAX_SPANS, EmphasisMap, merge_spans
from kdn.errors import InvalidInput
from kdn.registry import Manifest
from kdn.registry.signing import SignatureError, Signer, Verifier, payload

M = "ab" * 32
A1 = "11" * 32
GOOD = {"v": 1, "spans": [[10, 20], [30, 31]], "region": [5, 90], "alpha": 0.05, "heads": [[3, 1], [4, 0]],
        "default_on": False, "source": "operator"}


def manifest(**kw) -> Manifest:
    base = dict(namespace="public", name="doc", model_id=M, addresses=[A1], tokens=100, chunk_tokens=256,
                prefix_tokens=list(range(100)), head_tokens=5, emphasis=GOOD)
    return Manifest(**{**base, **kw})


def test_a_map_round_trips_in_its_canonical_form():
    m = EmphasisMap.from_dict(GOOD, n_tokens=100)
    assert m.to_dict() == GOOD
    assert m.spans == ((10, 20), (30, 31)) and m.n_emphasized == 11
    assert EmphasisMap.from_dict({"spans": [], "region": [0, 1]}).to_dict()["alpha"] == 0.05  # defaults filled
    assert m.shifted(7).spans == ((17, 27), (37, 38)) and m.shifted(7).region == (12, 97)


@pytest.mark.parametrize("change, match", [
    ({"spans": [[20, 10]]}, "empty"),
    ({"spans": [[10, 10]]}, "empty"),
    ({"spans": [[10, 20], [15, 25]]}, "overlaps"),
    ({"spans": [[30, 31], [10, 20]]}, "out of order"),
    ({"spans": [[0, 8]]}, "region"),  # before the region
    ({"spans": [[80, 95]]}, "region"),  # past it
    ({"spans": [[True, 20]]}, "pair of ints"),
    ({"spans": [[1.5, 20]]}, "pair of ints"),
    ({"spans": [[1, 2, 3]]}, "pair of ints"),
    ({"spans": "10-20"}, "list"),
    ({"spans": [[i, i + 1] for i in range(5, 5 + MAX_SPANS + 1)], "region": [5, 5000]}, "at most"),
    ({"region": [5, 101]}, "published tokens"),
    ({"region": [-1, 50]}, "region"),
    ({"region": [50, 50]}, "region"),
    ({"region": None}, "pair"),
    ({"alpha": 0}, "alpha"),
    ({"alpha": 1.5}, "alpha"),
    ({"alpha": float("nan")}, "alpha"),
    ({"alpha": float("inf")}, "alpha"),
    ({"alpha": "0.1"}, "alpha"),
    ({"alpha": True}, "alpha"),
    ({"heads": [[-1, 0]]}, "out of range"),
    ({"heads": [[0, 1 << 40]]}, "out of range"),
    ({"heads": [[1, 1], [1, 1]]}, "twice"),
    ({"heads": [[0, h] for h in range(MAX_HEADS + 1)]}, "at most"),
    ({"default_on": "yes"}, "bool"),
    ({"source": "edge"}, "source"),
    ({"v": 2}, "version"),
    ({"evil": 1}, "unknown"),
    ({f"k{i}": 1 for i in range(40)}, "at most 16 keys"),
])
def test_hostile_maps_are_refused(change, match):
    with pytest.raises(InvalidInput, match=match):
        EmphasisMap.from_dict({**GOOD, **change}, n_tokens=100)
    with pytest.raises(InvalidInput):  # and a manifest carrying one cannot be built (nor read from the registry)
        manifest(emphasis={**GOOD, **change})


@pytest.mark.parametrize("bad", [None, [], "x", 3])
def test_a_map_is_a_map(bad):
    with pytest.raises(InvalidInput, match="must be a map"):
        EmphasisMap.from_dict(bad)


def test_merge_spans_clips_sorts_and_merges():
    assert merge_spans([(20, 30), (0, 12), (10, 15), (30, 31), (90, 120)], 5, 100) == ((5, 15), (20, 31), (90, 100))
    with pytest.raises(InvalidInput, match="at most"):
        merge_spans([(2 * i, 2 * i + 1) for i in range(MAX_SPANS + 1)], 0, 10_000)


def test_a_manifest_keeps_its_map_through_the_registry_encoding():
    m = manifest()
    again = Manifest.unpack(m.pack())
    assert again.emphasis == GOOD and again.emphasis_map == EmphasisMap.from_dict(GOOD)
    assert Manifest.from_dict({k: v for k, v in m.to_dict().items() if k != "emphasis"}).emphasis is None


@pytest.fixture
def key(tmp_path):
    return Signer.generate(tmp_path / "k")


@pytest.mark.parametrize("change", [
    {"spans": [[10, 21], [30, 31]]},  # a span moved
    {"spans": [[10, 20]]},  # a span dropped
    {"alpha": 0.001},  # a harder bias
    {"default_on": True},  # steering forced on
    {"heads": [[3, 1]]},
    {"region": [5, 99]},
    {"source": "probe"},
])
def test_the_signature_covers_the_map(key, change):
    signed = key.sign(manifest())
    v = Verifier([key.public])
    assert v.ok(Manifest.unpack(signed.pack()))
    forged = dataclasses.replace(signed, emphasis={**GOOD, **change})
    with pytest.raises(SignatureError, match="does not match"):
        v.check(forged)


def test_adding_or_removing_a_map_breaks_the_signature(key):
    v = Verifier([key.public])
    with_map, without = key.sign(manifest()), key.sign(manifest(emphasis=None))
    assert v.ok(with_map) and v.ok(without)
    assert not v.ok(dataclasses.replace(with_map, emphasis=None))
    assert not v.ok(dataclasses.replace(without, emphasis=GOOD))


def test_manifests_without_a_map_sign_as_before():
    """Manifests signed before maps existed still verify: their payload has no emphasis key."""
    assert b"emphasis" not in payload(manifest(emphasis=None))
    assert b'"emphasis":{"alpha":0.05' in payload(manifest())
