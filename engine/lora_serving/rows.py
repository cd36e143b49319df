"""Which rows of a step each adapter owns, and a projection's weight with those adapters attached.

A step's tokens are packed into one (tokens, hidden) matrix (engine.model); a token's adapter is its
sequence's. LoRARows records each token's adapter once per step, on the host, so a block's products never
ask the device which rows are whose (a host sync per projection). RowLoRAWeight is data, as the packed
weight types are: engine.ops multiplies it as one base product over every row plus the step's adapters'
low-rank products. On the CPU one kernel takes each row through its own adapter's columns (row_cols); elsewhere
the adapters are stacked into two products whose middle is masked to each row's own adapter (mask): a
handful of operations per projection whatever the number of adapters (one pair per adapter, each on its
rows, was dozens of small operations per projection, which cost more than the products).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRARows:
    """slots: the adapter slot of each token of the step, in packed order (None: the base alone), the
    per-row index as positions are per row; present: the slots that have rows this step, in order;
    row_slots: the same per token on the device (-1: the base)."""

    slots: tuple[int | None, ...]
    present: tuple[int, ...]
    row_slots: torch.Tensor  # (tokens,) int64
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def mask(self, cols: tuple[tuple[int, int], ...], dtype: torch.dtype) -> torch.Tensor:
        """(tokens, sum of R): 1 where a token's adapter owns the column, for a stack whose columns are
        (slot, R) runs in order. Made once per step and column layout (most weights share one)."""
        m = self._cache.get(cols)
        if m is None:
            col_slots = torch.tensor([s for s, r in cols for _ in range(r)], dtype=torch.long)
            m = (self.row_slots[:, None] == col_slots.to(self.row_slots.device)[None, :]).to(dtype)
            self._cache[cols] = m
        return m

    def row_cols(self, cols: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """(tokens, 2) int64 on the host: each token's run of columns [start, count] in a stack whose columns
        are (slot, R) runs in order; count 0 where the token's adapter has no columns there (the base's rows,
        or an adapter that leaves this weight alone). Made once per step and column layout."""
        key = ("row_cols", cols)
        rc = self._cache.get(key)
        if rc is None:
            runs, start = {}, 0
            for slot, r in cols:
                runs[slot] = (start, r)
                start += r
            rc = torch.tensor([runs.get(s, (0, 0)) for s in self.slots], dtype=torch.long).reshape(-1, 2)
            self._cache[key] = rc
        return rc

    @staticmethod
    def of(slots: list[int | None], device: torch.device) -> LoRARows | None:
        """None when no token has an adapter: the step is the base model's alone (and keeps every fused path)."""
        present = tuple(sorted({s for s in slots if s is not None}))
        if not present:
            return None
        row_slots = torch.tensor([-1 if s is None else s for s in slots], dtype=torch.long)
        return LoRARows(tuple(slots), present, row_slots.to(device, non_blocking=device.type == "cuda"))


@dataclass(frozen=True)
class RowLoRAWeight:
    """A frozen base weight (out, in), dense or packed, with the step's adapters on their own rows of x: their
    A stacked (sum of R, in) and their B transposed and stacked (sum of R, out) in the compute dtype, each
    adapter's scale folded into its B (a stacked weight's B block diagonal over q/k/v or gate/up); cols: the
    (slot, R) run of each adapter's columns, which rows.mask and rows.row_cols turn into each token's own."""

    base: object
    a: torch.Tensor
    b_t: torch.Tensor
    cols: tuple[tuple[int, int], ...]
    rows: LoRARows
    kind: str = "lora_rows"

    @property
    def shape(self):
        return self.base.shape
