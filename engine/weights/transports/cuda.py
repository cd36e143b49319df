"""CUDA transport: streamed blocks copied from pinned host memory into a ring of device buffers on a
dedicated copy stream, ordered against compute by events alone.

Per streamed block (ticket), with buffer b taken from the free ring and staging buffer s:
  prefetch thread  prepare():  wait (host) until staging s's previous copy finished  [staged[s]]
                               fill staging s from the mmap (page faults, dtype conversion)
                               copy stream waits on free[b]  (last kernels reading b are done)
                               copy_(non_blocking=True) staging s -> device b on the copy stream
                               record ready[b] and staged[s] on the copy stream
  compute thread   activate(): compute stream waits on ready[b]; weights are views into b
                   retire():   record free[b] on the compute stream; b back to the ring
No host synchronisation and no allocation happen in activate/retire: every buffer, view and event
is made once here (trace=True, for tests and benchmarks only, adds timing events per block). The
only host wait is the prefetch thread's on staged[s], which keeps it from overwriting pinned memory
a DMA is still reading.

Why it is race-free: a buffer is handed to a new ticket only after retire() of the ticket that last
used it (the streamer allows depth + 1 tickets in flight and there are depth + 1 buffers), and that
retire recorded free[b] after the kernels reading b were issued, so the next copy into b waits for
them on the device. Compute of a block waits on ready[b], recorded after its copy. Copies are
issued in order on one stream, so a buffer never receives two copies at once.

With pin_host_memory, every streamed block is converted and kept in pinned memory once at load
(when host memory allows), and prepare() only issues the copy: no staging, no page faults.

Packed checkpoints (GGUF; `fmt` given): a block's quantized tensors are staged and copied as their
stored bytes (uint8 rows, Q/K rows put in engine order while staging), only its plain tensors are
converted; compute gets `GGUFWeight`s over the device buffer, dequantized by the matmul that uses
them. So the link, the staging buffers and the device ring all carry packed bytes.

All CUDA calls go through CudaRuntime (cuda_runtime.py), so tests can replay the transport on CPU with
a runtime that records the order of events instead of running them. Buffers are packed by cuda_layout.py;
trace=True timing lives in cuda_trace.py; the out-of-memory message is engine.errors'.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import bandwidth
from ...planner import MemoryPlan, format_bytes
from ...errors import DeviceMemoryError, out_of_memory_error
from ...host_memory import host_memory_available
from .cuda_runtime import CudaRuntime
from .cuda_trace import TraceRecord, intervals
from .disk import DiskTransport
from .cuda_layout import Layout
from ..packed.compute_form import PackedFormat
from ..formats.safetensors_index import MADV_POPULATE_READ
from ..formats.block_source import BlockSource
from .base import DISK, HOST, Ticket, Transport
from ..formats.views import row_shape

log = logging.getLogger("layerstream")

HOST_MARGIN = 2 << 30  # host memory left free when deciding whether a pinned cache fits
FILL_CHUNK = 8 << 20  # bytes per piece of a staging fill; pieces are copied in parallel


class CudaTransport(Transport):
    """See the module docstring. Everything the constructor takes (device buffers, pinned host memory,
    threads, the disk tier's reader) is given back by close(), and by the constructor itself when it
    fails half-way."""

    def __init__(self, source: BlockSource, dtype: torch.dtype, device: torch.device, plan: MemoryPlan,
                 pin_host_memory: bool = False, host_budget: int | None = None, release_pages: bool = False,
                 disk_gbps: float | None = None, fmt: PackedFormat | None = None):
        self.source = source
        self.dtype = dtype
        self.fmt = fmt
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.plan = plan
        self.rt = CudaRuntime(self.device)
        self.trace = False  # tests and benchmarks set it: timing events around every streamed block
        self.traces: list[TraceRecord] = []
        # Checkpoint larger than host memory: drop a block's pages from this process once staged.
        self.release_pages = release_pages
        # The plan's disk-tier blocks are read by a DiskTransport (O_DIRECT) in the checkpoint's
        # dtype: disk -> aligned host buffer -> pinned staging (converting) -> device.
        self.disk: DiskTransport | None = None
        self.h2d_gbps: float | None = None
        self.device_gbps: float | None = None
        self.host_bytes = 0  # pinned host memory held: staging buffers + pinned cache
        self.num_buffers = 0
        self._dev: list[torch.Tensor] = []
        self._dev_views, self._dev_flat = [], []
        self._pinned: dict[int, torch.Tensor] = {}
        self._stage: list[torch.Tensor] = []
        self._stage_views, self._stage_flat = [], []
        self._free: collections.deque = collections.deque()
        self._fill_pool: ThreadPoolExecutor | None = None
        try:
            self._build(plan, pin_host_memory, host_budget, disk_gbps)
        except BaseException:
            self.close()  # unregister pinned memory, stop threads, close the disk reader
            raise

    def _build(self, plan: MemoryPlan, pin_host_memory: bool, host_budget: int | None,
               disk_gbps: float | None) -> None:
        source, dtype = self.source, self.dtype
        streamed = list(plan.streamed_blocks)
        # Blocks of one architecture share a layout; views into every buffer are made once per layout.
        self._layout: dict[int, Layout] = {b: Layout.of(self._specs(b)) for b in streamed}
        layouts = sorted(set(self._layout.values()), key=lambda lay: lay.nbytes)
        self._lid = {b: layouts.index(lay) for b, lay in self._layout.items()}
        # What crosses the link per block: its tensors in the compute dtype (staging converts first),
        # packed ones as stored.
        self._nbytes = {b: source.streamed_bytes(b, dtype) for b in streamed}
        self.buffer_bytes = max((lay.nbytes for lay in layouts), default=0)
        self.num_buffers = plan.prefetch_depth + 1 if streamed else 0
        if plan.disk_blocks:
            self.disk = DiskTransport(source, None, plan.disk_blocks, depth=0)
        try:
            self._dev = [self.rt.device_bytes(self.buffer_bytes) for _ in range(self.num_buffers)]  # (bytes,) u8
        except torch.OutOfMemoryError as e:
            raise out_of_memory_error(plan, self.device, e) from e
        self._dev_views = [[lay.views(buf) for lay in layouts] for buf in self._dev]
        self._dev_flat = [[buf[:lay.nbytes] for lay in layouts] for buf in self._dev]
        self._free = collections.deque(range(self.num_buffers))
        self._copy_stream = self.rt.stream() if streamed else None
        self._ready = [self.rt.event() for _ in range(self.num_buffers)]
        self._freed = [self.rt.event() for _ in range(self.num_buffers)]
        if streamed and pin_host_memory:
            self._pin_all(streamed, host_budget)
        n_stage = 0 if self._pinned or not streamed else self.num_buffers
        try:
            self._stage = [self.rt.pinned_bytes(self.buffer_bytes) for _ in range(n_stage)]  # (bytes,) u8
        except RuntimeError as e:  # cudaHostAlloc failures surface as RuntimeError
            raise DeviceMemoryError(f"could not pin {n_stage} x {format_bytes(self.buffer_bytes)} of host memory "
                                    f"for staging: {e}") from e
        self.host_bytes += n_stage * self.buffer_bytes
        self._stage_views = [[lay.views(buf) for lay in layouts] for buf in self._stage]
        self._stage_flat = [[buf[:lay.nbytes] for lay in layouts] for buf in self._stage]
        self._staged = [self.rt.event() for _ in range(n_stage)]
        self._next_stage = 0
        # One thread's memcpy out of the page cache is far below a PCIe 4/5 link (docs/benchmarks/gpu.md), so the
        # staging fill is split into pieces copied by a few threads (copy_ releases the GIL).
        fill_threads = min(4, max(1, (os.cpu_count() or 1) // 4))
        self._pieces = [lay.pieces(FILL_CHUNK) for lay in layouts]
        self._fill_pool = (ThreadPoolExecutor(fill_threads, thread_name_prefix="layerstream-fill")
                           if n_stage and fill_threads > 1 else None)
        if streamed:
            self._report(disk_gbps)

    def _specs(self, block: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor as staged: the compute dtype, or a packed tensor's rows of bytes."""
        out = {}
        for k, info in self.source.tensors(block).items():
            if info.quant is None:
                out[k] = (info.shape, self.dtype)
            else:
                out[k] = (row_shape(info.shape, info.nbytes), torch.uint8)
        return out

    def _stored(self, block: int) -> dict[str, torch.Tensor]:
        """The block's tensors to stage: mmap views (plain), or packed rows in engine row order."""
        return self.source.stored(block) if self.fmt is not None else self.source.views(block)

    def _compute_form(self, block: int, views: dict[str, torch.Tensor]) -> dict[str, object]:
        """Device views as compute takes them: packed rows wrapped as GGUFWeight (no copy, no kernel)."""
        if self.fmt is None:
            return views
        return {k: self.fmt.streamed(info, views[k]) if info.quant is not None else views[k]
                for k, info in self.source.tensors(block).items()}

    # -- load time ---------------------------------------------------------------------------
    def _pin_all(self, streamed: list[int], host_budget: int | None) -> None:
        """Convert and pin every streamed block once; prepare() then only issues DMAs."""
        need = sum(self._layout[b].nbytes for b in streamed)
        room = (host_budget or host_memory_available()) - HOST_MARGIN
        if need > room:
            log.warning("--pin-host-memory: the %d streamed blocks need %s pinned but only %s of host memory is "
                        "free to pin; staging from the mmap instead", len(streamed), format_bytes(need),
                        format_bytes(max(room, 0)))
            return
        t0 = time.perf_counter()
        try:
            for b in streamed:
                lay = self._layout[b]
                buf = self.rt.pinned_bytes(lay.nbytes)
                views = lay.views(buf)
                for name, v in self._stored(b).items():
                    views[name].copy_(v)
                self._pinned[b] = buf
        except RuntimeError as e:
            log.warning("--pin-host-memory: pinning failed after %d blocks (%s); staging from the mmap instead",
                        len(self._pinned), e)
            self._pinned.clear()
            self.rt.release()  # nothing else is registered yet: staging comes after this
            return
        self.host_bytes += need
        log.info("pinned %d streamed blocks (%s of host memory) in %.1f s", len(streamed), format_bytes(need),
                 time.perf_counter() - t0)

    def _report(self, disk_gbps: float | None) -> None:
        mode = (f"pinned cache {format_bytes(self.host_bytes)}" if self._pinned else
                f"{len(self._stage)} pinned staging buffers ({format_bytes(self.host_bytes)} host)")
        log.info("cuda transport: %d device buffers of %s, %s", self.num_buffers, format_bytes(self.buffer_bytes), mode)
        src = self._stage[0] if self._stage else next(iter(self._pinned.values()))
        self.h2d_gbps = self.rt.copy_gbps(self._dev[0][:src.numel()], src)
        if self.num_buffers >= 2:
            # A device-to-device copy reads and writes every byte: reads alone run about twice as fast.
            d2d = self.rt.copy_gbps(self._dev[1], self._dev[0])
            self.device_gbps = 2 * d2d if d2d else None
        est = bandwidth.expected_step(self.plan, self.h2d_gbps, disk_gbps,
                                      compute_seconds=bandwidth.decode_compute_seconds(self.plan, self.device_gbps))
        if self.h2d_gbps:
            log.info("host->device %.1f GB/s measured; %s", self.h2d_gbps, est.describe())

    # -- Transport ---------------------------------------------------------------------------
    def link_gbps(self) -> float | None:
        return self.h2d_gbps

    @property
    def pinned_cache(self) -> bool:
        return bool(self._pinned)

    def resident(self, block: int) -> dict[str, torch.Tensor]:
        # Load time only: a pageable synchronous copy is fine, and converting on the device is faster.
        # Each tensor travels in its own checkpoint dtype (a block may mix, e.g. fp32 norms in bf16).
        if self.fmt is not None:
            return {k: self.fmt.resident(info, self.source.rows(block, k))
                    for k, info in self.source.tensors(block).items()}
        return {k: v.to(self.device).to(self.dtype) for k, v in self.source.views(block).items()}

    def prepare(self, block: int) -> Ticket:
        lid = self._lid[block]
        assert self._free, "more tickets in flight than device buffers: the streamer's slot count is off"
        b = self._free.popleft()
        try:
            return self._fill(block, lid, b)
        except BaseException:
            self._free.appendleft(b)  # the streamer resets after a failure; the ring must stay whole
            raise

    def _fill(self, block: int, lid: int, b: int) -> Ticket:
        rt = self.rt
        src = self._pinned.get(block)
        s = None
        tier, disk_bytes, disk_seconds = HOST, 0, 0.0
        if src is None:
            s = self._next_stage
            self._next_stage = (s + 1) % len(self._stage)
            # A disk-tier block is read before the wait below, so the read overlaps the DMA draining s.
            from_disk = self.disk.prepare(block) if self.disk is not None and block in self.disk.disk_blocks else None
            rt.host_wait(self._staged[s])  # the DMA still reading staging s must finish first
            if from_disk is not None:
                tier, disk_bytes, disk_seconds = DISK, from_disk.disk_bytes, from_disk.disk_seconds
                try:
                    self._fill_staging(self._stage_views[s][lid], from_disk.weights, self._pieces[lid])
                finally:
                    self.disk.retire(from_disk)
            else:
                # One syscall maps the block's pages in bulk; touching them one 4 KiB fault at a time
                # would make this fill, not the DMA, the slowest stage of the pipeline.
                self.source.advise(block, MADV_POPULATE_READ)
                self._fill_staging(self._stage_views[s][lid], self._stored(block), self._pieces[lid])
                if self.release_pages:
                    self.source.advise(block, mmap.MADV_DONTNEED)
            src = self._stage_flat[s][lid]
        rec = None
        rt.wait(self._copy_stream, self._freed[b])
        if self.trace:
            rec = TraceRecord(block, b, rt.event(timing=True), rt.event(timing=True))
            rt.record(rec.copy_start, self._copy_stream)
        rt.copy(self._dev_flat[b][lid], src, self._copy_stream)
        rt.record(self._ready[b], self._copy_stream)
        if s is not None:
            rt.record(self._staged[s], self._copy_stream)
        if rec is not None:
            rt.record(rec.copy_end, self._copy_stream)
        return Ticket(block, self._compute_form(block, self._dev_views[b][lid]), self._nbytes[block], tier=tier,
                      disk_bytes=disk_bytes, disk_seconds=disk_seconds, device_buffer=b, trace=rec)

    def _fill_staging(self, staging: dict[str, torch.Tensor], views: dict[str, torch.Tensor],
                      pieces: list[tuple[str, int, int]]) -> None:
        """Copy (and convert to the compute dtype) a block's mmap views into pinned staging."""
        if self._fill_pool is None:
            for name, v in views.items():
                staging[name].copy_(v)
            return
        flat_dst = {k: t.view(-1) for k, t in staging.items()}
        flat_src = {k: t.reshape(-1) for k, t in views.items()}
        list(self._fill_pool.map(lambda p: flat_dst[p[0]][p[1]:p[2]].copy_(flat_src[p[0]][p[1]:p[2]]), pieces))

    def activate(self, ticket: Ticket) -> dict[str, torch.Tensor]:
        b = ticket.device_buffer
        stream = self.rt.current_stream()
        self.rt.wait(stream, self._ready[b])
        rec = ticket.trace
        if rec is not None:
            rec.compute_start = self.rt.event(timing=True)
            self.rt.record(rec.compute_start, stream)
        return ticket.weights

    def retire(self, ticket: Ticket) -> None:
        b = ticket.device_buffer
        if b is None:
            return  # retired twice (a reset after a failed step)
        stream = self.rt.current_stream()
        self.rt.record(self._freed[b], stream)
        rec = ticket.trace
        if rec is not None and rec.compute_start is not None:
            rec.compute_end = self.rt.event(timing=True)
            self.rt.record(rec.compute_end, stream)
            self.traces.append(rec)
        ticket.device_buffer = None
        ticket.weights = {}
        self._free.append(b)

    def close(self) -> None:
        if self.num_buffers:
            self.rt.synchronize()  # no DMA may still target memory about to be released
        self._dev, self._dev_views, self._dev_flat, self._pinned = [], [], [], {}
        self._stage, self._stage_views, self._stage_flat = [], [], []
        self.rt.release()
        if self._fill_pool is not None:
            self._fill_pool.shutdown()
            self._fill_pool = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        self._free.clear()
        self.host_bytes = 0

    # -- diagnostics -------------------------------------------------------------------------
    def trace_intervals(self) -> list[tuple[int, tuple[float, float], tuple[float, float]]]:
        """(block, (copy start, end), (compute start, end)) in ms from the first traced copy."""
        self.rt.synchronize()
        return intervals(self.traces)
