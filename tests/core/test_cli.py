"""The `kdn` console script, run for real in subprocesses: address, registry show|ls|nodes, relation
sign|put|show|list, bad input."""

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
from blake3 import blake3

from kdn.format import address as A
from kdn.registry import (BaseRelation, EmbeddedRegistry, Encoding, EtcdRegistry, ModelRecord, NodeRecord, ObjectRecord,
                          find_relation)
from kdn.registry.signing import Verifier

MID = blake3(b"cli-test-model").hexdigest()
KDN_SCRIPT = Path(sys.executable).with_name("kdn")


def _addr(seed: str) -> str:
    return blake3(seed.encode()).hexdigest()


def _object(seed: str = "obj-1") -> ObjectRecord:
    return ObjectRecord(
        address=_addr(seed),
        model_id=MID,
        namespace="public",
        kind="kv",
        start=0,
        end=256,
        parent=None,
        standalone=False,
        encodings={"raw": Encoding("raw", 4, _addr("blob"))},
        origin="origin-1",
        tails={17: _addr("tail")},
        created=1700000000.0,
    )


def _model() -> ModelRecord:
    return ModelRecord(MID, "tiny", "LlamaForCausalLM", "bfloat16", 256, {"layers": 2}, {"note": "t"})


class Cli:
    """Runs ``kdn`` with $KDN_REGISTRY on a fresh file registry, from a folder outside the checkout."""

    def __init__(self, tmp_path: Path) -> None:
        self.cwd = tmp_path
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDN_REGISTRY")}
        self.env["KDN_REGISTRY"] = f"file:{tmp_path / 'registry.sqlite3'}"
        self.env["XDG_DATA_HOME"] = str(tmp_path / "xdg")  # never the user's default registry

    def run(self, *args: str, cmd: list[str] | None = None) -> subprocess.CompletedProcess:
        argv = (cmd or [sys.executable, "-P", "-m", "kdn.cli"]) + list(args)
        return subprocess.run(argv, env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=60)

    async def arun(self, *args: str) -> subprocess.CompletedProcess:
        """``run`` in a thread, so the test's event loop (and a lease keep-alive on it) keeps running."""
        return await asyncio.to_thread(self.run, *args)


@pytest.fixture
def cli(tmp_path):
    return Cli(tmp_path)


@pytest.fixture
def reg_path(tmp_path):
    return tmp_path / "registry.sqlite3"


def assert_one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdn: error:"), r.stderr
    assert r.stdout == ""
    return lines[0]


# --- kdn address ---------------------------------------------------------------

TOKENS = list(range(1, 12))


def _tokens_arg(tokens: list[int]) -> str:
    return ",".join(map(str, tokens))


def test_address_matches_prefix_addresses(cli):
    r = cli.run("address", "--model-id", MID, "--namespace", "public", "--tokens", _tokens_arg(TOKENS), "--chunk-tokens", "4")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    assert [a for _, a in rows] == A.prefix_addresses(MID, "public", TOKENS, 4)
    assert [s for s, _ in rows] == ["0-4", "4-8", "8-11"]


def test_address_default_chunk_is_256_tokens(cli):
    tokens = list(range(300))
    r = cli.run("address", "--model-id", MID, "--tokens", _tokens_arg(tokens))
    assert r.returncode == 0, r.stderr
    first, second = A.prefix_addresses(MID, "public", tokens)
    assert [line.split() for line in r.stdout.splitlines()] == [["0-256", first], ["256-300", second]]


def test_address_tokens_may_contain_spaces(cli):
    r = cli.run("address", "--model-id", MID, "--tokens", "1, 2, 3", "--chunk-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert [line.split()[1] for line in r.stdout.splitlines()] == A.prefix_addresses(MID, "public", [1, 2, 3], 2)


def test_address_json(cli):
    r = cli.run("address", "--model-id", MID, "--namespace", "acme", "--tokens", _tokens_arg(TOKENS), "--chunk-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    addrs = A.prefix_addresses(MID, "acme", TOKENS, 4)
    assert json.loads(r.stdout) == [
        {"start": 0, "end": 4, "address": addrs[0]},
        {"start": 4, "end": 8, "address": addrs[1]},
        {"start": 8, "end": 11, "address": addrs[2]},
    ]


def test_address_namespace_changes_addresses(cli):
    public = cli.run("address", "--model-id", MID, "--tokens", "1,2,3", "--json")
    acme = cli.run("address", "--model-id", MID, "--namespace", "acme", "--tokens", "1,2,3", "--json")
    assert json.loads(public.stdout)[0]["address"] != json.loads(acme.stdout)[0]["address"]


def test_address_standalone(cli):
    r = cli.run("address", "--model-id", MID, "--tokens", _tokens_arg(TOKENS), "--chunk-tokens", "4", "--standalone", "--json")
    assert r.returncode == 0, r.stderr
    got = [row["address"] for row in json.loads(r.stdout)]
    assert got == A.standalone_addresses(MID, "public", TOKENS, 4)
    assert got != A.prefix_addresses(MID, "public", TOKENS, 4)
    # Position-independent: a chunk has the same address wherever it sits.
    assert got[1] == A.standalone_address(MID, "public", TOKENS[4:8])


# --- kdn registry --------------------------------------------------------------


async def test_registry_show_object(cli, reg_path):
    rec = _object()
    async with EmbeddedRegistry(reg_path) as reg:
        await reg.put_objects([rec])
    r = await cli.arun("registry", "show", rec.address)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["type"] == "object"
    out = out["record"]
    assert out["address"] == rec.address and out["model_id"] == MID and out["origin"] == "origin-1"
    assert out["encodings"] == {"raw": {"name": "raw", "size": 4, "digest": _addr("blob")}}
    assert ObjectRecord.from_dict(out) == rec


async def test_registry_show_says_the_record_is_an_object(cli, reg_path):
    # The record type and the record's own fields (an object has its own `kind`) must not collide.
    rec = _object()
    async with EmbeddedRegistry(reg_path) as reg:
        await reg.put_objects([rec])
    out = json.loads((await cli.arun("registry", "show", rec.address)).stdout)
    assert ObjectRecord.from_dict(out["record"]) == rec  # the record itself, its kind "kv" included
    assert out["type"] == "object", f"output does not say it is an object record: {out}"


async def test_registry_show_model(cli, reg_path):
    rec = _model()
    async with EmbeddedRegistry(reg_path) as reg:
        await reg.put_model(rec)
    r = await cli.arun("registry", "show", MID)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["type"] == "model"
    assert ModelRecord.from_dict(out["record"]) == rec


async def test_registry_show_explicit_registry_flag_beats_env(cli, tmp_path):
    other = tmp_path / "other.sqlite3"
    rec = _object("only-in-other")
    async with EmbeddedRegistry(other) as reg:
        await reg.put_objects([rec])
    assert (await cli.arun("registry", "show", rec.address)).returncode == 1
    r = await cli.arun("registry", "show", rec.address, "--registry", f"file:{other}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["record"]["address"] == rec.address


def test_registry_show_missing_exits_1(cli):
    missing = _addr("never-published")
    r = cli.run("registry", "show", missing)
    assert r.returncode == 1
    assert r.stdout == ""
    assert missing in r.stderr and "not in the registry" in r.stderr
    assert "Traceback" not in r.stderr


async def test_registry_ls_lists_keys(cli, reg_path):
    recs = [_object("a"), _object("b")]
    async with EmbeddedRegistry(reg_path) as reg:
        await reg.put_objects(recs)
        await reg.put_model(_model())
    r = await cli.arun("registry", "ls", "--prefix", "objects/")
    assert r.returncode == 0, r.stderr
    keys = [line.split("\t")[0] for line in r.stdout.splitlines()]
    assert keys == sorted(f"objects/{rec.address}" for rec in recs)
    assert all(line.endswith(" B") for line in r.stdout.splitlines())
    everything = (await cli.arun("registry", "ls")).stdout
    assert f"models/{MID}\t" in everything and len(everything.splitlines()) == 3


async def test_registry_nodes_lists_live_node(cli, reg_path):
    rec = NodeRecord("edge", "eu", "edge-1", "http://edge-1.test:8080")
    async with EmbeddedRegistry(reg_path) as reg:
        lease = await reg.register_node(rec, ttl=30)
        try:
            r = await cli.arun("registry", "nodes")
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == ["edge", "eu", "edge-1", "http://edge-1.test:8080"]
            assert (await cli.arun("registry", "nodes", "--role", "origin")).stdout == ""
            assert "edge-1" in (await cli.arun("registry", "nodes", "--region", "eu")).stdout
        finally:
            await lease.close()
        r = await cli.arun("registry", "nodes")
    assert r.returncode == 0 and r.stdout == ""
    assert "no live nodes" in r.stderr


async def test_registry_show_on_etcd(cli, etcd_server):
    u = urlsplit(etcd_server)
    prefix = f"kdn-cli-{uuid.uuid4().hex[:12]}"
    rec = _object()
    async with EtcdRegistry(u.hostname, u.port, prefix) as reg:
        await reg.put_objects([rec])
        await reg.put_model(_model())
    url = f"etcd://127.0.0.1:{u.port}/{prefix}"
    r = await cli.arun("registry", "show", rec.address, "--registry", url)
    assert r.returncode == 0, r.stderr
    assert ObjectRecord.from_dict(json.loads(r.stdout)["record"]) == rec
    r = await cli.arun("registry", "show", MID, "--registry", url)
    assert r.returncode == 0, r.stderr
    assert ModelRecord.from_dict(json.loads(r.stdout)["record"]) == _model()
    # Another prefix on the same etcd is another registry.
    r = await cli.arun("registry", "show", rec.address, "--registry", f"etcd://127.0.0.1:{u.port}/elsewhere-{prefix}")
    assert r.returncode == 1 and "not in the registry" in r.stderr


# --- kdn relation ----------------------------------------------------------------


def _relation() -> BaseRelation:
    return BaseRelation(variant=MID, base=_addr("base-model"), layers=8, recompute=[0, 1], metric="nll%",
                        budget=5.0, measured={"nll%": [2.0, 0.5]}, name="tiny+sft")


def _keygen(cli: Cli, name: str) -> Path:
    assert cli.run("origin", "keygen", "--out", name).returncode == 0
    return cli.cwd / name


async def test_relation_sign_put_show_list_then_found_by_a_consumer(cli, reg_path):
    key, other = _keygen(cli, "pub.key"), _keygen(cli, "other.key")
    (cli.cwd / "rel.msgpack").write_bytes(_relation().pack())
    r = cli.run("relation", "put", "rel.msgpack")
    assert "unsigned" in assert_one_line_error(r)  # no consumer takes an unsigned relation
    assert "untrusted" in assert_one_line_error(
        cli.run("relation", "put", "rel.msgpack", "--signing-key", str(other), "--trusted-keys", f"{key}.pub"))
    assert cli.run("relation", "sign", "rel.msgpack", "--signing-key", str(key)).returncode == 0
    r = cli.run("relation", "put", "rel.msgpack", "--trusted-keys", f"{key}.pub")
    assert r.returncode == 0 and f"relations/{MID}" in r.stdout, r.stderr
    r = cli.run("relation", "show", MID, "--trusted-keys", f"{key}.pub")
    assert r.returncode == 0, r.stderr
    out, signed = json.loads(r.stdout), BaseRelation.unpack((cli.cwd / "rel.msgpack").read_bytes())
    assert out["type"] == "relation" and out["verified"] is True and signed.sig
    assert BaseRelation.from_dict(out["record"]) == signed
    assert json.loads(cli.run("relation", "show", MID, "--trusted-keys", f"{other}.pub").stdout)["verified"] is False
    r = cli.run("relation", "list", "--trusted-keys", f"{key}.pub")
    assert r.stdout.splitlines() == [f"{MID}\tbase {_addr('base-model')}\trecomputes layers [0, 2) of 8\t"
                                     "nll% <= 5\ttiny+sft\tverified"]
    async with EmbeddedRegistry(reg_path) as reg:  # what a consumer reads: only under a key it trusts
        assert await find_relation(reg, MID, Verifier.from_file(f"{key}.pub")) == signed
        assert await find_relation(reg, MID, Verifier.from_file(f"{other}.pub")) is None


def test_relation_show_of_an_absent_variant_exits_1(cli):
    r = cli.run("relation", "show", MID)
    assert r.returncode == 1 and "no relation" in r.stderr
    assert cli.run("relation", "list").stdout == ""


# --- bad input: one line, status 2 -----------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (["registry", "show", "not-an-address"], "invalid address or model id"),
        (["registry", "show", "AB" * 32], "invalid address or model id"),
        (["address", "--model-id", "zz", "--tokens", "1"], "invalid model id"),
        (["address", "--model-id", MID, "--namespace", "Not/OK", "--tokens", "1"], "invalid namespace"),
        (["address", "--model-id", MID, "--namespace", "", "--tokens", "1"], "invalid namespace"),
        (["address", "--model-id", MID, "--tokens", "1,two,3"], "--tokens must be comma-separated integers"),
        (["address", "--model-id", MID, "--tokens", "1.5"], "--tokens must be comma-separated integers"),
        (["address", "--model-id", MID, "--tokens", ","], "--tokens is empty"),
        (["address", "--model-id", MID, "--tokens", "-1"], "token ids must be integers"),
        (["address", "--model-id", MID, "--tokens", str(2**32)], "token ids must be integers"),
        (["registry", "ls", "--registry", "ftp://x"], "bad registry URL"),
        (["registry", "ls", "--registry", "file:"], "bad registry URL"),
        (["registry", "ls", "--registry", "etcd://127.0.0.1:99999"], "bad registry URL"),
        (["registry", "show", MID, "--registry", "etcd://127.0.0.1:1"], "unreachable"),
        (["registry", "nodes", "--registry", "etcd://127.0.0.1:1/kdn"], "unreachable"),
        (["registry", "nodes", "--role", "bad/role"], "invalid name"),
        (["address", "--tokens", "1"], "the following arguments are required: --model-id"),
        (["registry"], "required"),
        (["relation", "show", "not-a-model"], "invalid model id"),
        (["relation", "put", "no-such-file"], "cannot read relation"),
        ([], "required"),
        (["no-such-command"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_status_2(cli, args, says):
    line = assert_one_line_error(cli.run(*args))
    assert says in line


def test_bad_env_registry_is_one_line_status_2(cli):
    cli.env["KDN_REGISTRY"] = "ftp://x"
    assert "bad registry URL" in assert_one_line_error(cli.run("registry", "ls"))


@pytest.mark.parametrize("flag", ["", "--standalone"])
@pytest.mark.parametrize("chunk", ["0", "-4"])
def test_non_positive_chunk_tokens_is_one_line_status_2(cli, chunk, flag):
    # Bug: cmd_address (kdn/cli.py) computes the addresses before chunk_spans(),
    # the only place that rejects chunk_tokens <= 0, and prefix_addresses /
    # standalone_addresses (kdn/format/address.py) do not check it: 0 raises
    # ValueError from range(), a negative value OverflowError from
    # int.to_bytes -- a traceback, status 1. (Negative with --standalone
    # happens to reach chunk_spans, because standalone_addresses returns [].)
    args = ["address", "--model-id", MID, "--tokens", "1,2,3", "--chunk-tokens", chunk] + ([flag] if flag else [])
    assert_one_line_error(cli.run(*args))


def test_registry_file_under_a_regular_file_is_one_line_status_2(cli, tmp_path):
    # Bug (kdn/registry/embedded.py): EmbeddedRegistry._db runs os.makedirs on
    # the file's folder, and EmbeddedRegistry._call wraps only sqlite3 errors, so the OSError
    # (FileExistsError here) escapes as a traceback, status 1.
    (tmp_path / "plain-file").write_text("x")
    r = cli.run("registry", "ls", "--registry", f"file:{tmp_path / 'plain-file' / 'registry.sqlite3'}")
    assert_one_line_error(r)


# --- help ------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["address", "--help"], ["registry", "--help"], ["registry", "show", "--help"]])
def test_help_exits_0(cli, args):
    r = cli.run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kdn")


def test_installed_console_script_runs(cli):
    assert KDN_SCRIPT.exists(), f"no `kdn` script next to {sys.executable}: is the package installed?"
    r = cli.run("--help", cmd=[str(KDN_SCRIPT)])
    assert r.returncode == 0, r.stderr
    assert "address" in r.stdout and "registry" in r.stdout
    r = cli.run("address", "--model-id", MID, "--tokens", "1,2,3", "--chunk-tokens", "2", cmd=[str(KDN_SCRIPT)])
    assert [line.split()[1] for line in r.stdout.splitlines()] == A.prefix_addresses(MID, "public", [1, 2, 3], 2)
