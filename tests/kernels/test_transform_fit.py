"""Fitting a kvtc basis on a tiny random Llama, end to end: PCA, metric, sensitivity, codec on its real KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kdn.adapters.hf.extract import extract_chunks  # noqa: E402
from kdn.kernels import transform as tf  # noqa: E402
from kdn.format.objects import decode_object, to_torch  # noqa: E402


def test_fit_basis_on_a_tiny_llama_and_code_its_kv():
    from kvtc_helpers import fit_tiny_basis

    lm, basis, g = fit_tiny_basis()
    vocab = lm.model.config.vocab_size
    assert basis.n_layers == 2 and basis.kv_heads == 2 and basis.head_dim == 16
    for pair in basis.layers:
        for lb in pair:
            assert np.allclose(lb.basis.T @ lb.basis, np.eye(basis.channels), atol=1e-4)
            assert (np.diff(lb.var) <= 1e-6 * lb.var[0]).all() and lb.alpha > 0
            assert abs(float(np.sqrt((lb.scale.astype(np.float64) ** 2).mean())) - 1) < 1e-4
    back = tf.Basis.from_bytes(basis.to_bytes())
    assert back.address == basis.address
    tf.register_basis(back)
    ids = torch.randint(3, vocab, (40,), generator=g)
    chunks = list(extract_chunks(lm.model, ids, chunk_tokens=16))
    for bits, bound in ((8.0, 0.02), (2.0, 1.0)):
        theta = tf.allocate(back, bits).theta
        errs = []
        for c in chunks:
            blob = tf.encode_kvtc_object(back, theta, tensors=c.tensors, position=c.start, kind=c.kind,
                                         address=f"{c.index + 1:064x}", model_id=lm.model_id, namespace="public",
                                         start=c.start, end=c.end, parent=None)
            out = to_torch(decode_object(blob))
            for name, x in c.tensors.items():
                rel = float((out[name].float() - x.float()).pow(2).mean() / x.float().var())
                errs.append(rel)
                if c.start == 0:  # sinks exact
                    assert torch.equal(out[name][:, :4], x[:, :4])
        assert max(errs) < bound, (bits, max(errs))
