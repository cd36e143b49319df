"""Tensor groups placed off the device (MemoryPlan.group_placement, engine.placement): where their weights
are for each step's path.

A block whose MLP is off the device has two sources: the groups on the device (attention, norms, router),
which ModelWeights keeps resident like any resident block, and the groups off it, which this tier serves:

  path "cpu":    the host's own tensors (views of the mapping where the checkpoint holds the compute dtype,
                 converted copies otherwise), made once at load; the CPU computes them, only activations
                 cross the link;
  path "stream": the same tensors moved through the transport as a streamed block is (prepare, activate,
                 retire: the simulated link's time, a CUDA copy stream and its events), for the device to
                 compute them; the step's next off-device groups are prepared on a thread while one computes
                 (up to the prefetch depth), never past the step's last one: the next step may not stream.

The runner asks per step and block (engine.placement.PathPolicy decides); this tier only moves weights.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

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
        self._tickets: dict[int, Ticket] = {}  # activated, until release
        # Prepared ahead on a thread of their own, within a step: the path is the step's, so once block i streams,
        # the next off-device blocks (up to the prefetch depth: the transport's buffers) are copied while it computes.
        self._depth = plan.prefetch_depth
        self._pending: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="layerstream-offload")
        self._lock = threading.Lock()  # the compute thread counts; telemetry reads from any thread
        self._stats = StreamStats()

    def acquire(self, block: int, path: str) -> dict[str, torch.Tensor]:
        """Block `block`'s off-device tensors for `path`: host tensors ("cpu"), or on the device ("stream",
        valid until release)."""
        if path == "cpu":
            self._drop(block)  # prefetched for a path this block did not take (groups of other sizes)
            return self._host[block]
        future = self._pending.pop(block, None) or self._pool.submit(self._link.prepare, block)
        # The next off-device blocks of this step, ahead: never past the last one (the next step may not stream).
        for nxt in [b for b in self._blocks if b > block][:self._depth]:
            if nxt not in self._pending:
                self._pending[nxt] = self._pool.submit(self._link.prepare, nxt)
        t0 = time.perf_counter()
        ticket = future.result()  # the compute thread waits here only if the copy is behind
        stall = time.perf_counter() - t0
        self._tickets[block] = ticket
        weights = self._link.activate(ticket)
        with self._lock:
            self._stats = self._stats.add(ticket, stall_seconds=stall)
        return weights

    def _drop(self, block: int) -> None:
        """A prefetched group no one will use: its buffer is given back in the protocol's order."""
        future = self._pending.pop(block, None)
        if future is not None:
            ticket = future.result()
            self._link.activate(ticket)
            self._link.retire(ticket)

    def release(self, block: int) -> None:
        """The block's off-device kernels were issued: a streamed group's buffer is given back."""
        ticket = self._tickets.pop(block, None)
        if ticket is not None:
            self._link.retire(ticket)

    def reset(self) -> None:
        """After a step failed half-way (or at close): what is prefetched or activated is given back."""
        for block in list(self._pending):
            try:
                self._drop(block)
            except Exception:  # noqa: BLE001 - the copy that failed already failed the step
                pass
        for block in list(self._tickets):
            self.release(block)

    @property
    def stats(self) -> StreamStats:
        """What streamed groups moved (counted like streamed blocks: bytes by tier, stall)."""
        with self._lock:
            return self._stats

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True)
        self._host.clear()
        self._link.close()
