"""Loading assembles a model: config -> checkpoint -> a frozen memory plan -> weights -> runner.

Each step is another module's job (arch, weights, planner, runner); this one only sizes the plan's
inputs from the first two and puts the pieces together, giving back whatever it opened if a later
step fails.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from . import ops
from .args import EngineArgs, resolve_dtype
from .arch import ModelConfig
from .errors import UnsupportedModelError, out_of_memory_error
from .grammar_probe import probe_memory_bytes
from .host_memory import anonymous_bytes, host_budget
from .cache import cache_root
from .kv_cache import KVCache
from .kv_disk import KVDiskTier
from .kv_groups import KVLayout
from .kv_quant import KV_CACHE_DTYPES, KVQuant
from .ops import KernelChoices
from .placement import PathPolicy, TensorGroup, block_groups
from .planner import MemoryPlan, PlanError, PlanInputs, format_bytes, plan_largest_context, plan_memory
from .runner import ModelRunner
from .workspace import attention_chunk_bytes, workspace_bytes
from .weights import ModelCheckpoint, ModelWeights, WeightSizes, self_draft_copies_every_block

log = logging.getLogger("layerstream")


# The smallest context worth starting with when the user did not choose one and the budget cannot
# hold the default: below this, chat templates alone leave no room for a conversation.
MIN_AUTO_MODEL_LEN = 256


def _plan_memory(host_room: int | None, make_plan: Callable[[], MemoryPlan]) -> MemoryPlan:
    """make_plan(), with a message about host memory when the budget came from it (CPU, model larger than RAM)."""
    try:
        return make_plan()
    except PlanError as e:
        if host_room is None:
            raise
        raise PlanError(f"the model does not fit in host memory ({format_bytes(host_room)} usable) and what must "
                        f"stay in RAM does not fit either: {str(e).split(': ', 1)[-1].split('; raise')[0]}; raise "
                        "--max-host-memory (or free memory) or lower --max-model-len / --max-num-seqs / "
                        "--max-num-batched-tokens") from e


def context_length(args: EngineArgs, cfg: ModelConfig) -> int:
    """--max-model-len, or the model's context capped at 4096; never beyond what the model supports."""
    max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    return max_len


def kv_host_bytes(args: EngineArgs, device: torch.device, host_room: int) -> int:
    """The KV host tier: --kv-host-memory, else min(4 GiB, a tenth of host memory) on CUDA and none
    on the CPU, where the device pool already is host memory (a second pool there would only copy
    blocks within the same RAM: give the pool more --kv-cache-memory instead). It holds only
    prefix-cache blocks, so it is off with prefix caching off."""
    if not args.enable_prefix_caching:
        return 0
    if args.kv_host_memory is not None:
        return args.kv_host_memory
    return min(4 << 30, host_room // 10) if device.type == "cuda" else 0


def kv_quant_for(args: EngineArgs, cfg: ModelConfig) -> KVQuant | None:
    """The KV cache's quantized format (--kv-cache-dtype, --kv-cache-rotation), None for auto; a model whose
    heads the format cannot split, or with sliding-window layers (whose pools the quantized attention path does
    not read yet), is a clear error before anything loads."""
    if cfg.mla is not None and args.kv_cache_dtype != "auto":
        raise UnsupportedModelError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported for multi-head latent "
                                    f"attention ({cfg.architecture}: its cache holds the latent, not K and V); "
                                    "use --kv-cache-dtype auto")
    try:
        quant = KVQuant.of(args.kv_cache_dtype, cfg.head_dim, args.kv_cache_rotation)
    except ValueError as e:
        raise UnsupportedModelError(f"--kv-cache-dtype {args.kv_cache_dtype}: {e}") from None
    if quant is not None and len(kv_layout(args, cfg).groups) > 1:
        raise UnsupportedModelError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported yet for a model with "
                                    f"sliding-window layers ({cfg.architecture}); use --kv-cache-dtype auto")
    return quant


def kv_dtype_options(cfg: ModelConfig, dtype: torch.dtype, rotate: bool) -> tuple[tuple[str, int], ...]:
    """(name, KV bytes per token) of every --kv-cache-dtype this model can use, for the plan's fits table."""
    heads, k_width, v_width = cfg.kv_cache_dims
    if cfg.mla is not None:  # the latent is cached in the compute dtype only (kv_quant_for)
        return ((str(dtype).replace("torch.", ""),
                 KVCache.bytes_per_token(cfg.num_layers, heads, k_width, dtype, None, v_width)),)
    options = []
    for name in KV_CACHE_DTYPES:
        try:
            quant = KVQuant.of(name, cfg.head_dim, rotate)
        except ValueError:
            continue
        label = str(dtype).replace("torch.", "") if quant is None else name
        options.append((label, KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, quant)))
    return tuple(options)


def model_identity(path: Path, cfg: ModelConfig, dtype: torch.dtype, quant: KVQuant | None, block_size: int) -> dict:
    """What KV on disk must have been computed with to be reused: the checkpoint's files (names, sizes,
    modification times: a changed file is another model), the config, the compute dtype, the KV format (int4:
    with its levels, which give the codes their meaning) and the block size."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return {"files": stats, "config": repr(cfg), "dtype": str(dtype), "block_size": block_size,
            "kv": None if quant is None else [quant.bits, quant.head_dim, quant.rotate, *quant.levels]}


def open_kv_disk(args: EngineArgs, path: Path, cfg: ModelConfig, dtype: torch.dtype, quant: KVQuant | None,
                 block_nbytes: int) -> KVDiskTier | None:
    """The KV disk tier of --kv-disk-bytes under --kv-disk-dir (default: the cache's kv/), or None."""
    if not args.kv_disk_bytes or not args.enable_prefix_caching:
        return None
    folder = Path(args.kv_disk_dir) if args.kv_disk_dir else cache_root() / "kv"
    disk = KVDiskTier(folder, args.kv_disk_bytes, model_identity(path, cfg, dtype, quant, args.block_size),
                      block_nbytes)
    log.info("KV disk tier: %s, up to %s (%d blocks of %s)", disk.folder, format_bytes(args.kv_disk_bytes),
             disk.capacity_blocks, format_bytes(disk.file_bytes))
    return disk


def grammar_cache_bytes(args: EngineArgs, host_room: int) -> int:
    """The compiled-grammar cache's cap: --grammar-cache-memory, else 256 MiB, at most a twentieth
    of host memory (it holds only what structured-output requests compiled)."""
    if args.grammar_cache_memory is not None:
        return args.grammar_cache_memory
    return max(1, min(args.grammar_limits().cache_bytes, host_room // 20))


def _plan_context(args: EngineArgs, cfg: ModelConfig, host_room: int | None, budget: int | None,
                  make_inputs: Callable[[int, int | None, int], PlanInputs]) -> MemoryPlan:
    """The plan for context_length(); when the budget cannot hold it, the step is made smaller before
    the model is: first attention calls bounded by the budget (attention_chunk_bytes: more, smaller
    calls, the same results), then steps of fewer tokens (a prefill reads each streamed block once
    per step, so a smaller step costs prompt speed, never what fits). Only then, when the user did not
    choose the context, the largest context that fits (MIN_AUTO_MODEL_LEN at least).
    make_inputs(max_len, attn_chunk_bytes, tokens) builds the inputs (the workspace depends on all three)."""
    max_len = context_length(args, cfg)
    auto = args.max_model_len is None and max_len > MIN_AUTO_MODEL_LEN
    tokens = step_tokens(args)
    small = attention_chunk_bytes(budget)
    steps = [(tokens, None)] + ([(tokens, small)] if small is not None else [])
    fewer = tokens // 2
    while fewer >= min_step_tokens(args):
        steps.append((fewer, small))
        fewer //= 2

    def make() -> MemoryPlan:
        first_error = None
        for n, chunk in steps:
            try:
                plan = plan_memory(make_inputs(max_len, chunk, n))
            except PlanError as e:
                first_error = first_error or e
                continue
            if n < tokens:
                plan = replace(plan, notes=plan.notes + (
                    f"max_num_batched_tokens lowered from {tokens} to {n} so a step's workspace fits the budget "
                    f"(a prompt is prefilled {n} tokens at a time)",))
            return plan
        if not auto:
            raise first_error
        n, chunk = steps[-1]
        return plan_largest_context(lambda m: make_inputs(m, chunk, n), max_len, MIN_AUTO_MODEL_LEN, args.block_size)

    return _plan_memory(host_room, make)


def step_tokens(args: EngineArgs) -> int:
    """Tokens of the largest step the scheduler may form, as asked (the plan may lower it)."""
    return max(args.max_num_batched_tokens, args.max_num_seqs)


def min_step_tokens(args: EngineArgs) -> int:
    """The smallest step a tight budget may lower max_num_batched_tokens to: every running sequence
    decodes (and verifies its drafts) each step, and below a few dozen tokens a prefill step costs
    a full read of the streamed blocks for too little work."""
    return max(logits_rows(args), 32)


def logits_rows(args: EngineArgs) -> int:
    """Rows of logits the largest step returns: k + 1 per sequence when drafts are verified."""
    return args.max_num_seqs * (1 + (args.num_speculative_tokens if args.speculative_method else 0))


@dataclass(frozen=True)
class DraftReservation:
    """Speculative decoding's draft, as the target's plan budgets it (PlanInputs.draft_*)."""

    fixed_bytes: int = 0  # a separate draft model: its planned bytes
    name: str = ""


def _draft_inputs(args: EngineArgs, cfg: ModelConfig, checkpoint: ModelCheckpoint | None, dtype: torch.dtype,
                  block_bytes: int, draft: DraftReservation | None) -> dict:
    """PlanInputs' draft fields: the separate draft model's bytes, or the self-draft's int4 copy per block."""
    if args.speculative_method == "self":
        copy, head = checkpoint.self_draft_sizes(dtype) if checkpoint is not None else (block_bytes, 0)
        if copy >= block_bytes:
            raise ValueError(f"the self-draft's int4 copy of a block ({format_bytes(copy)}) is not smaller than the "
                             f"block itself ({format_bytes(block_bytes)}): it needs a 16/32-bit safetensors target; "
                             "use --speculative-method ngram or draft for this model")
        if self_draft_copies_every_block(torch.device(args.device)):
            return dict(draft_fixed_bytes=head + cfg.num_layers * copy,
                        draft_name="self-draft: int4 copies of every block (on the CPU an int4 block runs ~2x "
                                   "faster than a 16-bit one, resident or not) and an int8 head")
        return dict(draft_block_bytes=copy, draft_fixed_bytes=head,
                    draft_name="self-draft: int4 copies of the streamed blocks (of every block when none streams) "
                               "and an int8 head")
    if draft is not None:
        return dict(draft_fixed_bytes=draft.fixed_bytes, draft_name=draft.name)
    return {}


def kv_layout(args: EngineArgs, cfg: ModelConfig) -> KVLayout:
    """The model's layers grouped by sliding window (engine.kv_groups). A separate draft model's pool
    mirrors group 0's table, which must then cover every position: a model without a full-attention
    layer keeps all its positions in one group when it has such a draft."""
    windows = [cfg.layer_attention(i).window for i in range(cfg.num_layers)]
    if args.speculative_method == "draft" and None not in windows:
        return KVLayout.single(cfg.num_layers)
    return KVLayout.of(windows)


def plan_for(args: EngineArgs, cfg: ModelConfig, checkpoint: ModelCheckpoint, dtype: torch.dtype,
             host_room: int, draft: DraftReservation | None = None, grammar_probe: bool = True) -> MemoryPlan:
    """The frozen memory plan for this model under args' device budget and `host_room` host bytes,
    with room for a speculative draft when one is configured. grammar_probe: count the grammar probe's
    process (False: the tokenizer cannot start one)."""
    plan = _plan_for(args, cfg, checkpoint, dtype, host_room, draft, grammar_probe, args.expert_streaming)
    if checkpoint.packed and plan.expert_streaming and (plan.disk_blocks or args.transport == "disk"):
        # A GGUF file's experts are served as views of its prepacked entry in the page cache; the disk tier does
        # not read single experts from the entry yet, so with blocks on disk (or the disk transport) its MoE blocks
        # stream whole.
        plan = _plan_for(args, cfg, checkpoint, dtype, host_room, draft, grammar_probe, False)
        plan = replace(plan, notes=plan.notes + (
            "MoE blocks stream whole: a GGUF file's experts stream one by one from the page cache only, and this "
            "plan reads blocks from disk (the disk tier)",))
    return plan


def _plan_for(args: EngineArgs, cfg: ModelConfig, checkpoint: ModelCheckpoint, dtype: torch.dtype,
              host_room: int, draft: DraftReservation | None, grammar_probe: bool,
              expert_streaming: bool) -> MemoryPlan:
    device = torch.device(args.device)
    sizes = checkpoint.sizes(dtype, args.quantization, device)
    budget = args.max_device_memory
    if budget is None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * 0.9) - (512 << 20)
    tiering = checkpoint.host_tiering(args.transport, device, dtype, args.prefetch_depth, args.quantization)
    experts = expert_inputs(args, cfg, sizes, dtype) if expert_streaming else {}
    streamed_block_bytes = sizes.streamed_block_bytes
    if experts and tiering is not None:  # what a disk-tier block read moves: the block without its experts
        tiering = replace(tiering, disk_block_bytes=sizes.dense_checkpoint_block_bytes)
    if experts and streamed_block_bytes is not None:  # a GGUF block streamed from its entry without its experts
        streamed_block_bytes = sizes.dense_checkpoint_block_bytes
    weights_bytes = cfg.num_layers * sizes.block_bytes + sizes.global_bytes
    # Checkpoint bytes staged for converted disk-tier blocks (converted copies are the plan's stream
    # buffers), and structured output's host memory: the compiled-grammar cache and the grammar probe.
    staging = (args.prefetch_depth + 1) * sizes.checkpoint_block_bytes if checkpoint.converts(dtype) else 0
    grammar_cap = grammar_cache_bytes(args, host_room)
    computes_on_host = device.type == "cpu" and (tiering is None or tiering.holds_device_plan)
    kv_host = kv_host_bytes(args, device, host_room)
    runtime = anonymous_bytes() if device.type == "cpu" else 0
    # one layer's K and V (codes and scales with a quantized cache)
    kv_heads, k_width, v_width = cfg.kv_cache_dims
    layer_bytes = KVCache.bytes_per_token(1, kv_heads, k_width, dtype, kv_quant_for(args, cfg), v_width)
    kv_groups = tuple((len(g.layers) * layer_bytes, g.window) for g in kv_layout(args, cfg).groups)
    groups = (tensor_groups(cfg, dtype, checkpoint.group_bytes(dtype, device))
              if places_groups(args, cfg, checkpoint) else ())

    def plan_with(grammar_probe: int) -> MemoryPlan:
        # The device is the host: the plan fits the room the host has (its memory cgroup, MemAvailable or
        # --max-host-memory) besides what is outside the plan, whatever the budget asks; what does not fit streams.
        outside = staging + grammar_cap + grammar_probe
        host_sized = computes_on_host and (weights_bytes if budget is None else budget) > host_room - outside
        limit = host_room - outside if host_sized else budget

        def inputs(max_len: int, chunk: int | None, tokens: int) -> PlanInputs:
            return PlanInputs(
                num_layers=cfg.num_layers,
                block_bytes=sizes.block_bytes,
                global_bytes=sizes.global_bytes,
                kv_bytes_per_token=KVCache.bytes_per_token(cfg.num_layers, kv_heads, k_width, dtype,
                                                           kv_quant_for(args, cfg), v_width),
                kv_dtype_options=kv_dtype_options(cfg, dtype, args.kv_cache_rotation),
                workspace_bytes=workspace_bytes(cfg, tokens, args.max_num_seqs, max_len, dtype, logits_rows(args),
                                                chunk),
                max_num_batched_tokens=tokens,
                runtime_bytes=runtime,
                budget=limit,
                max_model_len=max_len,
                max_num_seqs=args.max_num_seqs,
                prefetch_depth=args.prefetch_depth,
                host_budget=host_room,
                host_tiering=tiering,
                checkpoint_bytes=sizes.checkpoint_bytes,
                streamed_block_bytes=streamed_block_bytes,
                kv_block_size=args.block_size,
                kv_groups=kv_groups,
                kv_cache_bytes=args.kv_cache_memory,
                kv_host_bytes=kv_host,
                grammar_cache_bytes=grammar_cap,
                grammar_probe_bytes=grammar_probe,
                **experts,
                **_draft_inputs(args, cfg, checkpoint, dtype, sizes.block_bytes, draft),
                attn_chunk_bytes=chunk,
                kv_latent_width=cfg.mla.cache_width if cfg.mla is not None else 0,
                tensor_groups=groups,
                offload_streams=args.cpu_offload_policy != "cpu",
            )

        plan = _plan_context(args, cfg, host_room if host_sized else None, limit, inputs)
        if host_sized and args.max_device_memory is not None:
            plan = replace(plan, notes=plan.notes + (
                f"--max-device-memory {format_bytes(args.max_device_memory)} lowered to the host memory this "
                f"process may use ({format_bytes(host_room)}: its memory cgroup, MemAvailable or --max-host-memory)",))
        return plan

    # The grammar probe isolates the cost of compiling a new grammar (engine/grammar_probe.py). Where the
    # host cannot hold it besides the model, the model comes first: compiles run in this process, their
    # cost checked after the fact, and the plan says so.
    probe = probe_memory_bytes(grammar_cap, cfg.vocab_size) if grammar_probe else 0
    try:
        return plan_with(probe)
    except PlanError:
        if not probe:
            raise
    plan = plan_with(0)
    return replace(plan, notes=plan.notes + (
        f"grammar probe off: host memory cannot hold its {format_bytes(probe)} besides the model; a new "
        "grammar compiles in this process and its cost is checked after the fact",))


PLACEMENT = "LAYERSTREAM_PLACEMENT"


def places_groups(args: EngineArgs, cfg: ModelConfig, checkpoint: ModelCheckpoint) -> bool:
    """Whether the plan places tensor groups (attention on the device, MLPs and routed experts off it when the
    budget is short, issue #38) rather than whole blocks: with LAYERSTREAM_PLACEMENT=groups, for a device behind a
    link (the simulated transport, or the CUDA one), safetensors or GGUF (a GGUF file's MLPs and routed experts
    computed on the CPU by the packed kernels, or streamed as its packed bytes: MLPs as its blocks stream, the chosen
    experts into the expert cache's slots). Whole blocks stay the default until a GPU run has measured groups."""
    mode = os.environ.get(PLACEMENT, "blocks").strip().lower() or "blocks"
    if mode not in ("blocks", "groups"):
        raise ValueError(f"{PLACEMENT} must be blocks or groups, got {mode!r}")
    if mode == "blocks":
        return False
    device = torch.device(args.device)
    linked = args.transport == "simulated" or device.type == "cuda" or args.transport == "cuda"
    why = ("a device without a link to the host (the CPU itself: use the simulated or the CUDA transport)"
           if not linked
           else f"--quantization {args.quantization}" if args.quantization
           else "LoRA adapters" if args.lora_modules
           else "the self-draft" if args.speculative_method == "self" else None)
    if why is not None:
        raise ValueError(f"{PLACEMENT}=groups places MLPs and routed experts off the device for now, not with {why}")
    return True


def tensor_groups(cfg: ModelConfig, dtype: torch.dtype,
                  packed: list[dict[str, tuple[int, int]]] | None = None) -> tuple[TensorGroup, ...]:
    """Every block's tensor groups (PlanInputs.tensor_groups): the planner's input for per-group placement, and
    the units the --cpu-offload-policy decides on each step. Their bytes are the compute dtype's, or a packed
    checkpoint's (ModelCheckpoint.group_bytes, per block): what the CPU reads and the link moves of a Q4 MLP is
    its ~4.5 bits a weight, and the cost model prices bytes."""
    top_k = cfg.moe.top_k if cfg.moe is not None else 0
    return tuple(g for layer in range(cfg.num_layers)
                 for g in block_groups(layer, cfg.block_shapes(layer), dtype.itemsize, cfg.hidden_size,
                                       top_k if cfg.is_moe_layer(layer) else 0,
                                       packed[layer] if packed is not None else None))


def expert_inputs(args: EngineArgs, cfg: ModelConfig, sizes: WeightSizes, dtype: torch.dtype) -> dict:
    """PlanInputs fields of expert-granular streaming (on the CPU, and on a GPU through the CUDA
    transport's expert slots); empty when it is off (a dense model, or the flag), where MoE blocks
    stream whole."""
    moe = cfg.moe
    if moe is None or not args.expert_streaming or not sizes.expert_bytes:
        return {}
    return dict(expert_bytes=sizes.expert_bytes, num_experts_total=sizes.num_experts_total,
                dense_block_bytes=sizes.dense_block_bytes,
                # this block's top_k and the next block's guesses, at the least
                min_expert_slots=min(2 * moe.top_k, sizes.num_experts_total),
                experts_per_token=moe.top_k * len(moe.sparse_layers),
                predictor_bytes=len(moe.sparse_layers) * ((moe.num_experts + 1) * cfg.hidden_size
                                                          + moe.num_experts * (moe.topk_method == "noaux_tc"))
                * dtype.itemsize)


@dataclass
class LoadedModel:
    cfg: ModelConfig
    plan: MemoryPlan
    runner: ModelRunner
    dtype: torch.dtype
    path: Path
    checkpoint: ModelCheckpoint
    weights: ModelWeights
    kernels: KernelChoices  # what this model's operations run on (engine.ops)

    @property
    def kv_cache(self) -> KVCache:
        """The paged KV cache's tensors (the runner's)."""
        return self.runner.kv

    @property
    def kv_disk(self) -> KVDiskTier | None:
        return self.runner.kv.disk

    def close(self) -> None:
        """Stop streaming and give back threads, buffers, pinned memory, file descriptors, mappings; finish
        the KV disk tier's writes."""
        self.weights.close()
        self.checkpoint.close()
        if self.runner.kv.disk is not None:
            self.runner.kv.disk.close()


def load_model(args: EngineArgs, path: str | os.PathLike, draft: DraftReservation | None = None,
               grammar_probe: bool = True) -> LoadedModel:
    """draft: a separate speculative draft model's bytes, for the plan to reserve; grammar_probe: whether
    the plan counts the grammar probe's process (plan_for)."""
    path = Path(path)
    checkpoint = ModelCheckpoint(path)  # a safetensors folder or a GGUF file; the config its format records
    cfg = checkpoint.cfg
    if args.quantization and cfg.moe is not None:
        checkpoint.close()
        raise UnsupportedModelError(f"{path}: quantization ({args.quantization}) is not supported for "
                                    f"mixture-of-experts models ({cfg.architecture}) yet")
    plan = weights = disk = None
    try:
        dtype = resolve_dtype(args.dtype, cfg.checkpoint_dtype)
        quant = kv_quant_for(args, cfg)
        host_room = host_budget(args.max_host_memory)
        device = torch.device(args.device)
        # Every kernel choice now, before the plan sizes packed weights for one and before any
        # request: a no-op where the engine loop (or an earlier load) has made them. Builds run on
        # prepare's threads, whose compilers a Ctrl-C here stops. The table is logged once.
        kernels = ops.choose(device, dtype)
        plan = plan_for(args, cfg, checkpoint, dtype, host_room, draft, grammar_probe)
        disk_gbps = None
        if plan.disk_blocks:
            disk_gbps, note = checkpoint.measure_disk()
            if note:
                log.warning("%s", note)
        log.info("%s: %s, %d layers, compute dtype %s\n%s", path, cfg.architecture, cfg.num_layers,
                 str(dtype).replace("torch.", ""), plan.describe(disk_gbps))
        if checkpoint.describe(dtype):
            log.info("%s", checkpoint.describe(dtype))
        # GGUF in CPU fast mode: every block is prepacked once (cached), then resident ones load.
        prepack = 0 if args.quantization else checkpoint.prepack_pending(dtype, device)
        bar = tqdm(total=len(plan.resident_blocks) + 1, desc="loading blocks", unit="block",
                   disable=not args.show_progress or not (plan.resident_blocks or args.quantization or prepack),
                   leave=False)
        if args.quantization:  # every block is quantized once (unless cached), then resident ones load
            bar.reset(total=cfg.num_layers + len(plan.resident_blocks) + 1)
            bar.set_description(f"quantizing to {args.quantization} (or reading the cached result)")
        elif prepack:
            bar.reset(total=prepack + len(plan.resident_blocks) + 1)
            bar.set_description("prepacking GGUF blocks for the CPU kernels (once)")
        try:
            weights = ModelWeights(checkpoint, plan, dtype, device, transport=args.transport,
                                   pin_host_memory=args.pin_host_memory, host_budget=host_room,
                                   disk_gbps=disk_gbps, on_progress=lambda _i: bar.update(1),
                                   quantization=args.quantization, resident_weights=args.resident_weights)
        finally:
            bar.close()
        layout = kv_layout(args, cfg)
        kv_heads, k_width, v_width = cfg.kv_cache_dims
        kv = KVCache(cfg.num_layers, plan.kv_group_blocks, plan.kv_block_size, kv_heads, k_width,
                     dtype, device, num_host_blocks=plan.kv_group_host_blocks, layer_groups=layout.layer_groups(),
                     quant=quant, v_head_dim=v_width)
        disk = None
        if len(layout.groups) == 1 and layout.groups[0].window is None:
            kv.disk = disk = open_kv_disk(args, path, cfg, dtype, quant, kv.bytes_per_block)
        elif args.kv_disk_bytes:
            log.info("KV disk tier: not used for a model with sliding-window layers (--kv-disk-bytes ignored)")
        runner = ModelRunner(cfg, weights, kv, device, dtype, attn_chunk_bytes=plan.attn_chunk_bytes,
                             placement=plan.group_placement, offload_policy=PathPolicy(args.cpu_offload_policy))
        # The simulated device computes on this CPU: its speeds are the CPU's; a GPU's products are timed on it.
        offload = runner.offload
        if offload.groups and args.cpu_offload_policy == "auto" and weights.links.h2d_gbps:
            speeds = offload.measure_speeds(weights.links.h2d_gbps, device)
            offload.set_speeds(speeds, live=True)
            thresholds = {"MLP" if g.kind == "mlp" else "routed experts' group":
                          offload.policy.threshold(g) or "no number of" for g in offload.groups.values()}
            log.info("cpu offload (auto): link %.2f GB/s, CPU %.2f GB/s at one row and %.1f GFLOP/s, device %.1f "
                     "GFLOP/s: %s per step, else the CPU computes it (refreshed as steps run)",
                     speeds.link_gbps, speeds.cpu_gbps, speeds.cpu_flops / 1e9, speeds.device_flops / 1e9,
                     "; ".join(f"an off-device {k} streams from {v} tokens" for k, v in thresholds.items()))
    except BaseException as e:
        # Whatever was built stops here: the prefetch thread, reader threads, pinned host memory.
        if weights is not None:
            weights.close()
        if disk is not None:
            disk.close()
        checkpoint.close()
        if isinstance(e, torch.OutOfMemoryError):
            raise out_of_memory_error(plan, torch.device(args.device), e) from e
        raise
    return LoadedModel(cfg, plan, runner, dtype, path, checkpoint, weights, kernels)


def load_draft_model(args: EngineArgs) -> LoadedModel:
    """Speculative decoding's separate draft model (--speculative-model), fully resident: no device
    budget of its own (the target's plan reserves its bytes: DraftReservation), the target's context
    and sequence limits. Its KV lives in a pool mirroring the target's (engine.speculative)."""
    from .model_source import resolve_model

    draft_args = EngineArgs(model=args.speculative_model, device=args.device, dtype=args.dtype,
                            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, show_progress=args.show_progress,
                            enable_prefix_caching=False)
    return load_model(draft_args, resolve_model(args.speculative_model))
