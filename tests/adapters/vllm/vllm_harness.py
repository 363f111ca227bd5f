"""Real processes for the vLLM connector tests: origins and edges (``kdn`` CLI), vLLM engines (driver.py).

(Imported by name from the test modules, which pytest runs with their folder on ``sys.path``;
``conftest.py`` holds the fixtures.)

Everything binds 127.0.0.1 on free ports, logs into the test's temp folder,
and is stopped by PID (its process group) at teardown. Engines take 10-40 s
to start here, so fixtures are module-scoped and started side by side.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from edge_proxy import Proxy  # noqa: F401  (bench/lib/edge_proxy.py: the tests import it from here)
from ports import free_port  # bench/lib/ports.py: ports the kernel will not hand out (tests/conftest.py puts it on sys.path)

HERE = Path(__file__).resolve().parent
PUBLISH = "pub-" + "a" * 28
EDGE_TOKEN = "edge-" + "c" * 27
TENANT_A = "tenant-a-" + "d" * 23
TENANT_B = "tenant-b-" + "e" * 23


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", KDN_LOG_LEVEL="INFO")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # vLLM's CPU build wants Intel's OpenMP preloaded
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


class Proc:
    """A child process in its own group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, *, stdin: bool = False, env: dict | None = None) -> None:
        self.name, self.log = name, log
        self._out = open(log, "wb")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE if stdin else self._out, stderr=self._out,
                                  stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=env or vllm_env(),
                                  start_new_session=True)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self._out.close()


def wait_http(proc: Proc, url: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.p.returncode}):\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{proc.name} did not answer {url} within {timeout:.0f} s:\n{proc.tail()}")


def http_json(method: str, url: str, body: dict | None = None, token: str | None = None, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Cluster:
    """A registry file, origins (transformers or vLLM), and one edge in front of the first origin."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.registry = f"file:{tmp / 'registry.sqlite3'}"
        (tmp / "tokens").write_text(f"{PUBLISH} admin *\n{EDGE_TOKEN} read *\n{TENANT_A} publish,read acme\n"
                                    f"{TENANT_B} publish,read beta\n")
        (tmp / "edge-token").write_text(EDGE_TOKEN + "\n")
        self.procs: list[Proc] = []
        self.origins: dict[str, str] = {}
        self.edge_port = free_port()  # known before the edge starts: engines may start first
        self.edge_url = f"http://127.0.0.1:{self.edge_port}"

    def origin(self, name: str, model: str, *, dtype: str, engine: str = "hf", store: str | None = None,
               signing_key: str | None = None, kvtc_basis: str | None = None) -> tuple[Proc, str]:
        port = free_port()
        p = Proc(f"origin-{name}", ["kdn", "origin", "serve", "--model", model, "--dtype", dtype, "--engine", engine,
                                    "--registry", self.registry, "--store", str(self.tmp / f"store-{store or name}"),
                                    "--port", str(port), "--token-file", str(self.tmp / "tokens"),
                                    "--node-id", f"origin-{name}", "--raw-copies", "always"]
                 + (["--signing-key", signing_key] if signing_key else [])
                 + (["--kvtc-basis", kvtc_basis] if kvtc_basis else []), self.tmp / f"origin-{name}.log")
        self.procs.append(p)
        self.origins[name] = f"http://127.0.0.1:{port}"
        return p, self.origins[name]

    def edge(self, origin: str) -> Proc:
        p = Proc("edge", ["kdn", "edge", "serve", "--region", "eu", "--registry", self.registry, "--origin", origin,
                          "--port", str(self.edge_port), "--node-id", "e1", "--token-file", str(self.tmp / "tokens"),
                          "--upstream-token-file", str(self.tmp / "edge-token")], self.tmp / "edge.log")
        self.procs.append(p)
        wait_http(p, self.edge_url + "/healthz")
        return p

    def publish(self, origin: str, text: str, name: str, namespace: str = "public", token: str = PUBLISH,
                encodings: list[str] | None = None) -> dict:
        job = http_json("POST", f"{self.origins[origin]}/v1/publish",
                        {"name": name, "namespace": namespace, "text": text,
                         **({"encodings": encodings} if encodings else {})}, token)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            job = http_json("GET", f"{self.origins[origin]}/v1/jobs/{job['job'] if 'job' in job else job['id']}",
                            token=token)
            if job["state"] == "done":
                return job["manifest"]
            assert job["state"] != "failed", job
            time.sleep(0.05)
        raise AssertionError(f"publish of {name} did not finish")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


class Engine:
    """One vLLM engine (driver.py) with the KDN connector, driven op by op."""

    def __init__(self, name: str, tmp: Path, **cfg) -> None:
        self.name = name
        self.proc = Proc(f"engine-{name}", [sys.executable, str(HERE / "driver.py"), json.dumps(cfg)],
                         tmp / f"engine-{name}.log", stdin=True)
        self._buf = b""

    def _read(self, timeout: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.p.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"@@ "):
                    return json.loads(line[3:])
                self.proc._out.write(line + b"\n")  # vLLM's own stdout: into the log
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"engine {self.name} did not answer within {timeout:.0f} s:\n{self.proc.tail()}")
            chunk = os.read(self.proc.p.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"engine {self.name} exited ({self.proc.p.poll()}):\n{self.proc.tail()}")
            self._buf += chunk

    def wait_ready(self, timeout: float = 300) -> Engine:
        assert self._read(timeout).get("ready")
        return self

    def call(self, timeout: float = 300, **op) -> dict:
        self.proc.p.stdin.write((json.dumps(op) + "\n").encode())
        self.proc.p.stdin.flush()
        out = self._read(timeout)
        if "error" in out:
            raise AssertionError(f"engine {self.name}: {out['error']}\n{out.get('trace', '')}")
        return out

    def generate(self, prompts: list[list[int]], **kw) -> list[dict]:
        return self.call(op="generate", prompts=prompts, **kw)["outputs"]

    def stats(self) -> dict:
        return self.call(op="stats")

    def close(self) -> None:
        try:
            if self.proc.p.poll() is None:
                self.call(op="quit", timeout=20)
        except (TimeoutError, RuntimeError, OSError, AssertionError):
            pass
        self.proc.stop()


def kv_config(role: str = "kv_consumer", **extra) -> dict:
    return {"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm", "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def document(seed: int, n: int) -> str:
    """``n`` bytes of plain text (the tiny models' byte tokenizer: ``n`` tokens), different per seed."""
    import random

    rng = random.Random(seed)
    words = ("keeper", "lamp", "storm", "harbor", "tide", "glass", "north", "ships", "night", "rocks", "wind",
             "log", "relit", "cracked", "beacon", "fog", "signal", "pier")
    out = []
    while sum(len(w) + 1 for w in out) < n + 16:
        out.append(rng.choice(words))
    return " ".join(out)[:n]


def question(seed: int, n: int = 40) -> list[int]:
    return [b + 3 for b in document(1000 + seed, n).encode()]


def salt() -> str:
    return secrets.token_hex(4)
