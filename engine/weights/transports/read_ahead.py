"""Disk-tier reads kept ahead of compute: the next disk blocks' reads start as soon as a staging
buffer is free, so the disk always has requests queued and never idles at a block boundary.

A transport's disk tier owns one ReadAhead: take(block) hands back the block's bytes in a staging
buffer (waiting for its read, or starting it), give(buffer) returns a buffer once nothing views it
and starts the next read into it. Blocks are visited in ascending order, cyclically (the streamer's
order); a take() out of that order (after a reset) waits for the reads in flight and drops them.
There are exactly as many buffers as the streamer lets tickets exist (prefetch depth + 1), so the
block asked for always finds one once the unwanted reads are dropped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .disk_reader import DiskReader, ReadPlan, StagingBuffer


class ReadAhead:
    def __init__(self, reader: DiskReader, plans: dict[int, ReadPlan], buffers: int):
        """`plans`: each disk block's read; `buffers` staging buffers, each as large as the largest read."""
        self.reader = reader
        self._plans = plans
        self._order = sorted(plans)
        self._lock = threading.Lock()  # take() runs on the prefetch thread, give() on the compute thread
        size = max(p.buffer_bytes for p in plans.values())
        self._free = [StagingBuffer(size) for _ in range(buffers)]  # pages untouched until read into
        self._buffers = buffers
        self._ahead: dict[int, tuple[Future, StagingBuffer]] = {}  # block -> its read in flight, its buffer
        self._last = -1  # the block whose read was started last
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="layerstream-read-ahead")

    @property
    def reading(self) -> list[int]:
        """Blocks whose reads were started ahead and not taken yet, in the order they were started."""
        with self._lock:
            return list(self._ahead)

    @property
    def held(self) -> int:
        """Buffers handed out by take() and not given back yet."""
        with self._lock:
            return self._buffers - len(self._free) - len(self._ahead)

    def take(self, block: int) -> tuple[StagingBuffer, int, float]:
        """Block `block` read into a staging buffer: (buffer, bytes read, seconds its read took)."""
        with self._lock:
            started = self._ahead.pop(block, None)
            if started is None:
                self._drop()  # the order was broken (a reset): the reads in flight are not wanted
                started = self._start(block)
        future, buf = started
        try:
            nbytes, seconds = future.result()
        except BaseException:
            self.give(buf)
            raise
        self._fill()
        return buf, nbytes, seconds

    def give(self, buf: StagingBuffer) -> None:
        """A buffer nothing views any more: the next block's read starts into it."""
        with self._lock:
            self._free.append(buf)
        self._fill()

    def _start(self, block: int) -> tuple[Future, StagingBuffer]:
        buf, plan = self._free.pop(), self._plans[block]

        def read() -> tuple[int, float]:
            t0 = time.perf_counter()
            return self.reader.read(plan, buf), time.perf_counter() - t0

        self._last = block
        return self._pool.submit(read), buf

    def _fill(self) -> None:
        with self._lock:
            while self._free:
                later = [b for b in self._order if b > self._last]
                block = later[0] if later else self._order[0]
                if block in self._ahead:
                    return
                self._ahead[block] = self._start(block)

    def _drop(self) -> None:
        for future, buf in self._ahead.values():
            future.exception()  # wait: the read writes into buf
            self._free.append(buf)
        self._ahead.clear()

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._free.clear()
        self._pool.shutdown(wait=True)
