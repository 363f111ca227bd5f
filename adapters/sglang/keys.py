"""SGLang's page keys as KDN addresses: a keyed hash in the writing tenant's namespace, never the key itself.

SGLang names a page by a hash string of its token chain (``get_hash_str``); it is not KDN's prefix-chain
address (it hashes other bytes), so KDN cannot derive it from tokens, only map it. The mapping, version 1::

    page_address = BLAKE3("kdn/sglang-page/v1\\0" || raw(model_id) || str(namespace) || str(shard) || str(key))

with ``str`` and ``raw`` as in ``kdn.format.address``. ``shard`` names which slice of the model's KV a page
holds (``heads r/n``: a TP rank's heads of a non-MLA model; ``layers r/n``: a pipeline stage's layers), since
ranks store different bytes under one SGLang key. The namespace keeps one tenant's pages from another's:
the same key in two namespaces is two addresses. Test vectors: ``tests/adapters/sglang/test_keys.py``.
"""

from __future__ import annotations

from blake3 import blake3

from kdn.format.address import Address, ModelId, _str, model_id, validate_model_id, validate_namespace
from kdn.errors import InvalidInput

_TAG_PAGE = b"kdn/sglang-page/v1\0"
MAX_KEY_BYTES = 1024  # SGLang's keys are 64 hex characters; a suffixed key (".mamba") a few more


def page_address(mid: ModelId, namespace: str, shard: str, key: str) -> Address:
    """The KDN address of SGLang page ``key``."""
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidInput(f"an SGLang page key must be a non-empty string of at most {MAX_KEY_BYTES} bytes")
    h = blake3(_TAG_PAGE)
    h.update(bytes.fromhex(validate_model_id(mid)))
    h.update(_str(validate_namespace(namespace)))
    h.update(_str(shard))
    h.update(_str(key))
    return Address(h.hexdigest())


def shard_of(*, mla: bool, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    """Which slice of the model's KV this rank's pages hold (an MLA latent is the same on every TP rank)."""
    heads = "heads all" if mla or tp_size == 1 else f"heads {tp_rank}/{tp_size}"
    return heads if pp_size == 1 else f"{heads} layers {pp_rank}/{pp_size}"


def derived_model_id(model_name: str | None, dtype: str, geometry: dict[str, int | bool]) -> ModelId:
    """A model id from SGLang's model name, the KV dtype and the page geometry, for a deployment that set no
    ``model_id``. It names the model by its name only: two deployments that serve different weights under one
    name (and one namespace) would read each other's pages, so set ``model_id`` where that can happen."""
    if not model_name:
        raise InvalidInput("SGLang gave no model name: set the KDN storage setting 'model_id'")
    return model_id(architecture=f"sglang:{model_name}", dtype=dtype, config_fields=dict(geometry),
                    weights_digest="", tokenizer_digest="")
