"""When a policy holds: a cron-like schedule in an explicit time zone, and the length of each window.

``Schedule(at="0 8 * * 1-5", tz="Europe/Berlin", for_s=7200)`` (``kdn policy set ... --at "0 8 * * 1-5"
--tz Europe/Berlin --for 2h``): a window opens at every local time in ``tz`` that the five fields match
(minute, hour, day of month, month, day of week) and stays open ``for_s`` seconds of elapsed time.

Rules, all checked when a schedule is made (``InvalidInput``, one line naming the field):

- A field is ``*``, a number, a range ``a-b``, either with a step (``*/15``, ``8-18/2``; ``5/15`` is
  ``5-max/15``), or a comma list of those. Months may be named ``jan``-``dec``, days ``sun``-``sat``;
  day of week runs 0-7, 0 and 7 both Sunday.
- Day of month and day of week: when both are restricted (neither is ``*``), a day matches if either does,
  as cron has it (``0 8 1 * mon``: the 1st, and every Monday); otherwise the restricted one decides.
- The zone is explicit, an IANA name (``Europe/Berlin``, ``UTC``): never the machine's own, which differs
  between the operator's laptop and every edge. Starts are computed in the zone, with its rules on that
  date: a start at a time the clocks skip (02:30 on the night they move forward) opens when 02:30 would have
  been under the old offset (03:30 new time); a start at a time that happens twice (the night they move
  back) opens once, the first time.
- A window is at most the shortest gap between two starts, in local time (a longer one would run into the
  next), and at most a year. On a night the clocks move forward two windows may touch or overlap by the
  hour skipped: they merge (``window`` returns the later one, which ends last).
- A schedule that matches no date (``0 0 30 2 *``) is refused: it would never hold.

Pure: nothing here reads a clock. The caller passes ``now`` (seconds since the epoch); the edge's policy
engine (``edge/policies.py``) asks ``window(now)`` after every change and again when the window's state
changes, on a clock it was given.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kdn.errors import InvalidInput

__all__ = ["MAX_WINDOW_S", "Schedule", "Window"]

MAX_WINDOW_S = 366 * 86400.0  # a window of at most a year: the longest a yearly schedule can hold
MAX_AT_LEN = 120
# Whole 28-year cycles of the Gregorian calendar's weekdays and leap days (between 1901 and 2099): a field
# combination that matches a date at all matches one in any 28 years, and the gaps between matching days
# repeat with this period.
CYCLE_DAYS = (date(2028, 1, 1) - date(2000, 1, 1)).days

MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, lowest, highest, names of lowest.. in order)
FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day-of-month", 1, 31, ()), ("month", 1, 12, MONTHS),
          ("day-of-week", 0, 7, DAYS))
# Names ZoneInfo resolves that are not an explicit zone: the machine's own, and placeholders.
NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})
_ZONE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+)*")


@dataclass(frozen=True)
class Window:
    """One window of a schedule: open from ``start`` (included) to ``end`` (excluded), seconds since the epoch."""

    start: float
    end: float

    def holds(self, t: float) -> bool:
        return self.start <= t < self.end


@dataclass(frozen=True)
class Cron:
    """The five fields, parsed: the values each admits, and the times of day a matching day starts windows."""

    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]  # of the month
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_any: bool  # day of month was '*'
    weekdays_any: bool  # day of week was '*'

    @property
    def times(self) -> tuple[tuple[int, int], ...]:
        """(hour, minute) of each start on a matching day, in order."""
        return tuple((h, m) for h in sorted(self.hours) for m in sorted(self.minutes))

    def matches(self, d: date) -> bool:
        if d.month not in self.months:
            return False
        by_day, by_weekday = d.day in self.days, (d.weekday() + 1) % 7 in self.weekdays
        if self.days_any or self.weekdays_any:
            return by_day and by_weekday
        return by_day or by_weekday  # both restricted: either, as cron has it


@dataclass(frozen=True)
class Schedule:
    """When a policy holds: windows of ``for_s`` seconds opening where ``at`` (five cron fields) matches in the
    IANA zone ``tz``. Checked when made; ``at`` is kept with single spaces, ``for_s`` as a float (the signed
    payload is built from these, so a record reads back as it was signed)."""

    at: str
    tz: str
    for_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.at, str) or not self.at.strip():
            raise InvalidInput("a schedule needs --at: five fields (minute hour day-of-month month day-of-week), "
                               "like '0 8 * * 1-5'")
        object.__setattr__(self, "at", " ".join(self.at.split()))
        cron = _cron(self.at)
        _zone(self.tz)
        s = self.for_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise InvalidInput(f"schedule {self.at!r}: the window (--for) must be a time longer than zero, like 2h")
        object.__setattr__(self, "for_s", float(s))
        if s > MAX_WINDOW_S:
            raise InvalidInput(f"schedule {self.at!r}: a window of {_words(s)} is longer than a year")
        gap = _shortest_gap(cron)
        if gap is not None and s > gap:
            raise InvalidInput(f"schedule {self.at!r}: a window of {_words(s)} is longer than the shortest gap "
                               f"between its starts ({_words(gap)}): each would run into the next")

    @classmethod
    def from_dict(cls, d: object) -> Schedule:
        """The wire form (``to_dict``), as a policy record holds it."""
        if not isinstance(d, Mapping) or not {"at", "tz", "for_s"} <= d.keys():
            raise InvalidInput("Policy.schedule must be a map of at, tz and for_s")
        return cls(at=d["at"], tz=d["tz"], for_s=d["for_s"])

    def to_dict(self) -> dict[str, object]:
        return {"at": self.at, "tz": self.tz, "for_s": self.for_s}

    def describe(self) -> str:
        """``0 8 * * 1-5 Europe/Berlin for 2h``: what ``kdn policy ls`` and the console show."""
        return f"{self.at} {self.tz} for {_words(self.for_s)}"

    def window(self, now: float) -> Window:
        """The window open at ``now``, else the next one to open."""
        zone = _zone(self.tz)
        day = datetime.fromtimestamp(now, zone).date()
        # The latest start at or before now: its window is the one that holds now, if any does (an earlier
        # start of the same length ends earlier).
        first = datetime.fromtimestamp(now - self.for_s, zone).date() - timedelta(days=1)
        d = day
        while d >= first:
            past = [s for s in self._starts(d, zone) if s <= now]
            if past:
                if past[-1] + self.for_s > now:
                    return Window(past[-1], past[-1] + self.for_s)
                break
            d -= timedelta(days=1)
        d = day
        for _ in range(CYCLE_DAYS + 366):  # (a schedule that was made matches a date in every cycle)
            ahead = [s for s in self._starts(d, zone) if s > now]
            if ahead:
                return Window(ahead[0], ahead[0] + self.for_s)
            d += timedelta(days=1)
        raise AssertionError(f"schedule {self.at!r} found no start after {now}")  # pragma: no cover

    def _starts(self, d: date, zone: ZoneInfo) -> list[float]:
        """The instants the windows of local date ``d`` open, in order (fold 0: a skipped time under the old
        offset, a repeated one the first time; two local times that land on one instant open one window)."""
        cron = _cron(self.at)
        if not cron.matches(d):
            return []
        return sorted({datetime(d.year, d.month, d.day, h, m, tzinfo=zone).timestamp() for h, m in cron.times})


@functools.lru_cache(maxsize=256)
def _cron(at: str) -> Cron:
    if len(at) > MAX_AT_LEN:
        raise InvalidInput(f"schedule {at[:40]!r}...: longer than {MAX_AT_LEN} characters")
    parts = at.split()
    if len(parts) != 5:
        raise InvalidInput(f"schedule {at!r}: {len(parts)} fields; a schedule has 5 (minute hour day-of-month "
                           "month day-of-week), like '0 8 * * 1-5'")
    sets = [_field(at, text, *spec) for text, spec in zip(parts, FIELDS)]
    weekdays = frozenset(v % 7 for v in sets[4])  # 7 is Sunday too
    cron = Cron(sets[0], sets[1], sets[2], sets[3], weekdays, parts[2].startswith("*"), parts[4].startswith("*"))
    if not any(cron.matches(date(2000, 1, 1) + timedelta(days=i)) for i in range(CYCLE_DAYS)):
        raise InvalidInput(f"schedule {at!r}: matches no date (day {parts[2]} of month {parts[3]} never comes)")
    return cron


def _field(at: str, text: str, name: str, lo: int, hi: int, names: tuple[str, ...]) -> frozenset[int]:
    out: set[int] = set()
    for item in text.split(","):
        where = f"schedule {at!r}: {name}"
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                raise InvalidInput(f"{where} {item!r}: the step after / must be a whole number of at least 1")
            step = int(step_text)
        if base == "*":
            first, last = lo, hi
        elif "-" in base:
            a, _, b = base.partition("-")
            first, last = _value(where, a, lo, hi, names), _value(where, b, lo, hi, names)
            if first > last:
                raise InvalidInput(f"{where} {item!r}: the range runs backwards")
        else:
            first = _value(where, base, lo, hi, names)
            last = hi if slash else first
        out.update(range(first, last + 1, step))
    return frozenset(out)


def _value(where: str, text: str, lo: int, hi: int, names: tuple[str, ...]) -> int:
    if text.isdigit():
        v = int(text)
        if not lo <= v <= hi:
            raise InvalidInput(f"{where} {v} is out of range {lo}-{hi}")
        return v
    if text.lower() in names:
        return names.index(text.lower()) + lo
    allowed = f", or a name ({names[0]}-{names[-1]})" if names else ""
    raise InvalidInput(f"{where} {text!r}: not a number, a range, a step or *{allowed}")


def _zone(tz: object) -> ZoneInfo:
    if tz is None or tz == "":
        raise InvalidInput("a schedule needs an explicit time zone (--tz): an IANA name like Europe/Berlin or UTC")
    if not isinstance(tz, str) or len(tz) > 64 or not _ZONE_NAME.fullmatch(tz) or tz in NOT_ZONES:
        raise InvalidInput(f"unknown time zone {str(tz)[:64]!r}: give an IANA name like Europe/Berlin or UTC")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidInput(f"unknown time zone {tz!r}: give an IANA name like Europe/Berlin or UTC") from None


@functools.lru_cache(maxsize=256)
def _shortest_gap(cron: Cron) -> float | None:
    """Seconds between the two closest starts in local time (None: one start in a whole cycle). Within a day,
    the closest times of day; across days, the last time of one matching day to the first of the next."""
    minutes = [h * 60 + m for h, m in cron.times]
    days = [i for i in range(CYCLE_DAYS) if cron.matches(date(2000, 1, 1) + timedelta(days=i))]
    gaps = [b - a for a, b in zip(minutes, minutes[1:])]
    day_gaps = [b - a for a, b in zip(days, days[1:])] + ([days[0] + CYCLE_DAYS - days[-1]] if len(days) > 1 else [])
    if day_gaps:
        gaps.append(min(day_gaps) * 1440 - (minutes[-1] - minutes[0]))
    return min(gaps) * 60.0 if gaps else None


def _words(seconds: float) -> str:
    from kdn.units import format_duration

    return format_duration(seconds)
