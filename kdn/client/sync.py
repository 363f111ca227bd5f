"""``SyncKDNClient``: the fetch client for scripts, blocking, on a loop of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from kdn.client.client import KDNClient
from kdn.client.lookup import Fetched, Lookup, PrefixStates

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import Manifest

T = TypeVar("T")


class SyncKDNClient:
    """Blocking wrapper for scripts: one ``asyncio.Runner`` owned by this object, closed with it."""

    def __init__(self, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self._client = self._runner.run(self._make(kwargs))

    @staticmethod
    async def _make(kwargs: dict[str, Any]) -> KDNClient:
        return KDNClient(**kwargs)

    @property
    def aclient(self) -> KDNClient:
        """The async client inside (for ``run``)."""
        return self._client

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on this wrapper's loop (e.g. ``kdn.adapters.hf.agenerate``)."""
        return self._runner.run(coro)

    def lookup(self, *args: Any, **kwargs: Any) -> Lookup:
        return self._runner.run(self._client.lookup(*args, **kwargs))

    def manifest(self, namespace: str, name: str, *, pin: str | None = None) -> Manifest | None:
        return self._runner.run(self._client.manifest(namespace, name, pin=pin))

    def fetch(self, *args: Any, **kwargs: Any) -> Fetched:
        return self._runner.run(self._client.fetch(*args, **kwargs))

    def fetch_prefix(self, *args: Any, **kwargs: Any) -> PrefixStates:
        return self._runner.run(self._client.fetch_prefix(*args, **kwargs))

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.close()

    def __enter__(self) -> SyncKDNClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
