"""How one block's weights get from the checkpoint to where compute reads them: the Transport interface,
the Ticket of a block in flight, and the helpers every transport shares (cpu.py is the plain one).

A transport has three steps, split by thread so that copies overlap compute:
  prepare(block)   prefetch thread: blocking work (page faults, disk reads, dtype conversion,
                   host->device copies issued on a copy stream); returns a Ticket
  activate(ticket) compute thread: make the weights usable by the next kernel (CUDA: the compute
                   stream waits on the copy's event; CPU: nothing) and return them
  retire(ticket)   compute thread, after the block's kernels were issued: give the memory back
                   (CUDA: record a "free" event; CPU: drop converted copies / release pages)
The streamer decides which block to prepare when; a transport never looks ahead by itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .buffers import BufferPool

HOST, DISK = "host", "disk"  # tiers a streamed block comes from (telemetry counts bytes by tier)


@dataclass
class Ticket:
    """One streamed block between prepare() and retire(), with the state each transport keeps for it."""

    block: int
    weights: dict[str, torch.Tensor]
    # Bytes this block moved over the link into compute's memory, in the compute dtype (what a
    # host->device copy carries after conversion), not checkpoint bytes: GB/s and % of the link's
    # floor are computed from it.
    nbytes: int
    tier: str = HOST
    disk_bytes: int = 0  # bytes read from disk for it (disk tier)
    disk_seconds: float = 0.0  # wall time of those reads
    prepare_seconds: float = 0.0
    converted: dict[str, torch.Tensor] | None = None  # a BufferPool set (host conversion)
    repacked: torch.Tensor | None = None  # a StreamRepacker slot the weights live in (packed, CPU fast mode)
    staging: object = None  # a disk_reader.StagingBuffer the weights view (disk tier)
    device_buffer: int | None = None  # slot of the CUDA transport's device ring
    trace: object = None  # cuda_trace.TraceRecord when tracing


class Transport(ABC):
    """Moves a block's weights onto the compute device; see the module docstring."""

    device: torch.device
    dtype: torch.dtype
    pool: BufferPool | None = None  # host conversion buffers, when this transport converts on the host
    host_bytes: int = 0  # page-locked host memory held
    device_gbps: float | None = None  # measured device memory read speed, when there is a device
    pinned_cache: bool = False  # streamed blocks kept pinned in host memory (CUDA --pin-host-memory)

    @abstractmethod
    def resident(self, block: int) -> dict[str, torch.Tensor]:
        """Materialise a block permanently on the device (called once at load time)."""

    def resident_is_view(self, block: int) -> bool:
        """Whether resident(block) returned views of the mapped source: stacking its q/k/v or gate/up
        (packed/fuse.py) would copy them, and the kernels take the parts as they are."""
        return False

    def views_read_faster_copied(self) -> bool:
        """Whether resident views are worth copying into huge pages of their own at load (resident_copy.py:
        --resident-weights auto copies where this says so)."""
        return False

    def release_resident(self, block: int) -> None:
        """Resident block `block` was copied out of its views: drop its mapped pages from this process (the page
        cache keeps them)."""

    @abstractmethod
    def prepare(self, block: int) -> Ticket: ...

    def activate(self, ticket: Ticket) -> dict[str, torch.Tensor]:
        return ticket.weights

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}

    def link_gbps(self) -> float | None:
        """The measured speed of the link this transport copies over (host->device), if it has one."""
        return None

    def close(self) -> None:
        pass


def to_compute(views: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
               copy: bool) -> dict[str, torch.Tensor]:
    """Convert mmap views to owned tensors in the compute dtype (copy=True forces ownership)."""
    out = {}
    for k, v in views.items():
        if v.dtype != dtype or v.device != device:
            out[k] = v.to(device=device, dtype=dtype)
        else:
            out[k] = v.clone() if copy else v
    return out


def nbytes_of(weights: dict[str, torch.Tensor]) -> int:
    return sum(w.numel() * w.element_size() for w in weights.values())
