"""Packing a block's tensors into one byte buffer: where each tensor lies, and the pieces a parallel
fill copies. Used by the CUDA transport for its device ring and its pinned staging buffers.

A tensor is packed with its own dtype, so a block may mix compute-dtype tensors with the raw uint8
bytes of packed (quantized) ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 256  # bytes; every tensor in a packed buffer starts at a cuBLAS-friendly address


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a block lies in a packed byte buffer."""

    entries: tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...]  # (name, byte offset, shape, dtype)
    nbytes: int

    @staticmethod
    def of(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> "Layout":
        """specs: name -> (shape, dtype) of each tensor, in the order they are packed."""
        entries, off = [], 0
        for name, (shape, dtype) in specs.items():
            entries.append((name, off, tuple(shape), dtype))
            off += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        return Layout(tuple(entries), off)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of each tensor inside `buf`, a (>= nbytes,) uint8 buffer."""
        return {name: buf[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for name, off, shape, dtype in self.entries}

    def pieces(self, chunk_bytes: int) -> list[tuple[str, int, int]]:
        """(tensor, first element, end element) pieces of about chunk_bytes covering the layout."""
        out = []
        for name, _off, shape, dtype in self.entries:
            step = max(1, chunk_bytes // dtype.itemsize)
            numel = math.prod(shape)
            out += [(name, a, min(a + step, numel)) for a in range(0, numel, step)]
        return out
