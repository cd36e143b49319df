"""Which transport serves which tier: the one place a transport name becomes a transport.

Names (EngineArgs.transport): "auto" (CUDA on a GPU; on the CPU the page cache, plus the disk tier
when host memory cannot keep every streamed block), "cpu", "cuda", "disk" (every streamed block read
from disk each step, CPU compute), "simulated" (the CPU transport behind a slow simulated link).
Planning asks `host_tiering` whether streamed blocks may go to disk; loading asks `make_transport`
for the transport that serves the finished plan.
"""

from __future__ import annotations

import torch

from ..planner import HostTiering, MemoryPlan
from .source import BlockSource, WeightSizes
from .transport import CpuTransport, Transport

TRANSPORTS = ("auto", "cpu", "cuda", "disk", "simulated")


def check_transport(kind: str, device: str) -> None:
    """ValueError for a transport name that does not exist or cannot serve this device."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; one of {', '.join(TRANSPORTS)}")
    if kind == "disk" and device != "cpu":
        raise ValueError(f"the disk transport computes on the CPU; got device {device!r}")


def host_tiering(kind: str, device: torch.device, sizes: WeightSizes, depth: int,
                 converts: bool) -> HostTiering | None:
    """How the planner may split streamed blocks between RAM and disk; None when this transport
    keeps every streamed block reachable in RAM (cpu, simulated)."""
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "auto-cpu"
    if kind not in ("auto-cpu", "disk", "cuda"):
        return None
    if kind == "cuda":
        # Host memory holds the pinned staging buffers and one disk read buffer besides kept blocks.
        fixed, holds_device = (depth + 1) * sizes.block_bytes + sizes.checkpoint_block_bytes, False
    else:
        # The device is the host: it holds the whole device plan, plus disk-tier staging in the
        # checkpoint's dtype when blocks are converted (converted copies are the plan's stream buffers).
        fixed, holds_device = ((depth + 1) * sizes.checkpoint_block_bytes if converts else 0), True
    return HostTiering(fixed, holds_device, sizes.checkpoint_block_bytes, force_disk=kind == "disk")


def make_transport(kind: str, source: BlockSource, dtype: torch.dtype, device: torch.device, plan: MemoryPlan,
                   pin_host_memory: bool = False, host_budget: int | None = None,
                   disk_gbps: float | None = None) -> Transport:
    """The transport that serves `plan`'s streamed blocks (and its disk tier, if it has one)."""
    check_transport(kind, str(device) if device.type == "cuda" else device.type)
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else ("disk" if plan.disk_blocks else "cpu")
    if kind == "disk":
        from .disk_transport import DiskTransport

        return DiskTransport(source, dtype, plan.disk_blocks, plan.prefetch_depth)
    if kind == "cpu":
        return CpuTransport(source, dtype, release_pages=plan.release_pages)
    if kind == "cuda":
        from .cuda_transport import CudaTransport

        return CudaTransport(source, dtype, device, plan, pin_host_memory=pin_host_memory, host_budget=host_budget,
                             release_pages=plan.release_pages, disk_gbps=disk_gbps)
    from .simulated_transport import SimulatedTransport

    return SimulatedTransport(CpuTransport(source, dtype, release_pages=plan.release_pages))
