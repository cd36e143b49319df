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
import time

import torch

from ..planner import MemoryPlan
from .formats.block_source import BlockSource
from .transports.base import Ticket, Transport
from .transports.cpu import CpuTransport
from .transports.streamer import StreamStats


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
        self._stats = StreamStats()

    @property
    def blocks(self) -> list[int]:
        return self._blocks

    def acquire(self, block: int, path: str) -> dict[str, torch.Tensor]:
        """Block `block`'s off-device tensors for `path`: host tensors ("cpu"), or on the device ("stream",
        valid until release)."""
        if path == "cpu":
            return self._host[block]
        # Prepared on demand, on the compute thread: the step's path is known only once its tokens are, so
        # nothing is prefetched yet, and the whole copy counts as stall.
        t0 = time.perf_counter()
        ticket = self._link.prepare(block)
        self._tickets[block] = ticket
        weights = self._link.activate(ticket)
        with self._lock:
            self._stats = self._stats.add(ticket, stall_seconds=time.perf_counter() - t0)
        return weights

    def release(self, block: int) -> None:
        """The block's off-device kernels were issued: a streamed group's buffer is given back."""
        ticket = self._tickets.pop(block, None)
        if ticket is not None:
            self._link.retire(ticket)

    def reset(self) -> None:
        for block in list(self._tickets):
            self.release(block)

    @property
    def stats(self) -> StreamStats:
        """What streamed groups moved (counted like streamed blocks: bytes by tier, stall)."""
        with self._lock:
            return self._stats

    def close(self) -> None:
        self.reset()
        self._host.clear()
        self._link.close()
