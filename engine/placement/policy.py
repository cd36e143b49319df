"""The per-step path of an off-device tensor group: the --cpu-offload-policy flag and the cost model's
threshold, as one frozen record the runner asks each step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cost import MeasuredSpeeds, StepShape, row_threshold
from .groups import TensorGroup

# auto: the cost model picks per step and group; stream: off-device groups always stream to the device;
# cpu: always computed on the CPU (only activations cross the link).
POLICIES = ("auto", "stream", "cpu")


def check_policy(name: str) -> str:
    """The one validation of --cpu-offload-policy (EngineArgs.cpu_offload_policy)."""
    if name not in POLICIES:
        raise ValueError(f"cpu_offload_policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return name


@dataclass(frozen=True)
class PathPolicy:
    """Where each off-device group computes in a step. Frozen: new measurements make a new PathPolicy
    (with_speeds), so a step never sees thresholds change halfway through.

    Without measured speeds, "auto" streams (what the engine did before the CPU could compute a group):
    nothing says the CPU is faster."""

    policy: str = "auto"
    speeds: MeasuredSpeeds | None = None
    _thresholds: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_policy(self.policy)

    def with_speeds(self, speeds: MeasuredSpeeds) -> PathPolicy:
        return PathPolicy(self.policy, speeds)

    def rows_threshold(self, group: TensorGroup) -> int | None:
        """The fewest rows per weight (per expert for experts) from which `group` streams (0: always;
        None: never)."""
        if self.policy == "stream" or (self.policy == "auto" and self.speeds is None):
            return 0
        if self.policy == "cpu":
            return None
        key = (group.kind, group.nbytes, group.params, group.activation_bytes, group.experts_total,
               group.experts_active)
        if key not in self._thresholds:  # every layer's MLP is priced alike: once per shape
            self._thresholds[key] = row_threshold(group, self.speeds)
        return self._thresholds[key]

    def threshold(self, group: TensorGroup) -> int | None:
        """The fewest tokens in a step from which `group` streams (0: always; None: never): for experts,
        the per-expert threshold scaled by total / active experts."""
        rows = self.rows_threshold(group)
        if not rows or group.kind != "experts":
            return rows
        return math.ceil(rows * group.experts_total / group.experts_active)

    def path(self, group: TensorGroup, step: StepShape) -> str:
        """"cpu" or "stream" for `group` in `step`: its rows this step (tokens; for experts tokens per expert,
        counted by the router or averaged) against the threshold."""
        rows = self.rows_threshold(group)
        if rows is None:
            return "cpu"
        if group.kind == "experts" and step.tokens_per_expert is None:
            # tokens x active / total >= rows, in whole numbers: the average is a fraction
            return "stream" if step.tokens * group.experts_active >= rows * group.experts_total else "cpu"
        return "stream" if step.rows(group) >= rows else "cpu"


@dataclass(frozen=True)
class PathStats:
    """Off-device groups computed since load, by path: steps that took the path for at least one group and
    their tokens, groups computed, and bytes across the link (cpu: the activations, both ways; stream: the
    weights). Immutable: the runner swaps in a new one per step, telemetry reads it from any thread."""

    steps_cpu: int = 0
    steps_stream: int = 0
    tokens_cpu: int = 0
    tokens_stream: int = 0
    groups_cpu: int = 0
    groups_stream: int = 0
    bytes_cpu: int = 0
    bytes_stream: int = 0

    def plus_step(self, tokens: int, groups: dict[str, int], nbytes: dict[str, int]) -> PathStats:
        """These counters after one step of `tokens` tokens that computed groups[path] groups moving
        nbytes[path] bytes (paths not taken: absent or 0)."""
        cpu, stream = groups.get("cpu", 0), groups.get("stream", 0)
        return PathStats(self.steps_cpu + (cpu > 0), self.steps_stream + (stream > 0),
                         self.tokens_cpu + tokens * (cpu > 0), self.tokens_stream + tokens * (stream > 0),
                         self.groups_cpu + cpu, self.groups_stream + stream,
                         self.bytes_cpu + nbytes.get("cpu", 0), self.bytes_stream + nbytes.get("stream", 0))
