"""Bandwidth: what the copy path can move, and what that means for the time of one step.

Streaming is bandwidth-bound by design: a step cannot be faster than the streamed bytes divided by
the slowest link they cross (disk -> host -> device), nor faster than its compute. This module
measures the host->device link and turns a MemoryPlan into that floor, so start-up can print the
expected time per step and the metrics can report achieved GB/s as a "% of floor".

Measured speeds are kept in their own record, `LinkSpeeds` (never patched into the plan); the
telemetry snapshot turns a step's bytes into achieved GB/s and "% of floor" with `floor_percent`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...planner import MemoryPlan, format_bytes

if TYPE_CHECKING:
    from .streamer import StreamStats

GB = 1e9


@dataclass(frozen=True)
class LinkSpeeds:
    """Measured speeds of the links streamed bytes cross, in GB/s (1e9 bytes/s); None = not measured.

    h2d_gbps: host -> device (the CUDA transport measures it at start-up; the simulated transport's
    rate stands in for it on CPU); disk_gbps: sequential reads of the checkpoint's disk (measured when
    the plan has a disk tier); device_gbps: device memory reads (for the compute estimate)."""

    h2d_gbps: float | None = None
    disk_gbps: float | None = None
    device_gbps: float | None = None

    def floor_seconds(self, stats: "StreamStats") -> float | None:
        """The least time these bytes need: each measured link carries its own bytes (every streamed
        byte crosses host->device; the disk tier's reads cross the disk), and links work in parallel."""
        parts = []
        if self.h2d_gbps:
            parts.append(stats.bytes_streamed / (self.h2d_gbps * GB))
        if self.disk_gbps:
            parts.append(stats.disk_bytes_read / (self.disk_gbps * GB))
        return max(parts) if parts else None


def floor_percent(stats: "StreamStats", seconds: float, links: LinkSpeeds) -> float | None:
    """% of floor of one step: the time its bytes need at the measured link speeds / the time it
    took. 100% means the step ran exactly as fast as streaming allows; None without a measured link."""
    floor = links.floor_seconds(stats)
    if floor is None or seconds <= 0:
        return None
    return 100.0 * floor / seconds


def measure_copy_gbps(dst: torch.Tensor, src: torch.Tensor, min_bytes: int = 256 << 20, max_repeats: int = 64) -> float:
    """GB/s of `dst.copy_(src, non_blocking=True)` on a side stream, timed with CUDA events.

    src/dst are flat byte tensors of equal size: a pinned host buffer and a device buffer measure
    host->device, two device buffers measure device memory (each byte is read once and written once).
    Repeats until at least min_bytes moved so that launch latency does not dominate small buffers.
    """
    assert dst.numel() == src.numel() and dst.numel() > 0
    device = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.Stream(device=device)
    repeats = max(2, min(max_repeats, -(-min_bytes // dst.numel())))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device), torch.cuda.stream(stream):  # device first: see CudaRuntime.copy
        dst.copy_(src, non_blocking=True)  # warm-up: first-touch mappings, lazy module loading
        start.record(stream)
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    return repeats * dst.numel() / seconds / GB


def host_to_device_gbps(device: torch.device | str = "cuda", nbytes: int = 256 << 20) -> float:
    """Host->device GB/s from pinned memory (allocates its own buffers; for benchmarks)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        return measure_copy_gbps(dst, src, min_bytes=4 * nbytes)
    finally:
        del src, dst


@dataclass
class StepEstimate:
    """Lower bounds on the time of one step under a plan."""

    streamed_bytes: int
    stream_gbps: float | None  # the slowest link streamed bytes cross; None = not measured
    copy_seconds: float  # streamed bytes / stream_gbps (0 when nothing streams)
    compute_seconds: float | None  # an estimate of the step's compute, if one was given

    @property
    def floor_seconds(self) -> float:
        return max(self.copy_seconds, self.compute_seconds or 0.0)

    def describe(self) -> str:
        if not self.streamed_bytes:
            return "expected step time: nothing streams, compute-bound"
        link = f"{self.stream_gbps:.1f} GB/s" if self.stream_gbps else "unmeasured bandwidth"
        line = (f"expected step time >= {self.copy_seconds * 1000:.2f} ms from streaming "
                f"{format_bytes(self.streamed_bytes)} per step at {link}")
        if self.compute_seconds is not None:
            bound = "copy-bound" if self.copy_seconds >= self.compute_seconds else "compute-bound"
            line += f" vs ~{self.compute_seconds * 1000:.2f} ms compute ({bound})"
        return line


def expected_step(plan: MemoryPlan, h2d_gbps: float | None, disk_gbps: float | None = None,
                  compute_seconds: float | None = None) -> StepEstimate:
    """The floor of one step: streamed bytes over the slowest measured link, vs compute.

    disk_gbps: read bandwidth of the checkpoint's storage when its pages are not cached; the
    streamed bytes then cross the disk first, so the slower of the two links sets the pace.
    """
    links = [g for g in (h2d_gbps, disk_gbps) if g]
    gbps = min(links) if links else None
    nbytes = plan.streamed_bytes_per_step
    copy = nbytes / (gbps * GB) if gbps and nbytes else 0.0
    return StepEstimate(nbytes, gbps, copy, compute_seconds)


def decode_compute_seconds(plan: MemoryPlan, device_gbps: float | None) -> float | None:
    """Decode is memory-bound: every weight is read once per step, so compute is about
    (all block weights + embeddings/head) / device memory read bandwidth."""
    if not device_gbps:
        return None
    return (plan.num_layers * plan.block_bytes + plan.global_bytes) / (device_gbps * GB)


def efficiency(nbytes: int, seconds: float, gbps: float | None) -> tuple[float, float | None]:
    """(achieved GB/s, % of floor) for nbytes streamed in `seconds` over a link of `gbps`.

    % of floor = time the bytes need at the link's measured speed / time they took: 100% means the
    step ran exactly as fast as streaming allows.
    """
    if seconds <= 0:
        return 0.0, None
    achieved = nbytes / seconds / GB
    return achieved, (100.0 * achieved / gbps if gbps else None)
