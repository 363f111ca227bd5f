"""An origin SIGKILLed in the middle of a publish leaves no record pointing at a missing object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kdn.format.address import blob_digest
from origin_records import open_records  # bench/lib/origin_records.py
from ports import free_port  # bench/lib/ports.py

from origin_helpers import PUBLISH_TOKEN, auth, write_tokens

pytestmark = pytest.mark.timeout(240)


def make_slow_model(path: Path) -> Path:
    """A random-init Llama big enough that a 16-chunk publish takes a second or more on this CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def start_origin(tmp_path: Path, model: Path, registry: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-P", "-m", "kdn.cli", "origin", "serve", "--model", str(model), "--registry", registry,
           "--store", str(tmp_path / "store"), "--port", str(port), "--token-file", str(tmp_path / "tokens"),
           "--node-id", "killme"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "origin.log", "ab"),
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 60
    import urllib.request

    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "origin.log").read_text()[-2000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("origin did not start")


def http(method: str, url: str, body: dict | None = None) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json", **auth(PUBLISH_TOKEN)})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


async def check_records_point_at_stored_blobs(registry_url: str, store: Path) -> int:
    reg = open_records(registry_url, store)  # the records beside the blobs (the origin's default)
    try:
        keys = await reg.list_keys("objects/")
        for key, _ in keys:
            rec = await reg.get_object(key.split("/")[-1])
            for enc in rec.encodings.values():
                blob = (store / rec.address[:2] / rec.address[2:4] / f"{rec.address}.{enc.name}").read_bytes()
                assert blob_digest(blob) == enc.digest, f"record {rec.address} points at a blob that is not there"
        return len(keys)
    finally:
        await reg.close()


async def test_publish_killed_midway_leaves_no_dangling_record(tmp_path, etcd_url):
    model = make_slow_model(tmp_path / "model")
    write_tokens(tmp_path / "tokens")
    text = ("The harbor light turns every ten seconds. " * 100)[:4000]  # byte tokens: 15 full chunks + a tail
    port = free_port()
    proc = start_origin(tmp_path, model, etcd_url, port)
    base = f"http://127.0.0.1:{port}"
    try:
        job = http("POST", f"{base}/v1/publish", {"name": "killed", "text": text})
        deadline = time.monotonic() + 120
        while True:
            state = http("GET", f"{base}/v1/jobs/{job['job']}")
            if state["progress"]["done"] >= 2:
                break
            assert time.monotonic() < deadline and state["state"] in ("queued", "running"), state
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # mid-publish: no cleanup runs
        proc.wait(10)
        assert state["progress"]["done"] < state["progress"]["total"], "the job finished before the kill; enlarge the model"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    recorded = await check_records_point_at_stored_blobs(etcd_url, tmp_path / "store")
    assert recorded >= 2
    reg = open_records(etcd_url, tmp_path / "store")
    try:
        assert await reg.get_manifest("public", "killed") is None, "a manifest was written before all its objects"
    finally:
        await reg.close()

    # A restarted origin (its lease and index rebuilt from disk) finishes the job without redoing stored chunks.
    proc = start_origin(tmp_path, model, etcd_url, port)
    try:
        job = http("POST", f"{base}/v1/publish", {"name": "killed", "text": text})
        deadline = time.monotonic() + 120
        while (state := http("GET", f"{base}/v1/jobs/{job['job']}"))["state"] not in ("done", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert state["state"] == "done", state
        assert state["progress"]["computed"] <= state["progress"]["total"] - recorded
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert await check_records_point_at_stored_blobs(etcd_url, tmp_path / "store") == 16
