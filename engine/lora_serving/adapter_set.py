"""The adapters an engine serves: each under its name in a slot, its tensors on the compute device.

Owned by the engine and changed only on its thread (between steps), so a step never sees an adapter
half-added or half-removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch import ModelConfig
from ..lora_targets import MODULE_OF, STACKED, projection_shapes
from .adapter_file import AdapterWeights, LoRAAdapterError
from .rows import LoRARows, RowLoRAWeight


class UnknownAdapterError(LookupError):
    """No adapter is served under this name."""

    def __init__(self, name: str):
        super().__init__(f"no LoRA adapter named {name!r} is loaded")
        self.name = name


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter in its slot: what the engine reports about it."""

    name: str
    slot: int
    path: str
    r: int
    target_modules: tuple[str, ...]
    digest: bytes  # AdapterWeights.digest: the prefix cache's salt for its sequences


class AdapterSet:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32):
        # A step's adapter products run in the compute dtype, as vLLM's do: in fp32 they are PEFT's
        # (tests/engine/test_lora_serving.py); in bf16 they read half the bytes and run on the kernels the
        # base's few-row products use, which fp32's small products cost several times.
        self.device, self.dtype = device, dtype
        self._rows_of = {short: projection_shapes(cfg)[module][0] for short, module in MODULE_OF.items()}
        self._by_name: dict[str, ServedAdapter] = {}
        # slot -> ((layer, PEFT module) -> (A (r, in), B (out, r)) fp32 on the device), and its scale
        self._params: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        self._scale: dict[int, float] = {}
        # (slot, layer, weight name) -> (A (R, in), B (out, R) * scale) as ops multiplies them, or None where
        # the adapter leaves that weight alone. Formed on first use: whether a block's q/k/v arrive stacked
        # depends on its placement (resident or streamed), fixed for the engine's life.
        self._products: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}
        # (layer, weight name, the step's adapter slots) -> those adapters' products side by side in the
        # compute dtype, as RowLoRAWeight holds them, or None where none of them adapts the weight.
        self._stacks: dict[tuple, tuple[torch.Tensor, torch.Tensor, tuple] | None] = {}

    def add(self, name: str, weights: AdapterWeights) -> ServedAdapter:
        """Serve `weights` as `name` in the lowest free slot; LoRAAdapterError when the name is taken."""
        if not name or not isinstance(name, str):
            raise LoRAAdapterError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        if name in self._by_name:
            raise LoRAAdapterError(f"a LoRA adapter named {name!r} is already loaded "
                                   f"(from {self._by_name[name].path}); unload it first")
        slot = next(s for s in range(len(self._params) + 1) if s not in self._params)
        self._params[slot] = {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in weights.params.items()}
        self._scale[slot] = weights.scale
        served = ServedAdapter(name, slot, weights.path, weights.r, weights.target_modules, weights.digest)
        self._by_name[name] = served
        return served

    def remove(self, name: str) -> ServedAdapter:
        served = self.get(name)
        del self._by_name[name], self._params[served.slot], self._scale[served.slot]
        for key in [k for k in self._products if k[0] == served.slot]:
            del self._products[key]
        for key in [k for k in self._stacks if served.slot in k[2]]:
            del self._stacks[key]
        return served

    def get(self, name: str) -> ServedAdapter:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownAdapterError(name) from None

    def served(self) -> tuple[ServedAdapter, ...]:
        """Every adapter, in the order they were added."""
        return tuple(self._by_name.values())

    def adapt(self, layer: int, w: dict[str, object], rows: LoRARows) -> dict[str, object]:
        """Block `layer`'s weights for a step whose tokens `rows` assigns to adapters: each projection some
        of those adapters target becomes a RowLoRAWeight; the rest stay as they are."""
        out = dict(w)
        for name, weight in w.items():
            parts = STACKED.get(name, (name,))
            if parts[0] not in MODULE_OF:
                continue
            key = (layer, name, rows.present)
            if key not in self._stacks:
                products = [(slot, self._product(slot, layer, name, parts)) for slot in rows.present]
                products = [(slot, p) for slot, p in products if p is not None]
                self._stacks[key] = (torch.cat([p[0] for _, p in products]).to(self.dtype),
                                     torch.cat([p[1] for _, p in products]).to(self.dtype),
                                     tuple((slot, p[0].shape[0]) for slot, p in products)) if products else None
            stack = self._stacks[key]
            if stack is not None:
                out[name] = RowLoRAWeight(weight, *stack, rows)
        return out

    def _product(self, slot: int, layer: int, name: str, parts: tuple[str, ...]):
        key = (slot, layer, name)
        if key not in self._products:
            found = [self._params[slot].get((layer, MODULE_OF[p])) for p in parts]
            self._products[key] = _stacked(found, [self._rows_of[p] for p in parts], self._scale[slot]) \
                if any(found) else None
        return self._products[key]


def _stacked(found: list, sizes: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight's adapter as two products: A (R, in) the segments' A stacked, B^T (R, out) block diagonal,
    segment s's columns holding its (B * scale)^T in its own rows (zeros for an unadapted segment). Folding
    the scale into B is PEFT's (x A^T B^T) * scale up to rounding; B transposed, each of its rows is one
    adapter column's contribution to every output, which the CPU kernel adds row by row."""
    pairs = [f for f in found if f is not None]
    a = torch.cat([p[0] for p in pairs]) if len(pairs) > 1 else pairs[0][0]  # (R, in)
    b_t = a.new_zeros(a.shape[0], sum(sizes))  # (R, out)
    row = col = 0
    for f, n in zip(found, sizes):
        if f is not None:
            r = f[0].shape[0]
            b_t[row:row + r, col:col + n] = (f[1] * scale).t()
            row += r
        col += n
    return a, b_t
