"""The CUDA runtime calls the CUDA transport makes, in one place: streams, events, device and pinned
host memory, copies. Tests replay the transport on CPU by substituting a runtime that records the
order of calls instead of running them (tests/support/cuda_replay.py RecordingRuntime).
"""

from __future__ import annotations

import logging
import mmap

import torch

from . import bandwidth

log = logging.getLogger("layerstream")

PAGE = mmap.PAGESIZE  # the granularity at which cudaHostRegister pins host memory
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not the caller's


class CudaRuntime:
    """The CUDA calls the transport makes, in one place (tests substitute a recording fake)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._registered: list[tuple[torch.Tensor, int]] = []  # (allocation, registered address)

    def stream(self):
        return torch.cuda.Stream(device=self.device)

    def event(self, timing: bool = False):
        # blocking: the prefetch thread's host_wait sleeps instead of spinning a core the compute
        # thread's kernel launches (and, on small hosts, the staging memcpy) need.
        return torch.cuda.Event(enable_timing=timing, blocking=True)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def device_bytes(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def pinned_bytes(self, n: int) -> torch.Tensor:
        """Exactly n page-locked bytes. pin_memory=True goes through the caching host allocator,
        which rounds every block up to a power of two (a 22 MiB block would pin 32 MiB), so
        register a plain allocation instead and fall back to the allocator if that fails.

        The driver pins whole pages, and registering a page that is already registered fails
        (cudaErrorHostMemoryAlreadyRegistered). Two small CPU tensors can share a page, so the
        registered range is page-aligned, page-rounded and lies inside an allocation of its own.
        A failed cudaHostRegister (already registered, or a sandbox without it) also leaves the
        runtime's last error pending, and torch's next kernel-launch check would raise it as that
        kernel's failure: clear_pending_error() takes it before falling back."""
        raw = torch.empty(n + 2 * PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        size = max(PAGE, -(-n // PAGE) * PAGE)
        try:
            # On the model's device, and portable: memory pinned for one context only is pageable
            # (driver-staged, slower) to the others, and the calling thread may be on GPU 0.
            with torch.cuda.device(self.device):
                err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr() + start, size, HOST_REGISTER_PORTABLE)
            ok = _succeeded(err)
        except (AttributeError, RuntimeError, TypeError):
            ok = False
        if not ok:
            clear_pending_error(self.device)
            return torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self._registered.append((raw, raw.data_ptr() + start))
        return raw[start:start + n]

    def release(self) -> None:
        """Unregister what pinned_bytes registered (after a synchronize: no DMA reads it any more)."""
        for _raw, ptr in self._registered:
            if not _succeeded(torch.cuda.cudart().cudaHostUnregister(ptr)):
                log.warning("cudaHostUnregister failed for a pinned buffer at %#x", ptr)
                clear_pending_error(self.device)
        self._registered.clear()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        # The prefetch thread's current device is cuda:0 whatever the model's. torch.cuda.stream()
        # alone switches to the stream's device and, on exit, back with cudaSetDevice(0), which
        # creates a context on GPU 0 for a model on cuda:1; torch.cuda.device restores lazily.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)  # a never-recorded event is a no-op: a fresh buffer is free

    def record(self, event, stream) -> None:
        event.record(stream)

    def host_wait(self, event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def copy_gbps(self, dst: torch.Tensor, src: torch.Tensor) -> float | None:
        return bandwidth.measure_copy_gbps(dst, src)


def _succeeded(err) -> bool:
    """A cudaError_t from torch.cuda.cudart() (a pybind enum, or an int) is cudaSuccess."""
    return int(getattr(err, "value", err)) == 0


def clear_pending_error(device: torch.device) -> None:
    """Take the error a failed runtime call left pending in this thread. torch exposes no
    cudaGetLastError, but its check after every kernel launch calls it: launch one and drop what
    it raises (nothing, when no error was pending)."""
    try:
        torch.empty(1, device=device).fill_(1)
    except RuntimeError as e:
        log.debug("cleared a pending CUDA error: %s", str(e).splitlines()[0] if str(e) else e)


def host_register_works(device: torch.device) -> bool:
    """Whether cudaHostRegister pins memory here (else pinned buffers come from torch's caching
    allocator, rounded up to a power of two): registers 64 pages, copies them to the device, checks
    what arrived, and unregisters them."""
    rt = CudaRuntime(device)
    try:
        buf = rt.pinned_bytes(64 * PAGE)
        ok = bool(rt._registered) and buf.is_pinned()
        dev = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
        dev.copy_(buf.fill_(3), non_blocking=True)
        torch.cuda.synchronize(device)
        assert int(dev[-1]) == 3, "a host->device copy from registered memory delivered the wrong bytes"
        return ok
    finally:
        torch.cuda.synchronize(device)
        rt.release()
