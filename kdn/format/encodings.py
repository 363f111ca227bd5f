"""What each object-level encoding costs in quality and decode time: the table the client chooses by.

Numbers come from ``bench/quality.py`` (SmolLM2-135M bf16, 4 shipped
documents x 512/1024-token contexts, 256 continuation tokens; see
docs/benchmarks.md, "Lossy codecs"). ``nll_pct`` is the WORST NLL increase
seen over the cases (not the median): a caller's quality budget is a bound,
so the choice must hold for the unlucky document too. ``decode_mbps`` is one
thread, MB of decoded output per second, measured on a loaded 2-core VM:
conservative.

Lossless encodings cost 0 by definition; an encoding missing from this table
is treated as unaffordable for any lossy budget (never chosen silently).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kdn.errors import InvalidInput

LOSSLESS = "lossless"
# The lossless encodings, preferred first: what a read without ``?encoding=`` gets, and what a publish
# must include before a lossy one can be derived.
LOSSLESS_PREFERENCE = ("zstd", "raw")


# ``kvtc-auto``: kvtc at a budget the publisher picked per object from its measured damage
# (``kdn.adapters.hf.kvtc_rate``); each tensor records its own water level, so it decodes as any kvtc.
KVTC_AUTO = "kvtc-auto"


@dataclass(frozen=True)
class EncodingCost:
    lossless: bool
    nll_pct: float  # worst measured NLL increase, %
    ratio: float  # decoded bytes / encoded bytes (bf16 KV)
    decode_mbps: float  # decoded MB/s, one thread


TABLE: dict[str, EncodingCost] = {
    "raw": EncodingCost(True, 0.0, 1.00, 1440.0),
    "zstd": EncodingCost(True, 0.0, 1.45, 404.0),
    "int8": EncodingCost(False, 0.18, 1.96, 227.0),
    "int8z": EncodingCost(False, 0.18, 2.05, 194.0),
    "int4-g32": EncodingCost(False, 0.82, 3.18, 160.0),
    "int4-g64": EncodingCost(False, 0.89, 3.53, 159.0),
    "cachegen-6": EncodingCost(False, 0.58, 2.84, 29.0),
    "ans-5": EncodingCost(False, 0.31, 3.30, 38.0),
    "ans-4": EncodingCost(False, 1.88, 4.25, 30.0),
    "cachegen-4": EncodingCost(False, 3.90, 4.59, 39.0),
    # kvtc-B (the transform codec, B estimated bits per value; docs/benchmarks.md, "Transform codec kvtc"):
    # SmolLM2-135M, 36 contexts, worst NLL increase, median ratio, decode MB/s. Needs the model's basis.
    "kvtc-2p5": EncodingCost(False, 0.68, 5.66, 13.0),
    "kvtc-2": EncodingCost(False, 1.43, 6.96, 13.0),
    "kvtc-1p75": EncodingCost(False, 1.74, 7.89, 15.0),
    "kvtc-1p65": EncodingCost(False, 2.36, 8.34, 16.0),
    "kvtc-1p5": EncodingCost(False, 2.11, 9.11, 17.0),
    # kvtc-auto (per-object budgets, the origin's default RateSettings): 8.35x median on the 36 contexts,
    # worst +1.40% there and +1.64% on the 15 held-out ones (the larger kept: a budget is a bound).
    KVTC_AUTO: EncodingCost(False, 1.64, 8.35, 15.0),
}

# ``kvtc-B``: B bits per value as an integer or ``<int>p<digits>`` (encoding names have no '.').
_KVTC = re.compile(r"kvtc-([0-9]{1,2})(?:p([0-9]{1,3}))?")
KVTC_MAX_BITS = 16.0


def kvtc_bits(encoding: object) -> float | None:
    """The bit budget of a ``kvtc-B`` encoding name (``kvtc-2`` -> 2.0, ``kvtc-1p65`` -> 1.65); None otherwise."""
    m = _KVTC.fullmatch(encoding) if isinstance(encoding, str) else None
    if m is None:
        return None
    bits = float(f"{m.group(1)}.{m.group(2) or '0'}")
    if not 0 < bits <= KVTC_MAX_BITS:
        raise InvalidInput(f"encoding {encoding!r}: kvtc takes 0 < B <= {KVTC_MAX_BITS:g} bits per value")
    return bits


def parse_budget(quality: str | float) -> float | None:
    """``"lossless"`` -> None (lossless only); a number -> the largest NLL increase (%) allowed."""
    if quality == LOSSLESS:
        return None
    try:
        budget = float(quality)
    except (TypeError, ValueError):
        raise InvalidInput(f"quality must be 'lossless' or a maximum NLL increase in %, got {quality!r}") from None
    if not budget >= 0:
        raise InvalidInput(f"quality budget must be >= 0, got {budget}")
    return budget


def affordable(encoding: str, budget: float | None) -> bool:
    """May ``encoding`` be used under ``budget`` (None: lossless only)?"""
    cost = TABLE.get(encoding)
    if cost is None:
        return False
    if cost.lossless:
        return True
    return budget is not None and cost.nll_pct <= budget


def decode_seconds(encoding: str, encoded_size: int) -> float:
    cost = TABLE[encoding]
    return encoded_size * cost.ratio / (cost.decode_mbps * 1e6)
