"""Loading a model folder: config, validated weight index, memory plan, transport, streamer, KV cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import attention_backend
from .arch import ModelConfig, load_model_config, validate_checkpoint
from .kv_cache import KVCache
from .planner import MemoryPlan, PlanError, PlanInputs, assign_host_tier, format_bytes, parse_bytes, plan_memory
from .runner import ModelRunner
from .weights.safetensors_index import WeightIndex
from .scheduler import check_at_least_one
from .weights.streamer import BlockStreamer
from .weights.transport import BlockSource, CpuTransport, Transport, to_compute

log = logging.getLogger("layerstream")

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
               "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class EngineArgs:
    model: str
    device: str = "cpu"
    dtype: str = "auto"
    max_device_memory: int | str | None = None
    max_host_memory: int | str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_queue: int = 256
    prefetch_depth: int = 1
    transport: str = "auto"  # auto | cpu | cuda | simulated | disk (every streamed block read from disk)
    show_progress: bool = True
    pin_host_memory: bool = False  # cuda: keep streamed blocks pinned in host memory when RAM allows

    def __post_init__(self) -> None:
        self.max_device_memory = parse_bytes(self.max_device_memory)
        self.max_host_memory = parse_bytes(self.max_host_memory)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        # Checked here, not only in SchedulerConfig (built after the weights load), so a bad value
        # fails at once, and `layerstream serve` reports it before it starts listening.
        check_at_least_one(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                           max_queue=self.max_queue, prefetch_depth=self.prefetch_depth)
        if self.max_model_len is not None:
            check_at_least_one(max_model_len=self.max_model_len)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPE_NAMES[name]
    return cfg.checkpoint_dtype if cfg.checkpoint_dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def _cgroup_room() -> int | None:
    """Bytes left under the memory cgroup this process is in (v1 or v2), if it has a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            limit_f, usage_f = f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            limit_f, usage_f = f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"
        else:
            continue
        try:
            raw = Path(limit_f).read_text().strip()
            if raw != "max" and int(raw) < (1 << 60):
                return int(raw) - int(Path(usage_f).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def host_budget(args: EngineArgs) -> int:
    """--max-host-memory, or what the cgroup/machine still allows minus a margin for the
    interpreter's own growth, allocator slack and temporaries of the compute."""
    if args.max_host_memory is not None:
        return args.max_host_memory
    room = host_memory_available()
    return max(0, room - room // 20 - (128 << 20))


def host_memory_available() -> int:
    """Bytes this process may still use: the tighter of its cgroup's room and MemAvailable."""
    avail = 1 << 62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def workspace_bytes(cfg: ModelConfig, tokens: int, seqs: int, max_len: int, dtype: torch.dtype) -> int:
    """Peak activations of the largest step the scheduler may form (`tokens` tokens over up to
    `seqs` sequences, contexts up to max_len): hidden states and MLP intermediates, logits, and
    attention in its padded layout. A step of s sequences pads every query to the longest chunk, and
    a step of s - 1 decodes and one prefill chunk of tokens - s + 1 gives s * (tokens - s + 1) padded
    rows, far more than `tokens`. Attention holds: the padded query and its output (a few copies),
    the boolean mask and its GQA-folded copy, K and V gathered for each sequence, and the
    temporaries of the largest attend() call (bounded by attention_backend's chunking)."""
    isz = dtype.itemsize
    act = tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * isz
    logits = seqs * cfg.vocab_size * 4 * 3
    group = cfg.num_heads // cfg.num_kv_heads
    attn = 0
    for s in range(1, min(seqs, tokens) + 1):
        mq = min(tokens - s + 1, max_len)
        padded = s * mq * cfg.num_heads * cfg.head_dim * isz * 4
        masks = s * mq * max_len * (1 + group)
        gathered = 2 * s * cfg.num_kv_heads * max_len * cfg.head_dim * isz
        call = attention_backend.workspace_bytes(s, group * mq, max_len, cfg.num_kv_heads, cfg.head_dim, isz)
        attn = max(attn, padded + masks + gathered + call)
    return act + attn + logits


def make_transport(args: EngineArgs, source: BlockSource, dtype: torch.dtype, plan: MemoryPlan,
                   release_pages: bool, host_room: int) -> Transport:
    kind = args.transport
    if kind == "auto":
        kind = "cuda" if args.device.startswith("cuda") else "cpu"
        if kind == "cpu" and plan.disk_blocks:
            kind = "disk"
    if kind == "disk":
        if args.device != "cpu":
            raise ValueError(f"the disk transport computes on the CPU; got device {args.device!r}")
        from .weights.disk_transport import DiskTransport

        return DiskTransport(source, dtype, plan.disk_blocks, args.prefetch_depth)
    if kind == "cpu":
        return CpuTransport(source, dtype, release_pages=release_pages)
    if kind == "cuda":
        from .weights.cuda_transport import CudaTransport

        cuda = CudaTransport(source, dtype, torch.device(args.device), plan, pin_host_memory=args.pin_host_memory,
                             host_budget=host_room, release_pages=release_pages)
        if plan.disk_blocks:
            from .weights.disk_transport import DiskTransport

            # Read in the checkpoint's dtype (views, no conversion): filling pinned staging converts.
            ckpt_dtype = source.index.entry(source.names(plan.disk_blocks[0])["wq"]).dtype
            cuda.disk = DiskTransport(source, ckpt_dtype, plan.disk_blocks, depth=0)
        return cuda
    if kind == "simulated":
        from .weights.simulated_transport import SimulatedTransport

        return SimulatedTransport(CpuTransport(source, dtype, release_pages=release_pages))
    raise ValueError(f"unknown transport {args.transport!r}")


def _plan_memory(host_room: int | None, inputs: PlanInputs) -> MemoryPlan:
    """plan_memory, with a message about host memory when the budget came from it (CPU, model larger than RAM)."""
    try:
        return plan_memory(inputs)
    except PlanError as e:
        if host_room is None:
            raise
        raise PlanError(f"the model does not fit in host memory ({format_bytes(host_room)} usable) and what must "
                        f"stay in RAM does not fit either: {str(e).split(': ', 1)[-1].split('; raise')[0]}; raise "
                        "--max-host-memory (or free memory) or lower --max-model-len / --max-num-seqs / "
                        "--max-num-batched-tokens") from e


def _assign_disk_tier(plan: MemoryPlan, index: WeightIndex, host_room: int, host_fixed: int, block_bytes: int,
                      force_disk: bool) -> None:
    assign_host_tier(plan, host_room, host_fixed, block_bytes, force_disk=force_disk)
    if not plan.disk_blocks:
        return
    from .weights.disk_bandwidth import disk_bandwidth

    try:
        plan.disk_gbps = disk_bandwidth(index.files.keys()).gbps
    except (OSError, ValueError) as e:
        plan.notes.append(f"disk bandwidth not measured: {e}")


@dataclass
class LoadedModel:
    cfg: ModelConfig
    index: WeightIndex
    plan: MemoryPlan
    runner: ModelRunner
    dtype: torch.dtype
    path: Path


def load_model(args: EngineArgs, path: str | os.PathLike) -> LoadedModel:
    path = Path(path)
    cfg = load_model_config(path)
    index = WeightIndex(path)
    plan = transport = streamer = None
    try:
        validate_checkpoint(cfg, index)
        device = torch.device(args.device)
        dtype = resolve_dtype(args.dtype, cfg, device)
        max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
        block_numel = sum(index.entry(n).nbytes // index.entry(n).dtype.itemsize
                          for n in cfg.block_tensor_names(0).values())
        glob = cfg.global_tensors(index)
        global_numel = sum(index.entry(n).nbytes // index.entry(n).dtype.itemsize for n, _ in glob.values())
        budget = args.max_device_memory
        if budget is None and device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * 0.9) - (512 << 20)
        host_room = host_budget(args)
        ckpt_block_bytes = sum(index.entry(n).nbytes for n in cfg.block_tensor_names(0).values())
        # Disk-tier staging holds checkpoint bytes; converted copies are the plan's stream buffers.
        staging = (args.prefetch_depth + 1) * ckpt_block_bytes if cfg.checkpoint_dtype != dtype else 0
        weights_bytes = (cfg.num_layers * block_numel + global_numel) * dtype.itemsize
        host_sized = budget is None and device.type == "cpu" and weights_bytes > host_room
        if host_sized:
            budget = host_room - staging  # the device is the host: what does not fit streams
        plan = _plan_memory(host_room if host_sized else None, PlanInputs(
            num_layers=cfg.num_layers,
            block_bytes=block_numel * dtype.itemsize,
            global_bytes=global_numel * dtype.itemsize,
            kv_bytes_per_token=KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype),
            workspace_bytes=workspace_bytes(cfg, tokens, args.max_num_seqs, max_len, dtype),
            budget=budget,
            max_model_len=max_len,
            max_num_seqs=args.max_num_seqs,
            prefetch_depth=args.prefetch_depth,
        ))
        tier = args.transport if args.transport != "auto" else ("cuda" if device.type == "cuda" else "auto-cpu")
        if plan.streamed_blocks and tier in ("auto-cpu", "disk", "cuda"):
            # Host memory holds, besides kept blocks: on the CPU the whole device plan; for a GPU the
            # pinned staging buffers and one disk read buffer.
            host_fixed = (plan.device_bytes + staging if tier != "cuda"
                          else (args.prefetch_depth + 1) * plan.block_bytes + ckpt_block_bytes)
            _assign_disk_tier(plan, index, host_room, host_fixed, ckpt_block_bytes, force_disk=tier == "disk")
        release_pages = (bool(plan.streamed_blocks) and not plan.disk_blocks
                         and index.total_bytes() > host_room - (256 << 20))
        if release_pages:
            plan.notes.append(f"checkpoint ({format_bytes(index.total_bytes())}) exceeds host memory "
                              f"({format_bytes(host_room)}): streamed pages are released after use")
        log.info("%s: %s, %d layers, compute dtype %s\n%s", path, cfg.architecture, cfg.num_layers,
                 str(dtype).replace("torch.", ""), plan.describe())

        source = BlockSource(index, cfg)
        transport = make_transport(args, source, dtype, plan, release_pages, host_room)
        bar = tqdm(total=len(plan.resident_blocks) + 1, desc="loading blocks", unit="block",
                   disable=not args.show_progress or not plan.resident_blocks, leave=False)
        # On CPU with a separate head, the embedding table is only gathered from (a few rows per
        # step): it stays a zero-copy view of the mapped file and the runner casts the rows it
        # gathers (the same elementwise cast, after the lookup instead of before: exact).
        lazy_embed = device.type == "cpu" and "lm_head" in glob
        globals_ = {k: index.view(n) if k == "embed" and lazy_embed
                    else to_compute({k: index.view(n)}, dtype, device, copy=True)[k] for k, (n, _) in glob.items()}
        bar.update(1)
        streamer = BlockStreamer(transport, plan.resident_blocks, plan.streamed_blocks, args.prefetch_depth,
                                 on_progress=lambda _i: bar.update(1))
        bar.close()
        kv = KVCache(cfg.num_layers, plan.max_num_seqs, cfg.num_kv_heads, plan.max_model_len, cfg.head_dim,
                     dtype, device)
        runner = ModelRunner(cfg, plan, globals_, streamer, kv, device, dtype)
    except BaseException as e:
        # Whatever was built stops here: the prefetch thread, reader threads, pinned host memory.
        if streamer is not None:
            streamer.close()  # closes its transport too
        elif transport is not None:
            transport.close()
        index.close()
        if isinstance(e, torch.OutOfMemoryError):
            from .weights.cuda_transport import out_of_memory_error

            raise out_of_memory_error(plan, torch.device(args.device), e) from e
        raise
    return LoadedModel(cfg, index, plan, runner, dtype, path)
