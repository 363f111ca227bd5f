"""`kdn policy set|ls|rm`, `kdn ring show` and `kdn edge serve`'s input checks, run for real in subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kdn.registry import EmbeddedRegistry, EtcdRegistry, NodeRecord, Policy
from kdn.ring import Ring


@pytest.fixture(params=["embedded", "etcd"])
def backend(request, tmp_path):
    """``(registry URL for the CLI, factory of a registry handle on the same data)``."""
    if request.param == "etcd":
        u = urlsplit(request.getfixturevalue("etcd_server"))
        prefix = f"/kdn-cli-{uuid.uuid4().hex[:12]}/"
        return f"etcd://{u.hostname}:{u.port}{prefix}", lambda: EtcdRegistry(u.hostname, u.port, prefix)
    path = tmp_path / "registry.sqlite3"
    return f"file:{path}", lambda: EmbeddedRegistry(path)


class Cli:
    """``kdn`` with $KDN_REGISTRY set, from a folder outside the checkout."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        self.cwd = tmp_path
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDN_REGISTRY")}
        self.env["KDN_REGISTRY"] = url
        self.env["XDG_DATA_HOME"] = str(tmp_path / "xdg")

    def argv(self, args) -> list[str]:
        return [sys.executable, "-P", "-m", "kdn.cli", *args]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(args), env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=60)

    async def arun(self, *args: str) -> tuple[int, str, str]:
        """Without blocking the event loop (leases held by this process keep being refreshed)."""
        proc = await asyncio.create_subprocess_exec(
            *self.argv(args), env=self.env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def cli(tmp_path, backend):
    return Cli(tmp_path, backend[0])


def one_error_line(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdn: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], lines[0]


async def test_policy_set_ls_rm_round_trip(cli, backend):
    r = cli.run("policy", "set", "pin-docs", "--pin", "public/docs", "--region", "eu")
    assert r.returncode == 0 and "pin public/docs in region eu" in r.stdout
    assert "not published yet" in r.stderr  # allowed: edges apply it once it is
    assert cli.run("policy", "set", "warm-faq", "--warm", "tenant-a/faq").returncode == 0
    assert cli.run("policy", "set", "ttl-news", "--ttl", "1h30m", "--namespace", "news").returncode == 0
    assert cli.run("policy", "set", "ttl-all", "--ttl", "90s").returncode == 0
    r = cli.run("policy", "set", "quota-a", "--quota", "2GiB", "--namespace", "tenant-a", "--region", "us")
    assert r.returncode == 0 and "2 GiB for namespace tenant-a in region us" in r.stdout
    r = cli.run("policy", "set", "shield", "--upper", "--region", "eu")
    assert r.returncode == 0 and "region eu is the upper tier" in r.stdout
    assert "no live edge in region eu" in r.stderr  # allowed: edges follow it once one starts

    reg = backend[1]()
    try:
        got = {p.name: p for p in await reg.list_policies()}
    finally:
        await reg.close()
    assert set(got) == {"pin-docs", "warm-faq", "ttl-news", "ttl-all", "quota-a", "shield"}
    assert (got["shield"].kind, got["shield"].region) == ("upper", "eu")
    assert (got["pin-docs"].kind, got["pin-docs"].manifest, got["pin-docs"].region) == ("pin", "public/docs", "eu")
    assert (got["warm-faq"].kind, got["warm-faq"].manifest, got["warm-faq"].region) == ("warm", "tenant-a/faq", None)
    assert (got["ttl-news"].ttl_s, got["ttl-news"].namespace) == (5400.0, "news")
    assert (got["quota-a"].quota_bytes, got["quota-a"].namespace) == (2 << 30, "tenant-a")
    assert isinstance(got["ttl-all"].extra["set_at"], float)

    r = cli.run("policy", "ls")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "REGION", "SCOPE", "SETTING"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(got)
    assert rows["quota-a"].split()[1:3] == ["quota", "us"] and rows["quota-a"].endswith("2 GiB")
    assert rows["ttl-news"].endswith("1h30m") and rows["ttl-all"].endswith("1m30s")
    assert rows["shield"].split()[1:3] == ["upper", "eu"] and "upper tier" in rows["shield"]
    r = cli.run("policy", "ls", "--json")
    assert r.returncode == 0 and {p["name"] for p in json.loads(r.stdout)} == set(got)

    # Set again: replaced, not duplicated.
    assert cli.run("policy", "set", "ttl-all", "--ttl", "2h").returncode == 0
    ls = {p["name"]: p for p in json.loads(cli.run("policy", "ls", "--json").stdout)}
    assert len(ls) == 6 and ls["ttl-all"]["ttl_s"] == 7200.0

    r = cli.run("policy", "rm", "ttl-all")
    assert r.returncode == 0 and "removed" in r.stdout
    r = cli.run("policy", "rm", "ttl-all")
    assert r.returncode == 1 and r.stderr.strip() == "kdn: no policy named ttl-all"
    assert "ttl-all" not in {p["name"] for p in json.loads(cli.run("policy", "ls", "--json").stdout)}


async def test_policy_ls_shows_a_record_no_edge_would_apply(cli, backend):
    reg = backend[1]()
    try:
        await reg._put(reg._key("policies/junk"), b"\xc1")  # raw: past put_policy's checks
        await reg.put_policy(Policy("pin-nothing", "pin"))  # a valid record, but a pin needs a manifest
    finally:
        await reg.close()
    r = cli.run("policy", "ls")
    assert r.returncode == 0
    kinds = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines()[1:]}
    assert kinds == {"junk": "invalid", "pin-nothing": "invalid"}
    assert cli.run("policy", "rm", "junk").returncode == 0


@pytest.mark.parametrize(
    "args, words",
    [
        (["policy", "set", "x", "--quota", "5XB", "--namespace", "a"], ["invalid size", "5XB"]),
        (["policy", "set", "x", "--quota=-1GiB", "--namespace", "a"], ["invalid size"]),
        (["policy", "set", "x", "--ttl", "forever"], ["invalid duration", "forever"]),
        (["policy", "set", "x", "--ttl=-5m"], ["invalid duration"]),
        (["policy", "set", "x"], ["one of the arguments --pin --warm --push --ttl --quota --upper is required"]),
        (["policy", "set", "x", "--upper"], ["--upper needs --region"]),
        (["policy", "set", "x", "--upper", "--region", "eu", "--namespace", "a"], ["takes no --namespace"]),
        (["policy", "set", "x", "--upper", "--ttl", "1h"], ["not allowed with"]),
        (["policy", "set", "x", "--pin", "a/b", "--ttl", "1h"], ["not allowed with"]),
        (["policy", "set", "x", "--quota", "1G"], ["--quota needs --namespace"]),
        (["policy", "set", "x", "--quota", "1G", "--namespace", "a", "--manifest", "a/b"], ["no --manifest"]),
        (["policy", "set", "x", "--pin", "a/b", "--namespace", "a"], ["--pin and --warm name their manifest"]),
        (["policy", "set", "x", "--pin", "docs"], ["invalid manifest reference", "docs"]),
        (["policy", "set", "x", "--ttl", "1h", "--namespace", "Bad NS"], ["invalid namespace"]),
        (["policy", "set", "bad name", "--ttl", "1h"], ["invalid name"]),
        (["policy", "set", "x", "--ttl", "1h", "--region", "e u"], ["invalid name"]),
        (["policy", "rm", "../etc"], ["invalid name"]),
        (["policy"], ["required"]),
        (["ring", "show", "no/region"], ["invalid name"]),
        (["ring", "show"], ["required"]),
        (["edge", "serve", "--mem-budget", "2XB"], ["invalid size", "2XB"]),
        (["edge", "serve", "--mem-budget", "0"], ["--mem-budget must be more than zero"]),
        (["edge", "serve", "--disk-budget", "50GiB"], ["--disk-budget needs --disk"]),
        (["edge", "serve", "--lease-ttl", "soon"], ["invalid duration"]),
        (["edge", "serve", "--port", "http"], ["invalid int value"]),
        (["edge", "serve", "--port", "70000"], ["--port must be 0-65535"]),
        (["edge", "serve", "--prefetch", "-1"], ["--prefetch must be >= 0"]),
        (["edge", "serve", "--region", "eu west"], ["invalid name"]),
        (["edge", "serve", "--origin", "ftp://x"], ["--origin", "must be http:// or https://"]),
        (["edge", "serve", "--url", "http://user@evil:8100"], ["--url", "must not carry a user"]),
        (["edge", "serve", "--token-hosts", "a b"], ["bad token host pattern"]),
        (["edge", "serve", "--token-file", "/no/such/file"], ["--token-file", "not a readable file"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    cli = Cli(tmp_path, f"file:{tmp_path / 'registry.sqlite3'}")
    one_error_line(cli.run(*args), *words)


async def test_ring_show_lists_live_edges_and_their_share(cli, backend):
    reg = backend[1]()
    leases = []
    try:
        for node_id in ("edge-b", "edge-a", "edge-c"):
            leases.append(await reg.register_node(NodeRecord("edge", "eu", node_id, f"http://{node_id}.test:8100"), ttl=30))
        leases.append(await reg.register_node(NodeRecord("edge", "us", "edge-us", "http://us.test:8100"), ttl=30))
        leases.append(await reg.register_node(NodeRecord("origin", "eu", "origin-1", "http://o.test:8000"), ttl=30))

        rc, out, err = await cli.arun("ring", "show", "eu")
        assert rc == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["NODE", "URL", "SHARE"]
        rows = [line.split() for line in lines[1:]]
        assert [r[0] for r in rows] == ["edge-a", "edge-b", "edge-c"]  # edges of eu only, sorted
        assert rows[0][1] == "http://edge-a.test:8100"
        expected = Ring(["edge-a", "edge-b", "edge-c"]).shares()
        for r in rows:
            assert r[2] == f"{expected[r[0]] * 100:.1f}%"

        rc, out, _ = await cli.arun("ring", "show", "eu", "--json")
        got = {n["node_id"]: n["share"] for n in json.loads(out)}
        assert got == pytest.approx(expected) and sum(got.values()) == pytest.approx(1.0)

        await leases[0].close()  # edge-b leaves: the others take its share
        rc, out, _ = await cli.arun("ring", "show", "eu", "--json")
        assert {n["node_id"] for n in json.loads(out)} == {"edge-a", "edge-c"}

        rc, out, err = await cli.arun("ring", "show", "asia")
        assert rc == 0 and out == "" and "no live edges in region asia" in err
    finally:
        for lease in leases:
            await lease.close()
        await reg.close()


def test_commands_are_listed_and_help_loads_nothing_heavy(tmp_path):
    code = (
        "import sys, kdn.cli; kdn.cli.build_parser(); "
        "print(sorted(m for m in ('aiohttp', 'torch', 'uhashring', 'aetcd', 'kdn.registry.etcd', 'kdn.registry.embedded', "
        "'kdn.edge.app', 'kdn.edge.policies') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    r = Cli(tmp_path, "file:x").run("--help")
    for cmd in ("edge", "policy", "ring"):
        assert cmd in r.stdout
    r = Cli(tmp_path, "file:x").run("edge", "serve", "--help")
    for flag in ("--region", "--registry", "--origin", "--mem-budget", "--disk", "--disk-budget", "--host", "--port",
                 "--node-id", "--url", "--token-file", "--upstream-token-file", "--prefetch", "--lease-ttl"):
        assert flag in r.stdout


async def test_a_policy_set_from_the_cli_reaches_a_running_edge(cli, backend, tmp_path):
    from blake3 import blake3

    from kdn.edge.memory import MemoryTier
    from kdn.edge.policies import PolicyEngine
    from kdn.edge.tiers import EntryMeta
    from kdn.registry import Manifest

    a = blake3(b"cli-doc/0").hexdigest()
    reg = backend[1]()
    mem = MemoryTier(10_000)
    eng = PolicyEngine(reg, "eu", [mem])
    try:
        await reg.put_manifest(Manifest("public", "docs", blake3(b"m").hexdigest(), [a], 4, 4, [1, 2, 3, 4]))
        await mem.put((a, "raw"), b"data", EntryMeta(4, blake3(b"data").hexdigest(), "public"))
        await eng.start()
        rc, _, err = await cli.arun("policy", "set", "pin-docs", "--pin", "public/docs", "--region", "eu")
        assert rc == 0 and err == ""  # the manifest exists: no note
        await eng.wait_applied(lambda e: a in e.pinned_addresses)
        assert dict(mem.entries())[(a, "raw")].pinned
        rc, _, _ = await cli.arun("policy", "rm", "pin-docs")
        await eng.wait_applied(lambda e: not e.pinned_addresses)
        assert not dict(mem.entries())[(a, "raw")].pinned
    finally:
        await eng.close()
        await reg.close()


async def test_policy_set_with_an_operator_key_signs_what_it_writes(cli, backend, tmp_path):
    from kdn.registry.signing import Signer, Verifier

    key = Signer.generate(tmp_path / "operator.key")
    r = cli.run("policy", "set", "ttl-signed", "--ttl", "90s", "--operator-key", str(tmp_path / "operator.key"))
    assert r.returncode == 0, r.stderr
    assert cli.run("policy", "set", "ttl-plain", "--ttl", "90s").returncode == 0
    reg = backend[1]()
    try:
        got = {p.name: p for p in await reg.list_policies()}
    finally:
        await reg.close()
    v = Verifier([key.public])
    assert v.ok(got["ttl-signed"]) and not v.ok(got["ttl-plain"])
    one_error_line(cli.run("policy", "set", "x", "--ttl", "1s", "--operator-key", str(tmp_path / "missing.key")),
                   "missing.key")


async def test_policy_rm_with_an_operator_key_writes_a_signed_tombstone(cli, backend, tmp_path):
    from kdn.registry.policy_records import is_tombstone, set_at
    from kdn.registry.signing import Signer, Verifier

    key = Signer.generate(tmp_path / "operator.key")
    k = ("--operator-key", str(tmp_path / "operator.key"))
    assert cli.run("policy", "set", "q", "--quota", "1MiB", "--namespace", "acme", *k).returncode == 0
    r = cli.run("policy", "rm", "q", *k)
    assert r.returncode == 0 and "signed tombstone" in r.stdout, r.stderr
    reg = backend[1]()
    try:
        got = {p.name: p for p in await reg.list_policies()}
    finally:
        await reg.close()
    t = got["q"]  # still there, as a tombstone the operator signed, newer than the policy it removes
    assert is_tombstone(t) and Verifier([key.public]).ok(t) and set_at(t) > 0
    assert t.quota_bytes is None and t.namespace is None  # built from the name alone, nothing of the record
    assert "removed (a signed tombstone)" in cli.run("policy", "ls").stdout
    assert cli.run("policy", "rm", "q", *k).returncode == 1  # removed already
    r = cli.run("policy", "rm", "nothing", *k)  # not in the registry (a writer may have deleted its key)
    assert r.returncode == 0 and "written anyway" in r.stderr


async def test_policy_rm_signs_no_name_a_registry_writer_planted_under_the_one_removed(cli, backend, tmp_path):
    """#28 second reading: the tombstone was built from the record stored under the name, so a writer who put
    a record naming ``victim`` at ``policies/x`` got the operator's `rm x` to sign the removal of ``victim``
    (and of nothing under ``x``). Now it is built from the name asked for, whatever the registry holds."""
    from kdn.registry.policy_records import is_tombstone
    from kdn.registry.records import Policy
    from kdn.registry.signing import Signer, Verifier

    key = Signer.generate(tmp_path / "operator.key")
    k = ("--operator-key", str(tmp_path / "operator.key"))
    assert cli.run("policy", "set", "victim", "--ttl", "1h", "--namespace", "acme", *k).returncode == 0
    assert cli.run("policy", "set", "x", "--ttl", "1m", "--namespace", "acme", *k).returncode == 0
    reg = backend[1]()
    try:
        await reg._put(reg._policy_key("x"), Policy("victim", "ttl", ttl_s=5, extra={"set_at": 1.0}).pack())
    finally:
        await reg.close()
    r = cli.run("policy", "rm", "x", *k)
    assert r.returncode == 0, r.stderr
    reg = backend[1]()
    try:
        got = {p.name: p for p in await reg.list_policies()}
    finally:
        await reg.close()
    assert not is_tombstone(got["victim"]) and Verifier([key.public]).ok(got["victim"])  # untouched
    assert is_tombstone(got["x"]) and Verifier([key.public]).ok(got["x"])
