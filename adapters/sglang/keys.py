"""SGLang's page keys as KDN addresses: a keyed hash in the writing tenant's namespace, never the key itself.

SGLang names a page by a hash string of its token chain (``get_hash_str``); it is not KDN's prefix-chain
address (it hashes other bytes), so KDN cannot derive it from tokens, only map it. The mapping, version 1::

    page_address = BLAKE3("kdn/sglang-page/v1\\0" || raw(model_id) || str(namespace) || str(shard) || str(key))

(``kdn.adapters.keyed.keyed_address`` of scheme ``sglang-page``; LMCache's backend shares it). ``shard`` names
which slice of the model's KV a page holds (``heads r/n``: a TP rank's heads of a non-MLA model; ``layers r/n``: a pipeline stage's layers), since
ranks store different bytes under one SGLang key. The namespace keeps one tenant's pages from another's:
the same key in two namespaces is two addresses. Test vectors: ``tests/adapters/sglang/test_keys.py``.
"""

from __future__ import annotations

from kdn.adapters.keyed import MAX_KEY_BYTES, keyed_address, named_model_id
from kdn.format.address import Address, ModelId
from kdn.errors import InvalidInput

__all__ = ["MAX_KEY_BYTES", "SCHEME", "derived_model_id", "page_address", "shard_of"]

SCHEME = "sglang-page"  # the key scheme: its tag in the address, and what an ingest names (X-KDN-Key-Scheme)


def page_address(mid: ModelId, namespace: str, shard: str, key: str) -> Address:
    """The KDN address of SGLang page ``key``."""
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidInput(f"an SGLang page key must be a non-empty string of at most {MAX_KEY_BYTES} bytes")
    return keyed_address(SCHEME, mid, namespace, shard, key)


def shard_of(*, mla: bool, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    """Which slice of the model's KV this rank's pages hold (an MLA latent is the same on every TP rank)."""
    heads = "heads all" if mla or tp_size == 1 else f"heads {tp_rank}/{tp_size}"
    return heads if pp_size == 1 else f"{heads} layers {pp_rank}/{pp_size}"


def derived_model_id(model_name: str | None, dtype: str, geometry: dict[str, int | bool]) -> ModelId:
    """A model id from SGLang's model name, the KV dtype and the page geometry, for a deployment that set no
    ``model_id`` (``kdn.adapters.keyed.named_model_id``: a name, not the weights)."""
    return named_model_id("sglang", model_name, dtype, geometry)
