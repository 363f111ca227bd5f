"""Reuse across edited text (adapters/hf/edits.py): alignment, and the new version prefilled from the old one's
published prefix states (tiny llama, random init; states from a real chunked prefill, served as real objects)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kdn.format import address as A
from kdn.adapters.hf import extract_chunks, load_model
from kdn.adapters.hf.edits import (EditPlan, Match, align, edit_blend, edit_prefill, edit_segments, generate_edited,
                                   plan_edit)
from kdn.adapters.hf.rag import full_prefill
from kdn.errors import InvalidInput, ModelMismatch
from kdn.kernels.blend import n_select
from kdn.kernels.rope import rope_shift
from kdn.client.lookup import Fetched
from kdn.format.objects import encode_object, from_torch

C = 64  # chunk tokens: several chunks on a short document, cheap on the tiny model
_LM: list = []


def lm():
    if not _LM:
        _LM.append(load_model("tiny-llama", dtype=torch.float32))
    return _LM[0]


def toks(seed: int, n: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


OLD = toks(1, 300)  # 5 chunks, the last partial
INS = toks(2, 20)
TAIL = toks(3, 7)


def states_of(old: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    return {c.index: c.tensors for c in extract_chunks(lm().model, old, chunk_tokens=C)}


_STATES: dict[tuple, dict] = {}


def old_states() -> dict[int, dict[str, torch.Tensor]]:
    key = tuple(OLD)
    if key not in _STATES:
        _STATES[key] = states_of(OLD)
    return _STATES[key]


# --- alignment --------------------------------------------------------------------------------------

EDITS = {
    # name: (new tokens, expected matches)
    "insert-start": (INS + OLD, [Match(0, 20, 300)]),
    "insert-middle": (OLD[:150] + INS + OLD[150:], [Match(0, 0, 150), Match(150, 170, 150)]),
    "insert-end": (OLD + INS, [Match(0, 0, 300)]),
    "delete-start": (OLD[40:], [Match(40, 0, 260)]),
    "delete-middle": (OLD[:100] + OLD[180:], [Match(0, 0, 100), Match(180, 100, 120)]),
    "delete-end": (OLD[:250], [Match(0, 0, 250)]),
    "replace-start": (INS + OLD[10:], [Match(10, 20, 290)]),
    "replace-middle": (OLD[:130] + INS + OLD[140:], [Match(0, 0, 130), Match(140, 150, 160)]),
    "replace-end": (OLD[:290] + INS, [Match(0, 0, 290)]),
    "two-edits": (OLD[:60] + INS + OLD[60:200] + OLD[230:], [Match(0, 0, 60), Match(60, 80, 140), Match(230, 220, 70)]),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_align_finds_the_runs(name):
    new, want = EDITS[name]
    got = align(OLD, new)
    assert got == want
    for m in got:
        assert OLD[m.old:m.old + m.size] == new[m.new:m.new + m.size]


def test_align_bounds_and_short_runs():
    new = OLD[:100] + INS + OLD[100:110] + INS + OLD[110:]  # a 10-token island between two insertions
    assert align(OLD, new) == [Match(0, 0, 100), Match(110, 150, 190)]  # the island: under min_run
    assert Match(100, 120, 10) in align(OLD, new, min_run=4)
    # a middle over the bound: prefix and suffix only
    assert align(OLD, OLD[:100] + INS + OLD[100:], max_tokens=10) == [Match(0, 0, 100), Match(100, 120, 200)]
    assert align(OLD, OLD[:150] + INS + OLD[150:290] + toks(9, 5), max_tokens=10) == [Match(0, 0, 150)]
    assert align(OLD, toks(7, 200)) == []
    with pytest.raises(InvalidInput):
        align(OLD, OLD, min_run=0)


def test_plan_names_the_chunks_it_reads():
    p = plan_edit(OLD, OLD[:100] + OLD[180:], C)
    assert (p.exact, p.approx) == (100, 120)
    assert p.chunks == [0, 1, 2, 3, 4]
    p = plan_edit(OLD, OLD[:30] + INS, C)  # an edit at the end of the first chunk, the rest deleted
    assert (p.exact, p.approx, p.chunks) == (30, 0, [0])


# --- prefill from the old version's states ---------------------------------------------------------


@pytest.mark.parametrize("name", ["insert-middle", "delete-start", "replace-end", "two-edits"])
def test_ratio_one_is_bit_identical_to_a_full_prefill_of_the_new_version(name):
    m = lm().model
    new, _ = EDITS[name]
    b, r = edit_blend(m, plan_edit(OLD, new, C), old_states(), TAIL, recompute_ratio=1.0, n_logits=len(TAIL))
    ref = full_prefill(m, new + TAIL, n_logits=len(TAIL))
    assert torch.equal(b.logits, ref.logits)
    for i in range(len(b.keys)):
        assert torch.equal(b.keys[i], ref.keys[i]) and torch.equal(b.values[i], ref.values[i])
    assert r.tokens_recomputed == r.tokens_exact + r.tokens_approx  # ratio 1 runs everything


@pytest.mark.parametrize("name", sorted(EDITS))
def test_report_counts_add_up_and_reused_states_are_the_old_ones(name):
    m = lm().model
    new, want = EDITS[name]
    plan = plan_edit(OLD, new, C)
    st = old_states()
    b, r = edit_blend(m, plan, st, TAIL, recompute_ratio=0.15)
    assert r.tokens_total == len(new) + len(TAIL) == b.n_tokens
    assert r.tokens_exact + r.tokens_approx + r.tokens_computed == r.tokens_total
    assert r.tokens_exact == plan.exact and r.tokens_approx == plan.approx
    assert r.tokens_exact + r.tokens_approx == sum(x.size for x in want)
    assert r.tokens_recomputed == n_select(r.tokens_approx, 0.15)
    assert 0 < r.recompute_share < 1 or not r.tokens_approx
    # the exact prefix: the old states as published, never recomputed
    for i in range(len(b.keys)):
        for t in range(plan.exact):
            j, o = divmod(t, C)
            assert torch.equal(b.keys[i][0, :, t], st[j][f"L{i}.k"][:, o])
            assert torch.equal(b.values[i][0, :, t], st[j][f"L{i}.v"][:, o])
    # ratio 0: the reused tokens' keys are the old ones turned by (new - old) positions, values as they were
    b0, _ = edit_blend(m, plan, st, TAIL, recompute_ratio=0.0)
    for x in plan.matches:
        for t in (0, x.size - 1):
            j, o = divmod(x.old + t, C)
            for i in range(len(b0.keys)):
                k = st[j][f"L{i}.k"][:, o:o + 1]
                assert torch.equal(b0.keys[i][0, :, x.new + t:x.new + t + 1], rope_shift(k, x.new - x.old, m))
                assert torch.equal(b0.values[i][0, :, x.new + t], st[j][f"L{i}.v"][:, o])


def test_an_edit_in_the_first_chunk_keeps_its_head_exact_and_shifts_the_rest():
    m = lm().model
    new = OLD[:5] + INS + OLD[12:]
    plan = plan_edit(OLD, new, C)
    assert plan.matches == [Match(0, 0, 5), Match(12, 25, 288)]
    segs = edit_segments(plan, old_states(), TAIL)
    assert [(len(s.ids), s.kv is not None, s.at, s.exact) for s in segs] == [
        (5, True, 0, True), (20, False, 0, False), (52, True, 12, False), (64, True, 64, False),
        (64, True, 128, False), (64, True, 192, False), (44, True, 256, False), (7, False, 0, False)]
    b, r = edit_blend(m, plan, old_states(), TAIL, recompute_ratio=1.0)
    assert torch.equal(b.logits, full_prefill(m, new + TAIL).logits)
    # approximate, and closer to the full prefill than computing the edited text without any context
    b, r = edit_blend(m, plan, old_states(), TAIL, recompute_ratio=0.15)
    assert (r.tokens_exact, r.tokens_approx, r.tokens_computed) == (5, 288, 27)
    ref = torch.log_softmax(full_prefill(m, new + TAIL).logits[-1], -1)
    assert torch.isfinite(b.logits).all()
    kl = torch.nn.functional.kl_div(torch.log_softmax(b.logits[-1], -1), ref, log_target=True, reduction="sum")
    assert kl.item() < 0.5, kl


def test_a_missing_chunk_is_computed():
    m = lm().model
    new, _ = EDITS["insert-middle"]
    st = dict(old_states())
    st[3] = None
    plan = plan_edit(OLD, new, C)
    segs = edit_segments(plan, st, TAIL)
    assert sum(len(s.ids) for s in segs) == len(new) + len(TAIL)
    assert all(not (s.kv is not None and 192 <= s.at < 256) for s in segs)
    b, r = edit_blend(m, plan, st, TAIL, recompute_ratio=1.0)
    assert torch.equal(b.logits, full_prefill(m, new + TAIL).logits)
    assert r.tokens_approx == plan.approx - 64


# --- through a client: published objects, verified ------------------------------------------------------


class ObjectClient:
    """Serves the old version's chain as published objects (``encode_object``, as the origin stores them)."""

    def __init__(self, mid, old, states, *, drop=()):
        self.addrs = A.prefix_addresses(mid, "public", old, C)
        self.blobs = {}
        for j, (s, e) in enumerate(A.chunk_spans(len(old), C)):
            if j in drop:
                continue
            self.blobs[self.addrs[j]] = encode_object(
                kind="kv", address=self.addrs[j], model_id=mid, namespace="public", start=s, end=e, position=s,
                parent=self.addrs[j - 1] if j else None, tensors=from_torch(states[j]), encoding="raw")
        self.fetched: list = []

    async def fetch(self, address):
        from kdn.errors import SourceError

        if address not in self.blobs:
            raise SourceError(f"{address} is not here")
        self.fetched.append(address)
        return Fetched(address=address, encoding="raw", blob=memoryview(self.blobs[address]), source="stub",
                       seconds=0.0)

    async def prepare(self, f):
        return None


def manifest(mid, old, addrs):
    """As ``KDNClient.manifest`` returns it."""
    from kdn.registry.records import Manifest

    return Manifest(namespace="public", name="doc", model_id=mid, addresses=addrs, tokens=len(old), chunk_tokens=C,
                    prefix_tokens=old, template=None, head_tokens=0)


def test_edit_prefill_fetches_only_the_chunks_it_reuses_and_verifies_them():
    L = lm()
    new = OLD[:100] + INS  # the last 200 old tokens deleted: chunks 0 and 1 only
    client = ObjectClient(L.model_id, OLD, old_states())
    man = manifest(L.model_id, OLD, client.addrs)
    out = asyncio.run(edit_prefill(L.model, L.tokenizer, man, new, TAIL, client, recompute_ratio=1.0))
    assert client.fetched == client.addrs[:2]
    assert out.report.chunks_fetched == 2 and out.report.sources == {"stub": 2}
    assert torch.equal(out.first_logits, full_prefill(L.model, new + TAIL).logits[-1].float())
    # another chunk served under an address: refused
    client.blobs[client.addrs[1]] = client.blobs[client.addrs[0]]
    from kdn.errors import DigestMismatch

    with pytest.raises(DigestMismatch):
        asyncio.run(edit_prefill(L.model, L.tokenizer, man, new, TAIL, client))


def test_generate_edited_matches_the_plain_blend_and_reports_missing_chunks():
    L = lm()
    new, _ = EDITS["delete-middle"]
    client = ObjectClient(L.model_id, OLD, old_states(), drop=(2,))
    man = manifest(L.model_id, OLD, client.addrs)
    g = asyncio.run(generate_edited(L.model, L.tokenizer, man, new, TAIL, client, max_new_tokens=3))
    r = g.report
    assert r.missing == [client.addrs[2]] and r.chunks_fetched == 4 and len(g.ids) == 3 == r.new_tokens
    assert r.tokens_exact + r.tokens_approx + r.tokens_computed == r.tokens_total == len(new) + len(TAIL)
    st = dict(old_states())
    st[2] = None
    b, _ = edit_blend(L.model, plan_edit(OLD, new, C), st, TAIL)
    assert torch.equal(g.first_logits, b.logits[-1].float())
    assert r.ttft_ms > 0 and r.line()


def test_bad_input_is_refused():
    L = lm()
    client = ObjectClient(L.model_id, OLD, old_states())
    man = manifest(L.model_id, OLD, client.addrs)
    run = asyncio.run
    with pytest.raises(ModelMismatch):  # another model's states (its map, read into a manifest)
        run(edit_prefill(L.model, L.tokenizer, {**man.to_dict(), "model_id": "ab" * 32}, OLD, TAIL, client))
    with pytest.raises(InvalidInput, match="nothing to reuse"):  # a rewrite, no run in common
        run(edit_prefill(L.model, L.tokenizer, man, toks(8, 200), TAIL, client))
    with pytest.raises(InvalidInput, match="not a manifest"):
        run(edit_prefill(L.model, L.tokenizer, {"prefix_tokens": OLD}, OLD, TAIL, client))
    with pytest.raises(InvalidInput, match="no prefix chain"):
        run(edit_prefill(L.model, L.tokenizer, {**man.to_dict(), "addresses": client.addrs[:2]}, OLD, TAIL, client))
    with pytest.raises(InvalidInput):
        plan_edit(OLD, [], C)
    with pytest.raises(InvalidInput):  # the query must be there to have logits
        edit_blend(L.model, EditPlan(OLD, OLD, C, [Match(0, 0, 300)]), old_states(), [])
    assert client.fetched == []
