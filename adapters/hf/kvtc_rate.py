"""Per-object rate control for the transform codec (encoding ``kvtc-auto``): the publisher picks each object's budget.

``kvtc-B`` codes every object at one estimated rate B, but the damage a rate does varies by object: on text
the model predicts almost surely (legal boilerplate) a small error costs a large share of a small NLL. The
origin holds the model and the exact states, so it measures the damage instead of guessing it:

1. Probe (:func:`make_probe`): the tokens right after the object in the publish (up to ``probe_tokens``),
   run on a cache of the exact prefix and the object; for an object with nothing after it (the publish's
   last, a standalone chunk), its own last tokens, run on the exact prefix and the object's first tokens
   (attention-only models; a hybrid's recurrent state cannot be cut, so such an object gets no probe and
   the dearest rung the size budget allows).
2. For each rung of a small ladder, cheapest first, the object is encoded at that rung, decoded (the bytes
   a reader decodes) and put in place of the exact object; the probe's next-token distributions are compared
   with the exact ones: KL(exact || lossy), nats per token, as a share of the probe's exact NLL (the NLL
   increase it predicts, relatively: the quality budget is relative, and on text the model predicts almost
   surely the same KL costs more). The first rung within ``kl_max`` is kept; if none is, the dearest the size
   budget allows (which needs no probe).
3. Size (:class:`RateControl`, one per publish): the mean estimated rate of a publish's objects stays within
   ``target_bits`` plus a burst of one top-rung object: a rung above the target is allowed only while the sum
   of (rung bits - target) over the objects so far stays within (top rung - target). Cheap objects earn the
   room that costly ones spend, in publish order, so the choice is causal (objects are stored as computed).

A rung is K and V budgets in estimated bits per value: ``2.5`` water-fills K and V at one level (as
``kvtc-2p5`` does), ``3/2`` water-fills K within 3 bits and V within 2 separately. Decoding needs nothing new:
every kvtc tensor records its own water level (``theta``), so a ``kvtc-auto`` object decodes as any kvtc one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kdn.errors import InvalidInput
from kdn.format.encodings import KVTC_AUTO, KVTC_MAX_BITS
from kdn.kernels.codecs import _KV_NAME
from kdn.kernels.transform import Basis, encode_kvtc_object, theta_for

Tensors = Mapping[str, torch.Tensor]
NLL_FLOOR = 1e-3  # nats: a probe the model predicts surely still divides by something


@dataclass(frozen=True)
class Rung:
    """One setting of the ladder: estimated bits per value for K and for V (equal: one joint water level)."""

    k_bits: float
    v_bits: float

    def __post_init__(self) -> None:
        for b in (self.k_bits, self.v_bits):
            if not (isinstance(b, (int, float)) and math.isfinite(b) and 0 < b <= KVTC_MAX_BITS):
                raise InvalidInput(f"kvtc-auto: a rung's bits must be in (0, {KVTC_MAX_BITS:g}], got {b!r}")

    @property
    def bits(self) -> float:
        """The rung's nominal rate, bits per K/V value (K and V have as many values)."""
        return 0.5 * (self.k_bits + self.v_bits)

    def __str__(self) -> str:
        return f"{self.k_bits:g}" if self.k_bits == self.v_bits else f"{self.k_bits:g}/{self.v_bits:g}"

    def thetas(self, basis: Basis) -> tuple[float, float]:
        """The water levels (K, V) of this rung under ``basis``."""
        if self.k_bits == self.v_bits:
            t = theta_for(basis, self.k_bits)
            return t, t
        return theta_for(basis, self.k_bits, "k"), theta_for(basis, self.v_bits, "v")


def parse_rung(text: str) -> Rung:
    """``"1.5"`` (K and V jointly) or ``"3/2"`` (K within 3 bits, V within 2)."""
    parts = str(text).split("/")
    try:
        bits = [float(p) for p in parts]
    except ValueError:
        raise InvalidInput(f"kvtc-auto: rung {str(text)[:20]!r} is not B or K/V bits (1.5, 3/2)") from None
    if len(bits) not in (1, 2):
        raise InvalidInput(f"kvtc-auto: rung {str(text)[:20]!r} is not B or K/V bits (1.5, 3/2)")
    return Rung(bits[0], bits[-1])


@dataclass(frozen=True)
class RateSettings:
    """The publisher's rate control: the ladder (cheapest first), the damage allowed, the size target.

    Defaults: measured on SmolLM2-135M (docs/whitebox.md, "Transform codec"; ``bench/quality_transform.py``).
    """

    ladder: tuple[Rung, ...] = (Rung(1.5, 1.5), Rung(2.5, 2.5))
    kl_max: float = 0.0067  # KL(exact || lossy) per probe token / the probe's exact NLL per token
    target_bits: float = 1.6  # mean estimated bits per value over a publish (+ one top-rung burst)
    probe_tokens: int = 64

    def __post_init__(self) -> None:
        ladder = self.ladder
        if not ladder or not all(isinstance(r, Rung) for r in ladder):
            raise InvalidInput("kvtc-auto: the ladder needs at least one rung")
        if any(a.bits >= b.bits for a, b in zip(ladder, ladder[1:])):
            raise InvalidInput(f"kvtc-auto: rungs must be cheapest first, strictly: {[str(r) for r in ladder]}")
        if not (isinstance(self.kl_max, (int, float)) and math.isfinite(self.kl_max) and self.kl_max > 0):
            raise InvalidInput(f"kvtc-auto: kl_max must be a positive share of the probe's NLL, got {self.kl_max!r}")
        t = self.target_bits
        if not (isinstance(t, (int, float)) and ladder[0].bits <= t <= ladder[-1].bits):
            raise InvalidInput(f"kvtc-auto: target_bits {t!r} must lie between the cheapest rung "
                               f"({ladder[0].bits:g}) and the dearest ({ladder[-1].bits:g})")
        if not (isinstance(self.probe_tokens, int) and 1 <= self.probe_tokens <= 4096):
            raise InvalidInput(f"kvtc-auto: probe_tokens must be 1..4096, got {self.probe_tokens!r}")

    @classmethod
    def parse(cls, text: str) -> RateSettings:
        """``"ladder=1.5,2.5 kl=0.0067 target=1.6 probe=64"`` (any subset; the rest default)."""
        kw: dict = {}
        for item in str(text).split():
            key, _, value = item.partition("=")
            try:
                if key == "ladder":
                    kw["ladder"] = tuple(parse_rung(r) for r in value.split(","))
                elif key in ("kl", "target"):
                    kw["kl_max" if key == "kl" else "target_bits"] = float(value)
                elif key == "probe":
                    kw["probe_tokens"] = int(value)
                else:
                    raise InvalidInput(f"kvtc-auto: unknown setting {key[:20]!r} (ladder, kl, target, probe)")
            except ValueError as e:
                if isinstance(e, InvalidInput):
                    raise
                raise InvalidInput(f"kvtc-auto: {key}={value[:20]!r} is not a number") from None
        return cls(**kw)


@dataclass(frozen=True)
class Choice:
    rung: int  # index into the ladder
    kls: tuple[float, ...]  # the probe's KL / NLL at each rung measured, cheapest first


class RateControl:
    """One publish's rate control over its objects in order (module docstring, step 3)."""

    def __init__(self, settings: RateSettings) -> None:
        self.settings = settings
        self.debt = 0.0  # sum over the objects so far of (rung bits - target)
        self.burst = settings.ladder[-1].bits - settings.target_bits
        self.chosen: list[int] = []

    def affordable(self, i: int) -> bool:
        s = self.settings
        return i == 0 or self.debt + s.ladder[i].bits - s.target_bits <= self.burst + 1e-9

    def choose(self, kl: Callable[[int], float]) -> Choice:
        """The next object's rung, given ``kl(i)``: the probe's KL at rung ``i``, asked cheapest first, lazily."""
        s = self.settings
        top = max(i for i in range(len(s.ladder)) if self.affordable(i))  # the budget's ceiling
        kls: list[float] = []
        pick = top
        for i in range(top):  # the ceiling is taken without a probe: nothing dearer is allowed
            kls.append(kl(i))
            if kls[-1] <= s.kl_max:
                pick = i
                break
        self.debt += s.ladder[pick].bits - s.target_bits
        self.chosen.append(pick)
        return Choice(pick, tuple(kls))

    def mean_bits(self) -> float:
        return sum(self.settings.ladder[i].bits for i in self.chosen) / max(1, len(self.chosen))


# --- the probe (model side) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What one object's damage is measured on: the cache is ``prefix`` + the object's first ``keep`` tokens."""

    prefix: tuple[Tensors, ...]  # the exact chunks before the object
    ids: torch.Tensor  # [m] the probe tokens
    keep: int | None  # None: the whole object; else its first ``keep`` tokens (the rest are ``ids``)
    exact: torch.Tensor  # [m, vocab] log-probs on the exact cache

    @property
    def nll(self) -> float:
        """The exact cache's NLL per probe token (of ``ids[1:]``; floored: a 1-token probe has none)."""
        if self.ids.numel() < 2:
            return NLL_FLOOR
        return max(NLL_FLOOR, float(-self.exact[:-1].gather(1, self.ids[1:, None]).mean()))


def _head(tensors: Tensors, keep: int | None) -> dict[str, torch.Tensor]:
    return dict(tensors) if keep is None else {n: t[:, :keep] for n, t in tensors.items()}  # [H, keep, D]


def _logp(model, chunks: Sequence[Tensors], ids: torch.Tensor) -> torch.Tensor:
    from kdn.adapters.hf.cache import build_cache, continue_from_cache

    cache, n = build_cache(model, list(chunks))
    return torch.log_softmax(continue_from_cache(model, cache, n, ids).float(), -1)  # [m, vocab]


def make_probe(model, prefix: Sequence[Tensors], tensors: Tensors, after_ids: Sequence[int] | torch.Tensor,
               own_ids: Sequence[int] | torch.Tensor, probe_tokens: int) -> Probe | None:
    """The probe of one object (module docstring, step 1); None when it has none (a hybrid's last object)."""
    after = torch.as_tensor(after_ids, dtype=torch.long)[:probe_tokens]
    keep = None
    if after.numel() == 0:
        own = torch.as_tensor(own_ids, dtype=torch.long)
        t = min(probe_tokens, own.numel() // 2)
        if t == 0 or not all(_KV_NAME.fullmatch(n) for n in tensors):
            return None
        keep, after = own.numel() - t, own[-t:]
    return Probe(tuple(prefix), after, keep, _logp(model, [*prefix, _head(tensors, keep)], after))


def probe_kl(model, probe: Probe, lossy: Tensors) -> float:
    """KL(exact || lossy) in nats per probe token with ``lossy`` in place of the object (not yet divided by
    ``probe.nll``)."""
    lp = _logp(model, [*probe.prefix, _head(lossy, probe.keep)], probe.ids)
    return max(0.0, float((probe.exact.exp() * (probe.exact - lp)).sum(-1).mean()))


def encode_auto(model, basis: Basis, control: RateControl, *, tensors: Tensors, position: int,
                prefix: Sequence[Tensors] = (), after_ids: Sequence[int] | torch.Tensor = (),
                own_ids: Sequence[int] | torch.Tensor = (), **fields) -> tuple[bytes, Choice]:
    """One ``kvtc-auto`` object (``encode_kvtc_object`` fields) at the rung ``control`` picks from its probe.

    ``prefix``: the exact chunks before this one in its publish; ``after_ids``: the tokens after it there
    (may be empty); ``own_ids``: its own tokens.
    """
    from kdn.format.objects import decode_object, to_torch

    ladder = control.settings.ladder
    blobs: dict[int, bytes] = {}
    probes: list[Probe | None] = []  # made on the first question: an object the budget keeps cheap needs none

    def coded(i: int) -> bytes:
        if i not in blobs:
            blobs[i] = encode_kvtc_object(basis, ladder[i].thetas(basis), tensors=dict(tensors), position=position,
                                          encoding=KVTC_AUTO, **fields)
        return blobs[i]

    def kl(i: int) -> float:
        if not probes:
            probes.append(make_probe(model, prefix, tensors, after_ids, own_ids, control.settings.probe_tokens))
        probe = probes[0]
        if probe is None:
            return math.inf
        return probe_kl(model, probe, to_torch(decode_object(coded(i), max_decoded=1 << 34))) / probe.nll

    choice = control.choose(kl)
    return coded(choice.rung), choice


class Publication:
    """One publish's ``kvtc-auto`` state at the origin: its rate control, its tokens and its exact chunks so far.

    The prefix chain calls :meth:`encode` for each chunk it stores and :meth:`advance` for every chunk, stored
    or not (the probe's cache is the exact prefix). A standalone chunk is its own context: ``alone=True``.
    """

    def __init__(self, model, basis: Basis | None, settings: RateSettings, tokens: Sequence[int]) -> None:
        if basis is None:
            raise InvalidInput(f"encoding {KVTC_AUTO!r} needs the model's kvtc basis, and none is configured "
                               "(kdn origin serve --kvtc-basis FILE)")
        self.model, self.basis, self.tokens = model, basis, tokens
        self.control = RateControl(settings)
        self.prefix: list[Tensors] = []

    def encode(self, tensors: Tensors, *, alone: bool = False, **fields) -> bytes:
        """The object of tokens ``[start, end)`` of the publish (``encode_kvtc_object`` fields: ``start``, ``end``,
        ``position``...)."""
        s, e = fields["start"], fields["end"]
        blob, _ = encode_auto(self.model, self.basis, self.control, tensors=tensors,
                              prefix=() if alone else self.prefix,
                              after_ids=() if alone else self.tokens[e : e + self.control.settings.probe_tokens],
                              own_ids=self.tokens[s:e], **fields)
        return blob

    def advance(self, tensors: Tensors) -> None:
        self.prefix.append(tensors)

    def resume(self, cache) -> None:
        """Start from a cache of the publish's first chunks (rebuilt from stored ones): its K/V are the prefix."""
        if cache is not None:
            self.prefix.append({f"L{i}.{x}": t[0] for i, layer in enumerate(cache.layers)
                                if getattr(layer, "keys", None) is not None
                                for x, t in (("k", layer.keys), ("v", layer.values))})  # [H, S, D] each
