"""RoPE position shift: move keys computed at positions ``0..n-1`` to ``delta..delta+n-1``.

A standalone chunk's keys were rotated for positions ``0..n-1``. RoPE rotates
each pair ``(x_i, x_{i+d/2})`` (the Llama ``rotate_half`` convention) by the
angle ``p * inv_freq[i]``, and rotations compose: ``R(p + delta) = R(delta) R(p)``.
So placing a chunk at offset ``delta`` is one more rotation by ``delta * inv_freq``,
whatever the chunk's own positions were. Values carry no position: only K moves.

RoPE types whose frequencies do not depend on the sequence length compose
this way (``default``, ``linear``, ``llama3``, ``yarn``: the latter's attention
scale multiplies both sides and stays). ``dynamic`` and ``longrope`` switch
frequencies with the context length: a key cached at one length is not a
rotation of the same key at another, so they are refused, as are families
that rotate interleaved pairs or are not known to use ``rotate_half``.

``rope_shift`` is the fast path (one cos/sin table, elementwise);
``rope_shift_ref`` is the direct one (complex numbers in float64: un-rotate
each key to its position-free form, re-rotate at the new position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kdn.errors import ModelMismatch

# model_type -> families that apply rotate_half RoPE to the whole (or leading part of the) head
ROTATE_HALF_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
SHIFTABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True)
class Rope:
    """The frequencies a model rotates keys with: the first ``2 * len(inv_freq)`` dims of each head."""

    inv_freq: torch.Tensor  # [rot_dim // 2], float32

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def _rope_type(config: Any) -> tuple[str, dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return kind, params


def rope_of(source: Any) -> Rope:
    """The ``Rope`` of a model (its own ``rotary_emb.inv_freq``), a config, or a ``Rope`` (returned as is).

    From a model, any shiftable RoPE type works (the model computed the
    frequencies). From a bare config, ``default``, ``linear`` and ``llama3``
    are derived here from ``rope_theta`` / ``rope_parameters`` / ``head_dim`` /
    ``partial_rotary_factor``. Raises ``ModelMismatch`` for anything else.
    """
    if isinstance(source, Rope):
        return source
    config = getattr(source, "config", source)
    family = getattr(config, "model_type", None)
    if family not in ROTATE_HALF_FAMILIES:
        raise ModelMismatch(f"RoPE shift supports {sorted(ROTATE_HALF_FAMILIES)} (rotate_half RoPE), not {family!r}")
    kind, params = _rope_type(config)
    if kind not in SHIFTABLE_ROPE_TYPES:
        raise ModelMismatch(f"RoPE type {kind!r} cannot be shifted: its frequencies depend on the context length "
                            f"or are unknown here (shiftable: {sorted(SHIFTABLE_ROPE_TYPES)})")
    rotary = getattr(getattr(source, "model", None), "rotary_emb", None)
    if rotary is not None:
        return Rope(rotary.original_inv_freq.detach().float().cpu().clone())
    return Rope(_inv_freq_from_config(config, kind, params))


def _inv_freq_from_config(config: Any, kind: str, params: dict) -> torch.Tensor:
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ModelMismatch("config has no rope_theta")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    inv = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    if kind == "linear":
        inv = inv / float(params["factor"])
    elif kind == "llama3":
        # transformers' _compute_llama3_parameters: long wavelengths slowed by `factor`,
        # short ones kept, a smooth blend between the two bands.
        factor, lo, hi = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, blended, scaled)
    elif kind != "default":
        raise ModelMismatch(f"RoPE type {kind!r} needs the model, not just its config: pass the model")
    return inv


def rope_shift(keys: torch.Tensor, delta: int, rope: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``keys`` ``[..., n, head_dim]`` rotated ``delta`` positions further (same dtype).

    ``rope``: a ``Rope``, a model or a config (see ``rope_of``). The rotation
    runs in float32 (float64 for float64 keys) from angles computed in float64,
    then casts back: bit for bit ``k * cos + rotate_half(k) * sin``, the model's
    own formula. ``out``: where to write (``keys`` itself is allowed); by
    default a new tensor.
    """
    r = rope_of(rope)
    assert keys.shape[-1] >= r.rot_dim, (keys.shape, r.rot_dim)
    if out is None:
        out = torch.empty_like(keys)
    assert out.shape == keys.shape, (out.shape, keys.shape)
    if delta == 0:
        return out if out is keys else out.copy_(keys)
    h = r.rot_dim // 2
    ang = float(delta) * r.inv_freq.double()  # [rot/2]: both halves of a pair turn by the same angle
    work = torch.promote_types(keys.dtype, torch.float32)
    cos = ang.cos().to(device=keys.device, dtype=work)  # [rot/2]
    sin = ang.sin().to(device=keys.device, dtype=work)
    x1, x2 = keys[..., :h].to(work), keys[..., h:r.rot_dim].to(work)  # [..., n, rot/2] each
    # rotate_half(k) = (-x2, x1), and a + (-b) is a - b exactly: the same bits as the model's formula.
    lo = x1 * cos - x2 * sin
    hi = x2 * cos + x1 * sin
    if out is not keys and r.rot_dim < keys.shape[-1]:
        out[..., r.rot_dim:] = keys[..., r.rot_dim:]
    out[..., :h] = lo
    out[..., h:r.rot_dim] = hi
    return out


def rope_shift_ref(keys: torch.Tensor, delta: int, rope: Any, *, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Direct reference: un-rotate each key from its position to position-free form, re-rotate at position + delta.

    Pairs ``(x_i, x_{i+rot/2})`` as complex numbers ``x_i + j x_{i+rot/2}``;
    rotating by ``a`` is multiplying by ``e^{ja}``. float64 throughout.
    """
    r = rope_of(rope)
    n = keys.shape[-2]
    pos = torch.arange(n, dtype=torch.float64) if positions is None else positions.double()  # [n]
    half = r.rot_dim // 2
    k = keys.double().cpu()
    z = torch.complex(k[..., :half], k[..., half : r.rot_dim])  # [..., n, rot/2]
    freq = r.inv_freq.double()  # [rot/2]
    free = z * torch.polar(torch.ones(n, half, dtype=torch.float64), -pos[:, None] * freq)  # position-free
    moved = free * torch.polar(torch.ones(n, half, dtype=torch.float64), (pos[:, None] + delta) * freq)
    out = torch.cat((moved.real, moved.imag, k[..., r.rot_dim:]), dim=-1)
    return out.to(device=keys.device, dtype=keys.dtype)
