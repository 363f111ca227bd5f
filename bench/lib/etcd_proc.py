"""A throwaway etcd server: free loopback ports, its own data directory, stopped by PID.

The one copy, used by the tests' fixtures, the fault harness (``bench/faultlib.py``: stopped and
restarted on the same data, snapshotted, restored, compacted) and the benches that need a real etcd.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from ports import free_port  # bench/lib/ports.py

ETCD_BIN = os.environ.get("KDN_ETCD_BIN", "/usr/bin/etcd")
ETCDCTL_BIN = "/usr/bin/etcdctl"  # Debian's etcd-client


class EtcdProcess:
    """One etcd member on 127.0.0.1.

    ``root``: the folder for its data (``root/data``) and log (``root/etcd.log``); kept across
    ``stop()``/``start()`` so the member restarts on the same data. Without it, a temp folder that
    ``stop()`` removes. ``tls``: (certificate, key, CA) to serve clients over TLS;
    ``client_cert_auth``: clients must show a certificate from that CA; ``extra``: more flags
    (``--auth-token-ttl``, ...)."""

    def __init__(self, binary: str = ETCD_BIN, *, root: str | Path | None = None,
                 tls: tuple[str, str, str] | None = None, client_cert_auth: bool = False,
                 extra: list[str] | None = None, retry_ports: bool = True) -> None:
        if not os.path.exists(binary):
            raise RuntimeError(
                f"{binary} not found: the registry tests need a real etcd "
                "(apt-get install -y etcd-server; scripts/setup does)"
            )
        self.binary = binary
        self._temp = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kdn-etcd-") if root is None else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data = self.root / "data"
        self.log = self.root / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port()
        self.tls, self.client_cert_auth, self.extra = tls, client_cert_auth, list(extra or [])
        self.name = "t"  # its member name; a cluster (bench/lib/etcd_cluster.py) names each and sets the list
        self.initial_cluster: str | None = None  # NAME=PEER_URL,...: None, a cluster of this member alone
        self.proc: subprocess.Popen[bytes] | None = None
        # Until it has started, nobody has its ports (unless the caller handed them out: retry_ports=False).
        self._started = not retry_ports
        self._port_retries = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def registry_url(self, prefix: str = "/kdn/") -> str:
        """The KDN registry URL of this server under ``prefix`` (plain http only)."""
        return f"etcd://127.0.0.1:{self.client_port}{prefix}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, timeout: float = 15.0, *, new: bool | None = None) -> None:
        """Start the member; ``new`` (default: no data yet) says whether it bootstraps a new cluster."""
        self.spawn(new=new)
        self.wait_healthy(timeout, new=new)

    def spawn(self, *, new: bool | None = None) -> None:
        """Start the process without waiting: a cluster's members must all be up before any is healthy."""
        c, p = self.url, self.peer_url
        state = "new" if (new if new is not None else not self.data.exists()) else "existing"
        args = [
            self.binary, "--name", self.name, "--data-dir", str(self.data),
            "--listen-client-urls", c, "--advertise-client-urls", c,
            "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
            "--initial-cluster", self.initial_cluster or f"{self.name}={p}", "--initial-cluster-state", state,
            "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
            "--log-level", "error", *self.extra,
        ]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--cert-file", cert, "--key-file", key]
            if self.client_cert_auth:  # (etcd 3.4 with a trusted CA but no client-cert-auth refuses certless clients)
                args += ["--trusted-ca-file", ca, "--client-cert-auth"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        """etcd's ``/health``: this member is up and sees a leader (and no alarm)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as r:
                return json.load(r).get("health") in ("true", True)
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 15.0, *, new: bool | None = None) -> None:
        assert self.proc is not None, "spawn it first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                # A port picked free can be taken (an outgoing connection's local port) before etcd binds
                # it. On a first start nothing has been told the ports yet: take new ones and try again.
                if "address already in use" in tail and not self._started and self._port_retries < 3:
                    self._port_retries += 1
                    self.client_port, self.peer_port, self.metrics_port = free_port(), free_port(), free_port()
                    shutil.rmtree(self.data, ignore_errors=True)
                    self.proc = None
                    return self.start(timeout, new=new)
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {tail}")
            if self.healthy():
                self._started = True
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {self._tail()}")

    def etcdctl(self, *args: str, auth: list[str] | None = None) -> str:
        """Run ``etcdctl`` against this server (``auth``: ``--user``/``--cert`` flags); its stdout."""
        tls = ["--cacert", self.tls[2]] if self.tls else []
        r = subprocess.run([ETCDCTL_BIN, f"--endpoints={self.url}", *tls, *(auth or []), *args],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"})
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {r.stderr.strip()[-500:]}")
        return r.stdout

    def compact_now(self) -> None:
        """Compact to the current revision: a watch resuming from an older one must re-list."""
        status = json.loads(self.etcdctl("endpoint", "status", "-w", "json"))
        self.etcdctl("compaction", str(status[0]["Status"]["header"]["revision"]))

    def snapshot(self, path: Path) -> None:
        self.etcdctl("snapshot", "save", str(path))

    def restore(self, path: Path) -> None:
        """Replace the data with a snapshot (member stopped): what an operator does after losing it."""
        assert self.proc is None, "stop etcd first"
        shutil.rmtree(self.data, ignore_errors=True)
        peer = self.peer_url
        r = subprocess.run([ETCDCTL_BIN, "snapshot", "restore", str(path), "--data-dir", str(self.data),
                            "--name", self.name, "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
                            "--initial-advertise-peer-urls", peer],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "ETCDCTL_API": "3"})
        if r.returncode != 0:
            raise RuntimeError(f"snapshot restore: {r.stderr[-500:]}")

    def _tail(self) -> str:
        try:
            return self.log.read_bytes()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the member (``sig``, then SIGKILL after 15 s); a temp folder goes with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._temp:
            shutil.rmtree(self.root, ignore_errors=True)
