"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) read and checked against the
served model: every tensor must name a projection this model has, with the shapes its config implies.

Nothing here touches the engine: reading runs off the engine thread (a folder of large adapters takes a
while), and the engine only registers what was read (AdapterSet.add).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..arch import ModelConfig
from ..lora_targets import MODULE_PATHS, TARGETS, projection_shapes

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's keys: <prefix>.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight (the prefix varies with the
# model class PEFT wrapped: base_model.model.model for a causal LM).
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
# Settings whose non-default value changes the math in a way the serving product does not compute.
_UNSUPPORTED = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
                "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None)}


class LoRAAdapterError(ValueError):
    """An adapter folder this model cannot serve; the message names the folder and what is wrong."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter as read: fp32 host tensors A (r, in) and B (out, r) by (layer, PEFT module name), the
    scale PEFT multiplies the low-rank product by, and a digest of the folder's two files (the prefix
    cache's salt: KV computed under one adapter's weights must not serve another's)."""

    path: str
    r: int
    scale: float
    params: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: bytes

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.params}, key=list(TARGETS).index))

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.params.values())


def check_servable(cfg: ModelConfig) -> None:
    """Models whose projections an adapter can target when served (those fine-tuning targets too)."""
    if cfg.family.fused_qkv or cfg.family.fused_gate_up:
        raise LoRAAdapterError(f"serving LoRA adapters over {cfg.architecture} (stored stacked q/k/v or "
                               "gate/up projections) is not supported yet")


def read_adapter(folder: str | Path, cfg: ModelConfig) -> AdapterWeights:
    """The adapter in `folder`, checked against the model: LoRAAdapterError (naming the folder) for a missing
    folder or file, a config PEFT would not write or one this product does not compute (DoRA, biases,
    per-module ranks), a target module this model does not have, a tensor whose rank or shape disagrees
    with the config or the model, or a file that is not safetensors."""
    check_servable(cfg)
    folder = Path(folder)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {str(folder)!r} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise LoRAAdapterError(f"{folder}: no {name} (a PEFT LoRA adapter folder holds {CONFIG_FILE} and "
                                   f"{WEIGHTS_FILE})")
    config_bytes = (folder / CONFIG_FILE).read_bytes()
    weights_bytes = (folder / WEIGHTS_FILE).read_bytes()
    config = _config(folder, config_bytes)
    r, alpha = config["r"], float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    params = _tensors(folder, weights_bytes, r, cfg)
    listed = config.get("target_modules")
    if isinstance(listed, list):
        # A list is exact (a string is a pattern PEFT matched against module names: the tensors say which).
        unknown = [m for m in listed if m not in TARGETS]
        if unknown:
            raise LoRAAdapterError(f"{folder}: target module(s) {unknown} are not projections of this model "
                                   f"({cfg.architecture}: {', '.join(TARGETS)})")
        missing = sorted(set(listed) - {m for _, m in params})
        if missing:
            raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} targets {missing} but {WEIGHTS_FILE} has no "
                                   "tensors for them")
    digest = hashlib.blake2b(config_bytes + b"\0" + weights_bytes, digest_size=16).digest()
    return AdapterWeights(str(folder), r, scale, params, digest)


def _config(folder: Path, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} is not a LoRA adapter's (peft_type "
                               f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)  # PEFT's default lora_alpha
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} has rank r={r!r}; it must be an integer >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} has lora_alpha={alpha!r}; it must be a number > 0")
    config["lora_alpha"] = alpha
    for key, allowed in _UNSUPPORTED.items():
        if config.get(key, allowed[0]) not in allowed:
            raise LoRAAdapterError(f"{folder}: {key}={config[key]!r} is not supported for serving (only "
                                   f"{allowed[0]!r})")
    return config


def _tensors(folder: Path, raw: bytes, r: int, cfg: ModelConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        state = load(raw)
    except (SafetensorError, ValueError, OSError) as e:
        raise LoRAAdapterError(f"{folder}: {WEIGHTS_FILE} is not a valid safetensors file ({e})") from None
    shapes = projection_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"{folder}: tensor {key!r} is not a LoRA A/B weight of a block's projection "
                                   "(embedding, head or bias adapters are not supported)")
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in TARGETS or MODULE_PATHS[module] != f"{parent}.{module}":
            raise LoRAAdapterError(f"{folder}: tensor {key!r} targets {parent}.{module}, which this model "
                                   f"({cfg.architecture}) does not have; its projections are {', '.join(TARGETS)}")
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"{folder}: tensor {key!r} is for block {layer}; this model has "
                                   f"{cfg.num_layers} blocks")
        if module in ("gate_proj", "up_proj", "down_proj") and cfg.is_moe_layer(layer):
            raise LoRAAdapterError(f"{folder}: tensor {key!r} targets the MLP of block {layer}, a mixture of "
                                   "experts (only dense projections are adaptable)")
        if not t.is_floating_point():
            raise LoRAAdapterError(f"{folder}: tensor {key!r} is {t.dtype}, not floating point")
        out_f, in_f = shapes[module]
        want = (r, in_f) if which == "A" else (out_f, r)
        if tuple(t.shape) != want:
            raise LoRAAdapterError(f"{folder}: tensor {key!r} has shape {tuple(t.shape)}, expected {want} "
                                   f"(rank r={r} in {CONFIG_FILE}, {module} of this model is {out_f} x {in_f})")
        found.setdefault((layer, module), {})[which] = t.float()
    pairs = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{folder}: block {layer} {module} has lora_{next(iter(ab))} but no "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
        pairs[layer, module] = (ab["A"], ab["B"])
    if not pairs:
        raise LoRAAdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA tensors")
    return pairs
