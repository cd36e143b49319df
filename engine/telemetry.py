"""The engine's telemetry snapshot: one immutable record of what the engine is doing, for /metrics,
benchmarks and tests, so that none of them walks the engine's object graph.

Taken with `LLMEngine.telemetry()` (or `EngineLoop.telemetry()` from any thread): every field is a
value copied at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import KVTelemetry
from .lora_serving import ServedAdapter
from .ops import KernelChoices
from .placement import PathStats
from .planner import MemoryPlan
from .speculative import SpecTelemetry
from .structured_output import MaskStats
from .weights import LinkSpeeds, StreamStats, floor_percent


@dataclass(frozen=True)
class PlanSummary:
    blocks_resident: int
    blocks_streamed: int
    blocks_host_tier: int  # streamed blocks that stay in host memory (page cache, pinned or kept)
    blocks_disk_tier: int  # streamed blocks read from disk each step
    planned_bytes_per_step: int  # streamed blocks x block size (compute dtype)
    planned_disk_bytes_per_step: int
    device_budget: int | None
    device_bytes: int  # what the plan places on the device
    release_pages: bool  # streamed pages are dropped after use (checkpoint larger than host memory)
    text: str  # MemoryPlan.describe()
    # Expert-granular streaming (0 slots: off): the expert cache and what a token fetches at random routing.
    expert_cache_slots: int = 0
    experts_total: int = 0
    expert_bytes_per_token_random: float = 0.0

    @staticmethod
    def of(plan: MemoryPlan, links: LinkSpeeds) -> "PlanSummary":
        streamed, disk = len(plan.streamed_blocks), len(plan.disk_blocks)
        return PlanSummary(len(plan.resident_blocks), streamed, streamed - disk, disk, plan.streamed_bytes_per_step,
                           plan.disk_bytes_per_step, plan.budget, plan.device_bytes, plan.release_pages,
                           plan.describe(links.disk_gbps), plan.expert_slots, plan.num_experts_total,
                           plan.expert_bytes_per_token_random())


@dataclass(frozen=True)
class StepTelemetry:
    """One engine step: its wall time and what streaming did during it."""

    seconds: float
    stream: StreamStats
    gbps: float  # bytes streamed / step seconds, 1e9 bytes/s
    floor_percent: float | None  # time the bytes need at the measured links / step time; None: no link measured

    @staticmethod
    def of(seconds: float, stream: StreamStats, links: LinkSpeeds) -> "StepTelemetry":
        gbps = stream.bytes_streamed / seconds / 1e9 if seconds > 0 else 0.0
        return StepTelemetry(seconds, stream, gbps, floor_percent(stream, seconds, links))


@dataclass(frozen=True)
class EngineTelemetry:
    plan: PlanSummary
    links: LinkSpeeds
    transport_name: str
    dtype: str  # compute dtype, e.g. "bfloat16"
    steps: int
    last_step: StepTelemetry | None
    total: StreamStats  # cumulative since load
    kv: KVTelemetry  # paged KV pool use, prefix-cache hits in tokens, host tier, preemptions
    pinned_host_bytes: int
    buffer_sets: int  # host conversion buffer sets allocated (<= prefetch depth + 1)
    blocks_converted: int
    structured_output: MaskStats  # token-mask work of structured output since start
    pinned_cache: bool = False  # CUDA: every streamed block pinned once in host memory (else staging)
    # CPU: resident blocks, and the head, copied out of their mapping at load (--resident-weights), and of them
    # those collapsed into huge pages so far (a background thread does it after the load)
    resident_copies: int = 0
    resident_copies_in_huge_pages: int = 0
    speculative: SpecTelemetry | None = None  # speculative decoding's counters; None when it is off
    kernels: KernelChoices | None = None  # which kernel each operation runs on (engine.ops), chosen at load
    lora_adapters: tuple[ServedAdapter, ...] = ()  # the LoRA adapters served, in the order they were loaded
    # Tensor groups off the device (engine.placement): steps, tokens, groups and link bytes by path ("cpu":
    # computed where the weights lie, activations crossing; "stream": weights crossing); None: none off it.
    offload: PathStats | None = None
