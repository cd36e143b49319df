"""Tiny random-weight checkpoints of every supported architecture, made with transformers' own
config classes and saved with save_pretrained, so tests load them through the real loading code."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from engine.demo import build_random_model

# Small but not degenerate: GQA everywhere (heads 4, kv heads 2), 5 blocks, head_dim 16.
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def make_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if arch == "llama3":  # Llama 3.x rope scaling
        return LlamaConfig(**_COMMON, tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
                           rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return MistralConfig(**_COMMON, sliding_window=None, architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    raise ValueError(arch)


ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def build(folder: Path, arch: str, dtype: torch.dtype = torch.float32, **kw) -> Path:
    return build_random_model(folder, make_config(arch), dtype=dtype, seed=zlib.crc32(arch.encode()) % 1000, **kw)


def to_v4_config_style(folder: Path) -> None:
    """Rewrite config.json the way transformers 4.x checkpoints on the hub look: rope_theta and
    rope_scaling at top level and torch_dtype instead of rope_parameters and dtype."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2))
