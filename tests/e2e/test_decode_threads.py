"""A prefix's objects are decoded on the client's own bounded pool (``decode_threads``), not on the event
loop's default executor: on two cores, two threads decoded a zstd load faster than the default six
(``kdn.client.connections.DECODE_THREADS``). The pool is the client's, made once, and ended with it."""

from __future__ import annotations

import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, publish  # noqa: E402

from kdn.client import KDNClient  # noqa: E402
from kdn.client.connections import DECODE_THREADS  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402

TEXT = ("The bell rope was checked at each watch and its wear noted in the log. " * 30)[:2000]


async def test_a_prefix_decodes_on_the_clients_own_threads(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, TEXT, "d", encodings=["zstd"])
        assert len(m["addresses"]) >= 5
        for n in (1, DECODE_THREADS):
            seen: set[str] = set()
            async with KDNClient(edges=[c.edge_url("e1")], decode_threads=n) as client:
                hit = await client.lookup(m["prefix_tokens"], m["model_id"])
                states = await client.fetch_prefix(hit, into=lambda i, view: seen.add(threading.current_thread().name))
                pool = client.decoders
            assert len(states.fetched) == len(m["addresses"]) and {f.encoding for f in states.fetched} == {"zstd"}
            assert seen and all(name.startswith("kdn-decode") for name in seen) and len(seen) <= n, seen
            assert not client.net.decoding and pool._shutdown  # ended with the client


def test_decode_threads_are_bounded():
    for bad in (0, 65, 1.5):
        with pytest.raises(InvalidInput, match="decode_threads"):
            KDNClient(edges=["http://127.0.0.1:9"], decode_threads=bad)
