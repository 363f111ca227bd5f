"""The engine's model as KDN names it: the same ``ModelId`` whichever engine loads the weights.

A model id hashes the architecture, the state-changing config fields, the
weights, the tokenizer and the dtype (``kdn.format.address.model_id``); it says
nothing of the engine. vLLM is given a folder of weights, so the id is
computed the way the transformers adapter computes it for that folder (load
on the CPU, hash, drop), once per process and folder. (No setting names the
id instead: a wrong one would load another model's states into this one.)
"""

from __future__ import annotations

import functools
import gc

from kdn.format.address import ModelId


@functools.lru_cache(maxsize=4)
def model_id_for(path: str, dtype: str) -> ModelId:
    from kdn.adapters.hf import load_model

    lm = load_model(path, dtype=dtype)
    mid = lm.model_id
    del lm
    gc.collect()
    return mid
