"""Ports for servers a test or bench starts as a child process, picked outside the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``),
the same range the kernel hands to every outgoing connection and every other ``bind(0)``. A child that binds
the port seconds later (a vLLM origin loads a model first) can find it taken by any of those: CI lost the vLLM
hybrid tests to ``bind on ('127.0.0.1', 34435): address already in use``. A port below that range is never
handed out by the kernel, so only another explicit pick can take it; picks are random, checked by binding,
and not repeated within a process.

(In bench/lib/: bench scripts and tests both import it, as ``etcd_proc``.)
"""

from __future__ import annotations

import random
import socket
import threading

_LOW = 20000  # above the registered services most hosts run, below the ephemeral range
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that the kernel will not give to anyone else."""
    high = _ephemeral_low() - 1
    with _lock:
        if high - _LOW < 1000:  # an unusual ephemeral range: fall back to asking the kernel
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return int(s.getsockname()[1])
        for _ in range(200):
            port = _rng.randint(_LOW, high)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port found in {_LOW}-{high}")


def free_port_block(n: int) -> int:
    """A port ``p`` with ``p`` .. ``p + n`` all free now (same range and rules as ``free_port``)."""
    high = _ephemeral_low() - 1 - n
    with _lock:
        for _ in range(200):
            base = _rng.randint(_LOW, high)
            ports = range(base, base + n + 1)
            if not _given.intersection(ports) and all(_bindable(p) for p in ports):
                _given.update(ports)
                return base
    raise RuntimeError(f"no {n + 1} consecutive free ports found in {_LOW}-{high + n}")
