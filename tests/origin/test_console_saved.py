"""The console's per-manifest savings (origin/console/saved.py) over the origin's measured speed
(origin/speed.py), without servers: the sums, and what the page says before the origin measured anything."""

from __future__ import annotations

from types import SimpleNamespace

from kdn.origin.console.saved import format_flops, region_savings, savings_table
from kdn.origin.speed import PublishSpeed, chunk_flops
from kdn.planner import PrefillModel


def shape() -> PrefillModel:
    return PrefillModel(params=1_000_000, layers=2, attn_width=64)


MANIFEST = SimpleNamespace(tokens=300, chunk_tokens=256, addresses=["a" * 64, "b" * 64])


def test_reads_become_tokens_flops_and_seconds_at_the_measured_speed():
    speed = PublishSpeed(shape())
    speed.observe([(0, 256, False), (256, 300, False)], 0.5)
    assert speed.tokens == 300 and speed.chunks == 2
    assert speed.flops_per_s == (chunk_flops(shape(), 0, 256) + chunk_flops(shape(), 256, 300)) / 0.5
    regions = {"eu": {"reads": {"memory": 2, "disk": 1}, "chunk_reads": {0: 2, 1: 1, 7: 5}},  # 7: past the end
               "us": {"reads": {}, "chunk_reads": {}}}
    got = region_savings(regions, MANIFEST, speed)
    flops = 2 * chunk_flops(shape(), 0, 256) + chunk_flops(shape(), 256, 300)  # the second chunk after 256
    assert got["eu"] == {"reads": {"memory": 2, "disk": 1}, "tokens": 2 * 256 + 44, "flops": flops,
                         "seconds": flops / speed.flops_per_s}
    assert got["us"]["tokens"] == 0 and got["us"]["flops"] == 0
    page = savings_table(regions, MANIFEST, speed)
    assert format_flops(flops) in page and "at the origin&#x27;s speed" in page


def test_an_unmeasured_origin_and_another_models_manifest_say_so():
    regions = {"eu": {"reads": {"memory": 1}, "chunk_reads": {0: 1}}}
    page = savings_table(regions, MANIFEST, PublishSpeed(shape()))  # nothing computed since it started
    assert "not measured yet" in page and "256" in page
    page = savings_table(regions, MANIFEST, None)  # another model's: reads and tokens, no compute
    assert "not known here" in page and "not measured yet" not in page
    assert region_savings(regions, MANIFEST, None)["eu"] == {"reads": {"memory": 1}, "tokens": 256, "flops": None,
                                                             "seconds": None}
    PublishSpeed(shape()).observe([(0, 10, False)], 0.0)  # an untimed step teaches nothing
    assert format_flops(2.5e12) == "2.5 TFLOP" and format_flops(12) == "12 FLOP"
