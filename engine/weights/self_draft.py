"""The self-draft's weights (speculative decoding, SubSpec-style): the target model with every
streamed block replaced by a resident int4 copy, quantized once at load from the checkpoint; the
target's resident blocks, embeddings and final norm are shared, not copied. On the CPU the resident
blocks get a copy too (self_draft_copies_every_block says why). The LM head gets an
int8 copy: a draft step's head is as large as several blocks on small models with large
vocabularies (SmolLM2-135M: 21% of the weights), and int8 runs it ~3x faster than bf16 on the CPU.
Nothing here streams, so a draft step costs only resident compute.

It offers the compute side of ModelWeights (globals, acquire/release/reset, stream_stats), so the
same runner code runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .packed.fuse import fuse_projections
from .packed.quantize import quantize_block, quantize_head
from .formats.block_source import BlockSource
from .transports.streamer import StreamStats
from .transports.base import to_compute

SELF_DRAFT_QUANTIZATION = "int4"  # blocks; the head is int8 (quantize.quantize_head)


def self_draft_copies_every_block(device: torch.device) -> bool:
    """Which blocks get an int4 copy. On the CPU every block does: a resident block is computed from
    host memory like a streamed one, and its int4 copy runs about twice as fast as its 16-bit
    weights (aten's int4 kernel against a bf16 matrix-vector product), so sharing it would make the
    draft step slower for a quarter of a block's bytes. On an accelerator only the streamed blocks
    would: its resident blocks already run at device speed and device memory is the scarce thing."""
    return device.type == "cpu"


class SelfDraftWeights:
    def __init__(self, globals_, shared: dict[int, dict], copies: dict[int, dict]):
        self.globals = globals_
        self._blocks = {**shared, **copies}
        self.copied_blocks = sorted(copies)
        self.nbytes = sum(_nbytes(w) for b in copies.values() for w in b.values())

    @classmethod
    def build(cls, source: BlockSource, globals_, resident: dict[int, dict], copy_blocks: list[int],
              dtype: torch.dtype, device: torch.device,
              on_progress: Callable[[int], None] | None = None) -> "SelfDraftWeights":
        """copy_blocks: the blocks that get an int4 copy (the streamed ones; every block when none streams)."""
        copies = {}
        for b in copy_blocks:
            copies[b] = fuse_projections(quantize_block(to_compute(source.views(b), dtype, device, copy=False),
                                                        SELF_DRAFT_QUANTIZATION, dtype))
            if on_progress:
                on_progress(b)
        head = globals_.head
        if isinstance(head, torch.Tensor):
            head = quantize_head(head, dtype)
        draft = cls(dataclasses.replace(globals_, head=head), {b: w for b, w in resident.items() if b not in copies},
                    copies)
        if head is not globals_.head:
            draft.nbytes += head.nbytes
        return draft

    def acquire(self, block: int) -> dict:
        return self._blocks[block]

    def release(self, block: int) -> None:
        pass

    def reset(self) -> None:
        pass

    @property
    def stream_stats(self) -> StreamStats:
        return StreamStats()  # the draft never streams


def _nbytes(w) -> int:
    """A dense tensor's bytes, or a packed weight's (engine.weights.packed.weights)."""
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
