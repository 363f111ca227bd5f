"""A CacheGen-style KV codec (Liu et al., SIGCOMM'24): anchor + delta per token group, entropy coded.

Design (``cachegen-B`` for B in 2..8, one registered codec per bit width):

1. The tensor ``[kv_heads, n, head_dim]`` is viewed as ``[n, C]``: tokens by
   channels (C = kv_heads * head_dim; the token axis is ``ndim-2``, recorded
   as ``axis``).
2. Tokens are cut into groups of ``group`` (16). The first token of a group is
   its anchor, quantized per channel (absmax, B bits). Every other token is
   coded as its delta against the *reconstructed* anchor, quantized per channel
   with its own scale (absmax over the chunk's deltas, B bits). Nearby tokens'
   KV are similar (CacheGen's "token-wise locality"), so the deltas' range is
   smaller than the values' and the same bits give a smaller error; anchoring to
   the reconstruction keeps errors from accumulating along the group.
3. Anchor codes and delta codes are entropy coded with ``constriction``'s rANS
   coder, each under its own categorical distribution: the chunk's histogram of
   that kind of code, stored in the payload (uint16 counts over the occupied
   code range). Deltas concentrate near zero, so B-bit codes cost about B-1.5
   bits each.
4. Bits per layer: CacheGen gives shallow layers more bits. The layer index
   is known to the plan, not to the codec (a codec sees bytes and a shape), so
   :func:`kdn.kernels.encodings.encoding_plan` picks the codec *name* per tensor
   from ``L{i}`` -- ``cachegen-6-5-4`` means 6 bits for the first third of the
   layers, 5 for the middle and 4 for the last -- and each name records its
   bits in ``params``, so decode needs only the header.

Payload: fp16 anchor scales ``[C]`` || fp16 delta scales ``[C]`` || anchor
section || delta section; a section is ``lo:i16, nbins:u16, nwords:u32,
counts:u16[nbins], words:u32[nwords]`` (a single-bin section has no words:
every code is ``lo``). Params: ``axis``, ``bits``, ``group``, ``crc32``.
Error bound per element: the anchor scale / 2 on anchor tokens, the delta
scale / 2 elsewhere.
"""

from __future__ import annotations

import struct

import constriction
import numpy as np
import torch

from kdn.format.codecs import register_codec
from kdn.errors import CodecError
from kdn.kernels.codecs import LossyCodec, Reader, int_param, reduce_axis, tensor_of
from kdn.kernels.quant import delta_dequantize, delta_quantize, qmax_of

DEFAULT_GROUP = 16
_SECTION = struct.Struct("<hHI")  # lo, nbins, nwords


def _model(counts: np.ndarray):
    p = counts.astype(np.float64)
    return constriction.stream.model.Categorical(p / p.sum(), perfect=False)


def encode_symbols(sym: np.ndarray) -> bytes:
    """Integer codes ``[N]`` -> one self-delimiting section: their histogram, then their rANS stream."""
    sym = sym.astype(np.int32, copy=False)
    lo, hi = int(sym.min()), int(sym.max())
    counts = np.bincount(sym - lo, minlength=hi - lo + 1).astype(np.int64)  # counts: [nbins]
    if counts.max() > 0xFFFF:
        # uint16 counts: scale down, keeping every occupied code's count >= 1 (it must stay codable).
        counts = np.where(counts > 0, np.maximum(1, counts * 0xFFFF // counts.max()), 0)
    words = np.empty(0, np.uint32)
    if len(counts) > 1:
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(sym - lo, _model(counts))
        words = coder.get_compressed()
    return _SECTION.pack(lo, len(counts), len(words)) + counts.astype("<u2").tobytes() + words.astype("<u4").tobytes()


def decode_symbols(rd: Reader, n: int, qmax: int, what: str) -> np.ndarray:
    """Read one section from ``rd`` and decode ``n`` codes in ``[-qmax, qmax]``."""
    lo, nbins, nwords = _SECTION.unpack(rd.take(_SECTION.size))
    if nbins < 1 or lo < -qmax or lo + nbins - 1 > qmax:
        raise CodecError(f"{what}: code range [{lo}, {lo + nbins - 1}] outside [-{qmax}, {qmax}]")
    counts = rd.array("<u2", nbins)
    words = rd.array("<u4", nwords).astype(np.uint32)  # an aligned copy for the coder
    if nbins == 1:
        if nwords:
            raise CodecError(f"{what}: a one-code section has {nwords} stray words")
        return np.full(n, lo, np.int32)
    if counts.sum() == 0:
        raise CodecError(f"{what}: empty histogram")
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        sym = coder.decode(_model(counts), n)
        ok = coder.is_empty()
    except Exception as e:  # constriction raises assorted errors on garbage; never crash the caller
        raise CodecError(f"{what}: rANS stream does not decode: {e}") from None
    if not ok or len(sym) != n:
        raise CodecError(f"{what}: rANS stream does not hold exactly {n} codes")
    return sym + lo


class CacheGenCodec(LossyCodec):
    """Anchor + delta quantization at ``bits`` bits per code, rANS coded. See the module docstring.

    ``mode`` picks the axis the codes run along and share a scale over:
    ``channel`` (tokens, axis ``ndim-2``: per-channel scales, anchors and
    deltas along tokens) or ``token`` (the last axis: per-token scales).
    ``group=1`` makes every row an anchor: plain absmax codes, rANS coded.
    """

    def __init__(self, bits: int, group: int = DEFAULT_GROUP, mode: str = "channel", name: str | None = None) -> None:
        assert 2 <= bits <= 8 and group >= 1 and mode in ("channel", "token")
        self.bits, self.group, self.mode = bits, group, mode
        self.name = name or f"cachegen-{bits}"

    def _encode(self, x: torch.Tensor) -> tuple[bytes, dict]:
        axis = reduce_axis(self.mode, x.dim())
        xt = x.reshape(1) if x.dim() == 0 else x.movedim(axis, 0)  # xt: [n, H, D] for K in channel mode
        rows = xt.reshape(xt.shape[0], -1)  # rows: [n, C]
        q, sa16, sd16 = delta_quantize(rows, self.bits, self.group)  # q: [n, C]; sa16, sd16: [C]
        qn = q.numpy()
        anchors = qn[:: self.group].reshape(-1)
        deltas = np.delete(qn, np.s_[:: self.group], axis=0).reshape(-1)
        parts = [sa16.numpy().tobytes(), sd16.numpy().tobytes(), encode_symbols(anchors)]
        if deltas.size:
            parts.append(encode_symbols(deltas))
        return b"".join(parts), {"axis": axis, "bits": self.bits, "group": self.group}

    def _decode(self, mv: memoryview, shape: tuple[int, ...], params: dict) -> torch.Tensor:
        axis = int_param(params, "axis", 0, max(len(shape) - 1, 0), self.name)
        bits = int_param(params, "bits", 2, 8, self.name)
        group = int_param(params, "group", 1, 1 << 16, self.name)
        n = shape[axis] if shape else 1
        c = int(np.prod(shape)) // n
        n_anchor = -(-n // group)
        rd = Reader(mv, self.name)
        sa = tensor_of(rd.take(2 * c), torch.float16, c)  # sa: [C]
        sd = tensor_of(rd.take(2 * c), torch.float16, c)  # sd: [C]
        qmax = qmax_of(bits)
        q = np.empty((n, c), np.int32)  # q: [n, C]
        q[::group] = decode_symbols(rd, n_anchor * c, qmax, self.name).reshape(n_anchor, c)
        if n > n_anchor:
            is_delta = np.arange(n) % group != 0
            q[is_delta] = decode_symbols(rd, (n - n_anchor) * c, qmax, self.name).reshape(-1, c)
        rd.done()
        x = delta_dequantize(torch.from_numpy(q), sa, sd, group)  # x: [n, C]
        if not shape:
            return x.reshape(())
        moved = (n, *shape[:axis], *shape[axis + 1 :])
        return x.reshape(moved).movedim(0, axis)


for _bits in range(2, 9):
    register_codec(CacheGenCodec(_bits), replace=True)
    # The same entropy coder over plain absmax codes (no deltas), keys per channel, values per token.
    for _mode in ("channel", "token"):
        register_codec(CacheGenCodec(_bits, group=1, mode=_mode, name=f"ans{_bits}-{_mode}"), replace=True)
