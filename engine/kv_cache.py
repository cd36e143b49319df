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
    """num_blocks: one pool size for every layer, or one per KV group (engine.kv_groups) with
    layer_groups saying each layer's group; num_host_blocks likewise."""

    def __init__(self, num_layers: int, num_blocks: int | tuple[int, ...], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int | tuple[int, ...] = 0,
                 layer_groups: tuple[int, ...] | None = None):
        self.layer_groups = layer_groups or (0,) * num_layers
        group_blocks = (num_blocks,) if isinstance(num_blocks, int) else tuple(num_blocks)
        group_host = (num_host_blocks,) * len(group_blocks) if isinstance(num_host_blocks, int) else num_host_blocks
        assert len(self.layer_groups) == num_layers and max(self.layer_groups) < len(group_blocks)
        # (blocks, block_size, kv_heads, head_dim) per layer, blocks of its group's pool
        shapes = [(group_blocks[g], block_size, num_kv_heads, head_dim) for g in self.layer_groups]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.num_blocks = group_blocks[0]
        self.block_size = block_size
        self.device = torch.device(device)
        # Pinned on CUDA so a copy in either direction is a real asynchronous DMA.
        pin = self.device.type == "cuda" and sum(group_host) > 0
        host_shapes = [(group_host[g], *shape[1:]) for g, shape in zip(self.layer_groups, shapes)]
        self.host_k = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape in host_shapes]
        self.host_v = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape in host_shapes]
        self.num_host_blocks = group_host[0]
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one block of a group's pool, K and V over the group's layers."""
        return sum(2 * self.k[i][0].numel() * self.k[i].element_size()
                   for i, g in enumerate(self.layer_groups) if g == group)

    @property
    def bytes_per_block(self) -> int:
        return self.group_block_bytes(0)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the block manager's queued copies, in order (a later copy may reuse a block an
        earlier one read). All are issued on the compute stream before the step's forward pass,
        so the stream orders them against it and against each other; the host never reads the
        host tier itself, so no copy needs waiting for."""
        for c in copies:
            for layer, g in enumerate(self.layer_groups):
                if g != c.group:
                    continue
                for dev, host in ((self.k[layer], self.host_k[layer]), (self.v[layer], self.host_v[layer])):
                    if c.direction == "out":
                        host[c.host_block].copy_(dev[c.device_block], non_blocking=True)
                    else:
                        dev[c.device_block].copy_(host[c.host_block], non_blocking=True)
            if c.direction == "out":
                self.bytes_swapped_out += self.group_block_bytes(c.group)
            else:
                self.bytes_swapped_in += self.group_block_bytes(c.group)
