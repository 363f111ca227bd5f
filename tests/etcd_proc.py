"""A throwaway etcd server for tests: free loopback ports, a temp data dir, stopped by PID."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

ETCD_BIN = "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    def __init__(self, binary: str = ETCD_BIN) -> None:
        if not os.path.exists(binary):
            raise RuntimeError(
                f"{binary} not found: the registry tests need a real etcd "
                "(apt-get install -y etcd-server; scripts/setup does)"
            )
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="kdn-etcd-")
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> None:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self._log = open(os.path.join(self.data_dir, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            [
                self.binary, "--name", "t", "--data-dir", os.path.join(self.data_dir, "data"),
                "--listen-client-urls", c, "--advertise-client-urls", c,
                "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                "--initial-cluster", f"t={p}", "--initial-cluster-state", "new",
                "--log-level", "error",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if json.load(r).get("health") in ("true", True):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {self._tail()}")

    def _tail(self) -> str:
        try:
            with open(os.path.join(self.data_dir, "etcd.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
