"""The disk tier: blocks that cannot stay in host memory are read from disk every step.

prepare() runs on the streamer's prefetch thread, so the reads of block i+1..i+depth overlap the
compute of block i. A disk-tier block is read (DiskReader: large aligned reads, several in flight)
into one of depth + 1 staging buffers, which is exactly how many tickets the streamer lets exist,
and its tensors are views into that buffer; retire() hands the buffer back, and the next disk
block's read starts into it at once (read_ahead.py), so the disk never idles between blocks. When the compute
dtype differs from the checkpoint's, prepare() converts into reused buffer sets (shared with the
host tier below) and the staging buffer is free again at once.

Streamed blocks the plan keeps in host memory (the host tier) are handed to a CpuTransport: their
pages are faulted in once and never released. Both tiers convert into one shared BufferPool.
With dtype=None (a GPU's disk tier) blocks stay in the checkpoint's dtype: filling pinned staging converts.

Packed checkpoints (GGUF; `fmt` given): a disk block's packed bytes are read, so the disk moves packed
bytes. With a `repacker` (CPU fast mode, packed/stream_repack.py) they are repacked from the staging buffer
into their resident twins' compute form in a reusable slot (the staging buffer free again, and
the next read started into it, once that is done); otherwise they are handed to compute as
`PackedFormat.streamed` weights viewing the staging buffer (unpacked by the matmul that uses them).
Host-tier blocks go through the PackedCpuTransport, which shares the repacker's slots. With
dtype=None the ticket holds the block's stored rows (engine row order) for the CUDA transport to stage.
"""

from __future__ import annotations

import time

import torch

from .buffers import BufferPool
from .disk_reader import DiskReader, ReadPlan, StagingBuffer, plan_reads
from .read_ahead import ReadAhead
from ..packed.compute_form import PackedFormat
from .gguf import PackedCpuTransport
from ..formats.block_source import BlockSource
from ..packed.stream_repack import StreamRepacker
from .base import DISK, Ticket, Transport, nbytes_of, to_compute
from .cpu import CpuTransport


class DiskTransport(Transport):
    def __init__(self, source: BlockSource, dtype: torch.dtype | None, disk_blocks, depth: int = 1,
                 direct: bool = True, fmt: PackedFormat | None = None, repacker: StreamRepacker | None = None):
        self.source = source
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.disk_blocks = set(disk_blocks)
        self.fmt = fmt if dtype is not None else None
        self.repacker = repacker if self.fmt is not None else None
        self.packed = source.packed
        self.pool = BufferPool(dtype) if dtype is not None and not self.packed else None
        self._host: Transport | None = None
        if dtype is not None:
            self._host = (PackedCpuTransport(source, fmt, repacker=self.repacker) if self.packed
                          else CpuTransport(source, dtype, pool=self.pool))
        self.plans: list[ReadPlan] = [plan_reads(source.tensors(b)) for b in range(source.num_blocks)]
        self.staging_bytes = max(p.buffer_bytes for p in self.plans)
        self.reader = DiskReader(source.files, direct=direct)
        self._reads: ReadAhead | None = None
        try:
            if self.disk_blocks:
                self._reads = ReadAhead(self.reader, {b: self.plans[b] for b in self.disk_blocks}, depth + 1)
        except BaseException:
            self.reader.close()
            raise

    def _read(self, block: int, buf: StagingBuffer) -> tuple[dict[str, torch.Tensor], int, float]:
        plan = self.plans[block]
        t0 = time.perf_counter()
        nbytes = self.reader.read(plan, buf)
        return plan.views(buf), nbytes, time.perf_counter() - t0

    def _take(self, block: int) -> tuple[StagingBuffer, dict[str, torch.Tensor], int, float]:
        """Block `block` read into a staging buffer (by the read-ahead): (buffer, views, bytes, seconds)."""
        buf, nbytes, seconds = self._reads.take(block)
        return buf, self.plans[block].views(buf), nbytes, seconds

    def _converts(self, views: dict[str, torch.Tensor]) -> bool:
        return self.dtype is not None and any(v.dtype != self.dtype for v in views.values())

    def _packed(self, block: int, views: dict[str, torch.Tensor], make) -> dict[str, object]:
        """A packed block's stored rows in engine row order, through `make` (a PackedFormat method) if given."""
        rows = {k: self.source.reorder(k, v) for k, v in views.items()}
        if make is None:
            return rows
        return {k: make(info, rows[k]) for k, info in self.source.tensors(block).items()}

    def resident(self, block: int) -> dict[str, torch.Tensor]:
        # Read through the reader too: loading resident blocks must not fill the page cache that a
        # memory cgroup charges to us.
        buf = StagingBuffer(self.plans[block].buffer_bytes)
        views, _, _ = self._read(block, buf)
        if self.packed:
            return self._packed(block, views, self.fmt.resident)
        # Each tensor copied out (as CpuTransport.resident does): views would keep the whole read buffer
        # alive once the streamer stacks q/k/v and gate/up into new tensors, a block and a half per
        # resident block where the plan holds one.
        return to_compute(views, self.dtype, self.device, copy=True)

    def prepare(self, block: int) -> Ticket:
        if block not in self.disk_blocks:
            return self._host.prepare(block)
        if self.repacker is not None:
            return self._prepare_repacked(block)
        buf, views, nbytes, seconds = self._take(block)
        if self.packed:
            # Packed bytes stay in the staging buffer (views), which retire() gives back.
            weights = self._packed(block, views, self.fmt.streamed if self.fmt is not None else None)
            moved = self.source.streamed_bytes(block, self.dtype) if self.dtype is not None else nbytes
            return Ticket(block, weights, moved, tier=DISK, disk_bytes=nbytes, disk_seconds=seconds, staging=buf)
        if not self._converts(views):
            return Ticket(block, views, nbytes_of(views), tier=DISK, disk_bytes=nbytes, disk_seconds=seconds,
                          staging=buf)
        # Every tensor is copied out, even one already in the compute dtype: the staging buffer is
        # recycled at once. The copies go to the pool the host tier shares, so disk and host blocks
        # together never hold more than depth + 1 converted blocks (the plan's stream buffers).
        converted = self.pool.take(views)
        for k, v in views.items():
            converted[k].copy_(v)
        self._reads.give(buf)
        return Ticket(block, converted, nbytes_of(converted), tier=DISK, disk_bytes=nbytes, disk_seconds=seconds,
                      converted=converted)

    def _prepare_repacked(self, block: int) -> Ticket:
        """A packed block repacked on the host (CPU fast mode) into its resident twins' compute form; its
        staging buffer is free again (and the next disk block's read started into it) once that is done."""
        buf, views, nbytes, seconds = self._take(block)
        try:
            weights, slot = self.repacker.fill(block, views)
            # Tensors the repacker leaves as stored (norms already in the compute dtype) view the buffer.
            weights = {k: w.clone() if isinstance(w, torch.Tensor) and _views(w, buf) else w for k, w in weights.items()}
        finally:
            self._reads.give(buf)
        return Ticket(block, weights, self.source.streamed_bytes(block, self.dtype), tier=DISK, disk_bytes=nbytes,
                      disk_seconds=seconds, repacked=slot)

    @property
    def reads(self) -> ReadAhead | None:
        """The disk tier's reads (None without disk blocks): what is read ahead, what tickets hold."""
        return self._reads

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}
        if ticket.staging is not None:
            self._reads.give(ticket.staging)
            ticket.staging = None
        if ticket.converted is not None:
            self.pool.give(ticket.converted)
            ticket.converted = None
        if self._host is not None:
            self._host.retire(ticket)  # host-tier pages (release_pages is off for the host tier)

    def close(self) -> None:
        if self._reads is not None:
            self._reads.close()
        if self._host is not None:
            self._host.close()  # its views of the mapping, so the checkpoint can unmap it
        self.reader.close()


def _views(t: torch.Tensor, buf: StagingBuffer) -> bool:
    """Whether tensor t lies in staging buffer buf's memory."""
    start = buf.tensor.data_ptr()
    return start <= t.data_ptr() < start + buf.nbytes
