"""A transform codec for KV (``kvtc``, in the spirit of KVTC): PCA basis, allocated steps, rANS.

Per model, layer and kind (K or V), a :class:`Basis` holds, fitted once on
calibration text (``kdn.adapters.hf.transform_fit``):

- ``mean`` ``[C]`` and ``scale`` ``[C]`` (C = kv_heads * head_dim): a token's
  row ``r`` (all heads of one token, concatenated) is centred and weighted,
  ``w = scale * (r - mean)``. ``scale`` is the square root of a diagonal
  sensitivity metric: for K, the energy of the queries that read that dim
  (summed over the query heads of its group, averaged over each RoPE pair);
  for V, the squared column norms of ``o_proj`` over those heads. Equal error
  in ``w`` then costs about equally in the model's output.
- ``basis`` ``[C, C]``: orthonormal eigenvectors of ``cov(w)`` (columns, by
  decreasing eigenvalue ``var`` ``[C]``). Coefficients ``y = w @ basis``.
- ``alpha``: measured sensitivity of the model's output (KL, nats per token)
  to unit noise variance per coefficient of that layer and kind.

K is cached post-RoPE; it is un-rotated to its position-free form before the
transform (decorrelating far better: a 2% relative MSE costs ~2.4 bits per
value post-RoPE and ~1.9 un-rotated, per-layer, cross-head, measured on
SmolLM2-135M) and re-rotated after decoding. Positions are the object's:
``pos`` (its first token's position) is a parameter of every tensor.

Allocation (:func:`allocate`): reverse water-filling over every coefficient
of every layer and kind. A coefficient of variance ``var`` in a layer/kind of
sensitivity ``alpha`` is kept if ``alpha * var > theta``, and then coded with
the uniform step ``sqrt(12 * theta / alpha)`` (its distortion ``theta /
alpha`` per unit ``alpha``: the same marginal cost everywhere); dropped
coefficients decode to 0 (the mean). Since ``var`` is sorted, the kept
coefficients of a layer/kind are a prefix (``m`` of them). ``theta`` is found
by bisection so that the estimated rate (entropy of a quantized Gaussian of
the calibrated variance, an upper bound for the same variance at high rate)
stays within a budget in bits per value; the encoder records ``theta`` in the
tensor's parameters, so the decoder needs no allocation of its own (and an object's
K and V may be coded at different levels: ``kvtc-auto``, ``kdn.adapters.hf.kvtc_rate``).

Entropy coding: the codes of each kept coefficient are rANS coded
(``constriction``) under a quantized Laplace model whose mean and scale are
measured on the object itself and stored as two bytes per kept coefficient
(mean: int8 in 1/16 codes; scale: ``2**((u - 64) / 8)`` codes). Attention-sink
tokens -- those at positions ``< sink_tokens`` (4) -- are stored exactly, in
the tensor's dtype.

Payload of one tensor ``[H, n, D]``: sink rows ``[ns, C]`` in the tensor's
dtype (token-major) || i8 means ``[m]`` || u8 scales ``[m]`` || rANS words
(u32, the codes coefficient-major). Params: ``basis`` (its BLAKE3 address),
``layer``, ``kv``, ``pos``, ``sinks``, ``theta``, ``crc32``.

The basis object's format is in ``kdn.kernels.basis``.

``encode_tensor`` / ``decode_tensor`` are the fast paths (torch float32);
``transform_codes_ref`` / ``reconstruct_ref`` their plain float64 numpy twins
with a loop per token.
"""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass

import constriction
import numpy as np
import torch

from kdn.format.address import Address
from kdn.format.codecs import Buffer, register_codec
from kdn.errors import CodecError, InvalidInput
from kdn.kernels.codecs import _KV_NAME, FLOAT_DTYPES, LossyCodec, Reader, int_param, write_float

from kdn.kernels.basis import KINDS, get_basis
# re-exported: callers import the basis from here
from kdn.kernels.basis import DEFAULT_SINKS as DEFAULT_SINKS
from kdn.kernels.basis import Basis as Basis
from kdn.kernels.basis import LayerBasis as LayerBasis
from kdn.kernels.basis import register_basis as register_basis

QMAX = (1 << 15) - 1  # codes are clipped to [-QMAX, QMAX] (never reached on real KV: see the tests)
_SCALE_OFFSET = 64  # a stored scale byte u means 2 ** ((u - 64) / 8) code units


# --- allocation ------------------------------------------------------------------------------------


def gaussian_code_entropy(r: np.ndarray) -> np.ndarray:
    """Entropy (bits) of ``round(N(0, r**2))``: r = std / step. Exact sum below r = 4, the high-rate formula above."""
    r = np.asarray(r, np.float64)
    out = np.log2(np.maximum(r, 1e-300) * math.sqrt(2 * math.pi * math.e))
    small = r < 4
    if small.any():
        rs = np.maximum(r[small], 1e-12)[:, None]  # [S, 1]
        k = np.arange(-40, 41, dtype=np.float64)[None]  # [1, 81]
        hi = torch.erf(torch.from_numpy((k + 0.5) / (rs * math.sqrt(2)))).numpy()
        lo = torch.erf(torch.from_numpy((k - 0.5) / (rs * math.sqrt(2)))).numpy()
        p = 0.5 * (hi - lo)  # [S, 81]
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
        out[small] = np.maximum(h, 0.0)
    return out


@dataclass(frozen=True)
class Allocation:
    theta: float
    kept: tuple[tuple[int, int], ...]  # per layer: (m_k, m_v)
    est_bits: float  # estimated bits per value over all K/V values (codes only)


def kept_and_step(lb: LayerBasis, theta: float) -> tuple[int, float]:
    """(coefficients kept, their step) of one layer/kind at water level ``theta``."""
    m = int(np.count_nonzero(lb.alpha * lb.var.astype(np.float64) > theta))
    return m, math.sqrt(12.0 * theta / lb.alpha)


def _kinds(kind: str | None) -> tuple[int, ...]:
    if kind is None:
        return (0, 1)
    if kind not in KINDS:
        raise InvalidInput(f"kvtc: kind must be one of {list(KINDS)} or None (both), got {str(kind)[:8]!r}")
    return (KINDS.index(kind),)


def estimate_bits(basis: Basis, theta: float, kind: str | None = None) -> float:
    """Estimated bits per K/V value at ``theta`` (quantized-Gaussian entropy of each kept coefficient);
    of ``kind``'s values only (``"k"`` or ``"v"``) if given."""
    total, kinds = 0.0, _kinds(kind)
    for pair in basis.layers:
        for lb in (pair[j] for j in kinds):
            m, step = kept_and_step(lb, theta)
            if m:
                total += float(gaussian_code_entropy(np.sqrt(lb.var[:m].astype(np.float64)) / step).sum())
    return total / (len(kinds) * basis.n_layers * basis.channels)


def allocate(basis: Basis, bits_per_value: float, kind: str | None = None) -> Allocation:
    """Reverse water-filling: the smallest ``theta`` whose estimated rate is <= ``bits_per_value``; over K and V
    together, or over ``kind``'s coefficients only (``kvtc-auto``'s separate K and V budgets)."""
    if not bits_per_value > 0:
        raise InvalidInput(f"kvtc: bit budget must be > 0, got {bits_per_value}")
    kinds = _kinds(kind)
    v = np.concatenate([pair[j].alpha * pair[j].var.astype(np.float64) for pair in basis.layers for j in kinds])
    lo, hi = math.log(max(v.min(), 1e-30) * 1e-6), math.log(max(v.max(), 1e-30) * 1.0001)  # hi: nothing kept
    if estimate_bits(basis, math.exp(lo), kind) <= bits_per_value:
        hi = lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if estimate_bits(basis, math.exp(mid), kind) > bits_per_value:
            lo = mid
        else:
            hi = mid
    theta = math.exp(hi)
    kept = tuple((kept_and_step(k, theta)[0], kept_and_step(v, theta)[0]) for k, v in basis.layers)
    return Allocation(theta, kept, estimate_bits(basis, theta, kind))


# --- RoPE (rotate_half pairs (i, i + rot/2)) -------------------------------------------------------


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: np.ndarray, sign: int) -> torch.Tensor:
    """``x`` ``[n, H, D]`` rotated by ``sign * position * inv_freq`` per pair (sign -1 un-rotates)."""
    half = int(inv_freq.size)
    if half == 0:
        return x
    ang = positions.double()[:, None] * torch.from_numpy(inv_freq)[None] * sign  # [n, half]
    cos = ang.cos().to(x.dtype)[:, None]  # [n, 1, half]
    sin = ang.sin().to(x.dtype)[:, None]
    a, b = x[..., :half], x[..., half : 2 * half]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, x[..., 2 * half :]), dim=-1)


# --- the codec -------------------------------------------------------------------------------------


def _laplace(lo: int = -QMAX, hi: int = QMAX):
    return constriction.stream.model.QuantizedLaplace(lo, hi)


def model_bytes(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per coefficient (columns of ``q`` ``[n, m]``): the Laplace mean and scale of its codes, one byte each.

    Mean: int8 in 1/16 code units (clipped to about +-8 codes); scale: u8, ``2**((u - 64) / 8)`` code units,
    the ML scale ``mean |q - mean|`` of a Laplace, floored at 2**-7.
    """
    mu = np.clip(np.round(q.mean(0) * 16), -127, 127).astype(np.int8)  # [m]
    b = np.maximum(np.abs(q - mu.astype(np.float64)[None] / 16).mean(0), 2.0**-7)  # [m]
    return mu, np.clip(np.round(8 * np.log2(b)) + _SCALE_OFFSET, 0, 255).astype(np.uint8)


# 2 ** (i / 8) as literals: the decoder's entropy model must equal the encoder's bit for bit, and a
# vectorized exp2 may differ by an ulp between CPUs; these times a power of two are exact everywhere.
_EIGHTHS = np.array([1.0, 1.0905077326652577, 1.189207115002721, 1.2968395546510096,
                     1.4142135623730951, 1.5422108254079407, 1.681792830507429, 1.8340080864093424])
_SCALE_TABLE = np.ldexp(_EIGHTHS[np.arange(256) % 8], np.arange(256) // 8 - _SCALE_OFFSET // 8)  # [256]


def scales_of(u: np.ndarray) -> np.ndarray:
    """Scale bytes -> Laplace scales, ``2 ** ((u - 64) / 8)`` code units (exactly, from a table)."""
    return _SCALE_TABLE[u]


def means_of(mu: np.ndarray) -> np.ndarray:
    return mu.astype(np.float64) / 16


def _check_shape(basis: Basis, layer: int, kind: str, shape: tuple[int, ...], what: str) -> None:
    if not 0 <= layer < basis.n_layers or kind not in KINDS:
        raise CodecError(f"{what}: no layer {layer} {kind!r} in a {basis.n_layers}-layer basis")
    if len(shape) != 3 or shape[0] != basis.kv_heads or shape[2] != basis.head_dim:
        raise CodecError(f"{what}: shape {list(shape)} is not [{basis.kv_heads}, n, {basis.head_dim}]")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0, 2)  # [H, n, D] -> [n, H, D]


def encode_tensor(basis: Basis, layer: int, kind: str, x: torch.Tensor, position: int, theta: float,
                  dtype: str = "BF16", rho: float = 0.5) -> tuple[bytes, dict]:
    """One K or V tensor ``[H, n, D]`` (float32 values of ``dtype``) -> (payload, params). See the module docstring.

    ``rho`` is the rounding offset, ``q = sign(y) floor(|y| / step + rho)``: 0.5 rounds to nearest
    (error <= step / 2); below 0.5 widens the zero bin (a dead zone: fewer bits, error <= (1 - rho) step).
    The decoder does not need it.
    """
    if not 0.0 <= rho <= 0.5:
        raise InvalidInput(f"kvtc: rounding offset rho must be in [0, 0.5], got {rho!r}")
    _check_shape(basis, layer, kind, tuple(x.shape), "kvtc encode")
    if not (isinstance(theta, float) and math.isfinite(theta) and theta > 0):
        raise InvalidInput(f"kvtc: theta must be a positive float, got {theta!r}")
    if not bool(torch.isfinite(x).all()):
        raise CodecError("kvtc: takes finite values only (found NaN or inf)")
    lb = basis.get(layer, kind)
    n, c = x.shape[1], basis.channels
    ns = max(0, min(n, basis.sink_tokens - position))
    rows = _rows(x.float())  # [n, H, D]
    parts = [rows[:ns].to(FLOAT_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()]
    m, step = kept_and_step(lb, theta)
    if m and n > ns:
        body = rows[ns:]
        if kind == "k":
            body = rotate(body, torch.arange(position + ns, position + n), basis.inv_freq, -1)
        w = (body.reshape(-1, c) - torch.from_numpy(lb.mean)) * torch.from_numpy(lb.scale)  # [n', C]
        y = w @ torch.from_numpy(lb.basis[:, :m])  # [n', m]
        a = y.abs() / step
        q = (torch.sign(y) * torch.floor(a + rho)).clamp_(-QMAX, QMAX).to(torch.int32).numpy()  # rho 0.5: rounding
        mu, u = model_bytes(q)
        parts += [mu.tobytes(), u.tobytes()]
        sym = np.ascontiguousarray(q.T).reshape(-1)  # coefficient-major
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(sym, _laplace(), np.repeat(means_of(mu), q.shape[0]), np.repeat(scales_of(u), q.shape[0]))
        parts.append(coder.get_compressed().astype("<u4").tobytes())
    params = {"basis": _address_cached(basis), "layer": layer, "kv": kind,
              "pos": position, "sinks": ns, "theta": theta}
    return b"".join(parts), params


_ADDR_CACHE: dict[int, tuple[Basis, Address]] = {}


def _address_cached(basis: Basis) -> Address:
    hit = _ADDR_CACHE.get(id(basis))
    if hit is None or hit[0] is not basis:
        hit = _ADDR_CACHE[id(basis)] = (basis, basis.address)
    return hit[1]


def decode_tensor(payload: Buffer, dtype: str, shape: tuple[int, ...], params: dict, basis: Basis | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`: float32 ``shape``. Everything is checked before allocating."""
    what = "kvtc decode"
    if not isinstance(params, dict):
        raise CodecError(f"{what}: params must be a dict")
    if basis is None:
        basis = get_basis(params.get("basis"))
    elif params.get("basis") != _address_cached(basis):
        raise CodecError(f"{what}: payload was coded with basis {str(params.get('basis'))[:16]}..., not this one")
    layer = int_param(params, "layer", 0, basis.n_layers - 1, what)
    kind = params.get("kv")
    if not isinstance(kind, str):
        raise CodecError(f"{what}: kv {str(kind)[:20]!r} is not one of {list(KINDS)}")
    _check_shape(basis, layer, kind, tuple(shape), what)
    position = int_param(params, "pos", 0, (1 << 53), what)
    n, c = shape[1], basis.channels
    ns = int_param(params, "sinks", 0, n, what)
    if ns != max(0, min(n, basis.sink_tokens - position)):
        raise CodecError(f"{what}: {ns} sink tokens at position {position}, the basis says {basis.sink_tokens}")
    theta = params.get("theta")
    if not (isinstance(theta, float) and math.isfinite(theta) and theta > 0):
        raise CodecError(f"{what}: theta {str(theta)[:20]!r} is not a positive float")
    if dtype not in FLOAT_DTYPES:
        raise CodecError(f"{what}: decodes to F32, BF16 or F16, not {dtype}")
    lb = basis.get(layer, kind)
    m, step = kept_and_step(lb, theta)
    rd = Reader(payload, what)
    item = torch.empty(0, dtype=FLOAT_DTYPES[dtype]).element_size()
    sink = rd.take(ns * c * item)
    out = torch.empty(n, c, dtype=torch.float32)  # [n, C]: bounded by the shape, itself bounded by the object's cap
    if ns:
        out[:ns] = torch.frombuffer(bytearray(sink), dtype=FLOAT_DTYPES[dtype]).float().view(ns, c)
    nb = n - ns
    if nb:
        y = torch.zeros(nb, m, dtype=torch.float32)
        if m:
            mu, u = rd.array("i1", m), rd.array("u1", m)
            rest = len(rd.mv) - rd.pos
            if rest % 4:
                raise CodecError(f"{what}: {rest} bytes of rANS words is not a whole number of words")
            words = rd.array("<u4", rest // 4).astype(np.uint32)
            try:
                coder = constriction.stream.stack.AnsCoder(words)
                sym = coder.decode(_laplace(), np.repeat(means_of(mu), nb), np.repeat(scales_of(u), nb))
                ok = coder.is_empty()
            except Exception as e:  # constriction raises assorted errors on garbage
                raise CodecError(f"{what}: rANS stream does not decode: {e}") from None
            if not ok:
                raise CodecError(f"{what}: rANS stream does not hold exactly {nb * m} codes")
            y = torch.from_numpy(sym.reshape(m, nb).T.astype(np.float32)) * step  # [nb, m]
        w = y @ torch.from_numpy(lb.basis[:, :m]).T  # [nb, C]
        r = w / torch.from_numpy(lb.scale) + torch.from_numpy(lb.mean)
        if kind == "k":
            r = rotate(r.view(nb, basis.kv_heads, basis.head_dim), torch.arange(position + ns, position + n),
                       basis.inv_freq, 1).reshape(nb, c)
        out[ns:] = r
    rd.done()
    return out.view(n, basis.kv_heads, basis.head_dim).permute(1, 0, 2).contiguous()


# --- reference twins: float64 numpy, a loop per token ------------------------------------------------


def _rotate_row_ref(row: np.ndarray, p: int, inv_freq: np.ndarray, sign: int) -> np.ndarray:
    """One token ``[H, D]``: pairs (i, i+half) as complex numbers, multiplied by e^{j sign p f_i}."""
    half = inv_freq.size
    z = (row[:, :half] + 1j * row[:, half : 2 * half]) * np.exp(1j * sign * p * inv_freq)[None]
    return np.concatenate([z.real, z.imag, row[:, 2 * half :]], axis=1)


def transform_codes_ref(basis: Basis, layer: int, kind: str, x: np.ndarray, position: int, theta: float,
                        rho: float = 0.5) -> np.ndarray:
    """Codes ``[n - sinks, m]`` of ``x`` ``[H, n, D]``: float64, one token at a time."""
    lb = basis.get(layer, kind)
    m, step = kept_and_step(lb, theta)
    ns = max(0, min(x.shape[1], basis.sink_tokens - position))
    out = np.zeros((x.shape[1] - ns, m), np.int64)
    for t in range(ns, x.shape[1]):
        row = x[:, t, :].astype(np.float64)  # [H, D]
        if kind == "k":
            row = _rotate_row_ref(row, position + t, basis.inv_freq, -1)
        w = (row.reshape(-1) - lb.mean.astype(np.float64)) * lb.scale.astype(np.float64)
        y = lb.basis.astype(np.float64)[:, :m].T @ w
        out[t - ns] = np.clip(np.sign(y) * np.floor(np.abs(y) / step + rho), -QMAX, QMAX)
    return out


def reconstruct_ref(basis: Basis, layer: int, kind: str, codes: np.ndarray, sinks: np.ndarray, position: int,
                    theta: float) -> np.ndarray:
    """``[H, n, D]`` float64 from codes ``[n', m]`` and the exact sink rows ``[H, ns, D]``."""
    lb = basis.get(layer, kind)
    m, step = kept_and_step(lb, theta)
    ns = sinks.shape[1]
    n = ns + codes.shape[0]
    out = np.zeros((basis.kv_heads, n, basis.head_dim))
    out[:, :ns] = sinks
    for t in range(ns, n):
        w = lb.basis.astype(np.float64)[:, :m] @ (codes[t - ns] * step)
        row = (w / lb.scale.astype(np.float64) + lb.mean.astype(np.float64)).reshape(basis.kv_heads, basis.head_dim)
        if kind == "k":
            row = _rotate_row_ref(row, position + t, basis.inv_freq, 1)
        out[:, t] = row
    return out


# --- the registered per-tensor codec and the object writer ----------------------------------------------

_PENDING = threading.local()


class TransformCodec(LossyCodec):
    """``kvtc``: decodes any kvtc tensor from its params and the registered basis they name.

    A codec's ``encode`` sees bytes, dtype and shape only, while kvtc also needs
    the layer, kind, position, basis and budget: objects are written by
    :func:`encode_kvtc_object`, which codes each K/V tensor first and hands the
    results to :func:`kdn.format.objects.encode_object` through this codec.
    """

    name = "kvtc"

    def encode(self, data: Buffer, dtype: str, shape: tuple[int, ...]) -> tuple[bytes, dict]:
        pending = getattr(_PENDING, "by_buffer", None) or {}
        hit = pending.get(id(data))
        if hit is None or hit[0] is not data:
            raise CodecError("kvtc: tensors are encoded by kdn.kernels.transform.encode_kvtc_object (the codec needs "
                             "the basis, layer and position)")
        payload, params = hit[1]
        params = dict(params)
        params["crc32"] = zlib.crc32(payload)
        return payload, params

    def decode(self, data: Buffer, dtype: str, shape: tuple[int, ...], params: dict, out: memoryview | None = None) -> Buffer:
        if dtype not in FLOAT_DTYPES:
            raise CodecError(f"kvtc: decodes to F32, BF16 or F16, not {dtype}")
        mv = memoryview(data).cast("B")
        crc = int_param(params, "crc32", 0, 0xFFFFFFFF, self.name)
        if zlib.crc32(mv) != crc:
            raise CodecError("kvtc: payload CRC-32 mismatch (corrupt or truncated payload)")
        return write_float(decode_tensor(mv, dtype, tuple(shape), params), dtype, out)


def encode_kvtc_object(basis: Basis, theta: float | tuple[float, float], *, tensors: dict[str, torch.Tensor],
                       position: int, encoding: str = "kvtc", rho: float = 0.5, **fields) -> bytes:
    """One KDN object (``kdn.format.objects.encode_object`` fields) whose K/V tensors are kvtc coded.

    ``tensors`` are torch tensors by name (``L{i}.k`` / ``L{i}.v`` ``[H, n, D]``);
    any other tensor is stored lossless (zstd). ``position`` is the position of
    the object's first token (its ``position`` field). ``theta``: one water level, or
    ``(K's, V's)`` (each tensor records its own, so the decoder needs nothing more).
    """
    from kdn.format.objects import encode_object, from_torch

    thetas = dict(zip(KINDS, theta if isinstance(theta, tuple) else (theta, theta)))
    raw = from_torch(tensors)
    pending: dict[int, tuple[Buffer, tuple[bytes, dict]]] = {}
    for name, rt in raw.items():
        m = _KV_NAME.fullmatch(name)
        if m and rt.dtype in FLOAT_DTYPES:
            x, kind = tensors[name].float(), m.group(2)
            pending[id(rt.data)] = (rt.data, encode_tensor(basis, int(m.group(1)), kind, x, position, thetas[kind],
                                                           rt.dtype, rho))
    _PENDING.by_buffer = pending
    try:
        return encode_object(tensors=raw, position=position, encoding=encoding,
                             codec_for=lambda t: "kvtc" if id(t.data) in pending else "zstd", **fields)
    finally:
        _PENDING.by_buffer = None


_THETA: dict[tuple[str, float, str | None], float] = {}


def theta_for(basis: Basis, bits: float, kind: str | None = None) -> float:
    """The allocation's ``theta`` for ``bits`` per value, of K and V or of ``kind`` alone (cached per basis,
    budget and kind: a bisection each)."""
    key = (_address_cached(basis), bits, kind)
    theta = _THETA.get(key)
    if theta is None:
        theta = _THETA[key] = allocate(basis, bits, kind).theta
    return theta


def encode_kvtc(encoding: str, basis: Basis, *, tensors, position: int, **fields) -> bytes:
    """One object in ``kvtc-B`` (``kdn.kernels.encode_as`` fields; ``tensors`` torch or raw tensors by name)."""
    from kdn.format.encodings import kvtc_bits
    from kdn.format.objects import RawTensor, to_torch

    bits = kvtc_bits(encoding)
    if bits is None:
        raise InvalidInput(f"{encoding!r} is not a kvtc-B encoding")
    model_id = fields.get("model_id")
    if model_id is not None and model_id != basis.model_id:
        raise InvalidInput(f"kvtc: the basis is fitted for model {basis.model_id[:16]}..., not {str(model_id)[:16]}...")
    if any(isinstance(t, RawTensor) for t in tensors.values()):
        tensors = to_torch(tensors)
    return encode_kvtc_object(basis, theta_for(basis, bits), tensors=tensors, position=position, encoding=encoding,
                              **fields)


def decoded_cap(basis: Basis, chunk_tokens: int, extra: int = 1 << 20) -> int:
    """An upper bound on what one ``chunk_tokens``-token kvtc object of this basis's model decodes to
    (F32 K and V of every layer, plus ``extra`` for the other tensors): ``max_decoded`` for
    :func:`kdn.format.objects.decode_object`, whose default (16x the blob) refuses kvtc's larger ratios."""
    return 2 * basis.n_layers * basis.channels * max(1, chunk_tokens) * 4 + extra


register_codec(TransformCodec(), replace=True)
