"""Shared fixtures: a real etcd server, and a fresh registry of each implementation."""

from __future__ import annotations

import os
import sys
import uuid
from urllib.parse import urlsplit

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ has no __init__.py: make etcd_proc importable

from etcd_proc import EtcdProcess  # noqa: E402

from kdn.registry import EmbeddedRegistry, EtcdRegistry  # noqa: E402


@pytest.fixture(scope="session")
def etcd_server():
    """Client URL (``http://127.0.0.1:PORT``) of a throwaway etcd; fails if etcd is not installed."""
    try:
        proc = EtcdProcess()
        proc.start()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield proc.url
    finally:
        proc.stop()


@pytest.fixture(params=["embedded", "etcd"])
async def registry_factory(request, tmp_path):
    """Call it to open another handle on the same registry (same file / etcd prefix); all are closed at the end."""
    if request.param == "etcd":
        u = urlsplit(request.getfixturevalue("etcd_server"))
        prefix = f"/kdn-test-{uuid.uuid4().hex[:12]}/"
        make = lambda: EtcdRegistry(u.hostname, u.port, prefix)  # noqa: E731
    else:
        path = tmp_path / "registry.sqlite3"
        make = lambda: EmbeddedRegistry(path)  # noqa: E731
    made = []

    def factory():
        made.append(make())
        return made[-1]

    yield factory
    for reg in made:
        await reg.close()


@pytest.fixture
def registry(registry_factory):
    """A fresh, empty registry: one per implementation (the test runs once for each)."""
    return registry_factory()
