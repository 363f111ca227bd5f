"""The fault scenarios live in bench/ (bench/faults.py, bench/faultlib.py); these tests import them from there."""

import sys
from pathlib import Path

_bench = str(Path(__file__).resolve().parents[2] / "bench")
if _bench not in sys.path:
    sys.path.insert(0, _bench)
