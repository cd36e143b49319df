"""CPU transport for GGUF blocks from the prepacked cache entry (packed/prepacked.py): blocks already in
their compute form, so no step repacks anything.

Resident blocks are zero-copy views of the mapped entry, faulted in at load (which the block streamer then
copies into memory of their own, by default: resident_copy.py); when the plan has a disk tier they are read by
its reader instead (into buffers of their own), so that loading does not fill the page cache a memory cgroup
charges to us and reclaims under pressure. A streamed block
kept in host memory is zero-copy views of the mapped entry: prepare() (prefetch thread) faults its
pages in ahead of use, once (every time with release_pages, after which retire() drops them). A
disk-tier block is read from the entry each step (DiskReader: one aligned O_DIRECT read, the block
being page aligned) into one of depth + 1 staging buffers that its weights view until retire().
A ticket counts the block's bytes in the entry, what mapping or reading it moves: the plan's
streamed and disk block bytes are the same figure (ModelCheckpoint.sizes).

The disk tier reads ahead of compute (read_ahead.py).
"""

from __future__ import annotations

import mmap

import torch

from .disk_reader import DiskReader, StagingBuffer, plan_reads
from .read_ahead import ReadAhead
from .resident_copy import offer_huge_pages
from ..packed.prepacked import PrepackedBlocks
from ..formats.safetensors_index import MADV_POPULATE_READ
from .base import DISK, Ticket, Transport


class PrepackedTransport(Transport):
    def __init__(self, store: PrepackedBlocks, disk_blocks=(), depth: int = 1, release_pages: bool = False,
                 direct: bool = True):
        """Owns `store` from here on (closed by close())."""
        self.store = store
        self.dtype = store.layout.dtype
        self.device = torch.device("cpu")
        self.release_pages = release_pages
        self.disk_blocks = set(disk_blocks)
        self._mapped: set[int] = set()  # host-tier blocks whose pages this process has faulted in
        # Each block's views, made once (as CpuTransport's: making them every step costs GIL time).
        self._views: dict[int, dict[str, object]] = {}
        self.reader = DiskReader([store.path], direct=direct) if self.disk_blocks else None
        self._reads = None
        if self.disk_blocks:
            self._plans = {b: plan_reads({"block": store.read_info(b)}) for b in self.disk_blocks}
            try:
                self._reads = ReadAhead(self.reader, self._plans, depth + 1)
            except BaseException:
                self.reader.close()
                raise

    def resident(self, block: int) -> dict[str, object]:
        if self.reader is None:
            # Views of the mapped entry: the bytes already are in the kernels' layout. Faulted in now (by
            # read-ahead, not a fault per page), so neither a copy nor the first step does.
            self.store.advise(block, MADV_POPULATE_READ)
            return self.store.mapped(block)
        plan = plan_reads({"block": self.store.read_info(block)})
        buf = StagingBuffer(plan.buffer_bytes)
        self.reader.read(plan, buf)
        offer_huge_pages(buf.tensor)
        return self.store.weights(block, plan.views(buf)["block"])  # a buffer of its own, kept alive by the views

    def resident_is_view(self, block: int) -> bool:
        return self.reader is None

    def views_read_faster_copied(self) -> bool:
        return True

    def release_resident(self, block: int) -> None:
        self.store.advise(block, mmap.MADV_DONTNEED)

    def prepare(self, block: int) -> Ticket:
        if block in self.disk_blocks:
            return self._read(block)
        if self.release_pages or block not in self._mapped:
            self.store.advise(block, MADV_POPULATE_READ)
            self._mapped.add(block)
        weights = self._views.get(block)
        if weights is None:
            weights = self._views[block] = self.store.mapped(block)
        return Ticket(block, weights, self.store.nbytes(block))

    def _read(self, block: int) -> Ticket:
        buf, nbytes, seconds = self._reads.take(block)
        try:
            weights = self.store.weights(block, self._plans[block].views(buf)["block"])
        except BaseException:
            self._reads.give(buf)
            raise
        return Ticket(block, weights, self.store.nbytes(block), tier=DISK, disk_bytes=nbytes, disk_seconds=seconds,
                      staging=buf)

    @property
    def reads(self) -> ReadAhead | None:
        """The disk tier's reads (None without disk blocks): what is read ahead, what tickets hold."""
        return self._reads

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}
        if ticket.staging is not None:
            self._reads.give(ticket.staging)
            ticket.staging = None
        elif self.release_pages:
            self.store.advise(ticket.block, mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._views.clear()  # the mapping can then be unmapped
        if self._reads is not None:
            self._reads.close()
        if self.reader is not None:
            self.reader.close()
        self.store.close()
