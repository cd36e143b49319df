"""Tensor groups placed off the device (MemoryPlan.group_placement, engine.placement): where their weights
are for each step's path.

A block whose MLP is off the device has two sources: the groups on the device (attention, norms, router),
which ModelWeights keeps resident like any resident block, and the groups off it, which this tier serves:

  path "cpu":    the host's own tensors (views of the mapping where the checkpoint holds the compute dtype,
                 converted copies otherwise; a GGUF file's in the CPU kernels' packed form: views of the
                 prepacked entry's mapping), made once at load; the CPU computes them, only activations
                 cross the link;
  path "stream": the same tensors moved through the transport as a streamed block is (prepare, activate,
                 retire: the simulated link's time, a CUDA copy stream and its events), for the device to
                 compute them; the step's next off-device groups are prepared on a thread while one computes
                 (up to the prefetch depth), never past the step's last one: the next step may not stream.

Routed experts off the device (a MoE block's "experts" group) take the same two paths, expert by expert:
  path "cpu":    the chosen experts' host tensors (made once at load, as the MLPs' are: a GGUF file's in the
                 packed kernels' form, or GGUFWeight views of the file in exact mode); the CPU computes them
                 from the hidden states and the routing, which alone cross the link;
  path "stream": only the experts the step's tokens chose, each read by byte range into a slot of the
                 expert tier's cache on the device (experts/: LRU over every block, so hot experts cost no
                 copy), as many slots as the plan's stream buffers hold; a GGUF file's move their packed
                 bytes (GGUFWeight in a GPU's slots; a CPU device's slots hold the CPU path's packed forms).
                 No guess of the next block's experts: the next block may compute on the CPU, and a guessed
                 fill would move its bytes for nothing.

The runner asks per step and block (engine.placement.PathPolicy decides); this tier only moves weights.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ..planner import MemoryPlan
from .formats.block_source import BlockSource
from .transports.base import Ticket, Transport
from .transports.cpu import CpuTransport
from .transports.streamer import StreamStats

if TYPE_CHECKING:
    from .experts.tier import ExpertTier

HostExperts = dict[int, dict[int, dict[str, object]]]  # block -> expert -> its tensors on the host, by name


class OffloadTier:
    """The off-device groups of every block: host tensors for the CPU, the transport (MLPs) or the expert
    tier (routed experts) for the device."""

    def __init__(self, source: BlockSource, plan: MemoryPlan, dtype: torch.dtype, link: Transport | None,
                 experts: Callable[[HostExperts], ExpertTier] | None = None, host: Transport | None = None):
        """source: only the off-device groups' tensors (BlockSource.select), routed experts included; link: a
        transport over its MLP groups (source.without_experts()) to the compute device, None when no MLP is off
        it; experts: makes the expert tier over its routed experts, given the host's expert tensors (a packed
        checkpoint's on a CPU device: its slots hold those), None when no expert may stream (no experts off the
        device, or a policy that never streams); host: the transport whose resident() blocks are the CPU's
        tensors (default: CpuTransport over source; a GGUF file's: ModelWeights picks). All owned from here on."""
        off = plan.group_placement.off_device
        self._blocks = sorted({layer for layer, kind in off if kind == "mlp"})  # the MLPs' stream order
        self._link = link
        self._experts: ExpertTier | None = None
        self._host_transport = host = host if host is not None else CpuTransport(source, dtype)
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._host_experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        # Host tensors in the compute dtype, once: the CPU computes from them every step that takes its path.
        for b in sorted({layer for layer, _ in off}):
            self._host[b], self._host_experts[b] = {}, {}
            for short, t in host.resident(b).items():
                if short.startswith("experts."):  # "experts.3.w_up": expert 3's "w_up"
                    _, e, name = short.split(".", 2)
                    self._host_experts[b].setdefault(int(e), {})[name] = t
                else:
                    self._host[b][short] = t
        if experts is not None:
            self._experts = experts(self._host_experts)
        self._tickets: dict[int, Ticket] = {}  # activated, until release
        # Prepared ahead on a thread of their own, within a step: the path is the step's, so once block i streams,
        # the next off-device blocks (up to the prefetch depth: the transport's buffers) are copied while it computes.
        self._depth = plan.prefetch_depth
        self._pending: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="layerstream-offload")
        self._lock = threading.Lock()  # the compute thread counts; telemetry reads from any thread
        self._stats = StreamStats()

    def link_gbps(self) -> float | None:
        """The host -> device GB/s the MLPs' transport measured, if it did."""
        return self._link.link_gbps() if self._link is not None else None

    def experts(self, block: int, chosen: list[int], path: str) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """Block `block`'s chosen routed experts for `path`, in groups {expert: its tensors} each valid until the
        next is asked for: "cpu", one group of host tensors; "stream", on the device through the expert tier's
        cache, as many per group as its slots hold."""
        if path == "cpu":
            host = self._host_experts[block]
            yield {e: host[e] for e in chosen}
            return
        if self._experts is None:
            raise ValueError("routed experts off the device stream only with stream buffers in the plan (a "
                             "--cpu-offload-policy other than cpu)")
        yield from self._experts.groups(block, chosen, None, None)

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
        if self._experts is not None:
            self._experts.reset()
        for block in list(self._pending):
            try:
                self._drop(block)
            except Exception:  # noqa: BLE001 - the copy that failed already failed the step
                pass
        for block in list(self._tickets):
            self.release(block)

    @property
    def stats(self) -> StreamStats:
        """What streamed groups moved (counted like streamed blocks: bytes by tier, stall; experts as the expert
        tier counts them)."""
        with self._lock:
            stats = self._stats
        return stats if self._experts is None else stats.plus(self._experts.stats)

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True)
        self._host.clear()
        self._host_experts.clear()
        if self._experts is not None:
            self._experts.close()
            self._experts = None
        if self._link is not None:
            self._link.close()
        self._host_transport.close()  # after the tensors it made are dropped: a mapping can then be unmapped
