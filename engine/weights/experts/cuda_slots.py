"""The device expert cache's slots on a GPU: expert slots in device memory, filled from pinned staging
on a copy stream, ordered against compute by events alone (the CUDA transport's protocol, per expert).

Per fill of slot d (the expert cache's fetch thread), with staging buffer s taken round-robin:
  fetch thread    fill():    the expert's bytes from the reader (mmap views, or an O_DIRECT read)
                             wait (host) until staging s's previous copy finished   [staged[s]]
                             fill staging s, converting to the compute dtype (a packed checkpoint's
                             experts: their GGML bytes as stored, experts/packed.py)
                             copy stream waits on freed[d]  (the last kernels reading d are done)
                             copy_(non_blocking=True) staging s -> slot d on the copy stream
                             record ready[d] and staged[s] on the copy stream
  compute thread  activate(slots): compute stream waits on ready[d] of every slot of the group
                  retire(slots):   record freed[d] on the compute stream, for every slot of the group
Why it is race-free: the expert cache hands slot d to a new fill only once compute released it
(ExpertCache: pinned and loading slots are never evicted), and the tier retires a group's slots
before releasing them in the cache, so freed[d] was recorded after the kernels that read d were
issued and the next copy into d waits for them on the device. Compute waits on ready[d] after the
cache said the fill returned, i.e. after ready[d] was recorded behind the copy. Copies are issued in
order on one stream, so a slot never receives two copies at once; the only host wait is the fetch
thread's on staged[s], which keeps it from overwriting pinned memory a DMA is still reading.

Every CUDA call goes through CudaRuntime, so tests replay this on CPU with a recording runtime
(tests/support/cuda_replay.py RecordingRuntime, check_protocol: the same attribute names as CudaTransport's
ring, `_dev`, `_stage`, `_ready`, `_freed`, `_staged`, one device "buffer" per slot).
"""

from __future__ import annotations

import torch

from ...planner import format_bytes
from ...errors import DeviceMemoryError
from ..transports.cuda_runtime import CudaRuntime
from ..transports.cuda_layout import Layout
from .packed import PackedExperts

STAGING_BUFFERS = 2  # fill of the next expert overlaps the DMA of the last


class CudaExpertSlots:
    """`slots` experts of one shape set (`shapes`: name -> shape) in device memory, in `dtype`."""

    def __init__(self, slots: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                 reader, packed: PackedExperts | None = None):
        """reader.views(key) -> the expert's tensors as stored (ExpertReader / DiskExpertReader). packed: a packed
        checkpoint's experts, whose slots hold their stored bytes (GGML rows) for compute to read as GGUFWeight."""
        self.reader, self.count = reader, slots
        self.packed = packed
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rt = CudaRuntime(self.device)
        specs = packed.specs if packed is not None else {k: (tuple(s), dtype) for k, s in shapes.items()}
        self.layout = Layout.of(specs)
        stride = self.layout.nbytes
        self.nbytes = sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize  # what one fill moves
        self._held: list[tuple[int, int] | None] = [None] * slots  # packed: the expert each slot holds
        self.host_bytes = 0
        self._dev, self._stage = [], []
        try:
            try:
                whole = self.rt.device_bytes(slots * stride)  # (slots * stride,) u8: one allocation
            except torch.OutOfMemoryError as e:
                raise DeviceMemoryError(f"could not allocate the expert cache ({slots} x {format_bytes(stride)}) "
                                        f"on {self.device}: {e}") from e
            self._dev = [whole[i * stride:(i + 1) * stride] for i in range(slots)]  # one (stride,) u8 per slot
            self._views = [self.layout.views(d) for d in self._dev]
            try:
                self._stage = [self.rt.pinned_bytes(stride) for _ in range(STAGING_BUFFERS)]  # (stride,) u8
            except RuntimeError as e:  # cudaHostAlloc failures surface as RuntimeError
                raise DeviceMemoryError(f"could not pin {STAGING_BUFFERS} x {format_bytes(stride)} of host memory "
                                        f"for expert staging: {e}") from e
            self.host_bytes = STAGING_BUFFERS * stride
            self._stage_views = [self.layout.views(s) for s in self._stage]
            self._copy_stream = self.rt.stream()
            self._ready = [self.rt.event() for _ in range(slots)]
            self._freed = [self.rt.event() for _ in range(slots)]
            self._staged = [self.rt.event() for _ in range(STAGING_BUFFERS)]
            self._next_stage = 0
        except BaseException:
            self.close()
            raise

    # -- the expert cache's fetch thread -----------------------------------------------------------
    def fill(self, key: tuple[int, int], slot: int) -> int:
        """Queue expert `key`'s copy into `slot` (asynchronous on the device); returns the bytes it moves."""
        rt = self.rt
        s = self._next_stage
        self._next_stage = (s + 1) % len(self._stage)
        views = self.reader.views(key)  # a disk read happens here, before the wait: it overlaps the DMA
        rt.host_wait(self._staged[s])
        staging = self._stage_views[s]
        if self.packed is not None:
            self.packed.stage(views, staging)
            self._held[slot] = key  # read by compute only after the cache says this fill returned
        else:
            for name, v in views.items():
                staging[name].copy_(v)
        rt.wait(self._copy_stream, self._freed[slot])
        rt.copy(self._dev[slot], self._stage[s], self._copy_stream)
        rt.record(self._ready[slot], self._copy_stream)
        rt.record(self._staged[s], self._copy_stream)
        return self.nbytes if self.packed is None else self.packed.nbytes(key)

    # -- the compute thread ------------------------------------------------------------------------
    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            return self.packed.weights(self._held[slot], self._views[slot])
        return self._views[slot]

    def activate(self, slots: list[int]) -> None:
        """Compute will read these slots: its stream waits for their copies (no host sync)."""
        stream = self.rt.current_stream()
        for d in slots:
            self.rt.wait(stream, self._ready[d])

    def retire(self, slots: list[int]) -> None:
        """Compute's kernels reading these slots were issued: a later copy into one waits for them."""
        stream = self.rt.current_stream()
        for d in slots:
            self.rt.record(self._freed[d], stream)

    def close(self) -> None:
        if self._dev:
            self.rt.synchronize()  # no DMA may still target memory about to be released
        self._dev, self._views, self._stage, self._stage_views = [], [], [], []
        self.rt.release()
        self.host_bytes = 0
