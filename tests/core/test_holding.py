"""``kdn.client.holding.parse_reads``: what an edge's HEAD says of its reads (``X-KDN-Reads``), taken from the network
as the operator console and ``kdn registry show`` take it: known tiers, bounded non-negative counts, junk left
out (never an error, never a huge or negative figure on the page)."""

from __future__ import annotations

import pytest

from kdn.client.holding import MAX_READS_DIGITS, parse_reads


@pytest.mark.parametrize("value, want", [
    ("memory=3, disk=1", {"memory": 3, "disk": 1}),
    ("memory=0", {"memory": 0}),
    ("disk=7,memory=2", {"disk": 7, "memory": 2}),
    (" memory = 5 ", {"memory": 5}),
    ("", {}),
    (None, {}),
    (42, {}),
    ("memory=-1", {}),  # negative
    ("memory=+4", {}),  # a sign
    ("memory=3.5, disk=x", {}),  # not an integer
    ("memory=1e9", {}),
    ("memory=" + "9" * (MAX_READS_DIGITS + 1), {}),  # huge: ignored, so a sum stays bounded
    ("memory=" + "9" * MAX_READS_DIGITS, {"memory": 10**MAX_READS_DIGITS - 1}),
    ("memory=٣", {}),  # a digit, but not ASCII
    ("peer=4, memory=1", {"memory": 1}),  # an unknown tier
    ("memory=1, memory=900", {"memory": 1}),  # the first per tier
    ("memory", {}),
    ("memory=1, " + "x" * 200, {}),  # over-long: all of it left out
    ("<script>=1", {}),
])
def test_parse_reads_keeps_known_tiers_with_bounded_counts_and_drops_junk(value, want):
    assert parse_reads(value) == want
