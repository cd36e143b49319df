"""The LoRA adapter's parameters, and a block's weights with its adapted projections wrapped.

The frozen base stays what the weights package hands out; a projection the adapter targets becomes a
LoRAWeight (kind "lora"), which engine.ops multiplies as base product + low-rank product. The model math
runs unchanged over it. A resident block on the CPU arrives with q/k/v and gate/up stacked (wqkv,
w_gate_up): the stacked weight gets one adapter per segment, as vLLM's merged LoRA layers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..lora_targets import MODULE_OF as _MODULE_OF
from ..lora_targets import STACKED as _STACKED
from .config import TARGETS, LoRAConfig


@dataclass(frozen=True)
class LoRAWeight:
    """A frozen base weight (out, in) (dense or packed) with adapters on segments of its output rows.
    a[s]: (r, in), b[s]: (rows of segment s, r), or None for an unadapted segment; sizes[s]: its rows."""

    base: object
    a: tuple[torch.Tensor | None, ...]
    b: tuple[torch.Tensor | None, ...]
    sizes: tuple[int, ...]
    scale: float
    dtype: torch.dtype
    kind: str = "lora"

    @property
    def shape(self):
        return self.base.shape


class LoRAAdapter:
    """The adapter's tensors, fp32, on the compute device: A (r, in) and B (out, r) for each adapted
    projection of each block, keyed (layer, PEFT module name). B starts at zero and A as PEFT draws it
    (Kaiming-uniform, a = sqrt(5)), so training starts from the base model's outputs."""

    def __init__(self, config: LoRAConfig, shapes: dict[str, tuple[int, int]], num_layers: int,
                 device: torch.device, seed: int = 0):
        """shapes: PEFT module name -> (out, in) of that projection, for every module in TARGETS."""
        self.config = config
        self.shapes = shapes
        self.num_layers = num_layers
        gen = torch.Generator().manual_seed(seed)
        self.params: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(num_layers):
            for module in config.target_modules:
                out_f, in_f = shapes[module]
                a = torch.empty(config.r, in_f)
                bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / in)
                a.uniform_(-bound, bound, generator=gen)
                b = torch.zeros(out_f, config.r)
                self.params[layer, module] = (a.to(device).requires_grad_(), b.to(device).requires_grad_())

    def tensors(self) -> list[torch.Tensor]:
        """Every trainable tensor in a fixed order (layer, module, A then B): the optimizer's order."""
        return [t for key in sorted(self.params, key=self._order) for t in self.params[key]]

    def _order(self, key: tuple[int, str]) -> tuple[int, int]:
        return key[0], list(TARGETS).index(key[1])

    def adapt(self, layer: int, w: dict[str, torch.Tensor]) -> dict[str, object]:
        """Block `layer`'s weights with every targeted projection wrapped in a LoRAWeight."""
        out = dict(w)
        scale = self.config.scale
        for name, weight in w.items():
            parts = _STACKED.get(name, (name,))
            if name not in _STACKED and name not in _MODULE_OF:
                continue
            found = [self.params.get((layer, _MODULE_OF[p])) for p in parts]
            if not any(found):
                continue
            sizes = tuple(self.shapes[_MODULE_OF[p]][0] for p in parts)
            out[name] = LoRAWeight(weight, tuple(f[0] if f else None for f in found),
                                   tuple(f[1] if f else None for f in found), sizes, scale, torch.float32)
        return out

    def state_dict(self, prefix: str = "base_model.model.model.layers") -> dict[str, torch.Tensor]:
        """PEFT's keys and tensors (contiguous host copies)."""
        from .config import MODULE_PATHS

        out = {}
        for (layer, module), (a, b) in self.params.items():
            key = f"{prefix}.{layer}.{MODULE_PATHS[module]}"
            out[f"{key}.lora_A.weight"] = a.detach().to("cpu", copy=True).contiguous()
            out[f"{key}.lora_B.weight"] = b.detach().to("cpu", copy=True).contiguous()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "base_model.model.model.layers") -> None:
        """Copy PEFT-keyed tensors into this adapter; every key must match in name and shape."""
        mine = self.state_dict(prefix)
        missing, extra = set(mine) - set(state), set(state) - set(mine)
        if missing or extra:
            raise ValueError(f"adapter tensors do not match: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
        from .config import MODULE_PATHS

        with torch.no_grad():
            for (layer, module), (a, b) in self.params.items():
                key = f"{prefix}.{layer}.{MODULE_PATHS[module]}"
                for t, suffix in ((a, "lora_A"), (b, "lora_B")):
                    src = state[f"{key}.{suffix}.weight"]
                    if src.shape != t.shape:
                        raise ValueError(f"{key}.{suffix}.weight has shape {tuple(src.shape)}, expected {tuple(t.shape)}")
                    t.copy_(src)

