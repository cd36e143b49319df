"""How one block's weights get from the checkpoint to where compute reads them.

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
from dataclasses import dataclass, field
import mmap
import queue

import torch

from ..arch import ModelConfig
from .safetensors_index import MADV_POPULATE_READ, WeightIndex


class BlockSource:
    """The checkpoint's view of one block: names, zero-copy tensors, bytes."""

    def __init__(self, index: WeightIndex, cfg: ModelConfig):
        self.index = index
        self.cfg = cfg
        self._names = [cfg.block_tensor_names(i) for i in range(cfg.num_layers)]

    def names(self, block: int) -> dict[str, str]:
        return self._names[block]

    def views(self, block: int) -> dict[str, torch.Tensor]:
        return {short: self.index.view(name) for short, name in self._names[block].items()}

    def nbytes(self, block: int) -> int:
        return sum(self.index.entry(n).nbytes for n in self._names[block].values())

    def advise(self, block: int, advice: int) -> None:
        self.index.advise(list(self._names[block].values()), advice)


@dataclass
class Ticket:
    block: int
    weights: dict[str, torch.Tensor]
    nbytes: int  # bytes this block moved (checkpoint bytes read)
    prepare_seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # transport-private state (buffer index, events, ...)


class Transport(ABC):
    """Moves a block's weights onto the compute device; see the module docstring."""

    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def resident(self, block: int) -> dict[str, torch.Tensor]:
        """Materialise a block permanently on the device (called once at load time)."""

    @abstractmethod
    def prepare(self, block: int) -> Ticket: ...

    def activate(self, ticket: Ticket) -> dict[str, torch.Tensor]:
        return ticket.weights

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}

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


class CpuTransport(Transport):
    """CPU compute straight from the page cache.

    When the checkpoint dtype is the compute dtype, a streamed block is the mmap view itself
    (zero copy); prepare() only faults its pages in ahead of use. Otherwise prepare() converts into
    a set of buffers that retire() hands back for the next block: the streamer keeps at most
    depth + 1 blocks in flight, so at most that many sets ever exist (the planner's stream buffers).
    Reusing them matters: a fresh tensor per block per step costs page faults to zero it, and once
    glibc raises its mmap threshold past a freed buffer's size the freed memory stays in the heap,
    fragmented, so RssAnon grew far past depth + 1 blocks.
    With release_pages, retire() also drops the block's pages from this process (MADV_DONTNEED)
    so a model larger than RAM keeps a bounded resident set.
    """

    def __init__(self, source: BlockSource, dtype: torch.dtype, release_pages: bool = False):
        self.source = source
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.release_pages = release_pages
        self._mapped: set[int] = set()  # streamed blocks whose pages this process has faulted in
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # conversion buffer sets not in use

    def resident(self, block: int) -> dict[str, torch.Tensor]:
        return to_compute(self.source.views(block), self.dtype, self.device, copy=True)

    def prepare(self, block: int) -> Ticket:
        views = self.source.views(block)
        # Pages stay mapped once faulted in until retire() releases them (or the kernel reclaims
        # them, and compute refaults them). Populating every step anyway walks every page-table
        # entry of the block again for nothing (~0.1 ms per 22 MB block on the prefetch thread).
        if self.release_pages or block not in self._mapped:
            self.source.advise(block, MADV_POPULATE_READ)
            self._mapped.add(block)
        convert = {k: v for k, v in views.items() if v.dtype != self.dtype}
        if not convert:
            return Ticket(block, views, self.source.nbytes(block))
        buffers = self._take_buffers(convert)
        for k, v in convert.items():
            buffers[k].copy_(v)
        return Ticket(block, {**views, **buffers}, self.source.nbytes(block), extra={"buffers": buffers})

    def _take_buffers(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            buffers = self._free.get_nowait()
            if all(k in buffers and buffers[k].shape == v.shape for k, v in like.items()):
                return buffers
        except queue.Empty:
            pass
        return {k: torch.empty(v.shape, dtype=self.dtype) for k, v in like.items()}

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}
        buffers = ticket.extra.pop("buffers", None)
        if buffers is not None:
            self._free.put(buffers)
        if self.release_pages:
            self.source.advise(ticket.block, mmap.MADV_DONTNEED)
