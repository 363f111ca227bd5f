"""Byte sizes and durations as operators type them on the command line."""

from __future__ import annotations

import pytest

from kdn.errors import InvalidInput
from kdn.units import MAX_SIZE, format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text, n",
    [
        ("0", 0),
        ("4096", 4096),
        ("512B", 512),
        ("2GiB", 2 * 1024**3),
        ("2Gi", 2 * 1024**3),
        ("2gib", 2 * 1024**3),
        ("50GiB", 50 * 1024**3),
        ("500MB", 500_000_000),
        ("500M", 500_000_000),
        ("1.5G", 1_500_000_000),
        ("1.5KiB", 1536),
        ("0.1KiB", 102),  # fractions round down to whole bytes
        (".5Ki", 512),
        ("3 TiB", 3 * 1024**4),
        (" 7k ", 7000),
        ("1PiB", 1024**5),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "text",
    ["", "GiB", "-1GiB", "2XB", "2 G B", "1.5", "1.5B", "nan", "inf", "1e9", "2GiBs", "0x10", "1,5G", "9999999PiB", "٣GiB"],
)
def test_parse_size_rejects(text):
    with pytest.raises(InvalidInput, match="invalid size"):
        parse_size(text)


def test_parse_size_takes_ints_and_rejects_other_types():
    assert parse_size(123) == 123
    assert parse_size(MAX_SIZE) == MAX_SIZE
    for bad in (-1, MAX_SIZE + 1, True, 1.5, None, b"1G"):
        with pytest.raises(InvalidInput):
            parse_size(bad)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1000, "1 KB"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (2 * 1024**3, "2 GiB"),
        (50 * 1024**3, "50 GiB"),
        (3 * 1024**5, "3 PiB"),
        (1_500_000_000, "1.5 GB"),
        (500_000_000, "500 MB"),
        (1_234_567, "1.2 MiB"),  # not exact in any unit: binary, rounded
    ],
)
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_size_round_trips_exact_forms():
    for n in (1, 1000, 1024, 1536, 3 * 1024**2, 7 * 1024**3, 2 * 1024**4, 1_500_000_000, 250_000):
        assert parse_size(format_size(n).replace(" ", "")) == n


@pytest.mark.parametrize(
    "text, s",
    [
        ("90s", 90.0),
        ("10m", 600.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1H30M", 5400.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("2m30s", 150.0),
        ("45", 45.0),
        ("0.25", 0.25),
        ("0s", 0.0),
        (" 3s ", 3.0),
    ],
)
def test_parse_duration(text, s):
    assert parse_duration(text) == pytest.approx(s)


@pytest.mark.parametrize("text", ["", "s", "-5s", "10 minutes", "1h 30m", "5x", "1h30", "h1", "nan", "inf", "1e3s", "--1s"])
def test_parse_duration_rejects(text):
    with pytest.raises(InvalidInput, match="invalid duration"):
        parse_duration(text)


def test_parse_duration_takes_numbers():
    assert parse_duration(90) == 90.0 and parse_duration(1.5) == 1.5
    for bad in (-1, float("nan"), float("inf"), True, None):
        with pytest.raises(InvalidInput):
            parse_duration(bad)


@pytest.mark.parametrize("s, text", [(0, "0s"), (0.25, "250ms"), (90, "1m30s"), (600, "10m"), (5400, "1h30m"), (86400, "1d"), (1.5, "1.5s")])
def test_format_duration(s, text):
    assert format_duration(s) == text
    assert parse_duration(text) == pytest.approx(s)
