"""A LoRA adapter trained over a frozen base: the base opened once, the adapter, its host optimizer, and
one optimizer step over micro-batches (gradient accumulation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..loader import LoadedModel
from ..planner import PlanError, format_bytes, parse_bytes
from ..lora_targets import projection_shapes
from .base import base_config, open_base
from .batch import Example, build_micro_batch
from .config import TrainConfig
from .lora import LoRAAdapter
from .memory import TrainingMemory, training_memory
from .optimizer import HostAdamW
from .step import forward_backward, forward_loss, visit_order


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean cross-entropy over the step's targets
    targets: int  # tokens the loss predicted
    tokens: int  # tokens the model ran over (forward)


def training_footprint(model: str, config: TrainConfig, **engine_args) -> TrainingMemory:
    """What training `model` with `config` adds to the base's memory, and where (from the checkpoint's
    headers; nothing is loaded). Its device_bytes come out of max_device_memory before the base is planned."""
    cfg, dtype = base_config(model, engine_args.get("dtype", "auto"))
    return training_memory(cfg, config, dtype, torch.device(engine_args.get("device", "cpu")))


class LoRATuner:
    def __init__(self, model: str, config: TrainConfig, **engine_args):
        """engine_args: EngineArgs fields for the base (device, dtype, max_device_memory, transport, ...)."""
        self.config = config
        cfg = base_config(model)[0]
        self.memory = training_footprint(model, config, **engine_args)
        budget = parse_bytes(engine_args.get("max_device_memory"))
        if budget is not None:
            # Training's own device memory first; the base's plan gets the rest.
            if budget <= self.memory.device_bytes:
                raise PlanError(f"device budget {format_bytes(budget)} cannot hold training's working set "
                                f"({self.memory.describe()}); raise --max-device-memory or lower "
                                "--batch-tokens / --lora-r")
            engine_args["max_device_memory"] = budget - self.memory.device_bytes
        self.base: LoadedModel = open_base(model, config.max_length, config.batch_tokens, **engine_args)
        try:
            self.device, self.dtype = torch.device(self.base.runner.device), self.base.dtype
            self.base.weights.set_visit_order(visit_order(cfg.num_layers))
            self.adapter = LoRAAdapter(config.lora, projection_shapes(cfg), cfg.num_layers, self.device, config.seed)
            self.optimizer = HostAdamW(self.adapter, config.lr, config.betas, config.eps, config.weight_decay)
        except BaseException:
            self.base.close()
            raise

    @property
    def cfg(self):
        return self.base.cfg

    @property
    def plan(self):
        return self.base.plan

    def accumulate(self, micro_batches: list[list[Example]]) -> StepResult:
        """The step's gradients in the adapter's .grad (the mean loss over every target of every
        micro-batch), without stepping the optimizer."""
        targets = sum(e.targets for mb in micro_batches for e in mb)
        if targets == 0:
            raise ValueError("a training step without any target token (every token masked out)")
        total, tokens = 0.0, 0
        for mb in micro_batches:
            batch = build_micro_batch(mb, self.cfg, self.dtype, self.device)
            total += forward_backward(self.base.weights, self.adapter, batch, self.cfg, self.dtype, self.device,
                                      1.0 / targets)
            tokens += batch.tokens
        return StepResult(total / targets, targets, tokens)

    def step(self, micro_batches: list[list[Example]], lr: float | None = None) -> StepResult:
        """One optimizer step: accumulate over the micro-batches, then AdamW on the host."""
        result = self.accumulate(micro_batches)
        self.optimizer.step(lr)
        return result

    def evaluate(self, micro_batches: list[list[Example]]) -> float:
        """The mean loss over every target of the micro-batches, forward only."""
        cfg, weights = self.cfg, self.base.weights
        targets = sum(e.targets for mb in micro_batches for e in mb)
        weights.set_visit_order(list(range(cfg.num_layers)))
        try:
            total = sum(forward_loss(weights, self.adapter, build_micro_batch(mb, cfg, self.dtype, self.device),
                                     cfg, self.dtype, self.device) for mb in micro_batches)
        finally:
            weights.set_visit_order(visit_order(cfg.num_layers))
        return total / max(targets, 1)

    def close(self) -> None:
        self.base.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
