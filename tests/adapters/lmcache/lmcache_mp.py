"""Helpers of the LMCache tests: LMCache's real multiprocess (MP) server on loopback, with the KDN L2 adapter
loaded by its own plugin factory, and an engine's side of LMCache's MP protocol on the CPU.

Telemetry is off before anything of LMCache is imported or started (``LMCACHE_TRACK_USAGE=false``,
``DO_NOT_TRACK=1``: LMCache's own switches, ``lmcache/usage_telemetry/identity.py``), here and in every server
process. ``MPServer`` runs ``python -m lmcache.v1.multiprocess.server`` (its CPU path: ``engine_driven``
transfer, a DRAM L1) with ``--l2-adapter '{"type": "plugin", "module_path": "kdn.adapters.lmcache", ...}'``.
``Engine`` is what LMCache's SDK (``lmcache/sdk/context.py``) does for a CPU engine, with the layout given
instead of read from a GPU engine's registration: LMCache's own ``create_transfer_context`` (engine-driven,
CPU paged caches in HND order), ``ContiguousTransferWrapper`` for store and retrieve, and its request client for
lookup. Nothing of LMCache or KDN is mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "lib"))

from ports import free_port  # noqa: E402

CHUNK = 32  # LMCache's --chunk-size here (256 in production): small, so a test moves a few chunks of real KV
BLOCK = 16  # the engine's paged-cache block


class MPServer:
    """One LMCache MP cache server process on 127.0.0.1, its L2 the KDN adapter with ``params``."""

    def __init__(self, tmp: Path, name: str, params: dict) -> None:
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.log = tmp / f"lmcache-{name}.log"
        self.l2 = {"type": "plugin", "module_path": "kdn.adapters.lmcache", "class_name": "KDNL2Adapter",
                   "adapter_params": params}
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 90.0) -> None:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
                "--port", str(self.port), "--chunk-size", str(CHUNK), "--supported-transfer-mode", "engine_driven",
                "--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(self.l2),
                "--disable-observability", stdout=out, stderr=asyncio.subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while "cache server is running..." not in self.text():
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server did not start:\n{self.text()[-3000:]}")
            await asyncio.sleep(0.2)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Engine:
    """A CPU engine's side of LMCache's MP protocol (what ``LMCacheSDKContext`` does, layout given)."""

    def __init__(self, url: str, *, model: str, layers: int, heads: int, head_dim: int, dtype) -> None:
        import torch
        import zmq
        from lmcache.sdk.wrapper.contiguous import ContiguousTransferWrapper
        from lmcache.v1.gpu_connector.utils import LayoutHints
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import create_transfer_context
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.model = model
        self.zmq = zmq.Context()
        self.rc = RequestClientFactory.create(url, context=self.zmq)
        self.instance_id = uuid.uuid4().int & ((1 << 63) - 1)
        caches = {f"layer.{i}": torch.zeros((1, 2, heads, BLOCK, head_dim), dtype=dtype) for i in range(layers)}
        self.tc = create_transfer_context(caches, instance_id=self.instance_id, req_client=self.rc)
        self.tc.register(caches, model, 1, CHUNK // BLOCK, 30.0,
                         layout_hints=LayoutHints(kv_layout="HND", num_kv_heads=heads, tokens_per_block=BLOCK,
                                                  head_dim=head_dim))
        self.wrapper = ContiguousTransferWrapper(self.tc.engine_driven_context, CHUNK)

    def _key(self, tokens, request_id: str, worker_id: int | None = 0, salt: str = ""):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name=self.model, world_size=1, num_kv_readers=1, worker_id=worker_id,
                                 token_ids=tuple(tokens), start=0, end=len(tokens), request_id=request_id,
                                 cache_salt=salt, request_configs=None)

    def store(self, kv, tokens, salt: str = "") -> bool:
        """``kv`` ``[2, L, T, H*D]`` of ``tokens`` (whole chunks) into LMCache (its L1, then its L2)."""
        rid = f"store-{uuid.uuid4().hex}"
        try:
            return self.wrapper.store(self._key(tokens, rid, salt=salt), self.instance_id, kv)
        finally:
            self.rc.end_session(rid).result(timeout=30)

    def retrieve(self, tokens, salt: str = "", timeout: float = 60.0):
        """The longest cached prefix of ``tokens`` (whole chunks) as ``[2, L, T, H*D]``, or None."""
        rid = f"retrieve-{uuid.uuid4().hex}"
        try:
            self.rc.lookup(self._key(tokens, rid, None, salt).no_worker_id_version(), 1).result(timeout=30)
            deadline = time.monotonic() + timeout
            chunks = self.rc.query_prefetch_status(rid).result(timeout=30)
            while chunks is None:
                assert time.monotonic() < deadline, "LMCache's prefetch did not finish"
                time.sleep(0.02)
                chunks = self.rc.query_prefetch_status(rid).result(timeout=30)
            if not chunks:
                return None
            return self.wrapper.retrieve(self._key(tokens[:chunks * CHUNK], rid, 0, salt), self.instance_id)
        finally:
            self.rc.end_session(rid).result(timeout=30)

    def close(self) -> None:
        self.tc.close()
        self.rc.close()
        self.zmq.term()

