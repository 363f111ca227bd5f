"""What docs/operations.md says of the host tier is the code's: its flags' defaults, its limits, its metrics."""

from __future__ import annotations

import re
from pathlib import Path

from kdn import cli
from kdn.host.leases import MAX_LEASES
from kdn.host.metrics import COUNTERS, GAUGES
from kdn.host.session import MAX_IN_FLIGHT

ROOT = Path(__file__).resolve().parents[2]


def section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    return text[text.index("\n## The host tier\n"):]


def serve_parser():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")  # noqa: SLF001
    host = sub.choices["host"]
    return next(a for a in host._actions if a.dest == "host_command").choices["serve"]  # noqa: SLF001


def test_the_flag_table_names_every_flag_and_its_default():
    rows = dict(re.findall(r"^\| `(--[a-z-]+)[^|]*\| ([^|]+) \|", section(), re.M))
    flags = {s for a in serve_parser()._actions for s in a.option_strings if s.startswith("--")} - {"--help"}  # noqa: SLF001
    documented = set(rows) | {"--origin"}  # (shares --edge's row)
    assert documented == flags, (documented ^ flags)
    defaults = {a.option_strings[0]: a.default for a in serve_parser()._actions if a.option_strings}  # noqa: SLF001
    for flag in ("--segment-bytes", "--eviction"):
        assert rows[flag].strip() == f"`{defaults[flag]}`", flag
    for flag in ("--socket", "--segment"):  # the path, with the user's id as the doc writes it
        assert rows[flag].strip() == f"`{re.sub(r'[0-9]+', 'UID', defaults[flag])}`", flag

def test_the_limits_and_metrics_quoted_are_the_codes():
    text = section()
    assert f"at most {MAX_LEASES} leases and {MAX_IN_FLIGHT} requests in flight" in text
    for name in GAUGES:
        assert f"`kdn_host_{name}`" in text, name
    quoted = re.search(r"`kdn_host_\{([a-z_,]+)\}_total`", text)
    assert quoted and set(quoted.group(1).split(",")) == set(COUNTERS)
