"""What every registry record shares: the dict and msgpack round trip (``Record``), and the checks each record's
``__post_init__`` makes of its fields (``require`` and the ``check_*``), raising ``InvalidInput`` that names the
record and the field. The record kinds themselves are ``records.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, TypeGuard, TypeVar

import msgpack

from kdn.errors import InvalidInput

R = TypeVar("R", bound="Record")


def require(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidInput(what)


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def check_str(rec: str, name: str, v: object, *, optional: bool = False) -> None:
    require(isinstance(v, str) or (optional and v is None), f"{rec}.{name} must be a string, got {type(v).__name__}")


def check_dict(rec: str, name: str, v: object) -> None:
    require(isinstance(v, dict), f"{rec}.{name} must be a map, got {type(v).__name__}")


def check_sig(rec: str, sig: object) -> None:
    require(isinstance(sig, dict) and len(sig) <= 4 and all(isinstance(k, str) and isinstance(v, str) and len(v) <= 256
                                                             for k, v in sig.items()),
             f"{rec}.sig must be a small map of strings")


class Record:
    """Dict and msgpack round trips shared by every record dataclass."""

    # Every subclass is a dataclass: this tells the type checker so (``asdict``, ``fields``).
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def fields_from(cls, d: object) -> dict[str, Any]:
        """The known fields of ``d``; unknown ones are dropped, missing required ones raise."""
        if not isinstance(d, dict):
            raise InvalidInput(f"{cls.__name__} record must be a map, got {type(d).__name__}")
        out: dict[str, Any] = {}
        missing = []
        for f in dataclasses.fields(cls):
            if f.name in d:
                out[f.name] = d[f.name]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                missing.append(f.name)
        if missing:
            raise InvalidInput(f"{cls.__name__} record lacks required field(s): {', '.join(missing)}")
        return out

    @classmethod
    def from_dict(cls: type[R], d: object) -> R:
        return cls(**cls.fields_from(d))

    def pack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def unpack(cls: type[R], data: bytes) -> R:
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise InvalidInput(f"{cls.__name__} record is not valid msgpack: {e}") from None
        return cls.from_dict(d)
