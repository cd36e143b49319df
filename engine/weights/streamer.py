"""The block streamer: the one place that decides where a block's weights come from.

Resident blocks are materialised once. Streamed blocks are prepared by a background thread in the
order every step visits them (cyclically, step after step), at most `depth` blocks ahead of the one
in use, so at most depth + 1 streamed blocks exist at once. `acquire(i)` hands block i's weights to
compute (waiting only if the prefetcher is behind, which is counted as stall time); `release(i)`
gives its buffer back so the prefetcher may fill it with the next block.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from .transport import Ticket, Transport


@dataclass
class StreamStats:
    bytes_streamed: int = 0
    blocks_streamed: int = 0
    stall_seconds: float = 0.0  # compute thread waiting for a block
    prepare_seconds: float = 0.0  # prefetch thread busy preparing blocks

    def snapshot(self) -> "StreamStats":
        return StreamStats(self.bytes_streamed, self.blocks_streamed, self.stall_seconds, self.prepare_seconds)

    def since(self, before: "StreamStats") -> "StreamStats":
        return StreamStats(
            self.bytes_streamed - before.bytes_streamed,
            self.blocks_streamed - before.blocks_streamed,
            self.stall_seconds - before.stall_seconds,
            self.prepare_seconds - before.prepare_seconds,
        )


class _Failure:
    def __init__(self, block: int, error: BaseException):
        self.block, self.error = block, error


class BlockStreamer:
    def __init__(self, transport: Transport, resident: list[int], streamed: list[int], depth: int = 1,
                 on_progress=None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.transport = transport
        self.depth = depth
        self.streamed = list(streamed)
        self.stats = StreamStats()
        self._resident: dict[int, dict[str, torch.Tensor]] = {}
        for i in resident:
            self._resident[i] = transport.resident(i)
            if on_progress:
                on_progress(i)
        self._in_use: dict[int, Ticket] = {}
        self._thread: threading.Thread | None = None
        if self.streamed:
            self._start()

    # -- prefetch thread ---------------------------------------------------------------------
    def _start(self) -> None:
        self._stop = threading.Event()
        self._slots = threading.Semaphore(self.depth + 1)
        self._ready: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._prefetch_loop, name="layerstream-prefetch", daemon=True)
        self._thread.start()

    def _prefetch_loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._slots.acquire()
            if self._stop.is_set():
                return
            block = self.streamed[i % len(self.streamed)]
            t0 = time.perf_counter()
            try:
                ticket = self.transport.prepare(block)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread to raise
                self._ready.put(_Failure(block, e))
                return
            ticket.prepare_seconds = time.perf_counter() - t0
            self._ready.put(ticket)
            i += 1

    # -- compute thread ----------------------------------------------------------------------
    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        w = self._resident.get(block)
        if w is not None:
            return w
        t0 = time.perf_counter()
        ticket = self._ready.get()
        self.stats.stall_seconds += time.perf_counter() - t0
        if isinstance(ticket, _Failure):
            raise RuntimeError(f"streaming block {ticket.block} failed: {ticket.error}") from ticket.error
        if ticket.block != block:
            # Blocks are visited in a fixed cyclic order; anything else is a runner bug.
            raise RuntimeError(f"streamer out of order: asked for block {block}, next is {ticket.block}")
        self._in_use[block] = ticket
        self.stats.bytes_streamed += ticket.nbytes
        self.stats.blocks_streamed += 1
        self.stats.prepare_seconds += ticket.prepare_seconds
        return self.transport.activate(ticket)

    def release(self, block: int) -> None:
        ticket = self._in_use.pop(block, None)
        if ticket is None:
            return
        self.transport.retire(ticket)
        self._slots.release()

    def reset(self) -> None:
        """Drop everything in flight and restart the cycle at the first streamed block: used after
        a step failed half-way, when the prefetcher's position no longer matches the runner's."""
        if self._thread is None:
            return
        self._shutdown_thread()
        self._start()

    def _shutdown_thread(self) -> None:
        self._stop.set()
        for _ in range(self.depth + 2):
            self._slots.release()
        self._thread.join()
        for ticket in list(self._in_use.values()):
            self.transport.retire(ticket)
        self._in_use.clear()
        while not self._ready.empty():
            t = self._ready.get_nowait()
            if isinstance(t, Ticket):
                self.transport.retire(t)

    def close(self) -> None:
        if self._thread is not None:
            self._shutdown_thread()
            self._thread = None
        self.transport.close()
