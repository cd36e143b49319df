"""Host buffer sets for converted blocks, reused across blocks and shared by the transports that convert.

A streamed block in a checkpoint dtype other than the compute dtype is converted into a set of
buffers (one tensor per block tensor). The streamer keeps at most depth + 1 blocks in flight, so at
most that many sets ever exist, whichever transport (host tier or disk tier) filled them: the
planner's stream buffers. Reusing them matters: a fresh tensor per block per step costs page faults
to zero it, and once glibc raises its mmap threshold past a freed buffer's size the freed memory stays
in the heap, fragmented, so RssAnon grew far past depth + 1 blocks.
"""

from __future__ import annotations

import queue

import torch


class BufferPool:
    """Thread-safe: take() runs on the prefetch thread, give() on the compute thread."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self.sets_made = 0  # buffer sets allocated so far (telemetry: stays <= depth + 1)
        self.takes = 0  # blocks converted so far

    def take(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A set with one `dtype` tensor per entry of `like`, shaped like it (contents undefined)."""
        self.takes += 1
        try:
            buffers = self._free.get_nowait()
            if all(k in buffers and buffers[k].shape == v.shape for k, v in like.items()):
                return buffers
        except queue.Empty:
            pass
        self.sets_made += 1
        return {k: torch.empty(v.shape, dtype=self.dtype) for k, v in like.items()}

    def give(self, buffers: dict[str, torch.Tensor]) -> None:
        self._free.put(buffers)
