"""Which rows of a step each adapter owns, and a projection's weight with those adapters attached.

A step's tokens are packed into one (tokens, hidden) matrix (engine.model); a token's adapter is its
sequence's. LoRARows groups the token rows by adapter once per step, on the host, so a block's products
never ask the device which rows are whose (a host sync per projection). RowLoRAWeight is data, as the
packed weight types are: engine.ops multiplies it as one base product over every row plus each adapter's
low-rank product over its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRARows:
    """slots: the adapter slot of each token of the step, in packed order (None: the base alone), the
    per-row index as positions are per row; groups: (slot, rows (n,) int64 on the device) for each
    adapter that has rows this step, in slot order."""

    slots: tuple[int | None, ...]
    groups: tuple[tuple[int, torch.Tensor], ...]

    def every_row(self, rows: torch.Tensor) -> bool:
        return rows.numel() == len(self.slots)

    @staticmethod
    def of(slots: list[int | None], device: torch.device) -> LoRARows | None:
        """None when no token has an adapter: the step is the base model's alone (and keeps every fused path)."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot is not None:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        order = sorted(by_slot)
        flat = torch.tensor([r for s in order for r in by_slot[s]], dtype=torch.long)  # (adapted tokens,)
        rows = torch.split(flat.to(device, non_blocking=device.type == "cuda"), [len(by_slot[s]) for s in order])
        return LoRARows(tuple(slots), tuple(zip(order, rows)))


@dataclass(frozen=True)
class LoRAGroup:
    """One adapter's share of a product: its rows of x, A (R, in) and B (out, R) fp32 with the adapter's
    scale folded into B. For a stacked weight (q/k/v, gate/up) A stacks the segments' A and B is block
    diagonal, so the whole stack is two products; an unadapted segment's rows of B are zero."""

    rows: torch.Tensor  # (n,) int64
    a: torch.Tensor  # (R, in)
    b: torch.Tensor  # (out, R)
    every_row: bool  # rows are all of the step's: no gather or scatter needed


@dataclass(frozen=True)
class RowLoRAWeight:
    """A frozen base weight (out, in), dense or packed, with each group's adapter on its own rows of x."""

    base: object
    groups: tuple[LoRAGroup, ...]
    kind: str = "lora_rows"

    @property
    def shape(self):
        return self.base.shape
