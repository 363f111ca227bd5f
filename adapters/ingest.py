"""A tenant's writer to an origin's authenticated ingest (``PUT /v1/objects/{address}``, ``kdn.origin.ingest``).

What the engine storage backends write through (LMCache's ``KDNL2Adapter``, SGLang's ``KDNHiCacheStorage``): one
object per request, with the tenant's token and the address's preimage (``kdn.adapters.keyed``: scheme, shard,
key), so the origin can check the token's ``publish`` grant on the namespace the object names and that the
address is that key's, then store the blob and sign its record with who sent it.

``put`` never raises for what the network or the origin does: it answers an outcome, the name a backend counts
it under (``OUTCOMES``), and logs a refusal or an error once, on the backend's logger. Built and used on one
asyncio loop (the backend's ``LoopThread``): the session belongs to it.
"""

from __future__ import annotations

import logging

import aiohttp

from kdn.adapters.keyed import MISSES
from kdn.format.address import Address

# What ``put`` answers: stored (201: new), stored_already (200: the same bytes were there), store_conflict (409:
# other bytes are stored at this address, never rewritten), store_refused (any other answer: a token without
# ``publish`` there, an address that is not the key's, ...), store_errors (no answer: the network, the deadline).
OUTCOMES = ("stored", "stored_already", "store_conflict", "store_refused", "store_errors")
KEPT = frozenset({"stored", "stored_already"})  # the origin holds these bytes now


class IngestClient:
    """``PUT``s objects to one origin's ingest as one tenant (its bearer token), naming the engine that made them."""

    def __init__(self, url: str, token: str | None, *, engine: str, ca: str | None, timeout: float,
                 log: logging.Logger) -> None:
        self.url, self.engine, self.log = url.rstrip("/"), engine, log
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        ssl = None
        if self.url.startswith("https://"):
            from kdn.tls import client_context

            ssl = client_context(ca)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl if ssl is not None else True),
                                             timeout=aiohttp.ClientTimeout(total=timeout))

    async def put(self, address: Address, encoding: str, blob: bytes, *, scheme: str, shard: str, key: str) -> str:
        """Send ``blob`` (the object at ``address``, in ``encoding``) with its preimage; one of ``OUTCOMES``."""
        headers = {**self._auth, "X-KDN-Key-Scheme": scheme, "X-KDN-Key-Shard": shard, "X-KDN-Key": key,
                   "X-KDN-Engine": self.engine, "Content-Type": "application/octet-stream"}
        try:
            async with self.session.put(f"{self.url}/v1/objects/{address}", params={"encoding": encoding}, data=blob,
                                        headers=headers) as r:
                if r.status in (200, 201):
                    return "stored" if r.status == 201 else "stored_already"
                status, detail = r.status, (await r.text())[:300]
        except MISSES as e:
            self.log.warning("KDN ingest of %s: %s", address[:16], str(e) or type(e).__name__)
            return "store_errors"
        self.log.warning("KDN ingest of %s refused (%d): %s", address[:16], status, detail)
        return "store_conflict" if status == 409 else "store_refused"

    async def close(self) -> None:
        await self.session.close()
