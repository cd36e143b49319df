"""Tensor groups placed off the device (MemoryPlan.group_placement, engine.placement): where their weights
are for each step's path.

A block whose MLP is off the device has two sources: the groups on the device (attention, norms, router),
which ModelWeights keeps resident like any resident block, and the groups off it, which this tier serves:

  path "cpu":    the host's own tensors (views of the mapping where the checkpoint holds the compute dtype,
                 converted copies otherwise), made once at load; the CPU computes them, only activations
                 cross the link;
  path "stream": the same tensors moved through the transport as a streamed block is (prepare, activate,
                 retire: the simulated link's time, a CUDA copy stream and its events), for the device to
                 compute them.

The runner asks per step and block (engine.placement.PathPolicy decides); this tier only moves weights.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from ..planner import MemoryPlan
from .formats.block_source import BlockSource
from .transports.base import Ticket, Transport
from .transports.cpu import CpuTransport


@dataclass(frozen=True)
class OffloadStats:
    """Off-device groups served since load, by path: how many (a block's groups at a time) and the weight
    bytes streamed for them (the CPU path streams none)."""

    served_cpu: int = 0
    served_stream: int = 0
    bytes_streamed: int = 0


class OffloadTier:
    """The off-device groups of every block: host tensors for the CPU, the transport for the device."""

    def __init__(self, source: BlockSource, plan: MemoryPlan, link: Transport):
        """source: only the off-device groups' tensors (BlockSource.select); link: a transport over that
        source to the compute device (owned from here on)."""
        self._blocks = sorted({layer for layer, _ in plan.group_placement.off_device})
        self._link = link
        host = CpuTransport(source, link.dtype)
        # Host tensors in the compute dtype, once: the CPU computes from them every step that takes its path.
        self._host = {b: host.resident(b) for b in self._blocks}
        self._tickets: dict[int, Ticket] = {}
        self._lock = threading.Lock()  # the compute thread counts; telemetry reads from any thread
        self._stats = OffloadStats()

    @property
    def blocks(self) -> list[int]:
        return self._blocks

    def acquire(self, block: int, path: str) -> dict[str, torch.Tensor]:
        """Block `block`'s off-device tensors for `path`: host tensors ("cpu"), or on the device ("stream",
        valid until release)."""
        if path == "cpu":
            with self._lock:
                self._stats = replace(self._stats, served_cpu=self._stats.served_cpu + 1)
            return self._host[block]
        ticket = self._link.prepare(block)
        self._tickets[block] = ticket
        with self._lock:
            self._stats = replace(self._stats, served_stream=self._stats.served_stream + 1,
                                  bytes_streamed=self._stats.bytes_streamed + ticket.nbytes)
        return self._link.activate(ticket)

    def release(self, block: int) -> None:
        """The block's off-device kernels were issued: a streamed group's buffer is given back."""
        ticket = self._tickets.pop(block, None)
        if ticket is not None:
            self._link.retire(ticket)

    def reset(self) -> None:
        for block in list(self._tickets):
            self.release(block)

    @property
    def stats(self) -> OffloadStats:
        with self._lock:
            return self._stats

    def close(self) -> None:
        self.reset()
        self._host.clear()
        self._link.close()
