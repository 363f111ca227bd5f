"""The backend's settings: SGLang's own keys taken, every other unknown key refused by name."""

from __future__ import annotations

import pytest

from kdn.adapters.sglang.config import StorageSettings
from kdn.errors import InvalidInput

SGLANG = {"backend_name": "kdn", "module_path": "kdn.adapters.sglang", "class_name": "KDNHiCacheStorage",
          "interface_v1": 1}


def test_reader_and_writer():
    r = StorageSettings.from_extra({**SGLANG, "edges": ["http://127.0.0.1:1/"], "namespace": "acme"})
    assert r.edges == ("http://127.0.0.1:1",) and r.namespace == "acme" and not r.writes and r.encoding == "raw"
    w = StorageSettings.from_extra({"edges": {"e1": "http://e1:1"}, "store": "/s", "registry": "file:/r"})
    assert w.writes and w.edges == (("e1", "http://e1:1"),) and w.ingest is None
    i = StorageSettings.from_extra({**SGLANG, "edges": ["http://e1:1"], "ingest": "http://origin:8000/"})
    assert i.writes and i.ingest == "http://origin:8000" and i.store is None


@pytest.mark.parametrize("extra,named", [
    ({"edges": ["http://a"], "edgez": 1}, "edgez"),
    ({}, "edges"),
    ({"edges": ["ftp://a"]}, "edges"),
    ({"edges": ["http://a"], "store": "/s"}, "store"),
    ({"edges": ["http://a"], "ingest": "origin:8000"}, "'ingest'.*not an http"),
    ({"edges": ["http://a"], "ingest": "http://o", "store": "/s", "registry": "file:/r"}, "not both"),
    ({"edges": ["http://a"], "ingest": "http://o", "registry": "file:/r"}, "not both"),
    ({"edges": ["http://a"], "ingest": "http://o", "signing_key": "/k"}, "signing_key"),
    ({"edges": ["http://a"], "signing_key": "/k"}, "signing_key"),
    ({"edges": ["http://a"], "encoding": "kvtc-2"}, "encoding"),
    ({"edges": ["http://a"], "timeout": 0}, "timeout"),
    ({"edges": ["http://a"], "model_id": "tiny"}, "model id"),
    ({"edges": ["http://a"], "namespace": "Acme/x"}, "namespace"),
])
def test_bad_settings_named(extra, named):
    with pytest.raises(InvalidInput, match=named):
        StorageSettings.from_extra(extra)
