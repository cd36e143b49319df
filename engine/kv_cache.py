"""Paged KV cache: per layer, a pool of fixed-size blocks of token positions, plus an optional
host-memory tier that holds blocks evicted from the device pool, and an optional disk tier
(engine.kv_disk) that keeps full prefix blocks across restarts.

Which block holds which tokens is the block manager's business (engine.block_manager); this module
only owns the tensors and performs the copies the block manager queued. Allocated with torch.zeros:
on the CPU untouched pages are never faulted in, and the block manager reuses the most recently
freed blocks first, so resident memory follows the tokens actually cached.

With a quantized format (engine.kv_quant: --kv-cache-dtype int8 | int4) each layer's K and V are a
QuantizedKV (codes and scales) instead of a tensor in the compute dtype; the host and disk tiers hold
the same quantized bytes, copied block by block as they lie.
"""

from __future__ import annotations

import torch

from .block_manager import BlockCopy
from .kv_quant import KVQuant, QuantizedKV, kv_bytes_per_token


class KVCache:
    """num_blocks: one pool size for every layer, or one per KV group (engine.kv_groups) with
    layer_groups saying each layer's group; num_host_blocks likewise. quant: the quantized format (None: the
    compute dtype); disk: an engine.kv_disk.KVDiskTier the block manager's "spill"/"fetch" copies go through
    (None: no disk tier; a model with one KV group only)."""

    def __init__(self, num_layers: int, num_blocks: int | tuple[int, ...], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int | tuple[int, ...] = 0,
                 layer_groups: tuple[int, ...] | None = None, quant: KVQuant | None = None, disk=None,
                 v_head_dim: int | None = None):
        # v_head_dim: V's width where it is not K's; 0 for latent attention, whose one cached head (K) holds
        # the latent that serves as V too: V's pools are then empty and every copy of them a no-op.
        vd = head_dim if v_head_dim is None else v_head_dim
        assert quant is None or vd == head_dim, "a quantized KV cache has K and V of one width"
        self.quant = quant
        self.dtype = dtype
        self.layer_groups = layer_groups or (0,) * num_layers
        group_blocks = (num_blocks,) if isinstance(num_blocks, int) else tuple(num_blocks)
        group_host = (num_host_blocks,) * len(group_blocks) if isinstance(num_host_blocks, int) else num_host_blocks
        assert len(self.layer_groups) == num_layers and max(self.layer_groups) < len(group_blocks)
        assert disk is None or len(group_blocks) == 1, "the KV disk tier is for models with one KV group"
        self.k = [self._pool(group_blocks[g], block_size, num_kv_heads, head_dim, device) for g in self.layer_groups]
        self.v = [self._pool(group_blocks[g], block_size, num_kv_heads, vd, device) for g in self.layer_groups]
        self.num_blocks = group_blocks[0]
        self.block_size = block_size
        self.device = torch.device(device)
        # Pinned on CUDA so a copy in either direction is a real asynchronous DMA.
        pin = self.device.type == "cuda" and sum(group_host) > 0
        self.host_k = [self._pool(group_host[g], block_size, num_kv_heads, head_dim, "cpu", pin)
                       for g in self.layer_groups]
        self.host_v = [self._pool(group_host[g], block_size, num_kv_heads, vd, "cpu", pin)
                       for g in self.layer_groups]
        self.num_host_blocks = group_host[0]
        self.disk = disk
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0

    def _pool(self, blocks: int, block_size: int, nkv: int, hd: int, device, pin: bool = False):
        if self.quant is not None:
            return QuantizedKV(self.quant, blocks, block_size, nkv, device, pin)
        # (blocks, block_size, kv_heads, head_dim)
        return torch.zeros((blocks, block_size, nkv, hd), dtype=self.dtype, device=device, pin_memory=pin)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        quant: KVQuant | None = None, v_head_dim: int | None = None) -> int:
        return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, quant, v_head_dim)

    @staticmethod
    def _parts(pool) -> tuple[torch.Tensor, ...]:
        """The tensors of one layer's K or V pool, each indexed by block first."""
        return pool.tensors() if isinstance(pool, QuantizedKV) else (pool,)

    def _layer_parts(self, layer: int, host: bool = False) -> list[torch.Tensor]:
        k, v = (self.host_k, self.host_v) if host else (self.k, self.v)
        return [*self._parts(k[layer]), *self._parts(v[layer])]

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one block of a group's pool, K and V (codes and scales where quantized) over the group's layers."""
        return sum(t[0].numel() * t.element_size()
                   for i, g in enumerate(self.layer_groups) if g == group for t in self._layer_parts(i))

    @property
    def bytes_per_block(self) -> int:
        return self.group_block_bytes(0)

    def layer(self, i: int):
        """Layer i's (K, V) pools: tensors (blocks, block_size, kv_heads, head_dim) in the compute dtype, or
        QuantizedKV."""
        return self.k[i], self.v[i]

    def block_bytes(self, block: int) -> bytes:
        """One block's K/V over every layer as bytes, layer by layer (K parts, then V parts): the disk
        tier's payload."""
        return b"".join(t[block].contiguous().cpu().view(torch.uint8).numpy().tobytes()
                        for layer in range(len(self.k)) for t in self._layer_parts(layer))

    def load_block(self, block: int, data: bytes | memoryview) -> None:
        """The inverse of block_bytes into device block `block`; data must be exactly bytes_per_block."""
        assert len(data) == self.bytes_per_block, (len(data), self.bytes_per_block)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        start = 0
        for layer in range(len(self.k)):
            for t in self._layer_parts(layer):
                n = t[block].numel() * t.element_size()
                t[block].copy_(raw[start:start + n].view(t.dtype).view(t[block].shape), non_blocking=True)
                start += n

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the block manager's queued copies, in order (a later copy may reuse a block an
        earlier one read). All are issued on the compute stream before the step's forward pass,
        so the stream orders them against it and against each other; the host never reads the
        host tier itself, so no copy needs waiting for. A "spill" snapshots a block's bytes now (before
        the pass may overwrite it) and leaves the file write to the disk tier's writer thread; a
        "fetch" copies the bytes the disk tier read and verified before the block manager counted them."""
        for c in copies:
            if c.direction == "spill":
                if self.disk is not None:
                    self.disk.put(c.key, self.block_bytes(c.device_block))
                continue
            if c.direction == "fetch":
                self.load_block(c.device_block, c.data)
                self.bytes_swapped_in += self.bytes_per_block
                continue
            for layer, g in enumerate(self.layer_groups):
                if g != c.group:
                    continue
                for dev, host in zip(self._layer_parts(layer), self._layer_parts(layer, host=True)):
                    if c.direction == "out":
                        host[c.host_block].copy_(dev[c.device_block], non_blocking=True)
                    else:
                        dev[c.device_block].copy_(host[c.host_block], non_blocking=True)
            if c.direction == "out":
                self.bytes_swapped_out += self.group_block_bytes(c.group)
            else:
                self.bytes_swapped_in += self.group_block_bytes(c.group)
