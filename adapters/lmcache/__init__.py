"""kdn.adapters.lmcache: LMCache's L2 storage on the KDN, loaded by LMCache's own plugin mechanism (no fork).

    LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 python -m lmcache.v1.multiprocess.server ... \\
        --l2-adapter '{"type": "plugin", "module_path": "kdn.adapters.lmcache", "class_name": "KDNL2Adapter",
                       "adapter_params": {"edges": ["http://127.0.0.1:8701"], "ingest": "http://127.0.0.1:8000",
                                          "namespace": "acme", "token_file": "/etc/kdn/token"}}'

LMCache's ``plugin`` L2 adapter factory imports this module and takes the class from it; the class (and
LMCache with it) is imported only then, so ``config`` and ``keys`` stay importable without LMCache. Layout:
``adapter.py`` (LMCache's ``L2AdapterInterface``), ``config.py`` (settings), ``keys.py`` (LMCache's object keys
as addresses).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KDNL2Adapter"]


def __getattr__(name: str) -> Any:
    if name == "KDNL2Adapter":
        from kdn.adapters.lmcache.adapter import KDNL2Adapter

        return KDNL2Adapter
    raise AttributeError(name)
