"""Host tier fixtures: a short folder for sockets. What the tests share besides is host_helpers.py (and, for
the cluster tests, bench/lib/edge_helpers.py on the session's etcd)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # host_helpers


@pytest.fixture
def short_dir():
    """A folder with a short path: a Unix socket path has at most 107 bytes, and pytest's tmp_path can be longer."""
    d = tempfile.mkdtemp(prefix="kh-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
