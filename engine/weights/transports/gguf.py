"""CPU transport for packed (GGUF) blocks: packed bytes move, compute multiplies packed.

prepare() (prefetch thread) faults the block's GGML bytes in from the page cache ahead of use, as
CpuTransport does for safetensors; the ticket counts those packed bytes. In fast mode with the VNNI
kernels, prepare() then repacks the block from the mapping into its resident twins' compute form in a
reusable slot (packed/stream_repack.py: the same bytes, stacked the same way, so the same kernels and tokens
as a resident block); retire() hands the slot back. Otherwise (fp32 exact mode, the aten fallback) the
weights it hands to compute are zero-copy `GGUFWeight` views (Q/K rows of llama-family files gathered
into engine order: the only copy, of two small tensors), dequantized to the compute dtype by the matmul
that uses them. Resident blocks are put in their compute form once, at load (`PackedFormat.resident`).
"""

from __future__ import annotations

import mmap

import torch

from ..packed.compute_form import PackedFormat
from ..formats.safetensors_index import MADV_POPULATE_READ
from ..formats.block_source import BlockSource
from ..packed.stream_repack import StreamRepacker
from .base import Ticket, Transport


class PackedCpuTransport(Transport):
    def __init__(self, source: BlockSource, fmt: PackedFormat, release_pages: bool = False,
                 repacker: StreamRepacker | None = None, resident_views: bool = False):
        """`repacker` (stream_repack.make_repacker): streamed blocks are repacked by it, else handed out
        as GGUFWeight views (shared with the disk tier, whose tiers then share its slots). resident_views:
        resident() hands out those views too, not a copy in the compute form (exact mode's host tensors of a
        group off the device: the file's bytes, dequantized per use as a streamed block's are, to the same
        values the resident form holds)."""
        self.source = source
        self.repacker = repacker
        self.fmt = fmt
        self.resident_views = resident_views
        self.dtype = fmt.dtype
        self.device = torch.device("cpu")
        self.release_pages = release_pages
        self._mapped: set[int] = set()

    def _weights(self, block: int, make) -> dict[str, object]:
        return {short: make(t, self.source.rows(block, short)) for short, t in self.source.tensors(block).items()}

    def resident(self, block: int) -> dict[str, object]:
        if self.resident_views:
            self.source.advise(block, MADV_POPULATE_READ)
            return self._weights(block, self.fmt.streamed)
        return self._weights(block, self.fmt.resident)

    def prepare(self, block: int) -> Ticket:
        if self.release_pages or block not in self._mapped:
            self.source.advise(block, MADV_POPULATE_READ)
            self._mapped.add(block)
        moved = self.source.streamed_bytes(block, self.dtype)
        if self.repacker is not None:
            weights, slot = self.repacker.fill(block, self.source.stored_rows(block))
            return Ticket(block, weights, moved, repacked=slot)
        return Ticket(block, self._weights(block, self.fmt.streamed), moved)

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}
        if ticket.repacked is not None:
            self.repacker.give(ticket.repacked)
            ticket.repacked = None
        if self.release_pages:
            self.source.advise(ticket.block, mmap.MADV_DONTNEED)
