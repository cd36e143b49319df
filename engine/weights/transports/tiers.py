"""Which transport serves which tier: the one place a transport name becomes a transport.

Names (EngineArgs.transport): "auto" (CUDA on a GPU; on the CPU the page cache, plus the disk tier
when host memory cannot keep every streamed block), "cpu", "cuda", "disk" (every streamed block read
from disk each step, CPU compute), "simulated" (the CPU transport behind a slow simulated link).
Planning asks `host_tiering` whether streamed blocks may go to disk; loading asks `make_transport`
for the transport that serves the finished plan. The kind of weights decides too: a packed checkpoint
(GGUF) streams its packed bytes through the same tiers, or, in CPU fast mode, the prepacked cache
entry's bytes (prepacked.py), and blocks quantized at load ("int8"/"int4") are served from the
quantization cache entry (quantized.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...planner import HostTiering, MemoryPlan
from ..formats.block_source import BlockSource, WeightSizes
from .base import Transport
from .cpu import CpuTransport
from .cuda_layout import ALIGN

if TYPE_CHECKING:
    from ...arch import ModelConfig
    from ..experts.tier import ExpertTier
    from ..packed.prepacked import PrepackedBlocks
    from ..packed.quant_cache import QuantizedBlocks

TRANSPORTS = ("auto", "cpu", "cuda", "disk", "simulated")


def check_transport(kind: str, device: str) -> None:
    """ValueError for a transport name that does not exist or cannot serve this device."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; one of {', '.join(TRANSPORTS)}")
    if kind == "disk" and device != "cpu":
        raise ValueError(f"the disk transport computes on the CPU; got device {device!r}")


def resolve(kind: str, device: torch.device) -> str:
    """"auto" made concrete, once, for planning and for loading alike: "cuda" on a GPU; on the CPU
    "auto-cpu" (the page cache, plus the disk tier if the plan puts blocks on disk)."""
    if kind != "auto":
        return kind
    return "cuda" if device.type == "cuda" else "auto-cpu"


def host_tiering(kind: str, device: torch.device, sizes: WeightSizes, depth: int,
                 converts: bool, packed: bool = False) -> HostTiering | None:
    """How the planner may split streamed blocks between RAM and disk; None when this transport
    keeps every streamed block reachable in RAM (cpu, simulated). Packed blocks (GGUF) tier the same
    way, in their stored bytes: their disk staging is held until the block is retired (its weights
    view it), so it counts as fixed host memory."""
    kind = resolve(kind, device)
    if kind not in ("auto-cpu", "disk", "cuda"):
        return None
    if kind == "cuda":
        # Host memory holds the pinned staging buffers and one disk read buffer besides kept blocks.
        fixed, holds_device = (depth + 1) * sizes.block_bytes + sizes.checkpoint_block_bytes, False
    else:
        # The device is the host: it holds the whole device plan, plus disk-tier staging in the
        # checkpoint's dtype when blocks are converted (converted copies are the plan's stream buffers).
        staged = converts or packed
        fixed, holds_device = ((depth + 1) * sizes.checkpoint_block_bytes if staged else 0), True
    return HostTiering(fixed, holds_device, sizes.checkpoint_block_bytes, force_disk=kind == "disk")


def make_transport(kind: str, source: BlockSource, dtype: torch.dtype, device: torch.device, plan: MemoryPlan,
                   pin_host_memory: bool = False, host_budget: int | None = None,
                   disk_gbps: float | None = None, quantized: "QuantizedBlocks | None" = None,
                   prepacked: "PrepackedBlocks | None" = None) -> Transport:
    """The transport that serves `plan`'s streamed blocks (and its disk tier, if it has one), for the
    kind of weights: plain (converted to the compute dtype), packed (GGUF: packed bytes move, compute
    unpacks), packed and prepacked (`prepacked`, the cache entry holding GGUF blocks in the CPU kernels'
    layout), or quantized at load (`quantized`, the cache entry). A cache entry given is owned by the
    transport from here on."""
    check_transport(kind, str(device) if device.type == "cuda" else device.type)
    if quantized is not None:
        from .quantized import QuantizedTransport

        t: Transport = QuantizedTransport(source, dtype, quantized, release_pages=plan.release_pages)
    elif prepacked is not None:
        from .prepacked import PrepackedTransport

        t = PrepackedTransport(prepacked, plan.disk_blocks, plan.prefetch_depth, release_pages=plan.release_pages)
    else:
        fmt = None
        if source.packed:
            from ..packed.compute_form import PackedFormat

            fmt = PackedFormat(dtype, device)
        t = _transport(resolve(kind, device), source, dtype, device, plan, pin_host_memory, host_budget, disk_gbps,
                       fmt)
    if kind == "simulated":
        from .simulated import SimulatedTransport

        t = SimulatedTransport(t)
    return t


def _transport(kind: str, source: BlockSource, dtype: torch.dtype, device: torch.device, plan: MemoryPlan,
               pin_host_memory: bool, host_budget: int | None, disk_gbps: float | None, fmt) -> Transport:
    if kind == "auto-cpu":
        kind = "disk" if plan.disk_blocks else "cpu"
    repacker = None
    if fmt is not None and kind != "cuda" and plan.streamed_blocks:
        # CPU fast mode: streamed GGUF blocks repacked into their resident form on the prefetch thread
        # (None where they stay dequantized per use). Made only when blocks stream: it may compile.
        from ..packed.stream_repack import make_repacker

        repacker = make_repacker(source, fmt)
    if kind == "disk":
        from .disk import DiskTransport

        return DiskTransport(source, dtype, plan.disk_blocks, plan.prefetch_depth, fmt=fmt, repacker=repacker)
    if kind == "cuda":
        from .cuda import CudaTransport

        return CudaTransport(source, dtype, device, plan, pin_host_memory=pin_host_memory, host_budget=host_budget,
                             release_pages=plan.release_pages, disk_gbps=disk_gbps, fmt=fmt)
    # cpu, and simulated's inner transport
    if fmt is not None:
        from .gguf import PackedCpuTransport

        return PackedCpuTransport(source, fmt, release_pages=plan.release_pages, repacker=repacker)
    return CpuTransport(source, dtype, release_pages=plan.release_pages)


def make_expert_tier(kind: str, cfg: "ModelConfig", source: BlockSource, dtype: torch.dtype, device: torch.device,
                     plan: MemoryPlan, guess: bool = True, forms=None, forms_moved: bool = False) -> "ExpertTier":
    """The expert tier for the same transport names. Where experts are read from: the disk (disk, or
    auto / cuda with a disk tier), the page cache (cpu, auto, cuda), or the page cache behind the
    simulated link. Where the cache's slots live: device memory behind pinned staging, a copy stream
    and events (cuda, and auto on a GPU), else host memory (the device is the CPU). A packed checkpoint's
    (GGUF) experts move as stored: a GPU's slots hold their GGML bytes (experts/packed.py), a CPU device's
    hold the forms the host already has for its CPU path (forms(key), ExpertReader), from the page cache
    (forms_moved: those forms are the prepacked entry's views, and their bytes are what a fill moves: block
    placement's expert streaming, and placement below the block)."""
    from ..experts.tier import DiskExpertReader, ExpertReader, ExpertTier, HostExpertSlots

    kind = resolve(kind, device)
    packed = source.packed
    if packed and (kind == "disk" or plan.disk_blocks or (kind != "cuda" and forms is None)):
        raise ValueError("a GGUF file's routed experts stream only from the page cache, into a GPU's expert "
                         "slots or (a CPU device) as the forms its CPU path holds")
    if kind == "disk" or (kind in ("auto-cpu", "cuda") and plan.disk_blocks):
        reader = DiskExpertReader(source)
    elif kind == "simulated":
        from .simulated import env_seconds_per_byte

        reader = ExpertReader(source, seconds_per_byte=env_seconds_per_byte(), forms=forms, forms_moved=forms_moved)
    else:
        reader = ExpertReader(source, forms=forms if kind != "cuda" else None, forms_moved=forms_moved)
    shapes = cfg.moe.expert_shapes(cfg.hidden_size)
    try:
        if kind == "cuda":
            from ..experts.cuda_slots import CudaExpertSlots
            from ..experts.packed import PackedExperts

            slots = CudaExpertSlots(plan.expert_slots, shapes, dtype, device, reader,
                                    packed=PackedExperts(source, dtype) if packed else None)
        else:
            if device.type != "cpu":
                raise ValueError(f"transport {kind!r} computes on the CPU; got device {device}")
            slots = HostExpertSlots(plan.expert_slots, shapes, dtype, device, reader)
    except BaseException:
        reader.close()
        raise
    return ExpertTier(cfg, source, dtype, device, slots, guess)


def make_activation_link(kind: str, cfg: "ModelConfig", plan: MemoryPlan, dtype: torch.dtype, device: torch.device):
    """The link a step's activations cross for the tensor groups the CPU computes (activations.py), for the same
    transport names: pinned staging on a copy stream where blocks would stream over CUDA (cuda, and auto on a
    GPU), sized once for the step's most tokens; the simulated link's rate behind "simulated"; else plain .to()."""
    from .activations import CudaActivationLink, HostLink

    kind = resolve(kind, device)
    if kind == "cuda":
        tokens = plan.max_num_batched_tokens or plan.max_model_len
        # A token's normed hidden state, and for routed experts its top-k ids (int64) and gates (fp32); each
        # tensor of a crossing starts aligned (cuda_layout.ALIGN), three at most.
        row = cfg.hidden_size * dtype.itemsize + (cfg.moe.top_k * (8 + 4) if cfg.moe is not None else 0)
        return CudaActivationLink(device, tokens * row + 3 * ALIGN)
    if kind == "simulated":
        from .simulated import env_seconds_per_byte

        return HostLink(env_seconds_per_byte())
    return HostLink()
