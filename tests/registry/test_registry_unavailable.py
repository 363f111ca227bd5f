"""A registry that cannot be reached says so, quickly and in one line."""

from __future__ import annotations

import socket

import pytest

from kdn.errors import RegistryUnavailable
from kdn.registry import EmbeddedRegistry, EtcdRegistry


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket closes


async def test_etcd_down():
    reg = EtcdRegistry("127.0.0.1", _closed_port(), timeout=2)
    with pytest.raises(RegistryUnavailable, match="unreachable"):
        async with reg:
            pass
    with pytest.raises(RegistryUnavailable):
        await reg.get_model("0" * 64)
    with pytest.raises(RegistryUnavailable):
        await reg.list_nodes()
    await reg.close()


async def test_embedded_file_cannot_be_opened(tmp_path):
    reg = EmbeddedRegistry(tmp_path)  # a directory, not a file
    with pytest.raises(RegistryUnavailable, match="registry file"):
        await reg.list_policies()
    await reg.close()
