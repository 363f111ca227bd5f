"""open_registry: URLs to registries, and the default."""

from __future__ import annotations

import pytest

from kdn.errors import InvalidInput
from kdn.registry import EmbeddedRegistry, EtcdRegistry, open_registry


@pytest.mark.parametrize(
    "url, host, port, prefix",
    [
        ("etcd://127.0.0.1:2379", "127.0.0.1", 2379, "/kdn/"),
        ("etcd://etcd.internal", "etcd.internal", 2379, "/kdn/"),
        ("etcd://h:1234/team-a", "h", 1234, "/team-a/"),
        ("etcd://h:1234/a/b/", "h", 1234, "/a/b/"),
    ],
)
async def test_etcd_urls(url, host, port, prefix):
    reg = open_registry(url)
    assert isinstance(reg, EtcdRegistry)
    assert (reg.host, reg.port, reg.prefix) == (host, port, prefix)
    await reg.close()


@pytest.mark.parametrize(
    "url, path",
    [("file:/tmp/r.sqlite3", "/tmp/r.sqlite3"), ("file:///tmp/r.sqlite3", "/tmp/r.sqlite3"), ("file:r.db", "r.db")],
)
async def test_file_urls(url, path):
    reg = open_registry(url)
    assert isinstance(reg, EmbeddedRegistry) and reg.path == path and reg.prefix == "/kdn/"
    await reg.close()


async def test_default_is_env_then_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KDN_REGISTRY", "etcd://e:1")
    reg = open_registry(None)
    assert isinstance(reg, EtcdRegistry)
    await reg.close()
    monkeypatch.delenv("KDN_REGISTRY")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    reg = open_registry(None)
    assert reg.path == str(tmp_path / "kdn" / "registry.sqlite3")
    # opening is lazy: nothing is created yet
    assert not (tmp_path / "kdn").exists()
    assert await reg.list_policies() == []
    assert (tmp_path / "kdn" / "registry.sqlite3").exists()
    await reg.close()
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    reg = open_registry(None)
    assert reg.path == str(tmp_path / ".local" / "share" / "kdn" / "registry.sqlite3")
    await reg.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:1", "etcd://", "etcd://h:notaport", "etcd://h:99999", "etcd://u:p@h:1",
        "etcd://h:1?x=1", "file:", "file://host/x", "/tmp/x", "",
    ],
)
def test_malformed_urls_are_one_line_errors(url):
    with pytest.raises(InvalidInput) as e:
        open_registry(url)
    assert "\n" not in str(e.value)


async def test_etcds_urls_carry_tls_files_and_a_user(tmp_path, monkeypatch):
    for name in ("ca.pem", "c.pem", "c.key"):
        (tmp_path / name).write_bytes(f"-- {name} --".encode())
    (tmp_path / "pw").write_text("s3cret\n")
    reg = open_registry(f"etcds://kdn@h:2379/team/?ca={tmp_path}/ca.pem&cert={tmp_path}/c.pem&key={tmp_path}/c.key"
                        f"&password_file={tmp_path}/pw")
    a = reg.auth
    assert a.tls and a.ca == b"-- ca.pem --" and a.cert == b"-- c.pem --" and a.key == b"-- c.key --"
    assert (a.user, a.password, reg.prefix) == ("kdn", "s3cret", "/team/")
    assert "s3cret" not in repr(reg) and "s3cret" not in repr(a) and "c.key" not in repr(a)
    await reg.close()
    monkeypatch.setenv("KDN_ETCD_PASSWORD", "from-env")
    reg = open_registry("etcd://kdn@h:2379")
    assert not reg.auth.tls and reg.auth.password == "from-env"
    await reg.close()
    reg = open_registry("etcds://h")  # TLS against the system's CAs, no client identity
    assert reg.auth.tls and reg.auth.ca is None and reg.auth.user is None and reg.port == 2379
    await reg.close()


@pytest.mark.parametrize("url, words", [
    ("etcd://kdn:hunter2@h:1", "does not belong in a URL"),
    ("etcd://h:1?ca=/x", "use etcds://"),
    ("etcds://h:1?cert=/x", "both cert= and key="),
    ("etcds://h:1?verify=no", "unknown option"),
    ("etcds://kdn@h:1", "needs a password"),
    ("etcds://h:1?ca=/no/such/file", "cannot read it"),
    ("etcds://h:1?ca", "key=value pairs"),
])
def test_bad_secured_urls_say_why_and_never_echo_a_password(url, words, monkeypatch):
    monkeypatch.delenv("KDN_ETCD_PASSWORD", raising=False)
    with pytest.raises(InvalidInput) as e:
        open_registry(url)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and "hunter2" not in msg
