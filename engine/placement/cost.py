"""The cost model: for an off-device tensor group and a step, is it cheaper to compute the group on the CPU
where its weights lie, or to stream its weights to the device and compute there?

Pure arithmetic over measured speeds (no torch, no measuring): the numbers come from a MeasuredSpeeds
record, taken at start-up and refreshed from live telemetry by whoever measures.

The derivation, for one weight of W bytes and P parameters that r rows (tokens) go through:

    CPU:     max(W / cpu_gbps, 2 P r / cpu_flops) + 2 r a / link_gbps
             (reads its weights once, until r is large enough to be compute-bound; each row's hidden
             state, a bytes, crosses the link to the host and its result back)
    stream:  max(W / link_gbps, W / device_gbps, 2 P r / device_flops)
             (the weights cross the link once whatever r is; the prefetcher overlaps the copy with compute,
             so the slower of the two bounds the step)

The CPU side grows with r once compute-bound while streaming stays flat at W / link_gbps, so there is a
row count r* from which streaming is cheaper: the threshold. Below it (decode at small batch) the CPU
computes; from it on (a prefill chunk, a large batch, a speculative verify) the group streams. Ties go to
the CPU: it moves nothing across the link.

Experts: a step of n tokens sends each of E routed experts n k / E rows on average (k: experts per token),
and streaming the group moves every expert, so the model above applies per expert, in rows per expert:
the threshold in tokens is the per-expert one scaled by E / k (the scaling ik_llama.cpp applies to its
batch threshold for MoE products).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .groups import TensorGroup

GB = 1e9
PATHS = ("cpu", "stream")


@dataclass(frozen=True)
class MeasuredSpeeds:
    """Measured throughputs the cost model needs: link_gbps (host <-> device, GB/s), cpu_gbps (the CPU
    kernel at one row: GB/s of weights read), cpu_flops (the CPU kernel at many rows: FLOP/s),
    device_flops (the device's products at many rows: FLOP/s), device_gbps (the device reading its own
    memory, GB/s; None: not a limit)."""

    link_gbps: float
    cpu_gbps: float
    cpu_flops: float
    device_flops: float
    device_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("link_gbps", "cpu_gbps", "cpu_flops", "device_flops", "device_gbps"):
            value = getattr(self, name)
            if value is None and name == "device_gbps":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"measured speed {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class StepShape:
    """What a step asks of a group: its tokens (rows), and for experts, if the router has counted them, the
    most rows any one expert gets (None: the average, tokens x active / total)."""

    tokens: int
    tokens_per_expert: float | None = None

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a step's tokens must be >= 0, got {self.tokens}")
        if self.tokens_per_expert is not None and self.tokens_per_expert < 0:
            raise ValueError(f"tokens_per_expert must be >= 0, got {self.tokens_per_expert}")

    def rows(self, group: TensorGroup) -> float:
        """Rows each weight of the group sees this step."""
        if group.kind != "experts":
            return float(self.tokens)
        if self.tokens_per_expert is not None:
            return float(self.tokens_per_expert)
        return self.tokens * group.experts_active / group.experts_total


def _unit(group: TensorGroup) -> tuple[float, float]:
    """(bytes, parameters) of the unit the model prices: the whole group, or one of its experts."""
    n = group.experts_total if group.kind == "experts" else 1
    return group.nbytes / n, group.params / n


def cpu_seconds(group: TensorGroup, rows: float, speeds: MeasuredSpeeds) -> float:
    """One unit of the group (the group, or one expert) computed on the CPU for `rows` rows."""
    nbytes, params = _unit(group)
    compute = max(nbytes / (speeds.cpu_gbps * GB), 2 * params * rows / speeds.cpu_flops)
    return compute + 2 * rows * group.activation_bytes / (speeds.link_gbps * GB)


def stream_seconds(group: TensorGroup, rows: float, speeds: MeasuredSpeeds) -> float:
    """One unit of the group streamed to the device and computed there for `rows` rows."""
    nbytes, params = _unit(group)
    copy = nbytes / (speeds.link_gbps * GB)
    read = nbytes / (speeds.device_gbps * GB) if speeds.device_gbps else 0.0
    return max(copy, read, 2 * params * rows / speeds.device_flops)


def row_threshold(group: TensorGroup, speeds: MeasuredSpeeds) -> int | None:
    """The fewest rows (per weight: per expert for experts) from which streaming is cheaper than the CPU;
    None: the CPU stays cheaper however many rows (a link slower than the CPU's own compute)."""
    def gain(r: float) -> float:  # > 0: streaming is cheaper
        return cpu_seconds(group, r, speeds) - stream_seconds(group, r, speeds)

    nbytes, params = _unit(group)
    if params <= 0:
        return None
    # Both sides are piecewise linear in r, with knees where each turns compute-bound; between knees the
    # gain is linear, so the first crossing is found exactly segment by segment.
    stream_fixed = max(nbytes / speeds.link_gbps, nbytes / speeds.device_gbps if speeds.device_gbps else 0.0) / GB
    knees = {nbytes * speeds.cpu_flops / (speeds.cpu_gbps * GB * 2 * params),
             stream_fixed * speeds.device_flops / (2 * params)}
    points = sorted({1.0} | {k for k in knees if k > 1.0}) + [math.inf]
    crossing = None
    for lo, hi in zip(points, points[1:]):
        g_lo = gain(lo)
        if g_lo > 0:
            crossing = lo
            break
        if hi == math.inf:  # past the last knee the gain is one line: it crosses only if it rises
            slope = gain(lo + 1) - g_lo
            crossing = lo - g_lo / slope if slope > 0 else None
            break
        g_hi = gain(hi)
        if g_hi > 0:
            crossing = lo - g_lo * (hi - lo) / (g_hi - g_lo)
            break
    if crossing is None:
        return None
    r = max(1, math.ceil(crossing))
    # Float rounding at the crossing: settle on the first whole row count that streams.
    while gain(r) <= 0:
        r += 1
    while r > 1 and gain(r - 1) > 0:
        r -= 1
    return r


def token_threshold(group: TensorGroup, speeds: MeasuredSpeeds) -> int | None:
    """The fewest tokens in a step from which the group streams: row_threshold, for experts scaled by
    total / active experts (a step's tokens spread over them); None: never."""
    rows = row_threshold(group, speeds)
    if rows is None or group.kind != "experts":
        return rows
    return math.ceil(rows * group.experts_total / group.experts_active)


def refreshed(speeds: MeasuredSpeeds, group: TensorGroup, rows: float, seconds: float,
              weight: float = 0.25) -> MeasuredSpeeds:
    """`speeds` after one CPU computation of `group` over `rows` rows (per expert for experts) was seen to
    take `seconds` (its compute only, not the activations' link time): the roofline term that bounds it at
    these speeds (weights read below the knee, FLOP/s above it) moves `weight` of the way to what was seen,
    so one noisy step nudges the threshold rather than sets it."""
    if not 0 < weight <= 1:
        raise ValueError(f"weight must be in (0, 1], got {weight}")
    nbytes, params = _unit(group)
    if seconds <= 0 or rows <= 0 or params <= 0:
        return speeds
    if nbytes / (speeds.cpu_gbps * GB) >= 2 * params * rows / speeds.cpu_flops:
        seen = nbytes / seconds / GB
        return replace(speeds, cpu_gbps=(1 - weight) * speeds.cpu_gbps + weight * seen)
    seen = 2 * params * rows / seconds
    return replace(speeds, cpu_flops=(1 - weight) * speeds.cpu_flops + weight * seen)
