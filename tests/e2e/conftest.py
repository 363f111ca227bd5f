"""End-to-end fixtures: a fresh etcd key prefix per test on the session's etcd."""

import secrets

import pytest


@pytest.fixture
def etcd_url(etcd_server) -> str:
    return f"{etcd_server.replace('http://', 'etcd://')}/x{secrets.token_hex(4)}/"
