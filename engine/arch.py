"""Which architectures layerstream runs, and what tensors (names, shapes) each one needs.

The Hugging Face config is read with transformers' own `AutoConfig`, which normalises the 4.x
(`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`) styles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .weights.safetensors_index import CheckpointError, WeightIndex

# architecture name in config.json -> family flags
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}

# short name used by the model math -> suffix under model.layers.{i}.
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: object = field(default=None, repr=False, compare=False)

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes = {
            "attn_norm": (h,),
            "wq": (q, h),
            "wk": (kv, h),
            "wv": (kv, h),
            "wo": (h, q),
            "mlp_norm": (h,),
            "w_gate": (self.intermediate_size, h),
            "w_up": (self.intermediate_size, h),
            "w_down": (h, self.intermediate_size),
        }
        if self.qkv_bias:
            shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
        if self.qk_norm:
            shapes.update(q_norm=(d,), k_norm=(d,))
        return shapes

    def block_tensor_names(self, layer: int) -> dict[str, str]:
        return {k: f"model.layers.{layer}.{BLOCK_TENSORS[k]}" for k in self.block_shapes()}

    def global_tensors(self, index: WeightIndex) -> dict[str, tuple[str, tuple[int, ...]]]:
        """short name -> (checkpoint name, shape) for embeddings, final norm and head."""
        v, h = self.vocab_size, self.hidden_size
        out = {"embed": ("model.embed_tokens.weight", (v, h)), "norm": ("model.norm.weight", (h,))}
        if "lm_head.weight" in index or not self.tie_word_embeddings:
            out["lm_head"] = ("lm_head.weight", (v, h))
        return out


def _torch_dtype(value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        d = getattr(torch, value.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
    return torch.float32


def load_model_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{cfg_path}: architecture {archs or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    flags = SUPPORTED_ARCHITECTURES[arch]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or getattr(hf, "dtype", None)
    sliding = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        checkpoint_dtype=_torch_dtype(ckpt_dtype),
        sliding_window=sliding,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids,
        hf_config=hf,
        **flags,
    )


def validate_checkpoint(cfg: ModelConfig, index: WeightIndex) -> None:
    """Every tensor the architecture needs is present with its expected shape."""
    expected: dict[str, tuple[int, ...]] = {}
    for name, shape in cfg.global_tensors(index).values():
        expected[name] = shape
    for layer in range(cfg.num_layers):
        shapes = cfg.block_shapes()
        for short, name in cfg.block_tensor_names(layer).items():
            expected[name] = shapes[short]
    for name, shape in expected.items():
        if name not in index:
            raise CheckpointError(f"{index.folder}: tensor {name!r} is missing from the checkpoint")
        entry = index.entry(name)
        if entry.shape != shape:
            raise CheckpointError(
                f"{entry.path}: tensor {name!r} has shape {list(entry.shape)}, expected {list(shape)}"
            )
