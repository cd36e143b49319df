"""Timing of the CUDA transport's pipeline, for tests and benchmarks only (CudaTransport.trace = True):
CUDA events around each streamed block's copy and compute, read back as intervals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TraceRecord:
    """CUDA timing events around one streamed block (trace=True only; for tests and benchmarks)."""

    block: int
    buffer: int
    copy_start: object
    copy_end: object
    compute_start: object = None
    compute_end: object = None


def intervals(records: list[TraceRecord]) -> list[tuple[int, tuple[float, float], tuple[float, float]]]:
    """(block, (copy start, end), (compute start, end)) in ms from the first traced copy; the events
    must have completed (synchronize first)."""
    recs = [r for r in records if r.compute_end is not None]
    if not recs:
        return []
    t0 = recs[0].copy_start
    ms = lambda e: t0.elapsed_time(e)  # noqa: E731
    return [(r.block, (ms(r.copy_start), ms(r.copy_end)), (ms(r.compute_start), ms(r.compute_end)))
            for r in recs]
