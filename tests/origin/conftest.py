"""Fixtures for origin tests; helpers live in origin_helpers.py (importable: this folder is on sys.path)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from origin_helpers import etcd_url  # noqa: E402,F401  (fixture)
