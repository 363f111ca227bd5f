"""The attack (#51 item 12): a replayed, superseded manifest taken by a fresh process that was given no state file.

A client with publisher keys refuses a manifest older than one it took before; that high-water mark lived in
its process unless ``manifest_state=PATH`` was passed, so every new process (a restarted engine, a second
worker) started again at 0 and took the replay. With keys and no state given, the marks now live in a
per-user file (``kdn.client.versions.state_file``): ``$KDN_MANIFEST_STATE``, else
``$XDG_STATE_HOME/kdn/manifest-versions``, else ``~/.local/state/kdn/manifest-versions``.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kdn.client import KDNClient
from kdn.client.trust import Trust
from kdn.errors import InvalidInput
from kdn.registry import Manifest
from kdn.registry.signing import Signer

ROOT = Path(__file__).resolve().parents[2]
M = "9" * 64


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user of our own: HOME and XDG_STATE_HOME under tmp_path, no KDN_MANIFEST_STATE."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.delenv("KDN_MANIFEST_STATE", raising=False)
    return tmp_path / "home"


@pytest.fixture
def signer(tmp_path):
    return Signer.generate(tmp_path / "origin.key")


def _manifest(signer: Signer, version: int, tokens: list[int]) -> dict:
    return signer.sign(Manifest(namespace="public", name="hours", model_id=M, addresses=[], tokens=len(tokens),
                                chunk_tokens=256, prefix_tokens=tokens, version=version, created=1.0e9)).to_dict()


def test_a_fresh_trust_with_keys_and_no_state_refuses_a_replay_another_took_the_newer_of(home, signer):
    old, new = _manifest(signer, 5, [1, 2]), _manifest(signer, 7, [3, 4])
    first = Trust([signer.public])  # one process takes the newer manifest
    assert first.manifest(new, "public/hours") == Manifest.from_dict(new)
    later = Trust([signer.public])  # another, started after it, is sent the older one
    assert later.manifest(old, "public/hours") is None and later.rejected == 1
    assert later.manifest(new, "public/hours") == Manifest.from_dict(new)  # the newer one is still taken


async def test_a_fresh_client_with_keys_and_no_state_refuses_the_replay_too(home, signer):
    old, new = _manifest(signer, 5, [1, 2]), _manifest(signer, 7, [3, 4])
    async with KDNClient(edges=["http://127.0.0.1:9"], trusted_keys=[signer.public]) as first:
        assert first.trust.manifest(new, "public/hours") == Manifest.from_dict(new)
    async with KDNClient(edges=["http://127.0.0.1:9"], trusted_keys=[signer.public]) as fresh:
        assert fresh.trust.manifest(old, "public/hours") is None and fresh.rejected_records == 1
        assert fresh.manifest_versions["public/hours"] == 7


def test_the_default_state_file_is_private_and_where_the_platform_keeps_state(home, signer, tmp_path, monkeypatch):
    t = Trust([signer.public])
    t.manifest(_manifest(signer, 7, [3]), "public/hours")
    path = home / ".local" / "state" / "kdn" / "manifest-versions"
    assert t.state_path == path and path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert Trust([signer.public]).state_path == tmp_path / "xdg" / "kdn" / "manifest-versions"
    monkeypatch.setenv("KDN_MANIFEST_STATE", str(tmp_path / "shared" / "versions"))  # one file for a fleet's workers
    shared = Trust([signer.public])
    assert shared.state_path == tmp_path / "shared" / "versions"
    assert shared.manifest(_manifest(signer, 5, [1]), "public/hours") is not None  # another file: its own marks


@pytest.mark.parametrize("opt_out", [False, "memory"])
def test_memory_only_is_an_explicit_choice(home, signer, opt_out):
    t = Trust([signer.public], manifest_state=opt_out)
    t.manifest(_manifest(signer, 7, [3]), "public/hours")
    assert t.state_path is None and not home.exists()
    assert Trust([signer.public], manifest_state=opt_out).manifest(_manifest(signer, 5, [1]), "public/hours")


def test_the_environment_can_choose_memory_and_a_client_without_keys_writes_nothing(home, signer, monkeypatch):
    assert Trust().state_path is None and not home.exists()  # no keys: a version is the sender's word
    monkeypatch.setenv("KDN_MANIFEST_STATE", "memory")
    assert Trust([signer.public]).state_path is None and not home.exists()


def test_a_state_folder_others_can_write_is_refused(home, signer):
    folder = home / ".local" / "state" / "kdn"
    folder.mkdir(parents=True)
    folder.chmod(0o777)  # anyone here could replace the file, and so reset the marks
    with pytest.raises(InvalidInput, match="chmod 700"):
        Trust([signer.public])


def test_security_md_names_the_default_state_file_and_its_variable():
    from kdn.client.versions import DEFAULT_STATE, ENV_STATE, MEMORY

    doc = (ROOT / "docs" / "security.md").read_text()
    assert f"~/.local/state/{DEFAULT_STATE}" in doc and f"$XDG_STATE_HOME/{DEFAULT_STATE}" in doc
    assert ENV_STATE in doc and f"{ENV_STATE}={MEMORY}" in doc
