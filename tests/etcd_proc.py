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
ETCDCTL_BIN = "/usr/bin/etcdctl"  # Debian's etcd-client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    """``tls``: (certificate, key, CA) to serve clients over TLS; ``client_cert_auth``: clients must show a
    certificate from that CA; ``extra``: more flags (``--auth-token-ttl``, ...)."""

    def __init__(self, binary: str = ETCD_BIN, *, tls: tuple[str, str, str] | None = None,
                 client_cert_auth: bool = False, extra: list[str] | None = None) -> None:
        if not os.path.exists(binary):
            raise RuntimeError(
                f"{binary} not found: the registry tests need a real etcd "
                "(apt-get install -y etcd-server; scripts/setup does)"
            )
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="kdn-etcd-")
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.metrics_port = _free_port()
        self.tls, self.client_cert_auth, self.extra = tls, client_cert_auth, list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> None:
        c, p = self.url, f"http://127.0.0.1:{self.peer_port}"
        self._log = open(os.path.join(self.data_dir, "etcd.log"), "wb")
        args = [
            self.binary, "--name", "t", "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", c, "--advertise-client-urls", c,
            "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
            "--initial-cluster", f"t={p}", "--initial-cluster-state", "new",
            "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
            "--log-level", "error", *self.extra,
        ]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--cert-file", cert, "--key-file", key]
            if self.client_cert_auth:  # (etcd 3.4 with a trusted CA but no client-cert-auth refuses certless clients)
                args += ["--trusted-ca-file", ca, "--client-cert-auth"]
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as r:
                    if json.load(r).get("health") in ("true", True):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {self._tail()}")

    def etcdctl(self, *args: str, auth: list[str] | None = None) -> str:
        """Run ``etcdctl`` against this server (``auth``: ``--user``/``--cert`` flags); its stdout."""
        tls = ["--cacert", self.tls[2]] if self.tls else []
        r = subprocess.run([ETCDCTL_BIN, f"--endpoints={self.url}", *tls, *(auth or []), *args],
                           capture_output=True, text=True, timeout=20, env={**os.environ, "ETCDCTL_API": "3"})
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {r.stderr.strip()[-500:]}")
        return r.stdout

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
