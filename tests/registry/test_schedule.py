"""A policy's schedule (kdn/registry/schedule.py): windows computed in the zone across daylight-saving changes and
month ends, the checks that refuse a bad one with one line, and the schedule inside a policy's record and its
signature. Pure: every instant is passed in, no clock is read.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from kdn.errors import InvalidInput
from kdn.registry import Policy
from kdn.registry.policy_records import policy_from_options, policy_row, validate_policy
from kdn.registry.schedule import Schedule, Window
from kdn.registry.signing import Signer, Verifier, payload

BERLIN, NEW_YORK, UTC = ZoneInfo("Europe/Berlin"), ZoneInfo("America/New_York"), ZoneInfo("UTC")
HOUR, DAY = 3600.0, 86400.0


def t(zone: ZoneInfo, *when: int, fold: int = 0) -> float:
    return datetime(*when, tzinfo=zone, fold=fold).timestamp()


def local(zone: ZoneInfo, ts: float) -> tuple[str, str]:
    """``(local wall time, UTC offset)`` of an instant: what an operator in the zone would read."""
    d = datetime.fromtimestamp(ts, zone)
    return d.strftime("%Y-%m-%d %a %H:%M"), d.strftime("%z")


def starts(s: Schedule, now: float, n: int) -> list[float]:
    """The next ``n`` window starts, stepping ``now`` to each window's end as the edge's clock would."""
    out = []
    for _ in range(n):
        w = s.window(now)
        out.append(w.start)
        now = w.end
    return out


def test_weekday_mornings_skip_the_weekend_and_keep_eight_oclock_across_the_spring_change():
    s = Schedule("0 8 * * 1-5", "Europe/Berlin", 2 * HOUR)
    fri = t(BERLIN, 2025, 3, 28, 7, 0)
    got = starts(s, fri, 3)
    # Clocks move forward on Sunday 30 March: Friday's 08:00 is CET (+0100), Monday's CEST (+0200).
    assert [local(BERLIN, x) for x in got] == [("2025-03-28 Fri 08:00", "+0100"), ("2025-03-31 Mon 08:00", "+0200"),
                                              ("2025-04-01 Tue 08:00", "+0200")]
    assert got[1] - got[0] == 3 * DAY - HOUR  # an hour fewer elapsed over the change
    assert s.window(fri) == Window(got[0], got[0] + 2 * HOUR)


def test_the_window_open_now_is_returned_until_its_end_then_the_next():
    s = Schedule("0 8 * * 1-5", "Europe/Berlin", 2 * HOUR)
    start = t(BERLIN, 2025, 6, 2, 8, 0)
    for now in (start, start + 1, start + 2 * HOUR - 0.001):
        w = s.window(now)
        assert w == Window(start, start + 2 * HOUR) and w.holds(now)
    after = s.window(start + 2 * HOUR)  # the end is not in the window
    assert after.start == t(BERLIN, 2025, 6, 3, 8, 0) and not after.holds(start + 2 * HOUR)


def test_a_window_that_spans_the_autumn_change_lasts_its_elapsed_time():
    s = Schedule("0 1 * * *", "Europe/Berlin", 3 * HOUR)
    w = s.window(t(BERLIN, 2025, 10, 26, 0, 0))
    assert local(BERLIN, w.start) == ("2025-10-26 Sun 01:00", "+0200")
    assert local(BERLIN, w.end) == ("2025-10-26 Sun 03:00", "+0100")  # 3 h later: 02:00-03:00 happened twice


def test_a_start_the_clocks_skip_opens_when_it_would_have_under_the_old_offset():
    s = Schedule("30 2 * * *", "Europe/Berlin", HOUR)
    got = starts(s, t(BERLIN, 2025, 3, 29, 12, 0), 2)
    # 02:30 does not exist on 30 March: it opens at 01:30 UTC, 03:30 CEST.
    assert [local(BERLIN, x) for x in got] == [("2025-03-30 Sun 03:30", "+0200"), ("2025-03-31 Mon 02:30", "+0200")]
    assert got[0] == datetime(2025, 3, 30, 1, 30, tzinfo=UTC).timestamp()


def test_a_start_that_happens_twice_opens_once_the_first_time():
    s = Schedule("30 2 * * *", "Europe/Berlin", HOUR)
    got = starts(s, t(BERLIN, 2025, 10, 25, 12, 0), 3)
    assert [local(BERLIN, x) for x in got] == [("2025-10-26 Sun 02:30", "+0200"), ("2025-10-27 Mon 02:30", "+0100"),
                                              ("2025-10-28 Tue 02:30", "+0100")]
    # The second 02:30 (+0100) is inside no window of its own: the first one ended there.
    second = t(BERLIN, 2025, 10, 26, 2, 30, fold=1)
    assert second == got[0] + HOUR and s.window(second).start == got[1]


def test_every_quarter_hour_through_the_spring_gap_has_no_duplicate_and_no_hole_past_the_gap():
    s = Schedule("*/15 * * * *", "America/New_York", 15 * 60)
    got = starts(s, t(NEW_YORK, 2025, 3, 9, 1, 0), 12)
    assert len(set(got)) == len(got) and got == sorted(got)
    # 02:00-02:59 does not exist on 9 March in New York: its four starts land on 03:00-03:45 EDT, which also
    # start themselves, so each such instant opens one window.
    assert [local(NEW_YORK, x)[0][-5:] for x in got] == ["01:00", "01:15", "01:30", "01:45", "03:00", "03:15",
                                                         "03:30", "03:45", "04:00", "04:15", "04:30", "04:45"]


@pytest.mark.parametrize("at, frm, want", [
    ("0 0 31 * *", (2025, 1, 31, 12), ["2025-03-31", "2025-05-31", "2025-07-31"]),  # months without a 31st skipped
    ("0 0 29 2 *", (2025, 1, 1, 0), ["2028-02-29", "2032-02-29", "2036-02-29"]),  # leap days only
    ("0 0 28-31 * *", (2025, 2, 27, 0), ["2025-02-28", "2025-03-28", "2025-03-29"]),  # February ends on the 28th
    ("0 0 1 * mon", (2025, 9, 1, 12), ["2025-09-08", "2025-09-15", "2025-09-22"]),  # both restricted: either
    ("0 12 * dec,jan-feb sun", (2025, 11, 29, 0), ["2025-12-07", "2025-12-14", "2025-12-21"]),
])
def test_month_ends_leap_days_and_day_matching(at, frm, want):
    got = starts(Schedule(at, "UTC", 60), t(UTC, *frm), 3)
    assert [local(UTC, x)[0][:10] for x in got] == want


def test_year_end_rolls_into_january():
    s = Schedule("0 23 31 12 *", "Europe/Berlin", 2 * HOUR)
    w = s.window(t(BERLIN, 2025, 12, 31, 23, 30))
    assert w.holds(t(BERLIN, 2026, 1, 1, 0, 59)) and local(BERLIN, w.end)[0] == "2026-01-01 Thu 01:00"
    assert local(BERLIN, s.window(w.end).start)[0] == "2026-12-31 Thu 23:00"


def test_a_year_of_weekday_windows_stays_at_local_eight_through_both_changes():
    s = Schedule("0 8 * * mon-fri", "Europe/Berlin", 2 * HOUR)
    got = starts(s, t(BERLIN, 2025, 1, 1, 0, 0), 261)  # 2025 has 261 weekdays
    days = {datetime.fromtimestamp(x, BERLIN).date() for x in got}
    assert len(days) == 261 and all(d.year == 2025 and d.weekday() < 5 for d in days)
    assert {datetime.fromtimestamp(x, BERLIN).strftime("%H:%M") for x in got} == {"08:00"}


@pytest.mark.parametrize("at, tz, for_s, words", [
    ("0 8 * *", "UTC", HOUR, "4 fields; a schedule has 5"),
    ("0 8 * * * *", "UTC", HOUR, "6 fields"),
    ("60 8 * * *", "UTC", HOUR, "minute 60 is out of range 0-59"),
    ("0 25 * * *", "UTC", HOUR, "hour 25 is out of range 0-23"),
    ("0 8 0 * *", "UTC", HOUR, "day-of-month 0 is out of range 1-31"),
    ("0 8 * 13 *", "UTC", HOUR, "month 13 is out of range 1-12"),
    ("0 8 * * 8", "UTC", HOUR, "day-of-week 8 is out of range 0-7"),
    ("0 8 * * mon-funday", "UTC", HOUR, "not a number, a range, a step or *, or a name (sun-sat)"),
    ("0 17-9 * * *", "UTC", HOUR, "the range runs backwards"),
    ("0 8 * dec-feb *", "UTC", HOUR, "month 'dec-feb': the range runs backwards"),  # no wrapping: dec,jan-feb
    ("*/0 * * * *", "UTC", 60, "the step after / must be a whole number of at least 1"),
    ("0 8 ,1 * *", "UTC", HOUR, "day-of-month '': not a number"),
    ("0 0 30 2 *", "UTC", HOUR, "matches no date"),
    ("0 8 * * *", None, HOUR, "needs an explicit time zone"),
    ("0 8 * * *", "", HOUR, "needs an explicit time zone"),
    ("0 8 * * *", "Europe/Berln", HOUR, "unknown time zone 'Europe/Berln'"),
    ("0 8 * * *", "localtime", HOUR, "unknown time zone 'localtime'"),  # the machine's own is not explicit
    ("0 8 * * *", "../etc/passwd", HOUR, "unknown time zone"),
    ("0 8 * * *", "UTC", 0, "longer than zero"),
    ("0 8 * * *", "UTC", float("nan"), "longer than zero"),
    ("0 8,9 * * *", "UTC", 2 * HOUR, "2h is longer than the shortest gap between its starts (1h)"),
    ("0 23 * * *", "UTC", 25 * HOUR, "1d1h is longer than the shortest gap between its starts (1d)"),
    ("0 8 1 * *", "UTC", 29 * DAY, "(28d)"),  # February: the 1st comes 28 days after the 1st
    ("0 22 * * fri", "UTC", 8 * DAY, "(7d)"),
    ("0 0 1 1 *", "UTC", 400 * DAY, "longer than a year"),
    ("", "UTC", HOUR, "needs --at"),
])
def test_a_bad_schedule_is_refused_with_one_line(at, tz, for_s, words):
    with pytest.raises(InvalidInput) as e:
        Schedule(at, tz, for_s)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_window_as_long_as_the_gap_is_allowed_and_spacing_is_normalised():
    s = Schedule("  0   8,9  * *  *  ", "UTC", HOUR)  # back to back: 08:00-10:00 held every day
    assert s.at == "0 8,9 * * *" and s.for_s == 3600.0 and isinstance(s.for_s, float)
    assert Schedule("0 0 1 * *", "UTC", 28 * DAY).window(t(UTC, 2025, 2, 20, 0, 0)).start == t(UTC, 2025, 2, 1)
    assert s.describe() == "0 8,9 * * * UTC for 1h"


def test_options_become_a_scheduled_policy_and_a_bad_combination_is_refused():
    p = policy_from_options("mornings", pin="public/docs", at="0 8 * * 1-5", tz="Europe/Berlin", window="2h", now=5.0)
    assert p.schedule == Schedule("0 8 * * 1-5", "Europe/Berlin", 7200.0) and p.extra == {"set_at": 5.0}
    assert policy_row(p) == ("mornings", "pin", "*", "public/docs", "0 8 * * 1-5 Europe/Berlin for 2h", "-")
    assert policy_row(policy_from_options("always", pin="public/docs"))[4] == "always"
    push = policy_from_options("q", push="acme/ledger", to="eu", at="0 6 25-31 3,6,9,12 *", tz="UTC", window="18h")
    assert push.schedule is not None and push.extra["regions"] == ["eu"]
    for opts, words in [
        (dict(pin="public/docs", at="0 8 * * *", window="2h"), "--at needs --tz"),
        (dict(pin="public/docs", at="0 8 * * *", tz="UTC"), "--at needs --for"),
        (dict(pin="public/docs", tz="UTC", window="2h"), "--tz and --for go with --at"),
        (dict(ttl="1h", at="0 8 * * *", tz="UTC", window="2h"), "--at goes with --pin, --warm or --push"),
        (dict(quota="1GiB", namespace="acme", at="0 8 * * *", tz="UTC", window="2h"), "not --quota"),
        (dict(pin="public/docs", at="0 8 * * *", tz="UTC", window="soon"), "--for: invalid duration 'soon'"),
        (dict(pin="public/docs", at="0 8 * * *", tz="Mars/Olympus", window="2h"), "unknown time zone"),
    ]:
        with pytest.raises(InvalidInput) as e:
            policy_from_options("x", **opts)
        assert words in str(e.value), (opts, str(e.value))


def test_a_schedule_on_a_kind_that_cannot_hold_one_is_refused_where_records_are_read():
    p = Policy("odd", "ttl", ttl_s=60, schedule=Schedule("0 8 * * *", "UTC", HOUR))  # past the options' checks
    with pytest.raises(InvalidInput, match="a schedule goes with pin, warm or push, not ttl"):
        validate_policy(Policy.unpack(p.pack()))


def test_the_schedule_round_trips_in_the_record_and_a_bad_one_on_the_wire_is_refused():
    p = policy_from_options("mornings", pin="public/docs", at="0 8 * * 1-5", tz="Europe/Berlin", window="2h")
    d = p.to_dict()
    assert d["schedule"] == {"at": "0 8 * * 1-5", "tz": "Europe/Berlin", "for_s": 7200.0}
    assert Policy.unpack(p.pack()) == p
    for bad, words in [({"at": "0 8 * * 1-5", "tz": "Europe/Nowhere", "for_s": 7200.0}, "unknown time zone"),
                       ({"at": "0 8 * * 1-5", "for_s": 7200.0}, "a map of at, tz and for_s"),
                       ("0 8 * * 1-5", "a map of at, tz and for_s")]:
        with pytest.raises(InvalidInput, match=words):
            Policy.from_dict({**d, "schedule": bad})
    assert Policy.from_dict({**d, "schedule": None}).schedule is None


def test_the_schedule_is_signed_and_a_policy_signed_before_schedules_still_verifies(tmp_path):
    signer = Signer.generate(tmp_path / "operator.key")
    verifier = Verifier([signer.public])
    p = signer.sign(policy_from_options("mornings", pin="public/docs", at="0 8 * * 1-5", tz="Europe/Berlin",
                                        window="2h"))
    assert verifier.ok(Policy.unpack(p.pack()))
    for other in (Schedule("0 8 * * *", "Europe/Berlin", 7200.0), Schedule("0 8 * * 1-5", "UTC", 7200.0),
                  Schedule("0 8 * * 1-5", "Europe/Berlin", 3 * HOUR), None):
        d = {**p.to_dict(), "schedule": None if other is None else other.to_dict()}
        assert not verifier.ok(Policy.from_dict(d)), other  # a writer cannot move, stretch or drop the windows
    plain = policy_from_options("always", pin="public/docs", now=1.0)
    assert b"schedule" not in payload(plain)  # the payload of a policy without one is what it was before
    assert payload(plain) == (b'{"extra":{"set_at":1.0},"kind":"pin","manifest":"public/docs","name":"always",'
                              b'"namespace":null,"quota_bytes":null,"region":null,"t":"kdn/policy/v1","ttl_s":null}')


def test_a_window_is_found_quickly_even_years_ahead():
    s = Schedule("0 0 29 2 *", "UTC", HOUR)
    now = t(UTC, 2029, 3, 1)
    assert local(UTC, s.window(now).start)[0][:10] == "2032-02-29"
    assert s.window(now - timedelta(days=425).total_seconds()).start == t(UTC, 2028, 2, 29)  # from 2028-01-31
