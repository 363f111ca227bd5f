"""The worker side of a blend (``blend.py``): fetch the chunks, blend through vLLM's own modules, write.

``VllmOps`` gives ``kdn.adapters.hf.blend.blend_prefill`` the steps of a vLLM Llama-family model: its
fused ``qkv_proj`` (split into q, k, v), its ``rotary_emb`` at explicit positions, its norms, ``o_proj``
and MLP, called as vLLM's own decoder layer calls them, outside vLLM's forward. On the CPU vLLM repacks
every linear layer's weights for oneDNN and drops the plain ones, so no transformers twin could share
them: the modules themselves are the only way to the weights. The attention of a partial recompute is
KDN's (queries of the tokens that run over the composed K/V of every token, ``blend._attend``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdn.errors import ModelMismatch
from kdn.format.address import ModelId
from kdn.kernels.rope import rope_of

from kdn.adapters.hf.blend import BLEND_FAMILIES, Segment, blend_prefill
from kdn.adapters.hf.rag import RagReport, fetch_chunks
from kdn.adapters.vllm import compat, paged
from kdn.adapters.vllm.blend import BlendJob

log = logging.getLogger("kdn.adapters.vllm")


class VllmOps:
    """``blend_prefill``'s steps (``kdn.adapters.hf.blend.HFOps``) through a vLLM model's own modules.

    ``rot`` is the positions themselves: vLLM's ``rotary_emb(positions, q, k)`` rotates at them.
    """

    def __init__(self, model: Any, hf_config: Any, device: torch.device, dtype: torch.dtype) -> None:
        if hf_config.model_type not in BLEND_FAMILIES:
            raise ModelMismatch(f"blending drives {sorted(BLEND_FAMILIES)} decoder layers, not {hf_config.model_type!r}")
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.config = hf_config
        self.device, self.dtype = device, dtype
        a = self.layers[0].self_attn
        self.kv_heads, self.head_dim = int(a.num_kv_heads), int(a.head_dim)
        self.rope = rope_of(hf_config)
        h, i = int(hf_config.hidden_size), int(hf_config.intermediate_size)
        q, kv = int(a.q_size), int(a.kv_size)
        self._kv_share = 2 * kv * h / ((q + 2 * kv) * h + q * h + 3 * i * h)  # of a layer's matmul weights

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)[None]  # [1, s, hidden]

    @staticmethod
    def rotary(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return idx

    @staticmethod
    def rot_rows(rot: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return rot[rows]

    def norm_in(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[i].input_layernorm(h[0].contiguous())[None]

    def qkv(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.layers[i].self_attn
        s, D = x.shape[1], self.head_dim
        qkv, _ = a.qkv_proj(x[0].contiguous())
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q, k = a.rotary_emb(pos, q, k)
        return (q.reshape(s, -1, D).transpose(0, 1)[None], k.reshape(s, -1, D).transpose(0, 1)[None],
                v.reshape(s, -1, D).transpose(0, 1)[None])

    def kv(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, k, v = self.qkv(i, x, pos)  # (the fused projection makes q too: 1/3 more than K/V alone)
        return k, v

    def q(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.qkv(i, x, pos)[0]

    def scaling(self, i: int) -> float:
        return float(self.layers[i].self_attn.scaling)

    def finish(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        s = h.shape[1]
        out, _ = layer.self_attn.o_proj(o.transpose(1, 2).reshape(s, -1))
        h = h + out[None]
        return h + layer.mlp(layer.post_attention_layernorm(h[0].contiguous()))[None]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        raise ModelMismatch("a vLLM blend computes no logits: vLLM computes the prompt's last tokens itself")

    def kv_share(self, i: int) -> float:
        return self._kv_share


@dataclass
class BlendResult:
    report: RagReport
    written: int  # tokens written into the cache
    recomputed: int  # reused tokens recomputed past the check layer
    seconds: float
    phases: dict[str, float]  # seconds: fetch (every chunk fetched, verified, decoded), segments (the prompt
    #                           cut, a cached part read back), layers (compose and blend_prefill), write


class BlendRunner:
    """Runs a step's blend jobs in ``start_load_kv``: fetch, blend, write ``[computed, end)`` of each."""

    def __init__(self, *, client: Any, bridge: Any, model_id: ModelId, namespace: str, attn: dict[str, Any],
                 block_size: int, vllm_config: Any, fetch_timeout: float) -> None:
        self.client, self.bridge = client, bridge
        self.model_id, self.namespace = model_id, namespace
        self.order = sorted(attn.values(), key=lambda a: a.index)
        self.block_size = block_size
        self.vllm_config = vllm_config
        self.fetch_timeout = fetch_timeout
        self._ops: VllmOps | None = None
        self._readers: dict[tuple, Any] = {}
        self.recent: list[BlendResult] = []  # the last 256 blends (benches, health reports)

    def ops(self) -> VllmOps:
        if self._ops is None:
            cache = self.order[0].module.kv_cache
            model = compat.decoder_model(self.order[0].module, len(self.order))
            self._ops = VllmOps(model, self.vllm_config.model_config.hf_config, cache.device, cache.dtype)
        return self._ops

    def run(self, job: BlendJob) -> BlendResult:
        t0 = time.perf_counter()
        ops = self.ops()
        report = RagReport(tokens_total=len(job.tokens))
        addrs = [a for a, _, _ in job.chunks]
        states = self.bridge.run(fetch_chunks(self.client, self.model_id, self.namespace, addrs, "cpu", report),
                                 timeout=self.fetch_timeout)
        t1 = time.perf_counter()
        segs = self._segments(job, states, ops)
        report.tokens_reused = sum(len(s.ids) for s in segs if s.kv is not None and not s.exact)
        with torch.inference_mode():
            t2 = time.perf_counter()
            b = blend_prefill(ops, segs, recompute_ratio=job.spec.ratio, check_layer=job.spec.check_layer,
                              n_logits=0, selection=job.spec.selection, upto=job.end)
            t3 = time.perf_counter()
            slots = paged.slots(job.block_ids, job.computed, job.end, self.block_size, ops.device)
            for a, k, v in zip(self.order, b.keys, b.values):
                rows = slice(job.computed, job.end)
                paged.write(a.module, a.module.kv_cache, k[0, :, rows].transpose(0, 1).contiguous(),
                            v[0, :, rows].transpose(0, 1).contiguous(), slots)
        t4 = time.perf_counter()
        report.tokens_recomputed = int(b.recomputed.numel())
        report.recompute_share = b.recompute_share
        report.blend_ms = (t4 - t0) * 1e3
        res = BlendResult(report, job.end - job.computed, int(b.recomputed.numel()), t4 - t0,
                          {"fetch": t1 - t0, "segments": t2 - t1, "layers": t3 - t2, "write": t4 - t3})
        self.recent = [*self.recent[-255:], res]
        return res

    def _segments(self, job: BlendJob, states: Sequence[dict | None], ops: VllmOps) -> list[Segment]:
        """The prompt as segments: vLLM's own cached prefix (exact), the chunks the KDN gave (clipped to what
        the cache does not hold; a clipped chunk keeps the position its first kept token was computed at),
        fresh tokens between and after."""
        toks, out = list(job.tokens), []
        pos = 0
        if job.computed:
            out.append(Segment(toks[:job.computed], self._cached(job, ops), exact=True))
            pos = job.computed
        for (_, lo, hi), kv in zip(job.chunks, states):
            if kv is None or hi <= pos:
                continue
            if lo > pos:
                out.append(Segment(toks[pos:lo]))
            a = max(lo, pos)
            cut = a - lo
            part = kv if not cut else {n: t[:, cut:] for n, t in kv.items() if n.endswith((".k", ".v"))}
            out.append(Segment(toks[a:hi], part, at=cut))
            pos = hi
        if pos < len(toks):
            out.append(Segment(toks[pos:]))
        return out

    def _cached(self, job: BlendJob, ops: VllmOps) -> dict[str, torch.Tensor]:
        """K/V of the tokens vLLM's prefix cache holds, read back from their blocks: ``L{i}.k`` [H, n, D]."""
        slots = paged.slots(job.block_ids, 0, job.computed, self.block_size, ops.device)
        out = {}
        for a in self.order:
            cache = a.module.kv_cache
            key = (tuple(cache.shape), cache.dtype)
            if key not in self._readers:
                self._readers[key] = paged.find_reader(a.module, cache, a.kv_heads, a.head_dim)[1]
            k, v = self._readers[key](cache, slots)  # [n, H, D]
            out[f"L{a.index}.k"], out[f"L{a.index}.v"] = k.transpose(0, 1), v.transpose(0, 1)
        return out
