"""The ``kvtc`` basis (``kdn.kernels.transform``): one model's per-layer, per-kind transform, fitted once
(``kdn.adapters.hf.transform_fit``), published as an object of its own, parsed and checked here, and
registered by address so the decoder finds a tensor's basis by the address in its params.

Basis object (:meth:`Basis.to_bytes`): ``b"KDNBASIS"`` || u32 header length ||
canonical JSON header (model id, n_layers, kv_heads, head_dim, the RoPE
``inv_freq`` count, sink tokens, ``alpha`` per layer and kind) || float64
``inv_freq`` || per layer, K then V: float32 mean, scale, var ``[C]`` and
basis ``[C, C]``. Its address is the BLAKE3 of those bytes
(:func:`kdn.format.address.blob_digest`), as for any blob.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from dataclasses import dataclass

import numpy as np

from kdn.format.address import Address, canonical_json, content_address
from kdn.format.codecs import Buffer
from kdn.errors import CodecError
from kdn.kernels.codecs import Reader, int_param

MAGIC = b"KDNBASIS"
BASIS_VERSION = 1
MAX_BASIS_HEADER = 1 << 16
MAX_LAYERS = 1024
MAX_CHANNELS = 16384  # kv_heads * head_dim
DEFAULT_MAX_BASIS_BYTES = 1 << 30
DEFAULT_SINKS = 4
KINDS = ("k", "v")
_HLEN = struct.Struct("<I")


@dataclass(frozen=True)
class LayerBasis:
    """The transform of one layer's K or V: ``y = (scale * (r - mean)) @ basis``."""

    mean: np.ndarray  # [C] float32
    scale: np.ndarray  # [C] float32, > 0
    var: np.ndarray  # [C] float32, decreasing: variance of each coefficient on the calibration text
    basis: np.ndarray  # [C, C] float32, orthonormal columns
    alpha: float  # KL (nats/token) per unit noise variance of one coefficient


@dataclass(frozen=True)
class Basis:
    model_id: str
    n_layers: int
    kv_heads: int
    head_dim: int
    inv_freq: np.ndarray  # [rot_dim / 2] float64: the RoPE frequencies K is un-rotated with
    layers: tuple[tuple[LayerBasis, LayerBasis], ...]  # per layer: (K, V)
    sink_tokens: int = DEFAULT_SINKS

    @property
    def channels(self) -> int:
        return self.kv_heads * self.head_dim

    def get(self, layer: int, kind: str) -> LayerBasis:
        return self.layers[layer][KINDS.index(kind)]

    # --- serialization -----------------------------------------------------------

    def _header(self) -> dict:
        return {
            "v": BASIS_VERSION,
            "model_id": self.model_id,
            "n_layers": self.n_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "n_freq": int(self.inv_freq.size),
            "sink_tokens": self.sink_tokens,
            "alpha": [[float(lb.alpha) for lb in pair] for pair in self.layers],
        }

    def to_bytes(self) -> bytes:
        head = canonical_json(self._header()).encode()
        parts = [MAGIC, _HLEN.pack(len(head)), head, np.asarray(self.inv_freq, "<f8").tobytes()]
        for pair in self.layers:
            for lb in pair:
                for a in (lb.mean, lb.scale, lb.var, lb.basis):
                    parts.append(np.ascontiguousarray(a, "<f4").tobytes())
        return b"".join(parts)

    @property
    def address(self) -> Address:
        return content_address(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: Buffer, *, max_bytes: int = DEFAULT_MAX_BASIS_BYTES) -> Basis:
        """Parse a basis object; sizes from its header are checked against the data and limits before allocating."""
        mv = memoryview(data).cast("B")
        if len(mv) > max_bytes:
            raise CodecError(f"basis object of {len(mv)} bytes exceeds max_bytes={max_bytes}")
        if len(mv) < len(MAGIC) + 4 or bytes(mv[: len(MAGIC)]) != MAGIC:
            raise CodecError("not a KDN basis object (bad magic)")
        (hlen,) = _HLEN.unpack_from(mv, len(MAGIC))
        if hlen > MAX_BASIS_HEADER or len(MAGIC) + 4 + hlen > len(mv):
            raise CodecError(f"basis header length {hlen} exceeds the object or {MAX_BASIS_HEADER}")
        rd = Reader(mv, "basis")
        rd.take(len(MAGIC) + 4)
        try:
            h = json.loads(bytes(rd.take(hlen)))
        except (ValueError, UnicodeDecodeError) as e:
            raise CodecError(f"basis header is not JSON: {e}") from None
        if not isinstance(h, dict) or h.get("v") != BASIS_VERSION:
            raise CodecError(f"basis header: unsupported version {str(h.get('v') if isinstance(h, dict) else h)[:20]}")
        n_layers = int_param(h, "n_layers", 1, MAX_LAYERS, "basis")
        kv_heads = int_param(h, "kv_heads", 1, MAX_CHANNELS, "basis")
        head_dim = int_param(h, "head_dim", 2, MAX_CHANNELS, "basis")
        n_freq = int_param(h, "n_freq", 0, head_dim // 2, "basis")
        sinks = int_param(h, "sink_tokens", 0, 1 << 16, "basis")
        c = kv_heads * head_dim
        if c > MAX_CHANNELS:
            raise CodecError(f"basis: {kv_heads} x {head_dim} channels exceed {MAX_CHANNELS}")
        want = 8 * n_freq + n_layers * 2 * 4 * (3 * c + c * c)
        if rd.pos + want != len(mv):
            raise CodecError(f"basis: header promises {want} bytes of arrays, the object holds {len(mv) - rd.pos}")
        model_id, alpha = h.get("model_id"), h.get("alpha")
        if not isinstance(model_id, str) or len(model_id) > 256:
            raise CodecError("basis: model_id missing or not a short string")
        if (not isinstance(alpha, list) or len(alpha) != n_layers
                or not all(isinstance(p, list) and len(p) == 2 for p in alpha)
                or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and a > 0
                           for p in alpha for a in p)):
            raise CodecError("basis: alpha must be one positive finite (K, V) pair per layer")
        inv_freq = rd.array("<f8", n_freq).astype(np.float64)
        layers = []
        for i in range(n_layers):
            pair = []
            for j in range(2):
                mean, scale, var = (rd.array("<f4", c).astype(np.float32) for _ in range(3))
                basis = rd.array("<f4", c * c).astype(np.float32).reshape(c, c)
                if not (np.isfinite(mean).all() and np.isfinite(basis).all() and np.isfinite(var).all()
                        and np.isfinite(scale).all() and (scale > 0).all() and (var >= 0).all()):
                    raise CodecError(f"basis: layer {i} {KINDS[j]} holds non-finite or non-positive values")
                pair.append(LayerBasis(mean, scale, var, basis, float(alpha[i][j])))
            layers.append((pair[0], pair[1]))
        rd.done()
        return cls(model_id, n_layers, kv_heads, head_dim, inv_freq, tuple(layers), sinks)


# --- loaded bases, by address (the decoder finds a tensor's basis by the address in its params) --------

_BASES: dict[str, Basis] = {}
_BASES_LOCK = threading.Lock()


def register_basis(basis: Basis) -> Address:
    """Make ``basis`` available to :func:`decode_tensor` under its address; returns the address."""
    addr = basis.address  # (the BLAKE3 of its bytes: an address by construction)
    with _BASES_LOCK:
        _BASES[addr] = basis
    return addr


def get_basis(address: object) -> Basis:
    basis = _BASES.get(address) if isinstance(address, str) else None
    if basis is None:
        raise CodecError(f"kvtc: basis {str(address)[:16]}... is not loaded (fetch it and register_basis)")
    return basis
