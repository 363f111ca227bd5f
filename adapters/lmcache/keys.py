"""LMCache's object keys as KDN addresses: a keyed hash in the writing tenant's namespace, never the key itself.

LMCache names a stored chunk by an ``ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``;
its ``chunk_hash`` is LMCache's own hash of the token chain (blake3 by default, over other bytes than KDN's
prefix chain), so KDN maps it (``kdn.adapters.keyed``, scheme ``lmcache-chunk``, version 1)::

    chunk_address = BLAKE3("kdn/lmcache-chunk/v1\\0" || raw(model_id) || str(namespace) || str(shard) || str(key))
    shard = "kv_rank {kv_rank:x} group {object_group_id}"
    key   = hex(chunk_hash), then "@" and the cache salt if there is one

``kv_rank`` is LMCache's bitmap of which slice of the KV a rank holds (ranks store different bytes under one
hash); the salt is LMCache's per-user isolation inside a namespace (it may not contain ``@``). The model id is
the ``model_id`` setting, else derived from LMCache's model name alone (``named_model_id``: a name, not the
weights). Test vectors: ``tests/adapters/lmcache/test_lmcache_keys.py``.
"""

from __future__ import annotations

from kdn.adapters.keyed import keyed_address, named_model_id
from kdn.errors import InvalidInput
from kdn.format.address import Address, ModelId

SCHEME = "lmcache-chunk"
MAX_HASH_BYTES = 256


def shard_of(kv_rank: int, object_group_id: int) -> str:
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or kv_rank < 0:
        raise InvalidInput(f"an LMCache kv_rank is a non-negative int, got {str(kv_rank)[:40]!r}")
    if isinstance(object_group_id, bool) or not isinstance(object_group_id, int) or object_group_id < 0:
        raise InvalidInput(f"an LMCache object_group_id is a non-negative int, got {str(object_group_id)[:40]!r}")
    return f"kv_rank {kv_rank:x} group {object_group_id}"


def key_text(chunk_hash: bytes, cache_salt: str = "") -> str:
    if not isinstance(chunk_hash, (bytes, bytearray)) or not 0 < len(chunk_hash) <= MAX_HASH_BYTES:
        raise InvalidInput(f"an LMCache chunk hash is 1..{MAX_HASH_BYTES} bytes, got {str(chunk_hash)[:40]!r}")
    if not isinstance(cache_salt, str) or "@" in cache_salt:
        raise InvalidInput("an LMCache cache salt is a string without '@'")
    return bytes(chunk_hash).hex() + (f"@{cache_salt}" if cache_salt else "")


def chunk_address(mid: ModelId | str, namespace: str, *, chunk_hash: bytes, kv_rank: int, object_group_id: int = 0,
                  cache_salt: str = "") -> Address:
    """The KDN address of LMCache's object key (its fields as keywords, so no LMCache import is needed)."""
    return keyed_address(SCHEME, mid, namespace, shard_of(kv_rank, object_group_id), key_text(chunk_hash, cache_salt))


def derived_model_id(model_name: str | None) -> ModelId:
    """KDN's model id for LMCache's ``model_name``, where the deployment set no ``model_id``."""
    return named_model_id("lmcache", model_name, "", {})
