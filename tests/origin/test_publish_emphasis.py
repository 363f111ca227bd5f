"""Publishing with an emphasis map: operator texts and spans resolved to token spans, hostile fields refused,
and the map stored with the manifest, signed, end to end through a running origin and its registry."""

from __future__ import annotations

import pytest

from kdn.adapters.hf import ByteTokenizer
from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput
from kdn.origin.publish import parse_request
from kdn.registry import Manifest
from origin_records import open_records  # bench/lib/origin_records.py
from kdn.registry.signing import Signer, Verifier

from origin_helpers import publish, running_origin

TOK = ByteTokenizer()
DOC = "Plain words come first. The vault code is 4417-K. Then more plain words follow, and the code 4417-K again."


def parse(emphasis, text: str | None = DOC, **kw):
    body = {"name": "doc", "emphasis": emphasis, **kw}
    if text is not None:
        body["text"] = text
    return parse_request(body, tokenizer=TOK, vocab_size=TOK.vocab_size, max_tokens=4096)


def test_texts_become_token_spans_of_every_occurrence():
    spec = parse({"texts": ["4417-K"]}, prefix_text="Context: ")
    head = len("Context: ")
    m = spec.emphasis
    assert m is not None and m.region == (head, head + len(DOC)) and m.source == "operator" and not m.default_on
    first, second = DOC.index("4417-K"), DOC.rindex("4417-K")
    assert m.spans == ((head + first, head + first + 6), (head + second, head + second + 6))
    for s, e in m.spans:
        assert TOK.decode(spec.tokens[s:e]) == "4417-K"


def test_spans_count_from_the_document_and_merge_with_texts():
    spec = parse({"spans": [[0, 5], [3, 9]], "texts": ["vault"], "alpha": 0.2, "default_on": True,
                  "heads": [[1, 0]]}, prefix_text="ab")
    m = spec.emphasis
    at = DOC.index("vault")
    assert m.spans == ((2, 11), (2 + at, 2 + at + 5)) and m.alpha == 0.2 and m.default_on and m.heads == ((1, 0),)


def test_a_smollm2_style_tokenizer_maps_texts_through_its_offsets():
    pytest.importorskip("transformers")
    from kdn.origin.publish import emphasis_spans_of_texts, token_char_ends

    class Fast:  # what a fast HF tokenizer answers: offsets per token
        def __call__(self, text, **kw):
            words = text.split(" ")
            ids, offs, at = [], [], 0
            for w in words:
                ids.append(len(w))
                offs.append((at, at + len(w)))
                at += len(w) + 1
            return {"input_ids": ids, "offset_mapping": offs}

    text = "alpha beta gamma delta"
    ids = Fast()(text)["input_ids"]
    assert token_char_ends(Fast(), text, ids) == [5, 10, 16, 22]
    assert emphasis_spans_of_texts(Fast(), text, ids, ["ta gam"]) == [(1, 3)]


@pytest.mark.parametrize("emphasis, match", [
    ([], "must be a map"),
    ({}, "must be a map"),
    ({"probes": ["x" * 600]}, "at most 512"),
    ({"probes": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"probes": [""]}, "non-empty"),
    ("4417-K", "must be a map"),
    ({"texts": []}, "marks nothing"),
    ({"texts": ["not in the document"]}, "does not occur"),
    ({"texts": [""]}, "non-empty strings"),
    ({"texts": [3]}, "non-empty strings"),
    ({"texts": ["x" * 5000]}, "non-empty strings"),
    ({"texts": ["a"] * 65}, "at most 64"),
    ({"texts": ["o"]}, None),  # fine: "o" occurs often, but fewer than MAX_SPANS times after merging
    ({"texts": [" "]}, "non-empty strings"),
    ({"spans": [[0, 10_000]]}, "document tokens"),
    ({"spans": [[-1, 3]]}, "document tokens"),
    ({"spans": [[3, 3]]}, "document tokens"),
    ({"spans": [[0, 1, 2]]}, "document tokens"),
    ({"spans": [[True, 3]]}, "document tokens"),
    ({"spans": [[i, i + 1] for i in range(300)]}, "at most 256"),
    ({"spans": [[0, 3]], "alpha": 0}, "alpha"),
    ({"spans": [[0, 3]], "alpha": "strong"}, "alpha"),
    ({"spans": [[0, 3]], "heads": [[0, -1]]}, "out of range"),
    ({"spans": [[0, 3]], "default_on": 1}, "bool"),
    ({"spans": [[0, 3]], "region": [0, 5]}, "unknown field"),  # the origin sets the region, not the caller
    ({"spans": [[0, 3]], "source": "probe"}, "unknown field"),
])
def test_hostile_emphasis_fields_are_refused(emphasis, match):
    if match is None:
        assert parse(emphasis).emphasis is not None
        return
    with pytest.raises(InvalidInput, match=match):
        parse(emphasis)


def test_probes_are_tokenized_as_prompt_suffixes():
    spec = parse({"probes": ["Which code?"]})
    assert spec.emphasis.spans == () and spec.emphasis.source == "probe"
    assert spec.probes == (tuple(TOK.encode("\n\nWhich code?\n")),)
    assert parse({"probes": ["Which code?"], "texts": ["vault"]}).emphasis.source == "mixed"


def test_texts_need_the_text_body():
    with pytest.raises(InvalidInput, match="needs the document as 'text'"):
        parse({"texts": ["code"]}, text=None, tokens=[5, 6, 7, 8])
    spec = parse({"spans": [[1, 3]]}, text=None, tokens=[5, 6, 7, 8])
    assert spec.emphasis.spans == ((1, 3),)


async def test_publish_with_emphasis_stores_a_signed_map(tmp_path, etcd_url):
    """publish with texts -> the job's manifest and the registry's carry the map; the origin's signature
    covers it, so a consumer that trusts the key gets it, and a forged map is refused."""
    key = Signer.generate(tmp_path / "origin.key")
    async with running_origin(tmp_path, etcd_url, signing_key=str(tmp_path / "origin.key")) as (server, session):
        job = await publish(session, {"name": "vault", "text": DOC, "emphasis": {"texts": ["4417-K"]}})
        assert job["state"] == "done", job
        assert EmphasisMap.from_dict(job["manifest"]["emphasis"]).n_emphasized == 12
        async with session.get("/v1/registry/manifests/public/vault") as r:
            assert r.status == 200
            served = await r.json()
    reg = open_records(etcd_url, tmp_path / "store")
    try:
        stored = await reg.get_manifest("public", "vault")
    finally:
        await reg.close()
    assert stored is not None and stored.emphasis == job["manifest"]["emphasis"] == served["emphasis"]
    v = Verifier([key.public])
    assert v.ok(stored) and v.ok(Manifest.from_dict(served))
    forged = {**served, "emphasis": {**served["emphasis"], "default_on": True}}
    assert not v.ok(Manifest.from_dict(forged))


async def test_publish_with_probes_adds_the_spans_the_model_attends_to(tmp_path, etcd_url):
    async with running_origin(tmp_path, etcd_url) as (server, session):
        job = await publish(session, {"name": "probed", "text": DOC, "emphasis": {
            "probes": ["What is the vault code?"], "texts": ["vault"], "heads": [[1, 0], [1, 1]]}})
    assert job["state"] == "done", job
    m = EmphasisMap.from_dict(job["manifest"]["emphasis"])
    at = DOC.index("vault")
    assert m.source == "mixed" and m.heads == ((1, 0), (1, 1)) and m.region == (0, len(DOC))
    assert any(s <= at and at + 5 <= e for s, e in m.spans)  # the operator's span is kept ...
    assert m.n_emphasized > 5  # ... and the probe added the 8 positions it attends to most (widened)


async def test_kdn_publish_emphasize(tmp_path, etcd_url, capsys):
    """`kdn publish FILE --emphasize TEXT` end to end: the printed manifest carries the map."""
    import asyncio
    import json

    from kdn.cli import main
    from origin_helpers import PUBLISH_TOKEN

    doc = tmp_path / "vault.md"
    doc.write_text(DOC)
    (tmp_path / "pub-token").write_text(PUBLISH_TOKEN + "\n")
    async with running_origin(tmp_path, etcd_url) as (server, session):
        url = str(server.make_url("")).rstrip("/")
        rc = await asyncio.to_thread(main, ["publish", str(doc), "--origin", url, "--token-file",
                                            str(tmp_path / "pub-token"), "--emphasize", "4417-K",
                                            "--emphasis-alpha", "0.2", "--emphasis-default-on", "--json"])
        assert rc == 0
        m = json.loads(capsys.readouterr().out)
        assert m["name"] == "vault" and m["emphasis"]["alpha"] == 0.2 and m["emphasis"]["default_on"]
        assert len(m["emphasis"]["spans"]) == 2
        rc = await asyncio.to_thread(main, ["publish", str(doc), "--origin", url, "--emphasis-alpha", "0.2"])
        assert rc == 2 and "go with --emphasize" in capsys.readouterr().err


async def test_an_origin_stores_the_scores_signed_and_refuses_heads_its_model_lacks(tmp_path, etcd_url):
    """``question_heads`` -> the manifest's map carries the content-free scores at those heads, covered by the
    origin's signature; a head the model lacks is a 400 before anything is computed."""
    from kdn.adapters.hf.question_map import NULL_QUESTION
    from origin_helpers import PUBLISH_TOKEN

    key = Signer.generate(tmp_path / "origin.key")
    async with running_origin(tmp_path, etcd_url, signing_key=str(tmp_path / "origin.key")) as (server, session):
        job = await publish(session, {"name": "gate", "text": DOC, "emphasis": {"question_heads": [[1, 0], [1, 1]]}})
        assert job["state"] == "done", job
        async with session.get("/v1/registry/manifests/public/gate") as r:
            served = await r.json()
        async with session.post("/v1/publish", json={"name": "far", "text": DOC,
                                                     "emphasis": {"question_heads": [[99, 0]]}},
                                headers={"Authorization": f"Bearer {PUBLISH_TOKEN}"}) as r:
            assert r.status == 400 and "not in this model" in (await r.json())["detail"]
    m = EmphasisMap.from_dict(served["emphasis"])
    assert m.baseline is not None and m.baseline.heads == ((1, 0), (1, 1)) and len(m.baseline.sentences) == 3
    assert list(m.baseline.null) == TOK.encode(f"\n\n{NULL_QUESTION}\n")
    v = Verifier([key.public])
    assert v.ok(Manifest.from_dict(served))
    forged = {**served, "emphasis": {**served["emphasis"], "baseline": {
        **served["emphasis"]["baseline"], "scores": [0.0] * len(m.baseline.scores)}}}
    assert not v.ok(Manifest.from_dict(forged))
