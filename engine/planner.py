"""Memory planning: what stays resident on the device, what streams, how much KV cache fits, and
which streamed blocks host memory keeps (the rest are read from disk each step).

Pure arithmetic over byte counts, so it is cheap to test and to print before anything is loaded. The
plan is made once and frozen; measured link speeds are not part of it (weights.LinkSpeeds).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .kv_groups import blocks_per_seq
from .placement import GROUP_KINDS, GroupPlacement, TensorGroup, place_groups, stream_buffer_bytes

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(text: str | int | None) -> int | None:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1234 -> 1234; None/'' -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 4GiB, 512MB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class HostTiering:
    """How streamed blocks may be split between host memory and disk (transports that read disk)."""

    fixed_bytes: int  # host memory held besides kept blocks (CPU: staging; GPU: pinned staging + a read buffer)
    holds_device_plan: bool  # CPU compute: host memory also holds everything the device plan holds
    disk_block_bytes: int  # checkpoint bytes of one block (what a disk read moves)
    force_disk: bool = False  # every streamed block is read from disk (transport "disk")


RELEASE_MARGIN = 256 << 20  # host bytes kept free when deciding whether the checkpoint fits in RAM


@dataclass(frozen=True)
class PlanInputs:
    num_layers: int
    block_bytes: int  # one block's weights in the compute dtype
    global_bytes: int  # embeddings + final norm + head in the compute dtype
    kv_bytes_per_token: int  # K and V over all layers for one token of one sequence
    workspace_bytes: int  # activations of the largest step
    budget: int | None  # device bytes; None = unlimited
    max_model_len: int
    max_num_seqs: int
    prefetch_depth: int = 1
    host_budget: int | None = None  # host memory this process may use; None = not limited
    host_tiering: HostTiering | None = None  # None: every streamed block stays reachable in RAM
    checkpoint_bytes: int = 0  # beyond the host budget, streamed pages are released after use
    # Bytes one streamed block moves, when that differs from its resident form (block_bytes):
    # a GGUF block streams its packed GGML bytes and is unpacked by the compute that uses it.
    streamed_block_bytes: int | None = None
    kv_block_size: int = 16  # token positions per paged KV block
    # Layers grouped by sliding window (engine.kv_groups): (K and V bytes per token of the group's layers,
    # window or None) each, the full-attention group first; () = one full-attention group. A windowed
    # group's pool holds each sequence's window and step only (KVLayout.blocks_per_seq).
    kv_groups: tuple[tuple[int, int | None], ...] = ()
    kv_cache_bytes: int | None = None  # the KV pool the user asked for (--kv-cache-memory); None = planned
    kv_host_bytes: int = 0  # host tier for KV blocks evicted from the pool (the loader's choice)
    # (name, KV bytes per token) of each KV cache dtype the model could use (--kv-cache-dtype): the plan
    # reports what each would hold under the same budget (MemoryPlan.kv_fits); () = not reported.
    kv_dtype_options: tuple[tuple[str, int], ...] = ()
    # Compiled structured-output grammars (--grammar-cache-memory) and the grammar probe, the process
    # that compiles each new grammar first (its start and at most a cache's worth of growth): host
    # memory whatever computes, in this process's memory cgroup.
    grammar_cache_bytes: int = 0
    grammar_probe_bytes: int = 0
    # Expert-granular streaming (mixtures of experts; 0 = off): when the model does not fit, blocks
    # stream without their routed experts (dense_block_bytes each) and experts go through a device
    # cache of expert_bytes slots holding at least min_expert_slots.
    expert_bytes: int = 0
    num_experts_total: int = 0
    dense_block_bytes: int = 0
    min_expert_slots: int = 0
    experts_per_token: int = 0  # top_k x sparse blocks: experts one token uses per step
    predictor_bytes: int = 0  # each sparse block's router and norm, kept on the device to guess the next block's experts
    # Latent attention (DeepSeek): the values each layer caches per token (kv_lora_rank + qk_rope_head_dim), in
    # place of K and V; 0: K and V. Only for the plan's description of kv_bytes_per_token.
    kv_latent_width: int = 0
    # Per-tensor-group placement (engine.placement, --cpu-offload-policy): every block's tensor groups
    # (block_groups); when the blocks do not all fit, attention, norms and router stay on the device in every
    # layer and MLPs / experts go off it (computed on the CPU or streamed, per step), instead of whole blocks
    # streaming. () = whole blocks. offload_streams: the policy may stream them (False for "cpu": no buffers).
    tensor_groups: tuple[TensorGroup, ...] = ()
    offload_streams: bool = True

    def streaming_needs(self) -> str:
        """min_streaming_bytes in words, for errors."""
        buffers = f"{self.prefetch_depth + 1} stream buffers of "
        groups = self.min_group_bytes()
        if groups is not None and groups == self.min_streaming_bytes():
            stay = sum(g.device_bytes for g in self.tensor_groups if not g.off_device_capable)
            return (f"the attention, norms and router of every layer ({format_bytes(stay)})"
                    + (f" and {buffers}{format_bytes(groups - stay)} in all (the largest MLP or experts)"
                       if groups > stay else ""))
        if self.expert_bytes and self.min_streaming_bytes() < (self.prefetch_depth + 1) * self.block_bytes:
            return (buffers + f"{format_bytes(self.dense_block_bytes)} (blocks without experts) and an expert "
                    f"cache of {self.min_expert_slots} experts ({format_bytes(self.min_expert_slots * self.expert_bytes)})")
        return buffers + format_bytes(self.block_bytes)

    def min_streaming_bytes(self) -> int:
        """What streaming needs on the device at least: stream buffers (and the smallest expert cache), or
        with tensor groups, what must stay of every layer and the buffers of the largest group off it."""
        whole = min((self.prefetch_depth + 1) * self.block_bytes, self.num_layers * self.block_bytes)
        if self.expert_bytes:
            whole = min(whole, (self.prefetch_depth + 1) * self.dense_block_bytes
                        + self.min_expert_slots * self.expert_bytes + self.predictor_bytes)
        groups = self.min_group_bytes()
        return whole if groups is None else min(whole, groups)

    def min_group_bytes(self) -> int | None:
        """The device bytes of per-group placement with every MLP and expert group off the device (None:
        no tensor groups)."""
        if not self.tensor_groups:
            return None
        stay = sum(g.device_bytes for g in self.tensor_groups if not g.off_device_capable)
        return stay + (stream_buffer_bytes(self.tensor_groups, self.prefetch_depth) if self.offload_streams else 0)
    # Speculative decoding's draft, budgeted with the target: a separate draft model's bytes
    # (weights and KV), and the self-draft's resident copy of each streamed block (of every block
    # when none streams).
    draft_fixed_bytes: int = 0
    draft_block_bytes: int = 0
    draft_name: str = ""  # what the draft is, for describe()
    attn_chunk_bytes: int | None = None  # bound on one attention call's temporaries that workspace assumed
    max_num_batched_tokens: int = 0  # tokens of the largest step, which workspace_bytes was sized for
    runtime_bytes: int = 0  # anonymous memory the process held before loading (interpreter, torch, kernels)

    @property
    def kv_block_bytes(self) -> int:
        return self.kv_block_size * self.kv_bytes_per_token

    @property
    def kv_blocks_per_seq(self) -> int:
        """Blocks one sequence of max_model_len tokens needs: the smallest pool that can serve."""
        return -(-self.max_model_len // self.kv_block_size)

    # The KV pool is counted in units of full-attention blocks: `units` of them hold units / kv_blocks_per_seq
    # sequences of max_model_len, and each group's pool holds as many sequences (kv_group_blocks).
    def _kv_groups(self) -> tuple[tuple[int, int | None], ...]:
        return self.kv_groups or ((self.kv_bytes_per_token, None),)

    def kv_group_blocks(self, units: int) -> tuple[int, ...]:
        """Each group's pool in blocks, for a pool of `units`."""
        one, step = self.kv_blocks_per_seq, self.max_num_batched_tokens or self.max_model_len
        return tuple(-(-units * blocks_per_seq(w, self.max_model_len, self.kv_block_size, step) // one)
                     for _, w in self._kv_groups())

    def kv_pool_bytes(self, units: int) -> int:
        return sum(n * self.kv_block_size * bpt for n, (bpt, _) in zip(self.kv_group_blocks(units), self._kv_groups()))

    def kv_units_within(self, nbytes: int) -> int:
        """The largest pool (in units) whose bytes are at most nbytes."""
        if nbytes <= 0:
            return 0
        one = self.kv_blocks_per_seq
        per_seq = self.kv_pool_bytes(one)  # bytes of one max_model_len sequence over every group
        units = nbytes * one // per_seq
        while units > 0 and self.kv_pool_bytes(units) > nbytes:
            units -= 1
        return units

    def min_budget(self) -> int:
        """The smallest device budget that serves one max_model_len sequence, all blocks streamed."""
        return (self.global_bytes + self.workspace_bytes + self.kv_pool_bytes(self.kv_blocks_per_seq)
                + self.min_streaming_bytes() + self.draft_bytes(0))

    def draft_bytes(self, streamed: int) -> int:
        """The speculative draft's bytes when `streamed` blocks stream (the self-draft copies those,
        or every block when none streams: the most it can take)."""
        return self.draft_fixed_bytes + (streamed or self.num_layers) * self.draft_block_bytes


@dataclass(frozen=True)
class KVFit:
    """What the KV pool holds under a plan's budget with one KV cache dtype."""

    dtype: str
    bytes_per_token: int
    pool_tokens: int  # the pool the plan makes with this dtype (its target: max_num_seqs x max_model_len or --kv-cache-memory)
    # The longest one sequence can be: every block streamed, all the room the budget leaves for KV (None: no budget).
    max_context: int | None


@dataclass(frozen=True)
class MemoryPlan:
    budget: int | None
    num_layers: int
    resident_blocks: list[int]
    streamed_blocks: list[int]
    block_bytes: int
    global_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    stream_buffer_bytes: int
    max_model_len: int
    max_num_seqs: int
    prefetch_depth: int
    notes: tuple[str, ...] = ()
    # Host tiering of the streamed blocks: kept in RAM, or read from disk each step.
    host_budget: int | None = None
    host_blocks: list[int] = field(default_factory=list)
    disk_blocks: list[int] = field(default_factory=list)
    disk_block_bytes: int = 0  # checkpoint bytes of one block (what a disk read moves)
    release_pages: bool = False  # checkpoint larger than host memory: drop streamed pages after use
    streamed_block_bytes: int | None = None  # see PlanInputs; None = block_bytes
    # The paged KV pool (kv_cache_bytes = num_kv_blocks x kv_block_size x bytes per token).
    kv_block_size: int = 16
    num_kv_blocks: int = 0
    # Host tier of the KV cache (prefix-cache blocks evicted from the pool).
    num_host_kv_blocks: int = 0
    kv_host_bytes: int = 0
    # KV groups (PlanInputs.kv_groups; () = one full-attention group) and each one's pool and host tier in
    # blocks; num_kv_blocks and num_host_kv_blocks are group 0's.
    kv_groups: tuple[tuple[int, int | None], ...] = ()
    kv_group_blocks: tuple[int, ...] = ()
    kv_group_host_blocks: tuple[int, ...] = ()
    grammar_cache_bytes: int = 0  # see PlanInputs
    grammar_probe_bytes: int = 0
    # Expert-granular streaming (see PlanInputs); expert_slots == 0: off, experts travel inside their blocks.
    expert_slots: int = 0
    expert_bytes: int = 0
    num_experts_total: int = 0
    experts_per_token: int = 0
    predictor_bytes: int = 0

    @property
    def expert_streaming(self) -> bool:
        return self.expert_slots > 0

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * self.expert_bytes

    def expert_bytes_per_token_random(self) -> float:
        """Expected expert bytes one decoded token fetches when routing is uniformly random (the worst
        case for a cache: a hit rate of slots / experts, whatever the eviction policy)."""
        hit = min(1.0, self.expert_slots / self.num_experts_total) if self.num_experts_total else 1.0
        return self.experts_per_token * self.expert_bytes * (1.0 - hit)
    draft_bytes: int = 0  # speculative decoding's draft (see PlanInputs)
    draft_name: str = ""
    attn_chunk_bytes: int | None = None  # see PlanInputs: the runner's attention calls keep to it
    max_num_batched_tokens: int = 0  # see PlanInputs: the scheduler forms no larger step
    runtime_bytes: int = 0  # see PlanInputs: outside the budget, printed beside it
    kv_fits: tuple[KVFit, ...] = ()  # see PlanInputs.kv_dtype_options
    kv_latent_width: int = 0  # see PlanInputs
    # Per-tensor-group placement (PlanInputs.tensor_groups), None: whole blocks. With it, resident_blocks are
    # the layers wholly on the device and streamed_blocks those with a group off it (only that group moves).
    group_placement: GroupPlacement | None = None

    @property
    def stream_block_bytes(self) -> int:
        return self.block_bytes if self.streamed_block_bytes is None else self.streamed_block_bytes

    @property
    def streamed_bytes_per_step(self) -> int:
        """The most weight bytes one step streams (with groups off the device: every one of them streamed)."""
        if self.group_placement is not None:
            return self.group_placement.off_device_bytes
        return len(self.streamed_blocks) * self.stream_block_bytes

    @property
    def device_bytes(self) -> int:
        if self.group_placement is not None:  # resident groups and their stream buffers, in place of blocks
            return (self.global_bytes + self.kv_cache_bytes + self.workspace_bytes + self.group_placement.device_bytes
                    + self.draft_bytes)
        return (
            self.global_bytes + self.kv_cache_bytes + self.workspace_bytes + self.stream_buffer_bytes
            + len(self.resident_blocks) * self.block_bytes + self.expert_cache_bytes + self.predictor_bytes
            + self.draft_bytes
        )

    def _describe_kv_pool(self) -> str:
        if len(self.kv_groups) <= 1 and not any(w for _, w in self.kv_groups):
            return (f"  KV pool: {format_bytes(self.kv_cache_bytes)} = {self.num_kv_blocks} blocks x "
                    f"{self.kv_block_size} tokens ({self.num_kv_blocks * self.kv_block_size} tokens shared by up to "
                    f"{self.max_num_seqs} seqs; max_model_len {self.max_model_len} per request)")
        pools = ", ".join(f"{n} blocks for the {'full-attention' if w is None else f'window-{w}'} layers"
                          for n, (_, w) in zip(self.kv_group_blocks, self.kv_groups))
        return (f"  KV pool: {format_bytes(self.kv_cache_bytes)} = {pools} (blocks of {self.kv_block_size} tokens, "
                f"shared by up to {self.max_num_seqs} seqs; max_model_len {self.max_model_len} per request)")

    def _describe_groups(self) -> str:
        """Per-tensor-group placement in two lines: what stays on the device, what does not and its bytes."""
        g = self.group_placement
        on = sorted({x.kind for x in g.groups if not x.off_device_capable}, key=GROUP_KINDS.index)
        off = g.off_device_groups
        kinds = sorted({x.kind for x in off}, key=GROUP_KINDS.index)
        counts = ", ".join(f"{sum(x.kind == k for x in off)} {k}" for k in kinds)
        line = (f"  tensor groups: {', '.join(on)} of all {self.num_layers} layers on the device; off it "
                f"(computed on the CPU or streamed each step, --cpu-offload-policy): {counts or 'none'} "
                f"({format_bytes(g.off_device_bytes)}, largest first)")
        if len(off) <= 16:
            line += "\n  off-device groups: " + ", ".join(f"{x.layer}:{x.kind}" for x in off)
        return line + (f"\n  blocks wholly on the device: {len(self.resident_blocks)}/{self.num_layers}"
                       f"  with a group off it: {len(self.streamed_blocks)}/{self.num_layers}")

    def _describe_kv_per_token(self) -> str:
        """K and V bytes per token: over every layer, and what sliding-window layers stop adding."""
        groups = self.kv_groups
        total = sum(b for b, _ in groups)
        if not groups:
            return ""
        if self.kv_latent_width and not any(w for _, w in groups):
            return (f"  KV per token: {format_bytes(total)} (the latent of multi-head latent attention: "
                    f"{self.kv_latent_width} values per layer, no per-head K or V)")
        if not any(w for _, w in groups):
            return f"  KV per token: {format_bytes(total)} (K and V over every layer)"
        windows = ", ".join(f"window {w}: {format_bytes(b)}" for b, w in groups if w is not None)
        full = sum(b for b, w in groups if w is None)
        return (f"  KV per token: {format_bytes(total)} up to the sliding windows, {format_bytes(full)} beyond them "
                f"(full-attention layers; the sliding-window layers keep only their window: {windows})")

    def budget_keeping(self, resident: int, depth: int | None = None) -> int:
        """A device budget under which this plan's model keeps exactly `resident` blocks besides
        depth + 1 stream buffers (half a block of slack, less than another block needs)."""
        depth = self.prefetch_depth if depth is None else depth
        return (self.global_bytes + self.kv_cache_bytes + self.workspace_bytes
                + (depth + 1 + resident) * self.block_bytes + self.block_bytes // 2)

    @property
    def disk_bytes_per_step(self) -> int:
        return len(self.disk_blocks) * self.disk_block_bytes

    def disk_seconds_per_step(self, disk_gbps: float | None) -> float | None:
        """The disk tier's floor: no step can be faster than reading its disk bytes at disk_gbps."""
        return self.disk_bytes_per_step / (disk_gbps * 1e9) if disk_gbps else None

    def describe(self, disk_gbps: float | None = None) -> str:
        """The plan in a few lines; with the disk's measured speed, the disk tier's floor too."""
        budget = "unlimited" if self.budget is None else format_bytes(self.budget)
        lines = [
            f"memory plan (budget {budget}, planned {format_bytes(self.device_bytes)}):",
            self._describe_groups() if self.group_placement is not None else
            f"  blocks resident: {len(self.resident_blocks)}/{self.num_layers}"
            f"  streamed: {len(self.streamed_blocks)}/{self.num_layers}"
            f"  ({format_bytes(self.block_bytes)} per block"
            + (f", {format_bytes(self.stream_block_bytes)} streamed" if self.streamed_block_bytes is not None else "")
            + ")",
            f"  bytes streamed per step: {'at most ' if self.group_placement else ''}"
            f"{format_bytes(self.streamed_bytes_per_step)}"
            f"  (prefetch depth {self.prefetch_depth}, stream buffers {format_bytes(self.stream_buffer_bytes)})",
            f"  embeddings/norm/head: {format_bytes(self.global_bytes)}"
            f"  workspace: {format_bytes(self.workspace_bytes)}"
            + (f" (steps of up to {self.max_num_batched_tokens} tokens)" if self.max_num_batched_tokens else ""),
            self._describe_kv_pool(),
        ]
        if self.kv_groups:
            lines.append(self._describe_kv_per_token())
        if self.kv_fits:
            lines.append("  KV fits by --kv-cache-dtype (pool tokens; the longest sequence this budget holds, "
                         "every block streamed): " + "; ".join(
                             f"{f.dtype} {f.pool_tokens} tokens, "
                             + ("no budget to bound a sequence" if f.max_context is None else f"{f.max_context} per sequence")
                             for f in self.kv_fits))
        if self.num_host_kv_blocks:
            lines.append(f"  KV host tier: {format_bytes(self.kv_host_bytes)} = {self.num_host_kv_blocks} blocks "
                         "(evicted prefix-cache blocks, copied back on a hit)")
        if self.grammar_cache_bytes:
            lines.append(f"  grammar cache: up to {format_bytes(self.grammar_cache_bytes)} of host memory "
                         "(compiled structured-output grammars)"
                         + (f", and up to {format_bytes(self.grammar_probe_bytes)} in the grammar probe process"
                            if self.grammar_probe_bytes else ""))
        if self.expert_streaming:
            lines.append(
                f"  expert cache: {self.expert_slots}/{self.num_experts_total} experts "
                f"({100 * self.expert_slots / self.num_experts_total:.0f}%, {format_bytes(self.expert_cache_bytes)}, "
                f"{format_bytes(self.expert_bytes)} each, LRU); blocks stream without their experts; expert bytes "
                f"per token at random routing (the worst case): {format_bytes(self.expert_bytes_per_token_random())}")
        if self.draft_name:
            lines.append(f"  speculative draft: {format_bytes(self.draft_bytes)} ({self.draft_name})")
        if self.streamed_blocks and len(self.streamed_blocks) <= 16 and self.group_placement is None:
            lines.append(f"  streamed blocks: {self.streamed_blocks}")
        if self.host_budget is not None and self.streamed_blocks:
            lines.append(f"  host tier (host budget {format_bytes(self.host_budget)}): streamed blocks kept in RAM: "
                         f"{len(self.host_blocks)}  read from disk each step: {len(self.disk_blocks)}")
        if self.disk_blocks:
            floor = self.disk_seconds_per_step(disk_gbps)
            speed = (f"at {disk_gbps:.2f} GB/s measured: expected >= {floor * 1e3:.1f} ms per step"
                     if floor is not None else "disk bandwidth not measured")
            lines.append(f"  disk bytes per step: {format_bytes(self.disk_bytes_per_step)} ({speed})")
        if self.runtime_bytes:
            lines.append(f"  runtime outside the budget: {format_bytes(self.runtime_bytes)} of anonymous memory "
                         "before loading (interpreter, torch, kernels)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _spread(count: int, total: int) -> list[int]:
    """`count` indices spread evenly over range(total): resident blocks between streamed ones
    give the prefetcher compute time to hide each copy behind."""
    if count <= 0:
        return []
    if count >= total:
        return list(range(total))
    return sorted({int(i * total / count) for i in range(count)})


def plan_memory(p: PlanInputs) -> MemoryPlan:
    """Split the budget between the KV pool, resident blocks and stream buffers.

    The KV pool comes before resident blocks (a block that does not fit can stream; a sequence
    whose cache does not fit cannot run), up to its target: what the user asked for, else what
    max_num_seqs sequences of max_model_len would need (more would never be used). It may be
    smaller down to one max_model_len sequence; then fewer sequences run at once when they are
    long, as many as their actual lengths allow. Below that the plan is refused.
    """
    if p.num_layers < 1:
        raise PlanError("model has no layers")
    one_seq = p.kv_blocks_per_seq
    target = p.max_num_seqs * one_seq
    notes: list[str] = []
    if p.kv_cache_bytes is not None:
        target = p.kv_units_within(p.kv_cache_bytes)
        if target < one_seq:
            raise PlanError(f"--kv-cache-memory {format_bytes(p.kv_cache_bytes)} holds {target} KV blocks; one "
                            f"sequence of max_model_len {p.max_model_len} needs {one_seq} "
                            f"({format_bytes(p.kv_pool_bytes(one_seq))})")

    host_units = p.kv_units_within(p.kv_host_bytes)
    host_group_blocks = p.kv_group_blocks(host_units)

    def plan(resident: list[int], buffers: int, blocks: int, block_bytes: int = p.block_bytes,
             **experts) -> MemoryPlan:
        streamed = [i for i in range(p.num_layers) if i not in set(resident)]
        group_blocks = p.kv_group_blocks(blocks)
        return _with_host_tier(p, MemoryPlan(
            p.budget, p.num_layers, resident, streamed, block_bytes, p.global_bytes, p.kv_pool_bytes(blocks),
            p.workspace_bytes, buffers, p.max_model_len, p.max_num_seqs, p.prefetch_depth, tuple(notes),
            streamed_block_bytes=p.streamed_block_bytes, kv_block_size=p.kv_block_size, num_kv_blocks=group_blocks[0],
            num_host_kv_blocks=host_group_blocks[0], kv_host_bytes=p.kv_pool_bytes(host_units),
            kv_groups=p._kv_groups(), kv_group_blocks=group_blocks, kv_group_host_blocks=host_group_blocks,
            draft_bytes=p.draft_bytes(len(streamed)), draft_name=p.draft_name,
            attn_chunk_bytes=p.attn_chunk_bytes, max_num_batched_tokens=p.max_num_batched_tokens,
            runtime_bytes=p.runtime_bytes, kv_latent_width=p.kv_latent_width, **experts))

    all_blocks = p.num_layers * p.block_bytes
    if p.budget is None:
        return plan(list(range(p.num_layers)), 0, target)
    buffers = (p.prefetch_depth + 1) * p.block_bytes
    # The draft's largest size is set aside first; each block then kept resident gives back its
    # self-draft copy (draft_block_bytes), so it costs block_bytes - draft_block_bytes.
    room = p.budget - p.global_bytes - p.workspace_bytes - p.draft_bytes(0)
    blocks = min(target, p.kv_units_within(room - p.min_streaming_bytes()))
    if blocks < one_seq:
        raise PlanError(
            f"device budget {format_bytes(p.budget)} is too small: embeddings/head "
            f"{format_bytes(p.global_bytes)}, KV cache for one sequence of {p.max_model_len} tokens "
            f"{format_bytes(p.kv_pool_bytes(one_seq))}, workspace {format_bytes(p.workspace_bytes)} and "
            f"{p.streaming_needs()}"
            + (f", the speculative draft {format_bytes(p.draft_bytes(0))}," if p.draft_name else "")
            + " need at least "
            f"{format_bytes(p.min_budget())}; raise --max-device-memory or lower --max-model-len (or "
            "--max-num-batched-tokens: the workspace holds a chunk's attention scores over the whole context)"
        )
    if blocks < target:
        wanted = "--kv-cache-memory" if p.kv_cache_bytes else f"{p.max_num_seqs} x max_model_len"
        notes.append(f"KV pool of {blocks} blocks ({blocks * p.kv_block_size} tokens) is less than the {target} "
                     f"blocks of {wanted}: long sequences run fewer at a time")
    room -= p.kv_pool_bytes(blocks)
    if room >= all_blocks:
        return plan(list(range(p.num_layers)), 0, blocks)
    if p.tensor_groups:
        placed = place_groups(p.tensor_groups, room, p.prefetch_depth, p.offload_streams)
        if placed is not None:
            partly = set(placed.layers_off_device)
            return plan([i for i in range(p.num_layers) if i not in partly], placed.stream_buffer_bytes, blocks,
                        group_placement=placed)
        stay = sum(g.device_bytes for g in p.tensor_groups if not g.off_device_capable)
        streams = stream_buffer_bytes(p.tensor_groups, p.prefetch_depth) if p.offload_streams else 0
        notes.append(f"attention, norms and router of every layer ({format_bytes(stay)})"
                     + (f" and the buffers off-device groups stream through ({format_bytes(streams)}: "
                        f"--prefetch-depth + 1 of the largest; --cpu-offload-policy cpu needs none)" if streams else "")
                     + f" do not fit the {format_bytes(room)} left after globals, workspace and the KV pool: "
                     "blocks stream whole")
    if p.expert_bytes:
        resident, buffers, slots = _plan_experts(p, room, notes)
        return plan(resident, buffers, blocks, p.dense_block_bytes, expert_slots=slots, expert_bytes=p.expert_bytes,
                    num_experts_total=p.num_experts_total, experts_per_token=p.experts_per_token,
                    predictor_bytes=p.predictor_bytes)
    resident_count = min(p.num_layers - 1, (room - buffers) // (p.block_bytes - p.draft_block_bytes))
    return plan(_spread(int(resident_count), p.num_layers), buffers, blocks)


def _plan_experts(p: PlanInputs, room: int, notes: list[str]) -> tuple[list[int], int, int]:
    """(resident blocks, stream buffer bytes, expert slots) of a mixture of experts that does not fit:
    blocks without their experts first (every token reads all of a block's dense part each step, but
    only top_k of its experts, so a resident dense byte saves a byte per step while a cached expert
    byte saves at most its hit rate), then the expert cache takes the rest. `room`: the budget left
    after globals, workspace and the KV pool (which came first)."""
    dense, depth = p.dense_block_bytes, p.prefetch_depth
    room -= p.predictor_bytes
    need_cache = p.min_expert_slots * p.expert_bytes
    if room - need_cache >= p.num_layers * dense:
        resident_count, buffers = p.num_layers, 0
    else:
        buffers = (depth + 1) * dense
        if room < buffers + need_cache:
            raise PlanError(
                f"device budget {format_bytes(p.budget)} is too small: embeddings/head {format_bytes(p.global_bytes)}, "
                f"workspace {format_bytes(p.workspace_bytes)}, the KV pool, {depth + 1} stream buffers of "
                f"{format_bytes(dense)} (blocks without experts) and an expert cache of {p.min_expert_slots} "
                f"experts ({format_bytes(need_cache)}) do not fit; raise --max-device-memory or lower --max-model-len")
        resident_count = min(p.num_layers - 1, (room - buffers - need_cache) // dense)
    slots = min(p.num_experts_total, (room - buffers - resident_count * dense) // p.expert_bytes)
    notes.append("expert-granular streaming: blocks without their experts are planned first (each is read "
                 "whole every step), the expert cache takes the rest")
    return _spread(int(resident_count), p.num_layers), buffers, int(slots)


def plan_largest_context(make_inputs, max_model_len: int, min_model_len: int, block_size: int) -> MemoryPlan:
    """plan_memory for the largest context in [min_model_len, max_model_len] (a multiple of the
    block size below max_model_len) whose plan fits; `make_inputs(max_len)` builds the inputs (the
    workspace grows with the context). Refuses with what a small and the full context would need."""
    try:
        return plan_memory(make_inputs(max_model_len))
    except PlanError:
        pass
    lo, hi = -(-min_model_len // block_size), (max_model_len - 1) // block_size  # in blocks
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best = plan_memory(make_inputs(mid * block_size))
            lo = mid + 1
        except PlanError:
            hi = mid - 1
    if best is None:
        small, full = make_inputs(min_model_len), make_inputs(max_model_len)
        raise PlanError(
            f"device budget {format_bytes(full.budget)} is too small even for a context of {min_model_len} "
            f"tokens: that needs at least {format_bytes(small.min_budget())} (embeddings/head "
            f"{format_bytes(small.global_bytes)}, workspace {format_bytes(small.workspace_bytes)}, KV "
            f"{format_bytes(small.kv_pool_bytes(small.kv_blocks_per_seq))}, stream buffers); the full "
            f"context of {max_model_len} needs {format_bytes(full.min_budget())}; raise --max-device-memory"
        )
    return replace(best, notes=best.notes + (
        f"max_model_len lowered from {max_model_len} to {best.max_model_len} so one sequence fits the budget "
        "(set --max-model-len to choose, or raise --max-device-memory)",))


def _with_host_tier(p: PlanInputs, plan: MemoryPlan) -> MemoryPlan:
    """The device plan completed on the host side: which streamed blocks stay in RAM and which are
    read from disk each step, and whether streamed pages must be released after use.

    Kept blocks are spread among the disk ones so each disk read overlaps the compute of the kept
    blocks before it.
    """
    streamed, tier, notes = plan.streamed_blocks, p.host_tiering, list(plan.notes)
    host_blocks, disk_blocks, disk_block_bytes = list(streamed), [], 0
    if tier is not None and streamed and p.host_budget is not None:
        disk_block_bytes = tier.disk_block_bytes
        # The KV host tier (pinned on CUDA) and the grammar memory are host memory whatever computes.
        room = (p.host_budget - tier.fixed_bytes - plan.kv_host_bytes - p.grammar_cache_bytes - p.grammar_probe_bytes
                - (plan.device_bytes if tier.holds_device_plan else 0))
        keep = (0 if tier.force_disk or disk_block_bytes <= 0
                else max(0, min(len(streamed), room // disk_block_bytes)))
        kept = {streamed[i] for i in _spread(int(keep), len(streamed))}
        host_blocks = [b for b in streamed if b in kept]
        disk_blocks = [b for b in streamed if b not in kept]
    release = (bool(streamed) and not disk_blocks and p.host_budget is not None
               and p.checkpoint_bytes > p.host_budget - RELEASE_MARGIN)
    if release:
        notes.append(f"checkpoint ({format_bytes(p.checkpoint_bytes)}) exceeds host memory "
                     f"({format_bytes(p.host_budget)}): streamed pages are released after use")
    return replace(plan, notes=tuple(notes), host_budget=p.host_budget if tier is not None else None,
                   grammar_cache_bytes=p.grammar_cache_bytes, grammar_probe_bytes=p.grammar_probe_bytes,
                   kv_fits=_kv_fits(p, plan),
                   host_blocks=host_blocks if tier is not None else [], disk_blocks=disk_blocks,
                   disk_block_bytes=disk_block_bytes, release_pages=release)


def _kv_fits(p: PlanInputs, plan: MemoryPlan) -> tuple[KVFit, ...]:
    """For each of p.kv_dtype_options: the pool tokens of the same plan made with that dtype's bytes per
    token, and the longest sequence the budget holds for it (globals, workspace, the smallest streaming and
    the draft set aside, everything else KV)."""
    fits = []
    for name, per_token in p.kv_dtype_options:
        if per_token == p.kv_bytes_per_token:
            pool = plan.num_kv_blocks
        else:
            try:
                # Every KV group's bytes scale with the dtype alike (each layer's K and V, codes and scales).
                groups = tuple((bpt * per_token // p.kv_bytes_per_token, w) for bpt, w in p.kv_groups)
                pool = plan_memory(replace(p, kv_bytes_per_token=per_token, kv_groups=groups,
                                           kv_dtype_options=())).num_kv_blocks
            except PlanError:
                pool = 0
        longest = None
        if p.budget is not None:
            room = p.budget - p.global_bytes - p.workspace_bytes - p.min_streaming_bytes() - p.draft_bytes(0)
            longest = max(0, room) // (per_token * p.kv_block_size) * p.kv_block_size
        fits.append(KVFit(name, per_token, pool * p.kv_block_size, longest))
    return tuple(fits)
