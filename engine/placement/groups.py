"""A block's tensors in groups the placement decides on as units, and where each group lives.

Pure arithmetic over byte counts (no torch), like the planner that calls it.

Attention projections, norms and the MoE router are small, read by every token and, for attention, tied
to the KV cache on the device: they stay on the device in every layer. The MLP (a dense block's, or a MoE
block's shared expert) and the routed experts are most of a block's bytes and need nothing but the
hidden state: they are what goes off the device first, the largest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The kinds of group, in the order a block uses them.
GROUP_KINDS = ("norms", "attention", "router", "mlp", "experts")
# Kinds that may live off the device: they need the hidden state only (no KV cache), so computing them where
# their weights lie moves a few activations instead of their weights.
OFF_DEVICE_KINDS = ("mlp", "experts")
_MLP_NAMES = ("w_gate", "w_up", "w_down", "w_gate_up")


def group_kind(short: str) -> str:
    """The group of a block tensor's short name (engine.arch's names: "wq", "mlp_norm", "experts.3.w_up")."""
    if short.startswith("experts."):
        return "experts"
    if short in ("router", "router_bias"):
        return "router"
    if short.endswith("norm"):  # attn_norm, mlp_norm, post_*_norm, q_norm/k_norm, MLA's q_a_norm/kv_a_norm
        return "norms"
    if short in _MLP_NAMES or short.startswith("shared.") or short == "shared_gate":
        # A MoE block's shared expert: every token reads it, like a dense MLP.
        return "mlp"
    return "attention"  # projections, their biases, attention sinks, latent attention's tensors


@dataclass(frozen=True)
class TensorGroup:
    """One group of one block: its bytes (in the form both the CPU reads and the link moves: a packed
    checkpoint's packed bytes) and its parameters (a weight read once per row multiplies and adds: 2 FLOPs per
    parameter per row)."""

    layer: int
    kind: str
    nbytes: int
    params: int
    activation_bytes: int = 0  # one row's hidden state, which crosses the link each way when the CPU computes it
    experts_total: int = 0  # "experts": how many the group holds ...
    experts_active: int = 0  # ... and how many each token uses (top_k)
    # What it takes on the device while it stays there, where that form is not the one that moves (a GGUF
    # file's in exact fp32 mode: dequantized when resident, packed bytes when streamed); None: nbytes.
    resident_nbytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"tensor group kind must be one of {', '.join(GROUP_KINDS)}, got {self.kind!r}")
        if self.kind == "experts" and not 0 < self.experts_active <= self.experts_total:
            raise ValueError(f"an experts group needs 0 < experts_active <= experts_total, got "
                             f"{self.experts_active} of {self.experts_total}")

    @property
    def off_device_capable(self) -> bool:
        return self.kind in OFF_DEVICE_KINDS

    @property
    def device_bytes(self) -> int:
        """Its bytes on the device while it stays there."""
        return self.nbytes if self.resident_nbytes is None else self.resident_nbytes


def block_groups(layer: int, shapes: dict[str, tuple[int, ...]], itemsize: int, hidden: int,
                 experts_active: int = 0, nbytes: dict[str, tuple[int, int]] | None = None
                 ) -> tuple[TensorGroup, ...]:
    """Block `layer`'s tensors (ModelConfig.block_shapes(layer)) in groups, GROUP_KINDS' order, each in a
    compute dtype of `itemsize` bytes; `experts_active`: the MoE's top_k (sparse layers). nbytes: by kind,
    (bytes read and moved, bytes resident on the device) where the weights are not in the compute dtype (a
    packed checkpoint: ModelCheckpoint.group_bytes)."""
    params: dict[str, int] = {}
    experts: set[str] = set()
    for short, shape in shapes.items():
        kind = group_kind(short)
        params[kind] = params.get(kind, 0) + math.prod(shape)
        if kind == "experts":
            experts.add(short.split(".")[1])
    out = []
    for kind in GROUP_KINDS:
        if kind not in params:
            continue
        n = len(experts) if kind == "experts" else 0
        moved, resident = (nbytes or {}).get(kind, (params[kind] * itemsize,) * 2)
        out.append(TensorGroup(layer, kind, moved, params[kind], hidden * itemsize, experts_total=n,
                               experts_active=experts_active if n else 0,
                               resident_nbytes=None if resident == moved else resident))
    return tuple(out)


@dataclass(frozen=True)
class GroupPlacement:
    """Which tensor groups live off the device (in host memory, computed on the CPU or streamed each step:
    engine.placement.PathPolicy decides per step), and the device bytes the rest take."""

    groups: tuple[TensorGroup, ...]
    off_device: frozenset[tuple[int, str]]  # (layer, kind)
    stream_buffer_bytes: int  # device buffers off-device groups stream through (0: the policy never streams)

    def is_off_device(self, layer: int, kind: str) -> bool:
        return (layer, kind) in self.off_device

    @property
    def off_device_groups(self) -> tuple[TensorGroup, ...]:
        return tuple(g for g in self.groups if (g.layer, g.kind) in self.off_device)

    @property
    def off_device_bytes(self) -> int:
        return sum(g.nbytes for g in self.off_device_groups)

    @property
    def resident_group_bytes(self) -> int:
        return sum(g.device_bytes for g in self.groups if (g.layer, g.kind) not in self.off_device)

    @property
    def device_bytes(self) -> int:
        return self.resident_group_bytes + self.stream_buffer_bytes

    @property
    def layers_off_device(self) -> list[int]:
        """Layers with at least one group off the device."""
        return sorted({layer for layer, _ in self.off_device})


def _spread(count: int, total: int) -> list[int]:
    """`count` indices spread evenly over range(total) (the planner's rule for resident blocks: groups kept
    between off-device ones give streaming compute time to hide behind)."""
    if count <= 0:
        return []
    if count >= total:
        return list(range(total))
    return sorted({int(i * total / count) for i in range(count)})


def stream_buffer_bytes(groups: tuple[TensorGroup, ...], prefetch_depth: int) -> int:
    """The device bytes per-group placement reserves to stream the groups that may leave the device:
    prefetch_depth + 1 buffers of the largest, or, where experts may leave too, of the largest MLP and the
    largest expert if that is more (streamed MLPs and the device's expert cache share the buffers, and the
    cache needs its slots whatever group sized them)."""
    movable = [g for g in groups if g.off_device_capable]
    if not movable:
        return 0
    largest = max(g.nbytes for g in movable)
    expert = max((g.nbytes // g.experts_total for g in movable if g.kind == "experts"), default=0)
    mlp = max((g.nbytes for g in movable if g.kind == "mlp"), default=0)
    return (prefetch_depth + 1) * max(largest, mlp + expert)


def place_groups(groups: tuple[TensorGroup, ...], room: int, prefetch_depth: int,
                 stream_buffers: bool) -> GroupPlacement | None:
    """Groups placed within `room` device bytes: every group that must stay (attention, norms, router) in
    every layer, then MLPs and experts taken off the device, the largest first, until the rest fits.

    Largest first: a step reads an off-device group over the link or on the CPU whatever its size, so each
    byte taken off in large groups costs the fewest groups per step; equal groups leave the device spread over
    the layers. When the policy may stream (stream_buffers), the stream buffers (stream_buffer_bytes) come out
    of the room too. None: the groups that must stay do not fit.
    """
    must_stay = sum(g.device_bytes for g in groups if not g.off_device_capable)
    movable = [g for g in groups if g.off_device_capable]
    total = must_stay + sum(g.device_bytes for g in movable)
    if total <= room:
        return GroupPlacement(groups, frozenset(), 0)
    if not movable:
        return None
    buffers = stream_buffer_bytes(groups, prefetch_depth) if stream_buffers else 0
    need = total + buffers - room  # bytes to take off the device
    off: set[tuple[int, str]] = set()
    for size in sorted({g.device_bytes for g in movable}, reverse=True):
        same = sorted((g for g in movable if g.device_bytes == size), key=lambda g: (g.layer, g.kind))
        take = min(len(same), -(-need // size)) if size else 0
        keep = set(_spread(len(same) - take, len(same)))
        off.update((g.layer, g.kind) for i, g in enumerate(same) if i not in keep)
        need -= take * size
        if need <= 0:
            return GroupPlacement(groups, frozenset(off), buffers)
    return None
