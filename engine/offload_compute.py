"""Tensor groups off the device, computed where each step's path says (issue #38; engine.placement decides,
engine.weights moves the weights, engine.model does the math): the part of a step the runner hands over for
a block whose MLP, routed experts or shared expert the plan placed off the device.

Per step and group, PathPolicy picks "cpu" (the CPU computes from the host's tensors: only activations cross
the link, there and back, through weights.activations, which orders the copies against the device's work) or
"stream" (the weights cross, the device computes). Each CPU computation is
timed: where the speeds were measured here (at start-up), they are refreshed from those timings after the
step; speeds a caller set are kept (a caller that pins them means them). PathStats counts steps, tokens,
groups and link bytes per path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from . import model as M
from .arch import ModelConfig
from .placement import GroupPlacement, MeasuredSpeeds, PathPolicy, PathStats, StepShape, TensorGroup, refreshed
from .weights import ModelWeights


class OffDeviceCompute:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, dtype: torch.dtype,
                 placement: GroupPlacement | None = None, policy: PathPolicy | None = None):
        self.cfg, self.weights, self.dtype = cfg, weights, dtype
        # By (layer, kind): a dense block's MLP; a MoE block's routed experts and its shared expert ("mlp").
        self.groups: dict[tuple[int, str], TensorGroup] = {} if placement is None else {
            (g.layer, g.kind): g for g in placement.off_device_groups}
        self.policy = policy or PathPolicy()
        self.stats = PathStats()
        self._live = False
        self._paths: dict[str, list[int]] = {}  # this step: path -> [groups, bytes across the link]
        self._cpu_seen: list[tuple[TensorGroup, float, float]] = []  # this step: (group, rows, seconds) on the CPU

    def group(self, layer: int, kind: str) -> TensorGroup | None:
        return self.groups.get((layer, kind))

    def dense_mlp(self, layer: int) -> TensorGroup | None:
        """A dense block's MLP when it lies off the device."""
        return None if self.cfg.is_moe_layer(layer) else self.groups.get((layer, "mlp"))

    def on_cpu(self, group: TensorGroup, shape: StepShape) -> bool:
        """Whether this step computes the group on the CPU (its activations cross the link), as mlp() will."""
        return self.policy.path(group, shape) == "cpu"

    def set_speeds(self, speeds: MeasuredSpeeds, live: bool = False) -> None:
        """Speeds for the policy from the next step on; live: refresh them from what steps observe."""
        self.policy = self.policy.with_speeds(speeds)
        self._live = live

    @torch.inference_mode()
    def measure_speeds(self, link_gbps: float, device: torch.device | None = None, rows: int = 64,
                       repeats: int = 3) -> MeasuredSpeeds:
        """The cost model's inputs, measured on the first off-device group's own host weights (an MLP, or one
        routed expert: the unit the cost model prices): GB/s of weights read at one row and FLOP/s at `rows` rows
        (best of `repeats`). The simulated device (device None or the CPU) computes on this same CPU, so its
        FLOP/s are the CPU's; a real device's are measured on it (measure_device_flops)."""
        (block, kind), group = next(iter(self.groups.items()))
        cfg = self.cfg
        if kind == "experts":
            (w,) = list(self.weights.offloaded_experts(block, [0], "cpu"))

            def compute(x: torch.Tensor) -> torch.Tensor:
                return M.expert_mlp(x, w[0], cfg.moe)

            nbytes, params = group.nbytes / group.experts_total, group.params / group.experts_total
        else:
            w = self.weights.offloaded(block, "cpu")

            def compute(x: torch.Tensor) -> torch.Tensor:
                if cfg.is_moe_layer(block):  # a MoE block's shared expert
                    return M.shared_expert(x, w)
                return M.mlp(x, w, activation=cfg.family.activation)

            nbytes, params = group.nbytes, group.params
        try:
            def best(n: int) -> float:
                x = torch.zeros(n, cfg.hidden_size, dtype=self.dtype)  # (n, hidden)
                compute(x)  # warm-up: first-touch pages, kernel choice
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    compute(x)
                    times.append(time.perf_counter() - t0)
                return max(min(times), 1e-9)

            one, many = best(1), best(rows)
        finally:
            if kind != "experts":
                self.weights.release_offloaded(block)
        flops = 2 * params * rows / many
        on_device = flops if device is None or device.type == "cpu" else measure_device_flops(
            cfg.hidden_size, max(1, int(params) // (3 * cfg.hidden_size)), self.dtype, device, rows, repeats)
        return MeasuredSpeeds(link_gbps=link_gbps, cpu_gbps=nbytes / one / 1e9, cpu_flops=flops,
                              device_flops=on_device)

    def begin_step(self) -> None:
        self._paths, self._cpu_seen = {}, []

    def end_step(self, tokens: int) -> None:
        """The step's counts into the stats; live speeds refreshed from its CPU computations."""
        if self._live and self._cpu_seen:
            speeds = self.policy.speeds
            for group, rows, seconds in self._cpu_seen:
                speeds = refreshed(speeds, group, rows, seconds)
            self.policy = self.policy.with_speeds(speeds)
        if self._paths:
            self.stats = self.stats.plus_step(tokens, {p: n for p, (n, _) in self._paths.items()},
                                              {p: b for p, (_, b) in self._paths.items()})

    def _count(self, path: str, crossed: int) -> None:
        count = self._paths.setdefault(path, [0, 0])
        count[0] += 1
        count[1] += crossed

    def mlp(self, block: int, group: TensorGroup, hn: torch.Tensor, shape: StepShape,
            compute: Callable[[torch.Tensor, dict], torch.Tensor]) -> torch.Tensor:
        """An MLP off the device (a dense block's, or a MoE block's shared expert) applied to hn (tokens, hidden)
        where the policy says: compute(x, weights) on the CPU from host tensors, only its input and output
        crossing the link; or streamed, its weights crossing instead. (tokens, hidden) on hn's device."""
        path = self.policy.path(group, shape)
        mw = self.weights.offloaded(block, path)
        try:
            if path == "cpu":
                link = self.weights.activations
                (x_host,) = link.to_host(hn).wait()  # (tokens, hidden)
                t0 = time.perf_counter()
                m = compute(x_host, mw)  # (tokens, hidden), on the host
                self._cpu_seen.append((group, shape.tokens, time.perf_counter() - t0))
                m = link.to_device(m, hn)
                crossed = 2 * hn.numel() * hn.element_size()
            else:
                m = compute(hn, mw)
                crossed = group.nbytes
        finally:
            self.weights.release_offloaded(block)
        self._count(path, crossed)
        return m

    def experts(self, block: int, group: TensorGroup, hn: torch.Tensor,
                routing: M.Routing) -> Callable[[], torch.Tensor]:
        """A MoE block's routed experts off the device, where the policy says for this step's tokens per expert
        (the router's count: the most rows any chosen expert gets): a call that returns their weighted sum
        (tokens, hidden) on hn's device, summed into zeros in expert order as the resident path sums them.

        On the CPU the normed hidden states and the routing start crossing the link here and the host computes
        in the call, so device work enqueued in between (a resident shared expert) runs while the CPU computes;
        the sum comes back. Streamed, only the chosen experts' weights cross, and those the device expert cache
        holds do not; the device computes here."""
        cfg = self.cfg
        chosen = routing.chosen
        path = self.policy.path(group, StepShape(hn.shape[0], tokens_per_expert=max(routing.counts)))
        if path == "stream":
            out = torch.zeros_like(hn)  # (tokens, hidden)
            before = self.weights.stream_stats.expert_bytes
            for experts in self.weights.offloaded_experts(block, chosen, "stream"):
                M.moe_experts(hn, routing, experts, out, cfg.moe)
            self._count(path, self.weights.stream_stats.expert_bytes - before)  # the misses: hits cross nothing
            return lambda: out
        link = self.weights.activations
        crossing = link.to_host(hn, routing.expert_ids, routing.weights)

        def on_the_cpu() -> torch.Tensor:
            # (tokens, hidden); (tokens, top_k) ids and gates: views of what landed, valid until the next crossing
            x_host, ids, gates = crossing.wait()
            o = torch.zeros_like(x_host)  # (tokens, hidden), the host's sum
            t0 = time.perf_counter()
            for experts in self.weights.offloaded_experts(block, chosen, "cpu"):
                M.moe_experts(x_host, M.Routing(ids, gates, routing.counts), experts, o, cfg.moe)
            if chosen:  # the cost model prices one expert: the mean expert's rows and seconds
                self._cpu_seen.append((group, sum(routing.counts) / len(chosen),
                                       (time.perf_counter() - t0) / len(chosen)))
            # There: the hidden states and the routing; back: the sum.
            self._count(path, sum(t.numel() * t.element_size() for t in (x_host, ids, gates, o)))
            return link.to_device(o, hn)

        return on_the_cpu


@torch.inference_mode()
def measure_device_flops(hidden: int, inner: int, dtype: torch.dtype, device: torch.device, rows: int = 64,
                         repeats: int = 3) -> float:
    """FLOP/s of one (rows, hidden) x (hidden, inner) product on `device` in `dtype`, best of `repeats` after a
    warm-up: the device side of the cost model at many rows (the off-device groups' weights are not on the
    device to time, so a product of their shape stands in)."""
    x = torch.randn(rows, hidden, dtype=dtype, device=device)  # (rows, hidden)
    w = torch.randn(inner, hidden, dtype=dtype, device=device)  # (inner, hidden)

    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    torch.nn.functional.linear(x, w)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * hidden * inner / max(best, 1e-9)
