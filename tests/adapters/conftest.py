"""Fixtures of the adapter tests that run a real KDN (etcd, an origin, edges): a fresh etcd key prefix per test
on the session's etcd (``tests/conftest.py``), as the end-to-end tests have."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture
def etcd_url(etcd_server) -> str:
    return f"{etcd_server.replace('http://', 'etcd://')}/x{secrets.token_hex(4)}/"
