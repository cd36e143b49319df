"""A transport that behaves like a slow copy engine, to prove copy/compute overlap without a GPU.

It wraps a real transport (so the weights, and therefore the outputs, are exactly the inner
transport's) and stretches time on both sides of the pipeline:
  prepare()  runs on the prefetch thread and takes at least `seconds_per_byte * nbytes`
             (+ `seconds_per_block`), like a DMA engine moving the block;
  retire()   holds the compute thread `compute_seconds_per_block`, as if the kernels reading the
             block ran that long (retire comes after the block's math, so the slot it frees stays
             taken meanwhile, exactly as a GPU buffer stays busy until its kernels finish).
Both are sleeps, which release the GIL: a correct streamer overlaps them, so a step with N
streamed blocks takes about N * max(copy, compute) + a small constant, not N * (copy + compute).

`EngineArgs(transport="simulated")` (e.g. `LLM(..., transport="simulated")`) reads its rates from
LAYERSTREAM_SIM_GBPS (copy bandwidth, default 2 GB/s) and LAYERSTREAM_SIM_COMPUTE_MS (per block,
default 0).
"""

from __future__ import annotations

import os
import time

from .base import Ticket, Transport


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {raw!r}")
    return value


def env_seconds_per_byte() -> float:
    """The simulated link's rate from LAYERSTREAM_SIM_GBPS (default 2 GB/s; 0 = no delay)."""
    gbps = _env_float("LAYERSTREAM_SIM_GBPS", 2.0)
    return 0.0 if gbps == 0 else 1.0 / (gbps * 1e9)


class SimulatedTransport(Transport):
    def __init__(self, inner: Transport, seconds_per_byte: float | None = None, seconds_per_block: float = 0.0,
                 compute_seconds_per_block: float | None = None):
        if seconds_per_byte is None:
            seconds_per_byte = env_seconds_per_byte()
        if compute_seconds_per_block is None:
            compute_seconds_per_block = _env_float("LAYERSTREAM_SIM_COMPUTE_MS", 0.0) / 1000
        for name, value in (("seconds_per_byte", seconds_per_byte), ("seconds_per_block", seconds_per_block),
                            ("compute_seconds_per_block", compute_seconds_per_block)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.inner = inner
        self.device = inner.device
        self.dtype = inner.dtype
        self.pool = inner.pool
        self.seconds_per_byte = seconds_per_byte
        self.seconds_per_block = seconds_per_block
        self.compute_seconds_per_block = compute_seconds_per_block

    def link_gbps(self) -> float | None:
        """The simulated link's speed, so that "% of floor" works the same on CPU as on a GPU."""
        return 1 / (self.seconds_per_byte * 1e9) if self.seconds_per_byte else None

    def copy_seconds(self, nbytes: int) -> float:
        """How long prepare() of a block of nbytes takes at least."""
        return nbytes * self.seconds_per_byte + self.seconds_per_block

    def resident(self, block: int):
        return self.inner.resident(block)

    def prepare(self, block: int) -> Ticket:
        t0 = time.perf_counter()
        ticket = self.inner.prepare(block)
        # Sleep out the rest, so the inner transport's own work counts towards the simulated copy
        # instead of adding to it.
        sleep_until(t0 + self.copy_seconds(ticket.nbytes))
        return ticket

    def activate(self, ticket: Ticket):
        return self.inner.activate(ticket)

    def retire(self, ticket: Ticket) -> None:
        if self.compute_seconds_per_block:
            sleep_until(time.perf_counter() + self.compute_seconds_per_block)
        self.inner.retire(ticket)

    def close(self) -> None:
        self.inner.close()


def sleep_until(deadline: float) -> None:
    # time.sleep may wake early on some platforms; loop so the simulated time is a lower bound.
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
