"""kdn.adapters.sglang: SGLang HiCache's storage tier (L3) on the KDN.

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kdn", "module_path": "kdn.adapters.sglang", "class_name": "KDNHiCacheStorage",
          "interface_v1": 1, "edges": ["http://127.0.0.1:8701"], "namespace": "acme",
          "token_file": "/etc/kdn/token", "ingest": "http://127.0.0.1:8000"}'

SGLang's ``StorageBackendFactory`` imports this module and takes the class from it; the class (and SGLang's
``HiCacheStorage`` with it) is imported only then, so ``config``, ``keys`` and ``pages`` stay importable
without SGLang. Layout: ``storage.py`` (SGLang's interface), ``config.py`` (settings), ``keys.py`` (page keys
as addresses), ``pages.py`` (a host page as layout-free tensors).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KDNHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KDNHiCacheStorage":
        from kdn.adapters.sglang.storage import KDNHiCacheStorage

        return KDNHiCacheStorage
    raise AttributeError(name)
