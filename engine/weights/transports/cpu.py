"""The CPU transport: compute reads a streamed block straight from the page cache."""

from __future__ import annotations

import mmap

import torch

from ..formats.block_source import BlockSource
from ..formats.safetensors_index import MADV_POPULATE_READ
from .base import Ticket, Transport, nbytes_of, to_compute
from .buffers import BufferPool


class CpuTransport(Transport):
    """CPU compute straight from the page cache.

    Resident blocks are views of the mapping too (converted copies where the dtypes differ). When the
    checkpoint dtype is the compute dtype, a streamed block is the mmap view itself (zero copy); prepare() only faults its pages in ahead of use. Otherwise prepare() converts into
    a buffer set from a BufferPool that retire() hands back for the next block (see buffers.py).
    With release_pages, retire() also drops the block's pages from this process (MADV_DONTNEED)
    so a model larger than RAM keeps a bounded resident set.
    """

    def __init__(self, source: BlockSource, dtype: torch.dtype, release_pages: bool = False,
                 pool: BufferPool | None = None):
        self.source = source
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.release_pages = release_pages
        self.pool = pool or BufferPool(dtype)
        self._mapped: set[int] = set()  # streamed blocks whose pages this process has faulted in
        # Each block's views, made once: making them every step (a buffer export of the mapping per
        # tensor) and freeing them (which takes the GIL back) was ~10% of a decode step in py-spy
        # samples, with two threads contending for the GIL. Views hold no memory of their own.
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def resident(self, block: int) -> dict[str, torch.Tensor]:
        # Views of the mapping where the checkpoint holds the compute dtype, as llama.cpp computes from its
        # mapping (copied into huge pages only with --resident-weights copy: docs/benchmarks/pages.md measured
        # plain blocks read no faster so). Faulted in now, so the first step does not. Other dtypes are
        # converted (copies).
        if self.resident_is_view(block):
            self.source.advise(block, MADV_POPULATE_READ)
            return self.source.views(block)
        return to_compute(self.source.views(block), self.dtype, self.device, copy=True)

    def resident_is_view(self, block: int) -> bool:
        return all(t.dtype == self.dtype for t in self.source.tensors(block).values())  # packed: dtype None

    def release_resident(self, block: int) -> None:
        self.source.advise(block, mmap.MADV_DONTNEED)

    def prepare(self, block: int) -> Ticket:
        views = self._views.get(block)
        if views is None:
            views = self._views[block] = self.source.views(block)
        # Pages stay mapped once faulted in until retire() releases them (or the kernel reclaims
        # them, and compute refaults them). Populating every step anyway walks every page-table
        # entry of the block again for nothing, on the prefetch thread.
        if self.release_pages or block not in self._mapped:
            self.source.advise(block, MADV_POPULATE_READ)
            self._mapped.add(block)
        convert = {k: v for k, v in views.items() if v.dtype != self.dtype}
        if not convert:
            return Ticket(block, views, nbytes_of(views))
        buffers = self.pool.take(convert)
        for k, v in convert.items():
            buffers[k].copy_(v)
        weights = {**views, **buffers}
        return Ticket(block, weights, nbytes_of(weights), converted=buffers)

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}
        if ticket.converted is not None:
            self.pool.give(ticket.converted)
            ticket.converted = None
        if self.release_pages:
            self.source.advise(ticket.block, mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._views.clear()  # the mapping can then be unmapped when the source closes
