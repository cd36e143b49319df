"""The block streamer: decides when each streamed block is prepared (the transport decides how).

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
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from .exit_stop import close_at_exit, closed
from ..packed.fuse import drop_symmetric_mins, fuse_projections
from .base import DISK, Ticket, Transport
from .resident_copy import HugePageCollapse, copies, owned


@dataclass(frozen=True)
class StreamStats:
    """Counters of what the streamer moved; the telemetry snapshot carries them per step and in total.

    Bytes are counted as they reach compute's memory, in the compute dtype (what crossed the link
    after any conversion), by the tier the block came from; disk_bytes_read counts the bytes the disk
    tier read (in the checkpoint's dtype, aligned), the disk link's own figure."""

    host_tier_bytes: int = 0
    disk_tier_bytes: int = 0
    disk_bytes_read: int = 0
    blocks_streamed: int = 0
    stall_seconds: float = 0.0  # compute thread waiting for a block
    prepare_seconds: float = 0.0  # prefetch thread busy preparing blocks
    disk_read_seconds: float = 0.0  # of which reading disk-tier blocks
    # Expert-granular streaming (mixtures of experts). Expert bytes are also in the tier counters above.
    expert_bytes: int = 0  # bytes fetched into the expert cache (demand and prefetch)
    expert_hits: int = 0  # chosen experts found in the cache (or already on their way by prefetch)
    expert_misses: int = 0  # chosen experts fetched on demand
    experts_guessed: int = 0  # experts prefetched on a guess (next block's router on this block's state)
    experts_guessed_right: int = 0  # guesses the block's tokens then chose
    experts_needed_guessed: int = 0  # experts chosen by blocks that had a guess

    @property
    def bytes_streamed(self) -> int:
        return self.host_tier_bytes + self.disk_tier_bytes

    @property
    def expert_hit_rate(self) -> float | None:
        asked = self.expert_hits + self.expert_misses
        return self.expert_hits / asked if asked else None

    @property
    def prefetch_accuracy(self) -> float | None:
        """Of the experts blocks chose, the fraction their guess named (recall); None without guesses."""
        return self.experts_guessed_right / self.experts_needed_guessed if self.experts_needed_guessed else None

    def add(self, ticket: Ticket, stall_seconds: float) -> "StreamStats":
        disk = ticket.tier == DISK
        return replace(
            self,
            host_tier_bytes=self.host_tier_bytes + (0 if disk else ticket.nbytes),
            disk_tier_bytes=self.disk_tier_bytes + (ticket.nbytes if disk else 0),
            disk_bytes_read=self.disk_bytes_read + ticket.disk_bytes,
            blocks_streamed=self.blocks_streamed + 1,
            stall_seconds=self.stall_seconds + stall_seconds,
            prepare_seconds=self.prepare_seconds + ticket.prepare_seconds,
            disk_read_seconds=self.disk_read_seconds + ticket.disk_seconds,
        )

    def plus(self, other: "StreamStats") -> "StreamStats":
        return StreamStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def since(self, before: "StreamStats") -> "StreamStats":
        return StreamStats(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))


class _Failure:
    def __init__(self, block: int, error: BaseException):
        self.block, self.error = block, error


class BlockStreamer:
    def __init__(self, transport: Transport, resident: list[int], streamed: list[int], depth: int = 1,
                 on_progress=None, fuse: bool = False, resident_weights: str = "map",
                 other_copies: Sequence[torch.Tensor] = ()):
        """resident_weights: auto | copy | map, whether resident views are copied into huge pages of their own
        (resident_copy.py; map on a device other than the CPU); other_copies: copies made for the same reason
        elsewhere (the head's), collapsed with the blocks'."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.transport = transport
        self.depth = depth
        self.streamed = list(streamed)
        self.order = list(streamed)  # the cycle the prefetcher follows (set_order: training's forward and back)
        self.stats = StreamStats()
        self._resident: dict[int, dict[str, torch.Tensor]] = {}
        copy_views, copies_made = copies(resident_weights, transport), list(other_copies)
        for i in resident:
            w = transport.resident(i)
            own = copy_views and transport.resident_is_view(i)
            # Stacked q/k/v and gate/up (packed/fuse.py): fewer, larger matmuls per step. Resident blocks only,
            # and not where they stay views of the mapping (stacking would copy them; the kernels take the
            # parts as they are): a streamed block is a view of its source, and stacking would copy it every step.
            # Q4_0's implied mins dropped (drop_symmetric_mins): 10% fewer bytes per decode step.
            if fuse and (own or not transport.resident_is_view(i)):
                w = fuse_projections(w)
            if fuse:
                w = drop_symmetric_mins(w)
            if own:
                w, allocation = owned(w)
                copies_made.append(allocation)
                transport.release_resident(i)
            self._resident[i] = w
            if on_progress:
                on_progress(i)
        # Blocks acquired and not yet released, and time.monotonic() of the last release: the collapse works only
        # once none has been held for a while. A held block counts as in use however long its compute
        # takes (a prefill chunk of a large model can spend seconds in one block).
        self._held = 0
        self._last_use = time.monotonic()
        # The copies collapsed into huge pages in idle time (resident_copy.py): None where none was made. The head's
        # too: read every step like a resident block, and left to khugepaged it stayed in 4 KiB pages for minutes.
        self.huge_pages = HugePageCollapse(copies_made, self._in_use_at) if copies_made else None
        self.resident_copies = len(copies_made)
        self._in_use: dict[int, Ticket] = {}
        self._thread: threading.Thread | None = None
        if self.streamed:
            self._start()

    def resident_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """The resident blocks' weights, to share (read only) with a draft that runs the same blocks."""
        return dict(self._resident)

    # -- prefetch thread ---------------------------------------------------------------------
    def _start(self) -> None:
        self._stop = threading.Event()
        self._slots = threading.Semaphore(self.depth + 1)
        self._ready: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._prefetch_loop, name="layerstream-prefetch", daemon=True)
        self._thread.start()
        close_at_exit(self)

    def _prefetch_loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._slots.acquire()
            if self._stop.is_set():
                return
            block = self.order[i % len(self.order)]
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
    def _in_use_at(self) -> float:
        """When the weights were last in use: now while a block is held (read by the collapse thread)."""
        return time.monotonic() if self._held else self._last_use

    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        self._held += 1  # in use from now on: _in_use_at() needs no time stamp while a block is held
        w = self._resident.get(block)
        if w is not None:
            return w
        t0 = time.perf_counter()
        ticket = self._ready.get()
        stall = time.perf_counter() - t0
        if isinstance(ticket, _Failure):
            self.stats = replace(self.stats, stall_seconds=self.stats.stall_seconds + stall)
            raise RuntimeError(f"streaming block {ticket.block} failed: {ticket.error}") from ticket.error
        if ticket.block != block:
            # Blocks are visited in a fixed cyclic order; anything else is a runner bug.
            raise RuntimeError(f"streamer out of order: asked for block {block}, next is {ticket.block}")
        self._in_use[block] = ticket
        # A new immutable record each time: a reader on another thread sees one step or the next,
        # never a half-updated mix.
        self.stats = self.stats.add(ticket, stall)
        return self.transport.activate(ticket)

    def release(self, block: int) -> None:
        self._last_use = time.monotonic()  # stamped before the count drops: the collapse never sees 0 with an old stamp
        self._held = max(0, self._held - 1)
        ticket = self._in_use.pop(block, None)
        if ticket is None:
            return
        self.transport.retire(ticket)
        self._slots.release()

    def set_order(self, blocks: list[int]) -> None:
        """From now on visit the streamed blocks among `blocks` in that cyclic order (a block may recur:
        training visits 0..n-1 then n-1..0); restarts the prefetcher, dropping what it had prepared."""
        streamed = set(self.streamed)
        order = [b for b in blocks if b in streamed]
        if set(order) != streamed:
            raise ValueError(f"a visit order must visit every streamed block; missing {streamed - set(order)}")
        self.order = order
        self.reset()

    def reset(self) -> None:
        """Drop everything in flight and restart the cycle at the first streamed block: used after
        a step failed half-way, when the prefetcher's position no longer matches the runner's."""
        self._held = 0  # a failed step releases nothing it held
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
        closed(self)
        if self.huge_pages is not None:
            self.huge_pages.close()
            self.huge_pages = None
        if self._thread is not None:
            self._shutdown_thread()
            self._thread = None
        self.transport.close()
