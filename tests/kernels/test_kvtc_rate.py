"""kvtc-auto, per-object rate control: the ladder's choice from probe KLs, the size budget, settings refused
clearly, per-kind water levels, and objects on a tiny Llama's real KV that decode as their rung says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import kdn.kernels  # noqa: E402, F401  (registers the codecs)
from kdn.adapters.hf import kvtc_rate as kr  # noqa: E402
from kdn.adapters.hf.extract import extract_chunks  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402
from kdn.format.objects import decode_object, to_torch  # noqa: E402
from kdn.kernels import transform as tf  # noqa: E402


def settings(ladder=("1.5", "2.5"), kl=0.01, target=1.75, probe=16) -> kr.RateSettings:
    return kr.RateSettings(tuple(kr.parse_rung(r) for r in ladder), kl, target, probe)


def test_more_bits_for_the_object_whose_kl_at_low_bits_is_high():
    ctl = kr.RateControl(settings(ladder=("1.5", "2", "2.5"), target=2.0))
    kls = {0: (0.003, 0.001), 1: (0.05, 0.004), 2: (0.002, 0.001)}  # per object: KL at rungs 0, 1
    asked: list[tuple[int, int]] = []
    picks = []
    for obj, kl in kls.items():
        def probe(i: int, obj: int = obj, kl: tuple = kl) -> float:
            asked.append((obj, i))
            return kl[i]
        picks.append(ctl.choose(probe).rung)
    assert picks == [0, 1, 0]
    assert asked == [(0, 0), (1, 0), (1, 1), (2, 0)]  # cheapest first, and no further than needed


def test_the_dearest_affordable_rung_needs_no_probe():
    ctl = kr.RateControl(settings())
    choice = ctl.choose(lambda i: math.inf)
    assert choice.rung == 1 and choice.kls == (math.inf,)  # rung 1 (the ceiling) was not probed


def test_the_size_target_holds_however_bad_every_object_is():
    s = settings(ladder=("1.25", "1.5", "2.5"), target=1.6)
    ctl = kr.RateControl(s)
    for n in range(1, 60):
        ctl.choose(lambda i: 1.0)  # every rung is over kl_max: each object wants the top
        burst = s.ladder[-1].bits - s.target_bits
        assert ctl.mean_bits() <= s.target_bits + burst / n + 1e-9
    assert 1.55 < ctl.mean_bits()  # and it spends the budget, it does not starve
    quiet = kr.RateControl(s)
    for _ in range(20):
        quiet.choose(lambda i: 0.0)
    assert quiet.mean_bits() == 1.25


@pytest.mark.parametrize("text, what", [
    ("ladder=2.5,1.5", "cheapest first"),
    ("ladder=1.5,1.5", "cheapest first"),
    ("ladder=1.5,abc", "not B or K/V"),
    ("ladder=1.5,2/3/4", "not B or K/V"),
    ("ladder=0,2", "must be in (0, 16]"),
    ("ladder=1.5,17", "must be in (0, 16]"),
    ("kl=-0.01", "kl_max"),
    ("kl=nan", "kl_max"),
    ("kl=x", "not a number"),
    ("target=3", "between the cheapest"),
    ("target=1", "between the cheapest"),
    ("probe=0", "probe_tokens"),
    ("bits=2", "unknown setting"),
])
def test_a_bad_setting_is_refused_clearly(text, what):
    with pytest.raises(InvalidInput, match=what.replace("(", r"\(").replace("]", r"\]")):
        kr.RateSettings.parse(text)


def test_settings_parse_and_name_rungs():
    s = kr.RateSettings.parse("ladder=1.5,3/2 kl=0.02 target=2 probe=32")
    assert [str(r) for r in s.ladder] == ["1.5", "3/2"] and s.ladder[1].bits == 2.5
    assert (s.kl_max, s.target_bits, s.probe_tokens) == (0.02, 2.0, 32)
    assert kr.RateSettings.parse("") == kr.RateSettings()


@pytest.fixture(scope="module")
def tiny():
    from kvtc_helpers import fit_tiny_basis

    lm, basis, g = fit_tiny_basis()
    tf.register_basis(basis)
    ids = torch.randint(3, lm.model.config.vocab_size, (48,), generator=g)
    return lm, basis, ids, list(extract_chunks(lm.model, ids, chunk_tokens=16))


def test_per_kind_allocation_stays_within_each_budget(tiny):
    _, basis, _, _ = tiny
    theta_k, theta_v = kr.parse_rung("3/1").thetas(basis)  # K water-filled within 3 bits, V within 1
    assert 0.95 * 3.0 <= tf.estimate_bits(basis, theta_k, "k") <= 3.0 + 1e-9
    assert 0.95 * 1.0 <= tf.estimate_bits(basis, theta_v, "v") <= 1.0 + 1e-9
    assert theta_k < theta_v  # more bits: a lower water level
    with pytest.raises(InvalidInput, match="kind"):
        tf.allocate(basis, 2.0, "q")


def _fields(c, model_id: str) -> dict:
    return dict(kind=c.kind, address=f"{c.index + 1:064x}", model_id=model_id, namespace="public", start=c.start,
                end=c.end, parent=None)


def test_objects_decode_bit_correctly_at_their_own_rung(tiny):
    lm, basis, ids, chunks = tiny
    s = settings(ladder=("1", "3/2", "8"), kl=1e-9, target=4.0)  # kl_max unreachable: as dear as allowed
    ctl = kr.RateControl(s)
    for i, c in enumerate(chunks):
        blob, choice = kr.encode_auto(lm.model, basis, ctl, tensors=c.tensors, position=c.start,
                                      prefix=[x.tensors for x in chunks[:i]], after_ids=ids[c.end : c.end + 8],
                                      own_ids=ids[c.start : c.end], **_fields(c, lm.model_id))
        theta_k, theta_v = s.ladder[choice.rung].thetas(basis)
        assert blob == tf.encode_kvtc_object(basis, (theta_k, theta_v), tensors=c.tensors, position=c.start,
                                             encoding="kvtc-auto", **_fields(c, lm.model_id))
        obj = decode_object(blob)
        assert obj.header.encoding == "kvtc-auto"
        out = to_torch(obj)
        for name, info in obj.header.tensors.items():
            params, (layer, kind) = info.params, name[1:].split(".")
            theta = theta_k if kind == "k" else theta_v
            assert params["theta"] == theta
            x = c.tensors[name].float().numpy()
            ns = params["sinks"]
            codes = tf.transform_codes_ref(basis, int(layer), kind, x, c.start, theta)
            ref = tf.reconstruct_ref(basis, int(layer), kind, codes, x[:, :ns], c.start, theta)
            assert np.allclose(out[name].float().numpy(), ref, atol=2e-3 * (1 + np.abs(ref).max()))
    assert ctl.chosen == [2, 1, 1]  # the burst (8 bits), then what the budget allows (2.5: mean 4.33 <= 4 + 4 / 3)


def test_the_probe_sees_the_damage_of_fewer_bits(tiny):
    lm, basis, ids, chunks = tiny
    first, last = chunks[0], chunks[-1]
    for c, after in ((first, ids[first.end : first.end + 8]), (last, ids[:0])):  # next tokens; own tail
        prefix = [x.tensors for x in chunks[: c.index]]
        probe = kr.make_probe(lm.model, prefix, c.tensors, after, ids[c.start : c.end], 8)
        assert probe is not None and probe.ids.numel() == 8 and (probe.keep is None) == (c is first)
        kl = {}
        for bits in (0.25, 8.0):
            blob = tf.encode_kvtc_object(basis, tf.theta_for(basis, bits), tensors=c.tensors, position=c.start,
                                         **_fields(c, lm.model_id))
            kl[bits] = kr.probe_kl(lm.model, probe, to_torch(decode_object(blob)))
        assert 0 <= kl[8.0] < kl[0.25], kl
        rel = {b: v / probe.nll for b, v in kl.items()}  # the ladder compares KL as a share of the probe's NLL
        # so a threshold between the two sends this object up the ladder, and one above both keeps it cheap
        for kl_max, rung in ((math.sqrt(rel[8.0] * rel[0.25]) if rel[8.0] > 0 else rel[0.25] / 2, 1),
                             (2 * rel[0.25], 0)):
            ctl = kr.RateControl(kr.RateSettings((kr.Rung(0.25, 0.25), kr.Rung(8.0, 8.0), kr.Rung(9.0, 9.0)),
                                                 kl_max, 8.0, 8))
            _, choice = kr.encode_auto(lm.model, basis, ctl, tensors=c.tensors, position=c.start, prefix=prefix,
                                       after_ids=after, own_ids=ids[c.start : c.end], **_fields(c, lm.model_id))
            assert choice.rung == rung and choice.kls[0] == pytest.approx(rel[0.25], rel=1e-6)
