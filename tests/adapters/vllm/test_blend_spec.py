"""A blend request's parameters, checked at the boundary (``kdn.adapters.vllm.blend.spec_of``), and its prompt."""

from __future__ import annotations

import pytest

from kdn.errors import InvalidInput


def spec(blend, n_ids: int = 1000, salt: str | None = "auto", **extra):
    from kdn.adapters.vllm.blend import BlendSpec, spec_of

    if salt == "auto":
        try:
            salt = BlendSpec(tuple(tuple(d) for d in blend["documents"]), float(blend.get("ratio", 0.15)),
                             blend.get("selection", "deviation-query"), blend.get("check_layer", 1)).salt
        except (TypeError, KeyError, ValueError):
            salt = ""
    return spec_of({"blend": blend, **extra}, n_ids=n_ids, n_layers=30, cache_salt=salt)


def test_blend_params_round_trip_through_the_check():
    from kdn.adapters.vllm.blend import blend_params, spec_of

    kdn, salt = blend_params([(10, 300), (300, 620)], ratio=0.12, check_layer=2)
    got = spec_of(kdn, n_ids=700, n_layers=30, cache_salt="tenant-7:" + salt)
    assert got.documents == ((10, 300), (300, 620)) and got.ratio == 0.12 and got.check_layer == 2
    assert got.salt == salt and salt != blend_params([(10, 300)], ratio=0.15)[1]  # a ratio of its own
    assert blend_params([(0, 5)])[1] == blend_params([(7, 90)])[1]  # the spans do not name the salt


@pytest.mark.parametrize("blend, why", [
    ({"documents": []}, "documents"),
    ({"documents": [[5, 2]]}, "not inside"),
    ({"documents": [[0, 1001]]}, "not inside"),
    ({"documents": [[0, 10], [5, 20]]}, "after the last"),
    ({"documents": [[0, "9"]]}, "integers"),
    ({"documents": [[0, 10]], "ratio": 1.5}, "ratio"),
    ({"documents": [[0, 10]], "ratio": True}, "ratio"),
    ({"documents": [[0, 10]], "selection": "magic"}, "selection"),
    ({"documents": [[0, 10]], "check_layer": 30}, "check_layer"),
    ({"documents": [[0, 10]], "check_layer": 0}, "check_layer >= 1"),
    ({"documents": [[0, 10]], "extra": 1}, "unknown"),
    ({"documents": [[i, i + 1] for i in range(65)]}, "documents"),
])
def test_a_bad_blend_is_refused_naming_what_is_wrong(blend, why):
    with pytest.raises(InvalidInput, match=why):
        spec(blend)


def test_a_blend_needs_its_salt_and_does_not_steer():
    with pytest.raises(InvalidInput, match="cache_salt"):
        spec({"documents": [[0, 10]]}, salt=None)
    with pytest.raises(InvalidInput, match="cache_salt"):
        spec({"documents": [[0, 10]]}, salt="kdn-blend-000000000000")
    with pytest.raises(InvalidInput, match="not both"):
        spec({"documents": [[0, 10]]}, steer=True)
    assert spec({"documents": [[0, 10]], "check_layer": 0, "ratio": 0.0}).ratio == 0.0  # nothing checked


def test_rag_prompt_places_each_document_as_tokenized_alone():
    from kdn.adapters.hf.models import ByteTokenizer
    from kdn.adapters.vllm.blend import rag_prompt
    from kdn.template import encode_text

    tok = ByteTokenizer()
    docs = ["the keeper relit the lamp", "ships passed the rocks at night"]
    ids, spans = rag_prompt(tok, "Who relit the lamp?", docs, system="Answer briefly.")
    assert [ids[s:e] for s, e in spans] == [encode_text(tok, d) for d in docs]
    assert spans[0][0] > 0 and spans[1][0] == spans[0][1] and spans[1][1] < len(ids)
    with pytest.raises(InvalidInput, match="at least one"):
        rag_prompt(tok, "q", [])
    with pytest.raises(InvalidInput, match="empty"):
        rag_prompt(tok, "q", [""])
