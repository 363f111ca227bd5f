"""Attention steering end to end: publish with an emphasis map through a signing origin, read the manifest
back through an edge with the origin's key (the map verified with it), load the prefix, generate steered."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "edge"))

from edge_helpers import cluster, publish  # noqa: E402

from kdn.adapters.hf import agenerate, load_model, prompt_tokens  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.registry.signing import Signer  # noqa: E402

DOC = ("The keeper's log for the night of the storm records wind from the north-east. " * 4
       + "The spare lamp key is kept under the third stair. "
       + "Two ships were sighted, and the lamp was relit twice after the glass cracked. " * 4)


async def test_publish_emphasis_then_generate_steered_from_loaded_kv(tmp_path, etcd_url):
    key = Signer.generate(tmp_path / "origin.key")
    lm = load_model("tiny-llama")
    async with cluster(tmp_path, etcd_url, edges=("e1",), origin_kw={"signing_key": str(tmp_path / "origin.key")}) as c:
        await publish(c, DOC, name="log", emphasis={"texts": ["under the third stair"], "heads": [[1, 0], [1, 1]]})
        async with KDNClient(edges=[c.edge_url("e1")], trusted_keys=[key.public]) as client:
            manifest = await client.manifest("public", "log")
            assert manifest is not None and manifest.emphasis["spans"], "the verified manifest carries the map"
            ids = prompt_tokens(lm.tokenizer, manifest, "Where is the key?")
            plain = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=2,
                                    emphasis=manifest.emphasis)  # off by default
            steered = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=2,
                                      emphasis=manifest.emphasis, steer=True)
            cold = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=2, use_cache=False,
                                   emphasis=manifest.emphasis, steer=True)
    assert plain.report.tokens_reused == steered.report.tokens_reused == len(manifest.prefix_tokens)
    assert not torch.allclose(plain.first_logits, steered.first_logits, atol=1e-4)  # steering acted on loaded KV
    torch.testing.assert_close(cold.first_logits, steered.first_logits, atol=1e-3, rtol=1e-3)  # as on a prefill
