"""The disk tier: blocks that cannot stay in host memory are read from disk every step.

prepare() runs on the streamer's prefetch thread, so the reads of block i+1..i+depth overlap the
compute of block i. A disk-tier block is read (DiskReader: large aligned reads, several in flight)
into one of depth + 1 staging buffers, which is exactly how many tickets the streamer lets exist,
and its tensors are views into that buffer; retire() hands the buffer back. When the compute
dtype differs from the checkpoint's, prepare() converts into reused buffer sets (shared with the
host tier below) and the staging buffer is free again at once.

Streamed blocks the plan keeps in host memory (the host tier) are handed to a CpuTransport: their
pages are faulted in once and never released, and a dtype conversion reuses its buffers.
"""

from __future__ import annotations

import queue

import torch

from .disk_reader import DiskReader, ReadPlan, StagingBuffer, plan_reads
from .transport import BlockSource, CpuTransport, Ticket, Transport, to_compute


class DiskTransport(Transport):
    def __init__(self, source: BlockSource, dtype: torch.dtype, disk_blocks, depth: int = 1,
                 direct: bool = True):
        self.source = source
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.disk_blocks = set(disk_blocks)
        self._host = CpuTransport(source, dtype)
        self.reader = DiskReader(source.index.files.keys(), direct=direct)
        num_layers = source.cfg.num_layers
        self.plans: list[ReadPlan] = [
            plan_reads({short: source.index.entry(name) for short, name in source.names(b).items()})
            for b in range(num_layers)
        ]
        self.staging_bytes = max(p.buffer_bytes for p in self.plans)
        # Buffers are allocated lazily (untouched pages cost nothing anyway) and recycled through
        # a queue: retire() runs on the compute thread, prepare() on the prefetch thread.
        self._free: queue.Queue[StagingBuffer] = queue.Queue()
        for _ in range(depth + 1 if self.disk_blocks else 0):
            self._free.put(StagingBuffer(self.staging_bytes))

    def _read(self, block: int, buf: StagingBuffer) -> tuple[dict[str, torch.Tensor], int]:
        plan = self.plans[block]
        nbytes = self.reader.read(plan, buf)
        return plan.views(buf), nbytes

    def resident(self, block: int) -> dict[str, torch.Tensor]:
        # Read through the reader too: loading resident blocks must not fill the page cache that a
        # memory cgroup charges to us.
        buf = StagingBuffer(self.plans[block].buffer_bytes)
        views, _ = self._read(block, buf)
        if all(v.dtype == self.dtype for v in views.values()):
            return views  # a buffer of its own, kept alive by the views: no copy needed
        return to_compute(views, self.dtype, self.device, copy=True)

    def prepare(self, block: int) -> Ticket:
        if block not in self.disk_blocks:
            return self._host.prepare(block)
        buf = self._free.get()
        try:
            views, nbytes = self._read(block, buf)
        except BaseException:
            self._free.put(buf)
            raise
        if all(v.dtype == self.dtype for v in views.values()):
            return Ticket(block, views, nbytes, extra={"buffer": buf})
        # Every tensor is copied out, even one already in the compute dtype: the staging buffer is
        # recycled at once. The copies go to the host tier's reused buffer sets, so disk and host
        # blocks together never hold more than depth + 1 converted blocks (the plan's stream buffers).
        converted = self._host._take_buffers(views)
        for k, v in views.items():
            converted[k].copy_(v)
        self._free.put(buf)
        return Ticket(block, converted, nbytes, extra={"buffers": converted})

    def retire(self, ticket: Ticket) -> None:
        buf = ticket.extra.pop("buffer", None)
        if buf is not None:
            self._free.put(buf)
        self._host.retire(ticket)  # drops the weights and hands converted buffer sets back

    def close(self) -> None:
        self.reader.close()
