"""BlobDir: atomic writes, fan-out, restart scan, and refusal of unsafe names."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kdn.errors import InvalidInput
from kdn.format import store
from kdn.format.store import BlobDir

A1 = "a1" * 32
A2 = "b2" * 32


def test_put_read_delete_roundtrip(tmp_path):
    d = BlobDir(tmp_path)
    p = d.put(A1, "zstd", b"hello")
    assert p == tmp_path / "a1" / "a1" / f"{A1}.zstd"
    assert d.read(A1, "zstd") == b"hello"
    assert d.size(A1, "zstd") == 5
    assert d.read(A1, "raw") is None
    assert d.delete(A1, "zstd") and d.read(A1, "zstd") is None
    assert not d.delete(A1, "zstd")


def test_replace_is_whole(tmp_path):
    d = BlobDir(tmp_path)
    d.put(A1, "raw", b"x" * 1000)
    d.put(A1, "raw", memoryview(b"y" * 10))
    assert d.read(A1, "raw") == b"y" * 10


def test_scan_finds_blobs_and_removes_half_written_files(tmp_path):
    d = BlobDir(tmp_path)
    d.put(A1, "raw", b"1")
    d.put(A2, "zstd", b"22")
    crashed = tmp_path / "tmp" / f"{A2}.raw.0000.part"
    crashed.write_bytes(b"half")
    old = time.time() - store.STALE_PART_S - 1
    os.utime(crashed, (old, old))  # a writer that died long ago
    writing = tmp_path / "tmp" / f"{A1}.zstd.1111.part"
    writing.write_bytes(b"in progress")  # another origin on the same folder, writing now
    (tmp_path / "a1" / "a1" / "notes.txt").write_text("not a blob")
    found = {(b.address, b.encoding, b.size) for b in BlobDir(tmp_path).scan()}
    assert found == {(A1, "raw", 1), (A2, "zstd", 2)}
    assert list((tmp_path / "tmp").iterdir()) == [writing]


def test_process_killed_mid_write_leaves_no_blob(tmp_path):
    # A child writes a blob whose bytes come from a generator that never ends;
    # we SIGKILL it while it is writing and check nothing is visible.
    code = textwrap.dedent(
        f"""
        import os, sys
        from kdn.format.store import BlobDir
        d = BlobDir({str(tmp_path)!r})
        class Slow:
            pass
        import kdn.format.store as s
        real_write = os.write
        def slow_write(fd, b):
            n = real_write(fd, bytes(b[:1]))
            print("writing", flush=True)
            import time; time.sleep(60)
            return n
        s.os.write = slow_write
        d.put({A1!r}, "raw", b"x" * 100)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait()
    d = BlobDir(tmp_path)
    assert d.read(A1, "raw") is None
    assert list(d.scan()) == []


@pytest.mark.parametrize("addr,enc", [("../" * 10, "raw"), (A1, "../x"), (A1, ""), (A1.upper(), "raw"), (A1, "a" * 40)])
def test_unsafe_names_never_reach_the_filesystem(tmp_path, addr, enc):
    d = BlobDir(tmp_path)
    with pytest.raises(InvalidInput):
        d.put(addr, enc, b"x")
    assert sorted(os.listdir(tmp_path)) == ["tmp"]
