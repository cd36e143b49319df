"""What training adds to the inference plan, and where it lives: the adapter and its gradients on the
device; AdamW's moments (and fp32 master copies off the CPU) and each block's checkpointed input on the
host. Printed with the plan at the start of a run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch import ModelConfig
from ..planner import format_bytes
from .base import projection_shapes
from .config import TrainConfig


@dataclass(frozen=True)
class TrainingMemory:
    adapter_bytes: int  # device: A and B of every adapted projection, fp32
    gradient_bytes: int  # device: their gradients
    optimizer_bytes: int  # host: AdamW's two moments, plus fp32 masters when the device is not the host
    checkpoint_bytes: int  # host: one micro-batch's block inputs (layers x tokens x hidden)

    def describe(self) -> str:
        return (f"training: adapter {format_bytes(self.adapter_bytes)} + gradients {format_bytes(self.gradient_bytes)} "
                f"on the device; AdamW state {format_bytes(self.optimizer_bytes)} and block-input checkpoints "
                f"{format_bytes(self.checkpoint_bytes)} (a micro-batch) on the host")


def training_memory(cfg: ModelConfig, config: TrainConfig, dtype: torch.dtype, device: torch.device) -> TrainingMemory:
    shapes = projection_shapes(cfg)
    r = config.lora.r
    params = cfg.num_layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in config.lora.target_modules)
    adapter = 4 * params  # fp32
    moments = 2 * adapter + (adapter if device.type != "cpu" else 0)
    checkpoints = cfg.num_layers * config.batch_tokens * cfg.hidden_size * dtype.itemsize
    return TrainingMemory(adapter, adapter, moments, checkpoints)
