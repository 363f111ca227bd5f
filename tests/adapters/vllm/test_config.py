"""The connector's settings: validated when the engine starts, every bad key named."""

from __future__ import annotations

import pytest

from kdn.adapters.vllm.config import ConnectorConfig
from kdn.errors import InvalidInput


def test_a_pinned_encoding_within_the_budget():
    c = ConnectorConfig.from_extra({"edges": ["http://x"], "encoding": "kvtc-2", "quality": 2.0}, consumer=True,
                                   producer=False)
    assert c.encoding == "kvtc-2"
    assert ConnectorConfig.from_extra({"edges": ["http://x"], "encoding": "raw"}, consumer=True,
                                      producer=False).encoding == "raw"


def test_defaults_and_edges_forms():
    c = ConnectorConfig.from_extra({"edges": ["http://127.0.0.1:8701/"]}, consumer=True, producer=False)
    assert c.edges == ("http://127.0.0.1:8701",) and c.namespace == "public" and c.quality == "lossless"
    assert c.load == "auto" and c.engines is None and c.load_timeout == 10.0 and c.decode_threads == 2
    assert ConnectorConfig.from_extra({"edges": ["http://x"], "decode_threads": 4}, consumer=True,
                                      producer=False).decode_threads == 4
    assert c.write_threads == 0  # written inside the forward's wait
    assert ConnectorConfig.from_extra({"edges": ["http://x"], "write_threads": 2}, consumer=True,
                                      producer=False).write_threads == 2
    assert c.host_write == "staged"  # a host-tier chunk copied by one region copy, one write per layer
    assert ConnectorConfig.from_extra({"edges": ["http://x"], "host_write": "in_place"}, consumer=True,
                                      producer=False).host_write == "in_place"
    c = ConnectorConfig.from_extra({"edges": {"e1": "http://a:1", "e2": "http://b:2"}}, consumer=True, producer=False)
    assert c.edges == (("e1", "http://a:1"), ("e2", "http://b:2"))
    c = ConnectorConfig.from_extra({"edges": "http://a:1,http://b:2", "engines": "vllm"}, consumer=True,
                                   producer=False)
    assert c.edges == ("http://a:1", "http://b:2") and c.engines == ("vllm",)


@pytest.mark.parametrize("extra, consumer, producer, match", [
    ({}, True, False, "needs 'edges'"),
    ({"registry": "file:/x"}, True, False, "needs 'edges'"),  # a registry needs the engine's region
    ({"edges": ["ftp://x"]}, True, False, "not an http"),
    ({"edges": ["http://x"], "namspace": "a"}, True, False, "unknown KDN connector setting"),
    ({"edges": ["http://x"], "namespace": "Bad/NS"}, True, False, "namespace"),
    ({"edges": ["http://x"], "quality": "best"}, True, False, "quality"),
    ({"edges": ["http://x"], "encoding": "kvtc-2"}, True, False, "costs more than 'quality'"),  # lossless
    ({"edges": ["http://x"], "encoding": "kvtc-2", "quality": 1.0}, True, False, "costs more"),  # worst +1.43%
    ({"edges": ["http://x"], "encoding": "gzip9", "quality": 5.0}, True, False, "unknown"),
    ({"edges": ["http://x"], "load_timeout": 0}, True, False, "load_timeout"),
    ({"edges": ["http://x"], "load_timeout": True}, True, False, "load_timeout"),
    ({"edges": ["http://x"], "load": "eager"}, True, False, "'load'"),
    ({"edges": ["http://x"], "chunk_tokens": -1}, True, False, "chunk_tokens"),
    ({"edges": ["http://x"], "decode_threads": 0}, True, False, "decode_threads"),
    ({"edges": ["http://x"], "decode_threads": "2"}, True, False, "decode_threads"),
    ({"edges": ["http://x"], "write_threads": -1}, True, False, "write_threads"),
    ({"edges": ["http://x"], "write_threads": True}, True, False, "write_threads"),
    ({"edges": ["http://x"], "host_write": "copy"}, True, False, "host_write"),
    ({}, False, True, "needs 'store'"),
    ({"store": "/s", "save": "some"}, False, True, "'save'"),
    ({"store": "/s", "encodings": []}, False, True, "encodings"),
    ({"registry": "file:/x", "region": "eu", "token_hosts": "a b"}, True, False, "token host pattern"),
])
def test_bad_settings_are_named(extra, consumer, producer, match):
    with pytest.raises(InvalidInput, match=match):
        ConnectorConfig.from_extra(extra, consumer=consumer, producer=producer)


def test_registry_and_region_is_enough_to_look_up():
    c = ConnectorConfig.from_extra({"registry": "etcd://127.0.0.1:2379", "region": "eu"}, consumer=True,
                                   producer=False)
    assert c.can_look_up


def test_every_setting_is_in_the_readme():
    """The README's table is what operators read: a key missing there is a key nobody can find."""
    import re
    from pathlib import Path

    from kdn.adapters.vllm.config import _KEYS

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    first_cells = re.findall(r"^\|([^|]*)\|", readme, flags=re.M)
    rows = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    assert _KEYS - rows == set()


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_a_consumer_with_a_quantized_cache_is_refused_at_start(dtype):
    from kdn.adapters.vllm.config import check_cache_dtype

    with pytest.raises(InvalidInput, match="kv_cache_dtype"):
        check_cache_dtype(dtype)
    for fine in ("auto", "bfloat16", "float16", "float32"):
        check_cache_dtype(fine)


@pytest.mark.parametrize("extra, piecewise", [
    ({}, True),  # loads inside the forward wait in each layer
    ({"load": "async"}, False),
    ({"load": "async", "steer": True}, True),
    ({"load": "async", "store": "/srv/kdn"}, True),  # a producer saves inside the forward: never a full graph
])
def test_full_cuda_graphs_only_where_nothing_runs_inside_the_forward(extra, piecewise):
    from kdn.adapters.vllm import KDNConnector

    assert KDNConnector.requires_piecewise_for_cudagraph(extra) is piecewise
