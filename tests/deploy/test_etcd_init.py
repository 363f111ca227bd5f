"""deploy/etcd-init.sh against a real etcd: after it, only user kdn (on its prefix) and root get in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from etcd_proc import ETCDCTL_BIN, EtcdProcess  # noqa: E402

from kdn.errors import RegistryError  # noqa: E402
from kdn.registry import open_registry  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "etcd-init.sh"


@pytest.fixture
def etcd():
    e = EtcdProcess()
    e.start()
    yield e
    e.stop()


def run_init(etcd: EtcdProcess, tmp_path: Path, root_pw: str = "root-secret-1") -> subprocess.CompletedProcess:
    (tmp_path / "root.pw").write_text(root_pw + "\n")
    (tmp_path / "kdn.pw").write_text("kdn-secret-2\n")
    bindir = tmp_path / "bin"  # the script calls `etcdctl` from PATH, as in the image
    bindir.mkdir(exist_ok=True)
    if not (bindir / "etcdctl").exists():
        (bindir / "etcdctl").symlink_to(ETCDCTL_BIN)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "ETCDCTL_ENDPOINTS": etcd.url,
           "ETCD_ROOT_PASSWORD_FILE": str(tmp_path / "root.pw"), "KDN_ETCD_PASSWORD_FILE": str(tmp_path / "kdn.pw")}
    return subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


async def test_init_gives_kdn_its_prefix_and_nothing_else(etcd, tmp_path):
    r = run_init(etcd, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "auth on" in r.stdout
    pw = tmp_path / "kdn.pw"
    host = etcd.url.removeprefix("http://")

    async with open_registry(f"etcd://kdn@{host}/kdn/?password_file={pw}") as reg:
        await reg._put(reg._key("probe"), b"x")  # noqa: SLF001 - a raw write under the prefix
        items, _ = await reg._range(reg._key("probe"))  # noqa: SLF001
        assert [v for _, v in items] == [b"x"]
    for url in (f"etcd://kdn@{host}/other/?password_file={pw}",  # outside its prefix
                f"etcd://{host}/kdn/"):  # anonymous
        with pytest.raises(RegistryError, match="refused|permission|denied|auth"):
            async with open_registry(url) as reg:
                await reg._put(reg._key("probe"), b"x")  # noqa: SLF001

    again = run_init(etcd, tmp_path)  # compose re-runs it on every `up`
    assert again.returncode == 0 and "already on" in again.stdout, again.stderr
    wrong = run_init(etcd, tmp_path, root_pw="not-the-root-password")
    assert wrong.returncode == 1 and "root with this password" in wrong.stderr
