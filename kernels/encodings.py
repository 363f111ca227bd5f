"""An object-level encoding's plan and its encoder: which lossy codec codes each tensor of an object in
``int8``, ``int4-g64``, ``cachegen-6-5-4``, ``kvtc-2`` ..., and an object encoded that way (``encode_as``).

Apart from codecs.py (the codecs themselves) so that the codecs, the kvtc basis and the kvtc transform stand
in one line (codecs <- basis <- transform <- encodings), not in a circle.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import cast

from kdn.errors import InvalidInput
from kdn.format.encodings import KVTC_AUTO, kvtc_bits
from kdn.kernels.codecs import _KV_NAME, FLOAT_DTYPES

_CACHEGEN = re.compile(r"(cachegen|ans)((?:-\d){1,3})")
_PAIRS = {
    "int8": ("int8-channel", "int8-token"),
    "int8z": ("int8z-channel", "int8z-token"),
    "int4-g32": ("int4-g32-channel", "int4-g32-token"),
    "int4-g64": ("int4-g64-channel", "int4-g64-token"),
}
# Keys per channel, values per token (KIVI, Liu et al. 2024): keys carry outlier
# channels, values do not, and a value's error is averaged over the attention weights.
LOSSLESS_STATE_CODEC = "zstd"


def cachegen_bits(encoding: str) -> tuple[str, tuple[int, ...]] | None:
    """``"cachegen-6-5-4"`` -> ``("cachegen", (6, 5, 4))`` (bits for the first, middle, last third of layers); None if not one."""
    m = _CACHEGEN.fullmatch(encoding)
    if not m:
        return None
    bits = tuple(int(b) for b in m.group(2)[1:].split("-"))
    if not all(2 <= b <= 8 for b in bits):
        raise InvalidInput(f"encoding {encoding!r}: bit widths must be 2..8")
    return m.group(1), bits


def encoding_names() -> list[str]:
    """Object-level encodings :func:`encoding_plan` knows (``cachegen``/``ans`` take 1 or 3 bit widths)."""
    return ["raw", "zstd", *_PAIRS, "cachegen-B[-B-B]", "ans-B[-B-B]", "kvtc-B (2, 2p5, 1p65...)", KVTC_AUTO]


def encoding_plan(encoding: str, *, n_layers: int | None = None) -> Callable:
    """The ``codec_for(RawTensor) -> codec name`` of an object-level ``encoding``.

    - ``raw`` / ``zstd``: every tensor (lossless).
    - ``int8``, ``int8z``, ``int4-g32``, ``int4-g64``: ``L{i}.k`` per channel,
      ``L{i}.v`` per token (see the codec table above).
    - ``cachegen-B``: every K/V with ``cachegen-B`` (anchor + delta along tokens,
      per-channel scales, rANS). ``ans-B``: keys ``ans{B}-channel``, values
      ``ans{B}-token`` (absmax codes, rANS, no deltas).
    - ``cachegen-B1-B2-B3`` / ``ans-B1-B2-B3``: the first, middle and last third
      of ``n_layers`` layers get B1, B2, B3 bits (CacheGen: shallow layers are
      the most sensitive). Needs ``n_layers``.
    - ``kvtc-B``: every K/V with ``kvtc`` (the transform codec,
      ``kdn.kernels.transform``) at an estimated budget of B bits per value
      (``2``, ``2p5`` = 2.5, ``1p65``...). Encoding it needs the model's basis:
      :func:`encode_as` takes it as ``basis=``.
    - ``kvtc-auto``: kvtc at a budget picked per object by the publisher's
      rate control, which runs the model (``kdn.adapters.hf.kvtc_rate``), so
      :func:`encode_as` refuses it.

    Everything else -- Mamba ``L{i}.conv`` / ``L{i}.ssm`` states, non-float
    tensors -- stays lossless (zstd): a recurrent state's error would be carried
    into every later token, and no measured quality row says it may be lossy.
    """
    if encoding in ("raw", "zstd"):
        return lambda t: encoding
    if encoding == KVTC_AUTO or kvtc_bits(encoding) is not None:
        return lambda t: "kvtc" if _KV_NAME.fullmatch(t.name) and t.dtype in FLOAT_DTYPES else LOSSLESS_STATE_CODEC
    pair = _PAIRS.get(encoding)
    family_bits = cachegen_bits(encoding) if pair is None and isinstance(encoding, str) else None
    if pair is None and family_bits is None:
        raise InvalidInput(f"unknown encoding {str(encoding)[:40]!r}: use one of {encoding_names()}")
    family, bits = family_bits or ("", ())
    if len(bits) == 2:
        raise InvalidInput(f"encoding {encoding!r}: give 1 bit width, or 3 (first, middle, last third of the layers)")
    if len(bits) == 3 and (not isinstance(n_layers, int) or n_layers < 1):
        raise InvalidInput(f"encoding {encoding!r} gives bits per third of the layers: pass n_layers")

    def codec_for(t) -> str:
        m = _KV_NAME.fullmatch(t.name)
        if m is None or t.dtype not in FLOAT_DTYPES:
            return LOSSLESS_STATE_CODEC
        if pair is not None:
            return pair[0] if m.group(2) == "k" else pair[1]
        # (three widths need n_layers: checked above)
        b = bits[0] if len(bits) == 1 else bits[min(3 * int(m.group(1)) // cast(int, n_layers), 2)]
        if family == "cachegen":
            return f"cachegen-{b}"
        return f"ans{b}-channel" if m.group(2) == "k" else f"ans{b}-token"

    return codec_for


def encode_as(encoding: str, *, n_layers: int, basis=None, **fields) -> bytes:
    """One object (``kdn.format.objects.encode_object`` fields) in ``encoding``, each tensor coded by its plan.

    ``kvtc-B`` also needs the model's ``basis`` (a ``kdn.kernels.transform.Basis``); InvalidInput without it.
    """
    from kdn.format.objects import encode_object

    if encoding == KVTC_AUTO:
        raise InvalidInput(f"encoding {KVTC_AUTO!r} is chosen per object by the publisher's rate control, which "
                           "needs the model: kdn.adapters.hf.kvtc_rate.encode_auto, not encode_as")
    bits = kvtc_bits(encoding)
    if bits is not None:
        from kdn.kernels.transform import encode_kvtc

        if basis is None:
            raise InvalidInput(f"encoding {encoding!r} needs the model's kvtc basis (none is configured)")
        return encode_kvtc(encoding, basis, **fields)

    codec_for = None if encoding in ("raw", "zstd") else encoding_plan(encoding, n_layers=n_layers)
    return encode_object(encoding=encoding, codec_for=codec_for, **fields)
