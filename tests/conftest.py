"""Shared fixtures: a real etcd server, a real S3 store (SeaweedFS), and a fresh registry of each implementation."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ has no __init__.py: make its helpers importable
# what benches and tests share (throwaway etcd, loopback ports): bench/lib/, imported by name
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "lib"))

from etcd_proc import EtcdProcess  # noqa: E402
from seaweed_proc import SeaweedProcess  # noqa: E402
from tls_certs import issue, make_ca  # noqa: E402

from kdn.registry import EmbeddedRegistry, EtcdRegistry  # noqa: E402
from kdn.registry.etcd_client import EtcdAuth  # noqa: E402


@pytest.fixture(autouse=True)
def _own_manifest_state(tmp_path_factory, monkeypatch):
    """Each test its own high-water marks: a client with keys keeps them in a per-user file by default
    (kdn.client.versions.state_file), which tests and concurrent runs must not share."""
    monkeypatch.setenv("KDN_MANIFEST_STATE", str(tmp_path_factory.mktemp("state") / "manifest-versions"))


@pytest.fixture(scope="session")
def s3_server():
    """A SeaweedFS on loopback (its S3 endpoint URL is ``.endpoint``); fails if ``weed`` is not installed."""
    try:
        proc = SeaweedProcess()
        proc.start()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def s3_store_url(s3_server) -> str:
    """``s3://kdn-tests/PREFIX?endpoint=...``: a fresh prefix in the session's SeaweedFS bucket (one bucket: each
    bucket is a SeaweedFS collection that takes volumes of its own)."""
    return f"s3://{s3_server.bucket}/t{uuid.uuid4().hex[:16]}?endpoint={s3_server.endpoint}"


@pytest.fixture(scope="session")
def etcd_server():
    """Client URL (``http://127.0.0.1:PORT``) of a throwaway etcd; fails if etcd is not installed."""
    try:
        proc = EtcdProcess()
        proc.start()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield proc.url
    finally:
        proc.stop()


@dataclass
class SecuredEtcd:
    """An etcd that serves TLS only, wants a client certificate from its CA, and has auth on.

    Users: ``root`` (certificate CN root: every permission, compaction included) and
    ``kdn`` (certificate CN kdn: read-write under ``/kdn-sec/`` only). ``stranger`` is a
    certificate from another CA.
    """

    proc: EtcdProcess
    dir: Path

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.proc.client_port}"

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def url(self, user: str = "kdn", prefix: str = "/kdn-sec/") -> str:
        d = self.dir
        return f"etcds://{self.host_port}{prefix}?ca={d}/ca.pem&cert={d}/{user}.pem&key={d}/{user}.key"

    def auth(self, user: str = "root") -> EtcdAuth:
        return EtcdAuth(tls=True, ca=(self.dir / "ca.pem").read_bytes(), cert=(self.dir / f"{user}.pem").read_bytes(),
                        key=(self.dir / f"{user}.key").read_bytes())


def _enable_auth(proc: EtcdProcess, auth: list[str], cert: list[str]) -> None:
    """Users root (password rootpw) and kdn (password kdnpw, read-write on /kdn-sec/), then auth on.

    ``cert``: the client certificate the server wants on every connection; ``auth``: how root
    gets in once auth is on."""
    for args in (("user", "add", "root", "--new-user-password=rootpw"), ("user", "grant-role", "root", "root"),
                 ("user", "add", "kdn", "--new-user-password=kdnpw"), ("role", "add", "kdn"),
                 ("role", "grant-permission", "kdn", "--prefix=true", "readwrite", "/kdn-sec/"),
                 ("user", "grant-role", "kdn", "kdn"), ("auth", "enable")):
        proc.etcdctl(*args, auth=cert)
    proc.etcdctl("get", "/", auth=auth)  # auth is on, and root gets in


def _secured(proc: EtcdProcess, d: Path, auth: list[str], cert: list[str]):
    """Start ``proc``, turn its auth on (``_enable_auth``), yield it as a ``SecuredEtcd``, stop it."""
    try:
        proc.start()
        _enable_auth(proc, auth, cert)
    except RuntimeError as e:
        proc.stop()
        pytest.fail(str(e), pytrace=False)
    try:
        yield SecuredEtcd(proc, d)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def secured_etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd-tls")
    ca = make_ca(d)
    cert, key = issue(ca, d, "srv", cn="127.0.0.1", server=True)
    for user in ("root", "kdn"):
        issue(ca, d, user, cn=user, server=False)
    issue(make_ca(d, "other-ca"), d, "stranger", cn="kdn", server=False)
    root = ["--cert", str(d / "root.pem"), "--key", str(d / "root.key")]
    yield from _secured(EtcdProcess(tls=(str(cert), str(key), str(ca[0])), client_cert_auth=True), d, root, root)


@pytest.fixture(scope="session")
def password_etcd(tmp_path_factory):
    """An etcd over TLS (no client certificates) with auth on and tokens that expire after 2 idle seconds."""
    d = tmp_path_factory.mktemp("etcd-pw")
    ca = make_ca(d)
    cert, key = issue(ca, d, "srv", cn="127.0.0.1", server=True)
    (d / "kdn.password").write_text("kdnpw\n")
    (d / "wrong.password").write_text("not-it\n")
    proc = EtcdProcess(tls=(str(cert), str(key), str(ca[0])), extra=["--auth-token", "simple", "--auth-token-ttl", "2"])
    yield from _secured(proc, d, ["--user", "root:rootpw"], [])


def make_registry_factory(request, tmp_path, kind: str):
    """The body of ``registry_factory`` for one kind: embedded, etcd, etcd-secured (TLS + client cert + auth)."""
    if kind == "etcd":
        u = urlsplit(request.getfixturevalue("etcd_server"))
        prefix = f"/kdn-test-{uuid.uuid4().hex[:12]}/"
        make = lambda: EtcdRegistry(u.hostname, u.port, prefix)  # noqa: E731
    elif kind == "etcd-secured":
        sec = request.getfixturevalue("secured_etcd")
        prefix = f"/kdn-test-{uuid.uuid4().hex[:12]}/"
        make = lambda: EtcdRegistry("127.0.0.1", sec.proc.client_port, prefix, auth=sec.auth("root"))  # noqa: E731
    else:
        path = tmp_path / "registry.sqlite3"
        make = lambda: EmbeddedRegistry(path)  # noqa: E731
    return make


@contextlib.asynccontextmanager
async def registry_handles(request, tmp_path, kind: str):
    """A factory of handles on one registry of ``kind`` (same file / etcd prefix); all closed on exit."""
    make = make_registry_factory(request, tmp_path, kind)
    made = []

    def factory():
        made.append(make())
        return made[-1]

    try:
        yield factory
    finally:
        for reg in made:
            await reg.close()


@pytest.fixture
def registry_maker():
    """``registry_handles`` for a module that overrides ``registry_factory`` with more kinds (a
    fixture, since ``from conftest import`` resolves to whichever conftest.py loaded first)."""
    return registry_handles


@pytest.fixture(params=["embedded", "etcd"])
async def registry_factory(request, tmp_path):
    """Call it to open another handle on the same registry (same file / etcd prefix); all are closed at the end."""
    async with registry_handles(request, tmp_path, request.param) as factory:
        yield factory


@pytest.fixture
def registry(registry_factory):
    """A fresh, empty registry: one per implementation (the test runs once for each)."""
    return registry_factory()
