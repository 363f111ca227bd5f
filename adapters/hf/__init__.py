"""kdn.adapters.hf: HF transformers adapter."""
