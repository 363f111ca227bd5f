"""Byte sizes and durations as operators write them: ``2GiB``, ``500MB``, ``1.5G``; ``90s``, ``10m``, ``1h30m``.

Sizes follow the Kubernetes/IEC convention: ``Ki Mi Gi Ti Pi`` (with or
without a trailing ``B``) are powers of 1024; ``K M G T P`` and ``KB MB GB
TB PB`` are powers of 1000; a bare number or ``B`` is bytes. Units are
case-insensitive. A fraction is allowed with a unit and rounds down to
whole bytes (``1.5KiB`` = 1536, ``0.1KiB`` = 102); a bare byte count must be
whole.

Durations are one or more ``NUMBER UNIT`` parts (``ms s m h d``), like Go's
``time.ParseDuration`` plus days; a bare number is seconds.

Everything malformed raises ``InvalidInput`` naming the value; nothing here
returns a negative, NaN or infinite result.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from kdn.errors import InvalidInput

__all__ = ["format_duration", "format_size", "parse_duration", "parse_size"]

MAX_SIZE = (1 << 63) - 1  # fits every int64 counter it will meet (etcd, Prometheus, sidecars)

_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_p] = _SIZE_UNITS[_p + "b"] = 1000**_i
    _SIZE_UNITS[_p + "i"] = _SIZE_UNITS[_p + "ib"] = 1024**_i

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)

_DURATION_UNITS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600), "d": Decimal(86400)}
_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s|m|h|d)", re.IGNORECASE | re.ASCII)
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


def parse_size(text: str | int) -> int:
    """``"2GiB"`` -> 2147483648, ``"500MB"`` -> 500000000, ``"1.5G"`` -> 1500000000, ``"4096"`` -> 4096."""
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= MAX_SIZE:
            raise InvalidInput(f"invalid size {text!r}: must be between 0 and {MAX_SIZE} bytes")
        return text
    if not isinstance(text, str):
        raise InvalidInput(f"invalid size {text!r}: expected a string like 2GiB or 500MB")
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise InvalidInput(f"invalid size {text[:40]!r}: expected a number and a unit, like 2GiB, 500MB or 1.5G")
    number = _decimal(m.group(1), text, "size")
    if _SIZE_UNITS[unit] == 1 and number != number.to_integral_value():
        raise InvalidInput(f"invalid size {text[:40]!r}: a byte count must be whole")
    n = int(number * _SIZE_UNITS[unit])  # rounds down to whole bytes
    if n > MAX_SIZE:
        raise InvalidInput(f"invalid size {text[:40]!r}: larger than {MAX_SIZE} bytes")
    return n


def format_size(n: int) -> str:
    """The largest unit that shows ``n`` exactly with at most one decimal, binary first; else binary, rounded.

    ``2147483648`` -> ``"2 GiB"``, ``1500000000`` -> ``"1.5 GB"``, ``1536`` -> ``"1.5 KiB"``, ``512`` -> ``"512 B"``,
    ``1234567`` -> ``"1.2 MiB"``. Exact forms parse back to ``n``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidInput(f"a size must be a non-negative int, got {n!r}")
    units = [(1024**i, p + "iB") for i, p in enumerate("KMGTP", start=1)] + [(1000**i, p + "B") for i, p in enumerate("KMGTP", start=1)]
    units.sort(key=lambda u: -u[0])  # PiB, PB, TiB, TB, ...: binary first within a power
    exact = [(scale, unit) for scale, unit in units if n >= scale and (n * 10) % scale == 0]
    if not exact and n < 1024:
        return f"{n} B"
    scale, unit = exact[0] if exact else next((s, u) for s, u in units if u.endswith("iB") and n >= s)
    text = f"{n / scale:.1f}".removesuffix(".0")
    return f"{text} {unit}"


def parse_duration(text: str | int | float) -> float:
    """Seconds: ``"90s"`` -> 90.0, ``"10m"`` -> 600.0, ``"2h"`` -> 7200.0, ``"1h30m"`` -> 5400.0, ``"45"`` -> 45.0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = Decimal(text) if text == text and abs(text) != float("inf") else Decimal(-1)
        if seconds < 0:
            raise InvalidInput(f"invalid duration {text!r}: must be a finite number of seconds >= 0")
        return float(seconds)
    if not isinstance(text, str):
        raise InvalidInput(f"invalid duration {text!r}: expected a string like 90s, 10m or 2h")
    s = text.strip()
    if _NUMBER.fullmatch(s):
        return float(_decimal(s, text, "duration"))
    total, pos = Decimal(0), 0
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        total += _decimal(m.group(1), text, "duration") * _DURATION_UNITS[m.group(2).lower()]
        pos = m.end()
    if pos == 0 or pos != len(s):
        raise InvalidInput(f"invalid duration {text[:40]!r}: expected a number and a unit (ms, s, m, h, d), like 90s, 10m or 1h30m")
    return float(total)


def format_duration(seconds: float) -> str:
    """The shortest exact-enough form: ``5400`` -> ``"1h30m"``, ``90`` -> ``"1m30s"``, ``0.25`` -> ``"250ms"``."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < float("inf"):
        raise InvalidInput(f"a duration must be a finite number of seconds >= 0, got {seconds!r}")
    if 0 < seconds < 1:
        ms = round(seconds * 1000, 3)
        return f"{ms:g}ms"
    parts, rest = [], float(seconds)
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        whole = int(rest // scale)
        if whole:
            parts.append(f"{whole}{unit}")
            rest -= whole * scale
    if rest or not parts:
        parts.append(f"{round(rest, 3):g}s")
    return "".join(parts)


def _decimal(number: str, text: str, what: str) -> Decimal:
    try:
        return Decimal(number)
    except InvalidOperation:  # the regexes admit only digits and one dot; kept for safety
        raise InvalidInput(f"invalid {what} {text[:40]!r}") from None
