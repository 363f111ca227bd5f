"""The origin's store in an S3 bucket (origin/s3store.py), against a real SeaweedFS on loopback.

The same contract as the folder store (tests/origin/test_store*.py), plus what a shared bucket adds:
several origins writing one name keep the first writer's bytes, a start indexes from the small info
objects without reading a blob, and credentials never ride in the URL.
"""

from __future__ import annotations

import threading

import obstore as obs
import pytest
from blake3 import blake3

from kdn.errors import DigestMismatch, InvalidInput
from kdn.format.objects import RawTensor, encode_object
from kdn.origin.s3store import S3ObjectStore, open_store, parse_s3_url, read_credentials
from kdn.origin.store import ObjectStore

ADDR = "ab" * 32


def blob(seed: int, n: int = 3 << 20) -> bytes:
    """A real object (its header names its namespace), n bytes of payload."""
    data = memoryview(blake3(bytes([seed])).digest(length=n))
    return encode_object(kind="kv", address=ADDR, model_id="cd" * 32, namespace="acme", start=0, end=1, position=0,
                         parent=None, tensors={"L0.k": RawTensor("L0.k", "BF16", (1, n // 2, 1), data)}, encoding="raw")


def test_put_get_and_a_restart_indexes_from_the_info_objects(s3_store_url):
    store = S3ObjectStore(s3_store_url, piece_bytes=1 << 20)
    b = blob(1)
    info = store.put(ADDR, "raw", b)
    assert info.digest == blake3(b).hexdigest() and info.namespace == "acme" and len(info.pieces) == 4
    got, again = store.get(ADDR, "raw")
    assert got == b and again == info
    assert store.free_space() is None  # a bucket has no disk to fill: raw copies are kept

    restarted = S3ObjectStore(s3_store_url, piece_bytes=1 << 20)
    assert restarted.info(ADDR, "raw") == info and restarted.namespace(ADDR) == "acme"
    assert len(restarted) == 1 and restarted.total_bytes == len(b)


def test_a_blob_without_its_info_is_hashed_at_start_and_given_one(s3_store_url):
    store = S3ObjectStore(s3_store_url)
    info = store.put(ADDR, "raw", blob(2))
    obs.delete(store._s3, store._key(ADDR, "raw") + ".meta")  # its writer stopped between the two writes
    restarted = S3ObjectStore(s3_store_url)
    assert restarted.info(ADDR, "raw") == info
    assert obs.head(restarted._s3, restarted._key(ADDR, "raw") + ".meta")["size"] > 0


def test_a_flipped_bit_in_the_bucket_is_found_when_read(s3_store_url):
    store = S3ObjectStore(s3_store_url)
    b = bytearray(blob(3))
    store.put(ADDR, "raw", bytes(b))
    b[len(b) // 2] ^= 1
    obs.put(store._s3, store._key(ADDR, "raw"), bytes(b))  # rot, or a writer outside KDN
    with pytest.raises(DigestMismatch):
        S3ObjectStore(s3_store_url).get(ADDR, "raw")


def test_two_origins_writing_one_name_both_record_the_first_writers_bytes(s3_store_url):
    """Two origins publish the same chunk at once, computed by different engines (other bytes): one PUT wins,
    the other keeps the winner's blob and records its digest; nothing is half-written or lost."""
    a, b = S3ObjectStore(s3_store_url), S3ObjectStore(s3_store_url)
    blobs = [blob(4), blob(5)]
    out: dict[int, object] = {}
    go = threading.Barrier(2)

    def write(i: int, store: S3ObjectStore) -> None:
        go.wait()
        out[i] = store.put(ADDR, "raw", blobs[i])

    threads = [threading.Thread(target=write, args=(i, s)) for i, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1]  # both indexed the same blob
    stored = bytes(obs.get(a._s3, a._key(ADDR, "raw")).bytes())
    assert stored in blobs and out[0].digest == blake3(stored).hexdigest()
    assert S3ObjectStore(s3_store_url).info(ADDR, "raw") == out[0]


def test_republishing_the_same_bytes_writes_nothing(s3_store_url):
    store = S3ObjectStore(s3_store_url)
    b = blob(6)
    first = store.put(ADDR, "raw", b)
    etag = obs.head(store._s3, store._key(ADDR, "raw"))["e_tag"]
    assert store.put(ADDR, "raw", b) == first
    assert S3ObjectStore(s3_store_url).put(ADDR, "raw", b) == first  # another origin, same text
    assert obs.head(store._s3, store._key(ADDR, "raw"))["e_tag"] == etag


@pytest.mark.parametrize("url, why", [
    ("s3://key:secret@bucket/kdn", "credentials"),
    ("s3://bucket/kdn?access_key=AKIA", "only"),
    ("s3://bucket/kdn?endpoint=http://a&endpoint=http://b", "once"),
    ("s3://Bucket/kdn", "bucket"),
    ("s3://bucket", "prefix"),
    ("s3://bucket/../x", "prefix"),
    ("s3://bucket/kdn?endpoint=ftp://x", "endpoint"),
    ("s3://bucket/kdn?endpoint=http://u:p@127.0.0.1:1", "endpoint"),
])
def test_bad_store_urls_fail_in_one_line(url, why):
    with pytest.raises(InvalidInput, match=why):
        parse_s3_url(url)


def test_credentials_come_from_a_file_never_the_url(tmp_path):
    f = tmp_path / "creds"
    f.write_text("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    f.chmod(0o600)
    assert read_credentials(f) == ("AK", "SK")
    f.write_text("aws_access_key_id = AK\n")
    with pytest.raises(InvalidInput, match="aws_secret_access_key"):
        read_credentials(f)
    with pytest.raises(InvalidInput, match="s3://"):
        open_store(tmp_path / "folder", credentials=f)
    assert isinstance(open_store(tmp_path / "folder"), ObjectStore)
