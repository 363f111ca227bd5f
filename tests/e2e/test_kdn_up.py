"""`kdn up`, as a newcomer runs it: one command, registry + origin + two regions of edges, a question."""

import os
import re
import socket
import subprocess
import sys

import pytest

from ports import free_port_block  # bench/lib/ports.py

pytestmark = pytest.mark.timeout(300)


def test_kdn_up_runs_the_demo_and_reuses_the_document(tmp_path):
    port = free_port_block(4)
    home = tmp_path / "up"
    home.mkdir()
    home.chmod(0o755)  # as a user's new folder usually is
    r = subprocess.run(
        [sys.executable, "-P", "-m", "kdn.cli", "up", "--no-serve", "--model", "tiny-llama", "--dir", str(home),
         "--port", str(port)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "Traceback" not in r.stderr
    assert re.search(r"published \d+ tokens as \d+ chunks", out)
    assert "edges     eu:" in out and "edges     us:" in out
    warm = re.search(r"KDN, warm .*reused (\d+)/(\d+) tokens .*memory", out)
    assert warm, out
    assert int(warm.group(1)) >= 3000  # the whole published document came from the cache
    # ... and from the machine's host tier, its shared memory filled from the eu edges ahead of the request
    hosted = re.search(r"KDN, host .*reused (\d+)/(\d+) tokens \(\d+ chunks from host x\d+\)", out)
    assert hosted and int(hosted.group(1)) == int(warm.group(1)), out
    assert "NOT the edge's" not in out and "host tier " in out
    assert re.search(r"\d+\.\dx faster with KDN", out)
    # the KDN's answer is the one computing the prompt in the origin's chunks gives, token for token
    assert re.search(r"the same \d+ tokens as computing the prompt here without KDN", out), out
    assert "NOT the same" not in out
    assert "kdn registry show" in out and "kdn publish" in out
    # its secrets, registry and blobs are the user's alone (once 0644 files in a 0755 folder)
    assert home.stat().st_mode & 0o777 == 0o700
    for secret in ("tokens", "edge-token", "origin.key"):
        assert (home / secret).stat().st_mode & 0o077 == 0, secret


def test_the_demo_question_is_one_smollm2_answers_right_on_the_path_the_kdn_is_exact_to():
    """`kdn up` on a machine with SmolLM2 asks ``up.QUESTION``: the model must answer it from the sample with the
    document's own figure, computed as a KDN hit is (published tokens in 256-token chunks, then the question)."""
    from kdn.adapters.hf import load_model, prompt_tokens
    from kdn.origin.publish import head_text
    from kdn.template import encode_frame, encode_text
    from kdn.up import ANSWER, QUESTION, SAMPLE, _chunked

    lm = load_model("smollm2-135m")
    tok = lm.tokenizer
    published = encode_frame(tok, head_text(tok, "chat", None, None)) + encode_text(tok, SAMPLE.read_text())
    ids = prompt_tokens(tok, {"prefix_tokens": published, "template": "chat"}, QUESTION)
    out = tok.decode(_chunked(lm, ids, len(published) // 256 * 256, 24), skip_special_tokens=True)
    assert ANSWER in out, out


def test_kdn_up_takes_free_ports_when_its_own_are_busy_and_floods_no_progress_bars(tmp_path):
    port = free_port_block(4)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 2))  # one edge port taken by someone else
        busy.listen()
        r = subprocess.run(
            [sys.executable, "-P", "-m", "kdn.cli", "up", "--no-serve", "--model", "tiny-llama", "--dir", str(tmp_path),
             "--port", str(port)],
            capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ports {port}-{port + 4} are not all free; using" in r.stdout
    assert re.search(r"KDN, warm .*reused", r.stdout)
    # not a terminal: no progress bar redraws in the captured output
    assert "it/s]" not in r.stdout + r.stderr


def test_kdn_up_startup_failure_is_one_line(tmp_path):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state folder should go")
    r = subprocess.run([sys.executable, "-P", "-m", "kdn.cli", "up", "--no-serve", "--model", "tiny-llama",
                        "--dir", str(blocker)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("kdn: error: kdn up could not start")
    assert len(r.stderr.strip().splitlines()) == 1
