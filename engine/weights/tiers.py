"""Which transport serves which tier: the one place a transport name becomes a transport.

Names (EngineArgs.transport): "auto" (CUDA on a GPU; on the CPU the page cache, plus the disk tier
when host memory cannot keep every streamed block), "cpu", "cuda", "disk" (every streamed block read
from disk each step, CPU compute), "simulated" (the CPU transport behind a slow simulated link).
Planning asks `host_tiering` whether streamed blocks may go to disk; loading asks `make_transport`
for the transport that serves the finished plan. The kind of weights decides too: a packed checkpoint
(GGUF) is served by the packed transport, and quantization at load ("int8"/"int4") by the quantizing one.
"""

from __future__ import annotations

from typing import Callable

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


PACKED_TRANSPORTS = ("auto", "cpu", "simulated")


def resolve(kind: str, device: torch.device) -> str:
    """"auto" made concrete, once, for planning and for loading alike: "cuda" on a GPU; on the CPU
    "auto-cpu" (the page cache, plus the disk tier if the plan puts blocks on disk)."""
    if kind != "auto":
        return kind
    return "cuda" if device.type == "cuda" else "auto-cpu"


def check_packed(kind: str, device: torch.device, where: object) -> None:
    """ValueError unless packed (GGUF) blocks can be served this way."""
    if device.type != "cpu":
        raise ValueError(f"{where}: GGUF models run on the CPU for now (device {str(device)!r} asked)")
    if kind not in PACKED_TRANSPORTS:
        raise ValueError(f"{where}: transport {kind!r} is not available for GGUF models "
                         f"({', '.join(PACKED_TRANSPORTS)} are)")


def host_tiering(kind: str, device: torch.device, sizes: WeightSizes, depth: int,
                 converts: bool, packed: bool = False) -> HostTiering | None:
    """How the planner may split streamed blocks between RAM and disk; None when this transport
    keeps every streamed block reachable in RAM (cpu, simulated, packed blocks)."""
    if packed:
        return None
    kind = resolve(kind, device)
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
                   disk_gbps: float | None = None, quantization: str | None = None,
                   on_progress: Callable[[int], None] | None = None) -> Transport:
    """The transport that serves `plan`'s streamed blocks (and its disk tier, if it has one)."""
    check_transport(kind, str(device) if device.type == "cuda" else device.type)
    if source.packed:
        check_packed(kind, device, source.files[0])
        from .packed_format import PackedFormat
        from .packed_transport import PackedCpuTransport

        t: Transport = PackedCpuTransport(source, PackedFormat(dtype), release_pages=plan.release_pages)
    else:
        t = _plain_transport(kind, source, dtype, device, plan, pin_host_memory, host_budget, disk_gbps)
    if quantization:
        # Weight-only int8/int4 at load: every block quantized once from the compute-dtype weights
        # (streamed ones up front), then served from memory with their packed bytes.
        from .quantize import QuantizingTransport

        try:
            t = QuantizingTransport(t, quantization, plan.streamed_blocks, on_progress=on_progress)
        except BaseException:
            t.close()
            raise
    if kind == "simulated":
        from .simulated_transport import SimulatedTransport

        t = SimulatedTransport(t)
    return t


def _plain_transport(kind: str, source: BlockSource, dtype: torch.dtype, device: torch.device, plan: MemoryPlan,
                     pin_host_memory: bool, host_budget: int | None, disk_gbps: float | None) -> Transport:
    kind = resolve(kind, device)
    if kind == "auto-cpu":
        kind = "disk" if plan.disk_blocks else "cpu"
    if kind == "disk":
        from .disk_transport import DiskTransport

        return DiskTransport(source, dtype, plan.disk_blocks, plan.prefetch_depth)
    if kind == "cuda":
        from .cuda_transport import CudaTransport

        return CudaTransport(source, dtype, device, plan, pin_host_memory=pin_host_memory, host_budget=host_budget,
                             release_pages=plan.release_pages, disk_gbps=disk_gbps)
    return CpuTransport(source, dtype, release_pages=plan.release_pages)  # cpu, and simulated's inner one
