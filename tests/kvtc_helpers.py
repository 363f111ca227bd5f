"""A small kvtc basis fitted on the random-init tiny-llama, for the tests that need one (kernels, e2e)."""

from __future__ import annotations

import torch


def fit_tiny_basis(seed: int = 0, spec: str = "tiny-llama", dtype: torch.dtype | None = None):
    """``(lm, basis, generator)``: a tiny model (``spec``, ``dtype``), a basis fitted on random windows of its
    vocabulary, and the generator those windows came from (a test draws its own ids from it next)."""
    from kdn.adapters.hf import models as hf_models
    from kdn.adapters.hf.transform_fit import fit_basis

    lm = hf_models.load_model(spec) if dtype is None else hf_models.load_model(spec, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    vocab = lm.model.config.vocab_size
    windows = [torch.randint(3, vocab, (96,), generator=g) for _ in range(4)]
    alpha_windows = [torch.randint(3, vocab, (48,), generator=g)]
    basis = fit_basis(lm.model, lm.model_id, windows, alpha_windows, alpha_context=32, alpha_next=16)
    return lm, basis, g


def write_tiny_basis(folder):
    """``(path, address)`` of ``fit_tiny_basis()``'s basis written into ``folder`` (an origin's ``kvtc_basis``)."""
    _, basis, _ = fit_tiny_basis()
    path = folder / "tiny-llama.basis"
    path.write_bytes(basis.to_bytes())
    return path, basis.address
