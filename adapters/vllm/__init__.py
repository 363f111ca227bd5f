"""kdn.adapters.vllm: a vLLM KV connector that loads published KDN states into vLLM's paged cache.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KDNConnector",
        "kv_connector_module_path": "kdn.adapters.vllm", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"edges": ["http://127.0.0.1:8701"]}}'

vLLM imports this module and takes ``KDNConnector`` from it; the class (and
vLLM with it) is imported only then, so ``kdn.adapters.vllm.plan`` and
``.config`` stay importable without vLLM. Settings: ``config.py``. Layout:
``connector.py`` (vLLM's interface) -> ``scheduler.py`` (lookup, what to load
and save), ``worker.py`` (fetch, verify, write), ``save.py`` (producer),
``paged.py`` (K/V in and out of the paged cache), ``steer.py`` (attention
steering from emphasis maps; ``question.py``: the map from the question itself), ``compat.py`` (every import from vLLM, and the list of what else touches its objects),
``produce.py`` (an origin publishing through vLLM).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KDNConnector"]


def __getattr__(name: str) -> Any:
    if name == "KDNConnector":
        from kdn.adapters.vllm.connector import KDNConnector

        return KDNConnector
    raise AttributeError(f"module 'kdn.adapters.vllm' has no attribute {name!r}")
