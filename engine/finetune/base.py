"""The frozen base model, opened for training through the same loading path as inference (checkpoint ->
frozen memory plan -> streamed weights), and the adapter's shapes for it."""

from __future__ import annotations

import torch

from ..args import EngineArgs, resolve_dtype
from ..arch import ModelConfig
from ..errors import UnsupportedModelError
from ..loader import LoadedModel, load_model
from ..model_source import resolve_model
from ..weights import ModelCheckpoint


def base_config(model: str, dtype: str = "auto") -> tuple[ModelConfig, torch.dtype]:
    """The base's config and compute dtype, read from its checkpoint's headers (nothing loaded)."""
    checkpoint = ModelCheckpoint(resolve_model(model))
    try:
        cfg = checkpoint.cfg
    finally:
        checkpoint.close()
    check_trainable(cfg)
    return cfg, resolve_dtype(dtype, cfg.checkpoint_dtype)


def open_base(model: str, max_length: int, batch_tokens: int, **engine_args) -> LoadedModel:
    """The base for training: planned like a prefill of batch_tokens tokens in sequences of at most
    max_length (engine_args: any EngineArgs field: device, dtype, max_device_memory, transport, ...).
    A packed base (GGUF, int4/int8) stays packed: its products run on its kernels forward and on its
    dequantized weight backward (engine.ops), QLoRA's way. Models whose blocks the adapter cannot target
    yet are refused once their config is read."""
    engine_args.setdefault("show_progress", False)
    args = EngineArgs(model=model, max_model_len=max_length, max_num_batched_tokens=batch_tokens,
                      max_num_seqs=1, enable_prefix_caching=False, **engine_args)
    loaded = load_model(args, resolve_model(model))
    try:
        check_trainable(loaded.cfg)
        if loaded.plan.group_placement is not None:
            # The training step computes whole blocks from acquire(): an MLP off the device is not there.
            raise UnsupportedModelError("fine-tuning with tensor groups off the device (LAYERSTREAM_PLACEMENT=groups) "
                                        "is not supported yet")
    except BaseException:
        loaded.close()
        raise
    return loaded


def check_trainable(cfg: ModelConfig) -> None:
    if cfg.moe is not None:
        raise UnsupportedModelError(f"fine-tuning {cfg.architecture} (a mixture of experts) is not supported yet")
    if cfg.family.fused_qkv or cfg.family.fused_gate_up:
        raise UnsupportedModelError(f"fine-tuning {cfg.architecture} (stored stacked q/k/v or gate/up "
                                    "projections) is not supported yet")
