"""The activations' link (issue #38): a block's tensor group the CPU computes takes its inputs from the device
and gives its output back to it; only these activations cross, never weights.

  to_host(*tensors) -> HostActivations     the inputs start crossing; .wait() -> host tensors, once they landed
  to_device(host, like) -> tensor          the output on like's device, ordered before the next kernel there

One crossing at a time, from the compute thread: to_host, wait, the CPU's computation, to_device (device work
the caller enqueues between to_host and wait overlaps the copy and the CPU's computation). The copy reads the
inputs until wait() returns: the caller keeps them alive and unchanged until then (the device may only read them
meanwhile), or memory the allocator hands on could be overwritten under the copy.

On a GPU (CudaActivationLink), two pinned staging buffers, sized once for the step's most tokens, one each way:
  to_host():   record computed on the compute stream      (the kernels producing the inputs were enqueued)
               copy stream waits on computed; copy_(non_blocking=True) device -> pinned "down" buffer
               record down_landed on the copy stream
  wait():      the host waits on down_landed; the inputs are views of the "down" buffer
  to_device(): the host waits on up_landed                (the last copy out of "up" finished reading it)
               the output into the pinned "up" buffer; the device tensor allocated on the compute stream
               record computed on the compute stream, the copy stream waits on it (the allocator may hand
               out memory whose last kernels on the compute stream have not run yet)
               copy_(non_blocking=True) "up" -> device on the copy stream; record up_landed there
               compute stream waits on up_landed          (the output's consumers run after it landed)
The copy stream is the link's own: activations are a step's critical path, and a streamed group's copy on the
weights' stream would hold them up. Every call goes through CudaRuntime, so tests replay it on CPU
(tests/support/cuda_replay.py: RecordingRuntime, check_activations).

Elsewhere (HostLink) the compute device shares the host's memory: the tensors cross with .to(), and behind the
simulated link (transport "simulated") the host's wait for its inputs, and the output's return, last as long
as their bytes take at the link's rate, as a streamed block's copy does.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from .cuda_layout import Layout
from .cuda_runtime import CudaRuntime
from .simulated import sleep_until


class HostActivations:
    """Inputs crossing to the host: wait() -> the host tensors, in to_host's order."""

    def __init__(self, wait):
        self._wait = wait

    def wait(self) -> tuple[torch.Tensor, ...]:
        return self._wait()


class ActivationLink(ABC):
    """See the module docstring: what the compute side calls."""

    host_bytes: int = 0  # pinned host memory held

    @abstractmethod
    def to_host(self, *tensors: torch.Tensor) -> HostActivations: ...

    @abstractmethod
    def to_device(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None:
        pass


class HostLink(ActivationLink):
    """Where compute's memory is the host's, or any device without a copy stream here: synchronous .to()."""

    def __init__(self, seconds_per_byte: float = 0.0):
        self.seconds_per_byte = seconds_per_byte  # the simulated link's rate (0: no delay)

    def to_host(self, *tensors: torch.Tensor) -> HostActivations:
        landed = time.perf_counter() + self.seconds_per_byte * _nbytes(tensors)
        host = tuple(t.to("cpu") for t in tensors)

        def wait() -> tuple[torch.Tensor, ...]:
            sleep_until(landed)  # work the caller did meanwhile overlapped the simulated copy
            return host

        return HostActivations(wait)

    def to_device(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        sleep_until(time.perf_counter() + self.seconds_per_byte * _nbytes((host,)))
        return host.to(like.device)


class CudaActivationLink(ActivationLink):
    """See the module docstring. `capacity` bytes each way: a step's largest crossing (the normed hidden states
    of its most tokens, and their routing), staging laid out as cuda_layout packs a block."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rt = CudaRuntime(self.device)
        self._copy_stream = self.rt.stream()
        self._computed = self.rt.event()  # on the compute stream: what a copy stream's next copy waits for
        self._down_landed = self.rt.event()
        self._up_landed = self.rt.event()
        self._down = self._up = None
        self.capacity = 0
        self.host_bytes = 0  # pinned host memory held
        try:
            self._grow(capacity)
        except BaseException:
            self.close()  # unpin what was pinned
            raise

    def _grow(self, capacity: int) -> None:
        """Staging of `capacity` bytes each way, pinned once; a larger crossing than the plan's step (none is
        expected) replaces them after the device drained every copy that reads or writes them."""
        if self._down is not None:
            self.rt.synchronize()
        self._down = self.rt.pinned_bytes(capacity)  # (capacity,) u8, device -> host
        self._up = self.rt.pinned_bytes(capacity)  # (capacity,) u8, host -> device
        self.capacity = capacity
        self.host_bytes += 2 * capacity

    def to_host(self, *tensors: torch.Tensor) -> HostActivations:
        rt = self.rt
        layout = Layout.of({str(i): (tuple(t.shape), t.dtype) for i, t in enumerate(tensors)})
        if layout.nbytes > self.capacity:
            self._grow(layout.nbytes)
        views = tuple(layout.views(self._down).values())  # pinned, the tensors' shapes and dtypes
        rt.record(self._computed, rt.current_stream())
        rt.wait(self._copy_stream, self._computed)
        for v, t in zip(views, tensors):
            rt.copy(v, t, self._copy_stream)
        rt.record(self._down_landed, self._copy_stream)

        def wait() -> tuple[torch.Tensor, ...]:
            rt.host_wait(self._down_landed)
            return views

        return HostActivations(wait)

    def to_device(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        rt = self.rt
        nbytes = host.numel() * host.element_size()
        if nbytes > self.capacity:
            self._grow(nbytes)
        rt.host_wait(self._up_landed)  # the DMA still reading "up" (the last crossing's) must finish first
        up = self._up[:nbytes].view(host.dtype).view(host.shape)
        up.copy_(host)
        dev = rt.device_bytes(nbytes).view(host.dtype).view(host.shape)  # on like's device: the runtime's
        compute = rt.current_stream()
        rt.record(self._computed, compute)
        rt.wait(self._copy_stream, self._computed)
        rt.copy(dev, up, self._copy_stream)
        rt.record(self._up_landed, self._copy_stream)
        rt.wait(compute, self._up_landed)
        return dev

    def close(self) -> None:
        self.rt.synchronize()  # no DMA may still read or write staging about to be unpinned
        self._down = self._up = None
        self.rt.release()
        self.host_bytes = 0


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
