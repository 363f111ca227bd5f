"""The test harness's port picker: below the ephemeral range, free, never the same port twice."""

import socket

from ports import _ephemeral_low, free_port, free_port_block


def test_free_ports_are_outside_the_ephemeral_range_and_distinct():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < low for p in ports)
    with socket.socket() as s:  # each one really binds
        s.bind(("127.0.0.1", ports[0]))


def test_a_port_block_is_free_and_does_not_overlap_single_picks():
    base = free_port_block(4)
    block = set(range(base, base + 5))
    assert not block & {free_port() for _ in range(50)}
    socks = []
    try:
        for p in block:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()
