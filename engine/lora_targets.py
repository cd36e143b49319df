"""The projections a LoRA adapter may target, by PEFT's module names: the math's weight name of each, where
it sits in a Hugging Face checkpoint, how stacked weights split into them, and their shapes. What training
adapters (engine.finetune) and serving them (engine.lora_serving) share; data only."""

from __future__ import annotations

from .arch import ModelConfig

# PEFT's module names for the projections LoRA may adapt -> the model math's short name of the weight.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
# Where each sits under model.layers.{i} in a Hugging Face checkpoint (PEFT's adapter keys use it).
MODULE_PATHS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                "down_proj": "mlp.down_proj"}
# A stacked weight's segments, in row order (engine.weights' fuse: q, k, v and gate, up).
STACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
MODULE_OF = {short: module for module, short in TARGETS.items()}  # "wq" -> "q_proj"


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection LoRA may adapt, by PEFT module name."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
