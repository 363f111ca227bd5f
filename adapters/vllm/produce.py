"""An origin publishing through vLLM: the engine computes, ``KDNConnector`` (producer role) stores.

``kdn origin serve --engine vllm`` keeps one ``VllmEngine`` on its model
thread. A publish runs the document's tokens as one prompt (one output
token); the connector in the same engine reads every chunk's K/V (and, for a
hybrid model, its state) out of the paged cache and writes the objects into
the origin's store folder, after which the origin indexes them and writes
their records exactly as it does for transformers-made objects.

The engine runs 256-token steps (``max_num_batched_tokens`` = the chunk
size) with prefix caching off: each step then ends on a chunk boundary,
where a hybrid model's state is the one its object must carry, and every
chunk is computed by this engine rather than taken from an earlier prompt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class VllmEngine:
    def __init__(self, folder: str, *, dtype: str, store: str, chunk_tokens: int, max_model_len: int,
                 memory_fraction: float = 0.3) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, on this thread
        from vllm import LLM

        self.chunk_tokens = chunk_tokens
        self.llm = LLM(
            model=folder, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False,
            max_num_batched_tokens=chunk_tokens, max_num_seqs=1, max_model_len=max_model_len,
            gpu_memory_utilization=memory_fraction,
            kv_transfer_config={
                "kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"store": store, "chunk_tokens": chunk_tokens},
            },
        )

    def compute(self, tokens: Sequence[int], namespace: str, encodings: Sequence[str]) -> None:
        """Prefill ``tokens``; the connector stores every chunk of them in ``encodings``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, detokenize=False, extra_args={"kv_transfer_params": {
            "kdn": {"save": True, "namespace": namespace, "encodings": list(encodings)}}})
        self.llm.generate([TokensPrompt(prompt_token_ids=list(tokens))], params, use_tqdm=False)

    @staticmethod
    def engine_name() -> str:
        from kdn.adapters.vllm.compat import ENGINE

        return ENGINE
