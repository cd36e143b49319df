"""Placement below the block: which tensor groups of a block live on the device, and, each step, where an
off-device group computes (on the CPU where its weights lie, or streamed to the device).

Public interface (the rest of the engine imports nothing else from engine/placement; no torch here, so its
tests run in milliseconds):

  block_groups(layer, shapes, itemsize, hidden, experts_active=0) -> tuple[TensorGroup, ...]
      A block's tensors (ModelConfig.block_shapes(layer)) in groups: norms, attention, router, mlp, experts
      (group_kind(short name) says which). A TensorGroup carries its bytes, parameters, one row's
      activation bytes and, for experts, total and active (top_k) experts.
  place_groups(groups, room, prefetch_depth, stream_buffers) -> GroupPlacement | None
      The planner's per-group placement for a device budget smaller than the model: attention, norms and
      router of every layer stay on the device; MLPs and experts go off it, the largest first, until the
      rest (and, when the policy may stream, prefetch_depth + 1 buffers of the largest) fits `room`.
      GroupPlacement (frozen) says which (layer, kind) are off the device and the device bytes it takes.
  stream_buffer_bytes(groups, prefetch_depth) -> int
      The stream buffers that placement reserves when the policy may stream (shared by streamed MLPs and
      the device's expert cache).
  MeasuredSpeeds(link_gbps, cpu_gbps, cpu_flops, device_flops, device_gbps=None); StepShape(tokens,
  tokens_per_expert=None)
      The cost model's inputs: measured throughputs (their own record, never in the plan) and what a step
      asks of a group. Both frozen, validated at construction (ValueError names the value).
  cpu_seconds / stream_seconds(group, rows, speeds); row_threshold / token_threshold(group, speeds)
      The cost model (cost.py's docstring derives it): from how many rows, and tokens, streaming a group
      beats computing it on the CPU. Experts: the per-expert threshold scaled by total / active experts.
  refreshed(speeds, group, rows, seconds) -> MeasuredSpeeds
      Live telemetry folded in: one observed CPU computation nudges the CPU term that bounded it.
  PathPolicy(policy="auto", speeds=None).path(group, step) -> "cpu" | "stream"; .threshold(group);
  .with_speeds(speeds)
      The per-step decision: --cpu-offload-policy (POLICIES: auto | stream | cpu; check_policy is its one
      validation) over the cost model's threshold. Frozen: refreshed measurements make a new one.
  PathStats
      Counters by path (steps, tokens, groups, bytes across the link) for telemetry and /metrics.

What it owns: the decisions, as pure functions of byte counts, shapes and measured speeds. What it does
not: measuring (the weights package measures links; start-up and telemetry feed MeasuredSpeeds), moving
weights (engine.weights), the math (engine.model computes a group wherever its weights are handed to it).
"""

from .cost import (PATHS, MeasuredSpeeds, StepShape, cpu_seconds, refreshed, row_threshold, stream_seconds,
                   token_threshold)
from .groups import (GROUP_KINDS, OFF_DEVICE_KINDS, GroupPlacement, TensorGroup, block_groups, group_kind,
                     place_groups, stream_buffer_bytes)
from .policy import POLICIES, PathPolicy, PathStats, check_policy

__all__ = [
    "GROUP_KINDS", "GroupPlacement", "MeasuredSpeeds", "OFF_DEVICE_KINDS", "PATHS", "POLICIES", "PathPolicy",
    "PathStats", "StepShape", "TensorGroup", "block_groups", "check_policy", "cpu_seconds", "group_kind",
    "place_groups", "refreshed", "row_threshold", "stream_buffer_bytes", "stream_seconds", "token_threshold",
]
