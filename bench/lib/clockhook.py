"""A test hook: step a process's wall clock by an offset read from a file, as an NTP step or
``date -s`` would, without touching the machine's clock (bench/faults.py ``clock_jump``).

Not part of the product: a bench runs a node through it instead of ``python -m kdn.cli``::

    python -P bench/lib/clockhook.py OFFSET_FILE edge serve ...

It installs the offset before any of KDN's modules are imported, so every ``time.time()`` /
``time.time_ns()`` call in the process, default arguments bound at import included, returns the real
wall time plus the number of seconds in the file (re-read every 20 ms; absent or unreadable: the last
value, 0 at first). ``time.monotonic`` is left alone: a wall-clock step does not move it.
"""

from __future__ import annotations

import threading
import time

def install(path: str) -> None:
    real_time, real_time_ns = time.time, time.time_ns
    offset = [0.0]

    def read() -> None:
        try:
            with open(path) as f:
                offset[0] = float(f.read().strip() or 0)
        except (OSError, ValueError):
            pass

    def poll() -> None:
        while True:
            read()
            time.sleep(0.02)

    read()
    time.time = lambda: real_time() + offset[0]
    time.time_ns = lambda: real_time_ns() + int(offset[0] * 1e9)
    threading.Thread(target=poll, name="kdn-test-wall-offset", daemon=True).start()


if __name__ == "__main__":
    import sys

    install(sys.argv[1])
    from kdn.cli import main  # (after the hook: its modules bind the stepped clock)

    sys.exit(main(sys.argv[2:]))
