"""kdn.adapters.hf: HF transformers adapter.

- ``load_model`` / ``model_id_of``: a model by name or path, and its KDN model id.
- ``extract_chunks`` / ``standalone_chunk`` (origin): per-chunk KV and SSM states of a prefill.
- ``build_cache`` / ``CacheBuilder`` / ``continue_from_cache`` (engine): chunk states back into a ``DynamicCache``
  (``CacheBuilder``: decoded straight into place as objects arrive).
- ``agenerate`` / ``generate`` / ``prompt_tokens`` (engine): reuse the longest cached prefix, then generate.
- ``steer``: attention steering from a manifest's emphasis map (``agenerate(..., emphasis=, steer=)``).
"""

from kdn.adapters.hf.cache import CacheBuilder, build_cache, continue_from_cache
from kdn.adapters.hf.generate import Generation, Report, agenerate, generate, model_id, prompt_tokens
from kdn.adapters.hf.rag import generate_rag
from kdn.adapters.hf.extract import (
    UNSUPPORTED_FAMILIES,
    ChunkState,
    LayerSpec,
    StateSpec,
    extract_chunks,
    layer_layout,
    prefill,
    standalone_chunk,
)
from kdn.adapters.hf.models import (
    BUILTIN_SPECS,
    TINY_SPECS,
    ByteTokenizer,
    LoadedModel,
    load_model,
    model_id_of,
    save_tiny,
    tokenizer_digest,
    weights_digest,
)

__all__ = [
    "Generation",
    "Report",
    "agenerate",
    "generate",
    "generate_rag",
    "model_id",
    "prompt_tokens",
    "BUILTIN_SPECS",
    "TINY_SPECS",
    "UNSUPPORTED_FAMILIES",
    "ByteTokenizer",
    "ChunkState",
    "LayerSpec",
    "LoadedModel",
    "StateSpec",
    "CacheBuilder",
    "build_cache",
    "continue_from_cache",
    "extract_chunks",
    "layer_layout",
    "load_model",
    "model_id_of",
    "prefill",
    "save_tiny",
    "standalone_chunk",
    "tokenizer_digest",
    "weights_digest",
]
