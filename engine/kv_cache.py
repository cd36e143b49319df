"""Paged KV cache: per layer, a pool of fixed-size blocks of token positions, plus an optional
host-memory tier that holds blocks evicted from the device pool.

Which block holds which tokens is the block manager's business (engine.block_manager); this module
only owns the tensors and performs the copies the block manager queued. Allocated with torch.zeros:
on the CPU untouched pages are never faulted in, and the block manager reuses the most recently
freed blocks first, so resident memory follows the tokens actually cached.
"""

from __future__ import annotations

import torch

from .block_manager import BlockCopy


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)  # (blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        host_shape = (num_host_blocks, *shape[1:])
        # Pinned on CUDA so a copy in either direction is a real asynchronous DMA.
        pin = self.device.type == "cuda" and num_host_blocks > 0
        self.host_k = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.host_v = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.num_host_blocks = num_host_blocks
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return 2 * len(self.k) * self.k[0][0].numel() * self.k[0].element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the block manager's queued copies, in order (a later copy may reuse a block an
        earlier one read). All are issued on the compute stream before the step's forward pass,
        so the stream orders them against it and against each other; the host never reads the
        host tier itself, so no copy needs waiting for."""
        for c in copies:
            for layer in range(len(self.k)):
                for dev, host in ((self.k[layer], self.host_k[layer]), (self.v[layer], self.host_v[layer])):
                    if c.direction == "out":
                        host[c.host_block].copy_(dev[c.device_block], non_blocking=True)
                    else:
                        dev[c.device_block].copy_(host[c.host_block], non_blocking=True)
            if c.direction == "out":
                self.bytes_swapped_out += self.bytes_per_block
            else:
                self.bytes_swapped_in += self.bytes_per_block
