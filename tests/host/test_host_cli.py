"""``kdn host serve``'s arguments: a bad one fails in one line, exit 2, before anything is created."""

from __future__ import annotations

import pytest

from kdn import cli


@pytest.mark.parametrize(("args", "says"), [
    (["--trusted-keys", "k"], "give at least one --edge"),
    (["--trusted-keys", "k", "--edge", "http://127.0.0.1:1", "--segment-bytes", "12 parsecs"], "invalid size"),
    (["--trusted-keys", "k", "--edge", "http://127.0.0.1:1", "--segment-bytes", "1MiB", "--budget", "2MiB"],
     "--budget must be"),
    (["--trusted-keys", "/nonexistent/keys", "--edge", "http://127.0.0.1:1"], "/nonexistent/keys"),
    (["--trusted-keys", "k", "--edge", "http://127.0.0.1:1", "--deny-floor-ms", "-1"], "--deny-floor-ms must be"),
])
def test_bad_arguments_fail_in_one_line(args, says, capsys, short_dir):
    where = ["--socket", str(short_dir / "h.sock"), "--segment", str(short_dir / "h.seg")]
    assert cli.main(["host", "serve", *args, *where]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdn: error:") and says in err and err.count("\n") == 1, err
    assert not (short_dir / "h.seg").exists() and not (short_dir / "h.sock").exists()


def test_trusted_keys_are_required(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["host", "serve", "--edge", "http://127.0.0.1:1"])
    assert e.value.code == 2 and "--trusted-keys" in capsys.readouterr().err


def test_the_engine_side_loads_no_web_framework_and_no_model_library():
    """An engine imports ``kdn.client.host`` on its hot path: a fresh interpreter loading it (and the leased
    object's helpers) loads neither aiohttp nor torch, nor the registry's etcd client."""
    import subprocess
    import sys

    code = ("import sys, kdn.client.host, kdn.client.leased; "
            "print(','.join(m for m in ('aiohttp', 'torch', 'transformers', 'aetcd') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ""


async def test_host_stats_prints_a_running_hosts_numbers_and_says_in_one_line_when_none_runs(short_dir, capsys):
    """``kdn host stats``: a running host's stats op as JSON (what an operator reads where no --metrics-port is
    served); with no host on the socket, one line and exit 2."""
    import asyncio
    import json

    from host_helpers import Shelf, host_config, running

    shelf = Shelf()
    address, _ = shelf.add(1)
    async with running(host_config(short_dir), upstream=shelf) as tier:
        from kdn.client.host import HostClient

        async with HostClient(tier.config.socket) as host:
            assert await host.warm([address], "raw") == ["filled"]
        capsys.readouterr()
        rc = await asyncio.to_thread(cli.main, ["host", "stats", "--socket", tier.config.socket])
        out = capsys.readouterr().out
        assert rc == 0, out
        got, now = json.loads(out), tier.stats()
        # (its own connection was counted while it asked, and may or may not be by now: that one number moves)
        assert got.pop("connections") >= 1 and got == {k: v for k, v in now.items() if k != "connections"}
        assert got["fills"] == 1 and got["objects"] == 1
    rc = await asyncio.to_thread(cli.main, ["host", "stats", "--socket", str(short_dir / "none.sock")])
    err = capsys.readouterr().err
    assert rc == 2 and "no host tier answers at" in err and err.count("\n") == 1, err
