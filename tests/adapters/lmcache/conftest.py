"""The LMCache tests' guard: telemetry off before anything of LMCache is imported or started
(``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``: LMCache's own switches, ``lmcache/usage_telemetry/identity.py``;
the servers of ``lmcache_mp.py`` get them too), and LMCache installed. The MP server and engine helpers are in
``lmcache_mp.py``."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"

if importlib.util.find_spec("lmcache") is None:
    pytest.fail("lmcache is not installed (scripts/setup installs lmcache==0.5.6 with --no-deps)", pytrace=False)


def pytest_configure(config) -> None:
    # LMCache's logging imports opentelemetry-sdk's LoggingHandler, which opentelemetry now marks deprecated.
    config.addinivalue_line("filterwarnings", "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated")
