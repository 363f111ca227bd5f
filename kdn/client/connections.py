"""A fetch client's ways onto the network, opened on first use and closed together.

``KDNClient`` reads object bodies through ``kdn.wire.bodyget`` (keep-alive connections
of its own that read straight into preallocated buffers), verifies them through
``kdn.wire.fetch`` over that, sends its JSON requests (lookups, records, manifests)
through one aiohttp session, and decodes what arrived on a small pool of threads
of its own. All four, and the settings they share (bearer token, TLS, the local
address to bind, the request deadline, how many fetches run at once), live here,
so the client itself holds only what it decides with.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from kdn.wire.bodyget import BodyGetter
from kdn.errors import InvalidInput
from kdn.wire.estimate import Estimates
from kdn.wire.fetch import Fetcher

# Threads that decode a prefix's arrived objects into place (zstd planes, lossy codecs). Two, not the event
# loop's default pool (six here): a zstd load of 8k tokens into the transformers cache took 229/228 ms on two
# against 285/322 ms on six, alternating in one setup (bench/datapath.py, 2 cores shared with the edge).
DECODE_THREADS = 2
CONNECT_S = 5.0  # at most this of a request's deadline goes to opening its connection


class Connections:
    """The session, the body reader, the verified fetcher and the decode threads of one client, each made when
    first used (``kdn.client`` stays importable without a running loop) and all closed by ``close``.

    ``estimates`` are the client's per-source speeds, which every verified fetch updates."""

    def __init__(self, estimates: Estimates, *, token: str | None = None, timeout: float = 30.0,
                 ca: str | None = None, ssl: _ssl.SSLContext | None = None, local_addr: str | None = None,
                 concurrency: int = 8, decode_threads: int = DECODE_THREADS) -> None:
        if not (isinstance(decode_threads, int) and 1 <= decode_threads <= 64):
            raise InvalidInput(f"decode_threads must be an int in [1, 64], not {decode_threads!r}")
        self.estimates = estimates
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout  # seconds, one request
        self.limit = asyncio.Semaphore(concurrency)  # object fetches in flight at once
        self._ssl, self._ca = ssl, ca  # HTTPS is always verified: ``ssl``, else ``ca`` / $KDN_CA, else system CAs
        self._local_addr = local_addr  # bind outgoing connections to this IP (multi-homed hosts, link emulation)
        self._decode_threads = decode_threads
        self._session: aiohttp.ClientSession | None = None
        self._getter: BodyGetter | None = None
        self._fetcher: Fetcher | None = None
        self._decoders: ThreadPoolExecutor | None = None

    def _context(self) -> _ssl.SSLContext:
        from kdn.tls import client_context

        return self._ssl if self._ssl is not None else client_context(self._ca)

    @property
    def getter(self) -> BodyGetter:
        """The object-body path: keep-alive connections that read into preallocated buffers."""
        if self._getter is None:
            self._getter = BodyGetter(ssl=self._context(), local_addr=self._local_addr)
        return self._getter

    @property
    def fetcher(self) -> Fetcher:
        """Verified fetches (``kdn.wire.fetch``) over ``getter``, measured into ``estimates``; each request
        carries ``headers`` (the bearer token), whichever route it goes to (the routes add none of their own)."""
        if self._fetcher is None:
            self._fetcher = Fetcher(self.getter, self.estimates, timeout=self.timeout, authorize=self._authorize)
        return self._fetcher

    def _authorize(self, url: str) -> Mapping[str, str]:
        return self.headers

    @property
    def session(self) -> aiohttp.ClientSession:
        """Every request that is not an object body (JSON: lookups, records, manifests, probes of health)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=64, ssl=self._context(),
                                             local_addr=(self._local_addr, 0) if self._local_addr else None)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=min(self.timeout, CONNECT_S)))
        return self._session

    @property
    def decode_threads(self) -> int:
        return self._decode_threads

    @property
    def decoders(self) -> ThreadPoolExecutor:
        """The threads a prefix's objects are checked and decoded on as they arrive (``decode_threads``)."""
        if self._decoders is None:
            self._decoders = ThreadPoolExecutor(self._decode_threads, thread_name_prefix="kdn-decode")
        return self._decoders

    @property
    def decoding(self) -> bool:
        """Whether the decode threads are up (made by a load, ended by ``close``)."""
        return self._decoders is not None

    async def close(self) -> None:
        if self._decoders is not None:
            self._decoders.shutdown(wait=False)
            self._decoders = None
        if self._getter is not None:
            self._getter.close()
            self._getter = None
            self._fetcher = None
        if self._session is not None:
            await self._session.close()
            self._session = None
