"""What training adds to the inference plan, and where it lives: the adapter and its gradients on the
device; AdamW's moments (and fp32 master copies off the CPU) and each block's checkpointed input on the
host. Printed with the plan at the start of a run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch import ModelConfig
from ..lora_targets import projection_shapes
from ..planner import format_bytes
from .config import TrainConfig


@dataclass(frozen=True)
class TrainingMemory:
    adapter_bytes: int  # device: A and B of every adapted projection, fp32
    gradient_bytes: int  # device: their gradients
    optimizer_bytes: int  # host: AdamW's two moments, plus fp32 masters when the device is not the host
    checkpoint_bytes: int  # host: one micro-batch's block inputs (layers x tokens x hidden)
    backward_bytes: int  # device: one block's recomputed activations and their gradients (an estimate)

    @property
    def device_bytes(self) -> int:
        """What training holds on the device beside the base's plan: taken out of the budget first."""
        return self.adapter_bytes + self.gradient_bytes + self.backward_bytes

    def describe(self) -> str:
        return (f"training: adapter {format_bytes(self.adapter_bytes)} + gradients {format_bytes(self.gradient_bytes)} "
                f"+ one block's backward {format_bytes(self.backward_bytes)} on the device; AdamW state {format_bytes(self.optimizer_bytes)} and block-input checkpoints "
                f"{format_bytes(self.checkpoint_bytes)} (a micro-batch) on the host")


def training_memory(cfg: ModelConfig, config: TrainConfig, dtype: torch.dtype, device: torch.device) -> TrainingMemory:
    shapes = projection_shapes(cfg)
    r = config.lora.r
    params = cfg.num_layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in config.lora.target_modules)
    adapter = 4 * params  # fp32
    moments = 2 * adapter + (adapter if device.type != "cpu" else 0)
    checkpoints = cfg.num_layers * config.batch_tokens * cfg.hidden_size * dtype.itemsize
    return TrainingMemory(adapter, adapter, moments, checkpoints, backward_bytes(cfg, config, dtype))


def backward_bytes(cfg: ModelConfig, config: TrainConfig, dtype: torch.dtype) -> int:
    """An upper estimate of one block's recomputation under autograd: the tensors it saves per token (norm
    outputs, q/k/v before and after rotary, attention output, gate, up and their SwiGLU, the fp32 inputs
    of the adapters), the attention probabilities of the longest example, and as much again for the
    gradients flowing back through them."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_token = dtype.itemsize * (4 * h + 3 * q + 4 * kv + 5 * i) + 4 * (3 * h + q + i + 2 * config.lora.r * 7)
    per_token += 4 * cfg.num_heads * config.max_length  # a row of attention probabilities per head, fp32
    return 2 * config.batch_tokens * per_token
