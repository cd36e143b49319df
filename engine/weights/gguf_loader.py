"""Loading a GGUF model: index, config, plan (in packed bytes), packed transport, streamer, KV cache.

The same steps as `engine.loader.load_model` for safetensors, with GGUF's own index and transport;
the plan counts each block twice over: its resident compute form (`block_bytes`) and the packed
GGML bytes a streamed block moves (`streamed_block_bytes`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..kv_cache import KVCache
from ..loader import (DTYPE_NAMES, EngineArgs, LoadedModel, _plan_kv_host_tier, _plan_memory, format_bytes, host_budget,
                      workspace_bytes)
from ..planner import PlanInputs, plan_memory
from ..runner import ModelRunner
from ..streamer import BlockStreamer
from .gguf_file import GGUFIndex
from .gguf_model import GLOBAL_NAMES, GGUFBlockSource, PackedFormat, load_gguf_config, validate_gguf
from .packed_transport import PackedCpuTransport

log = logging.getLogger("layerstream")


def gguf_dtype(name: str) -> torch.dtype:
    """auto -> bfloat16 (packed kernels); float32 -> the exact reference mode."""
    return torch.bfloat16 if name == "auto" else DTYPE_NAMES[name]


def load_gguf_model(args: EngineArgs, path: str | Path) -> LoadedModel:
    path = Path(path)
    index = GGUFIndex(path)
    transport = streamer = None
    try:
        cfg = load_gguf_config(index)
        validate_gguf(cfg, index)
        if args.device != "cpu":
            raise ValueError(f"{path}: GGUF models run on the CPU for now (device {args.device!r} asked); "
                             "convert to safetensors for CUDA")
        if args.transport not in ("auto", "cpu", "simulated"):
            raise ValueError(f"{path}: transport {args.transport!r} is not available for GGUF models "
                             "(auto, cpu, simulated are)")
        dtype = gguf_dtype(args.dtype)
        fmt = PackedFormat(dtype)
        source = GGUFBlockSource(index, cfg)
        max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
        block_bytes = sum(fmt.resident_bytes(t) for t in source.tensors(0).values())
        embed_t = index.entry(GLOBAL_NAMES["embed"])
        head_t = index.entry(GLOBAL_NAMES["lm_head"]) if GLOBAL_NAMES["lm_head"] in index else embed_t
        norm_t = index.entry(GLOBAL_NAMES["norm"])
        global_bytes = embed_t.nbytes + fmt.resident_bytes(head_t) + fmt.resident_bytes(norm_t)
        host_room = host_budget(args)
        budget = args.max_device_memory
        weights_bytes = cfg.num_layers * block_bytes + global_bytes
        host_sized = budget is None and weights_bytes > host_room
        if host_sized:
            budget = host_room
        kv_per_token = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        plan = _plan_memory(host_room if host_sized else None, lambda: plan_memory(PlanInputs(
            num_layers=cfg.num_layers,
            block_bytes=block_bytes,
            global_bytes=global_bytes,
            kv_bytes_per_token=kv_per_token,
            workspace_bytes=workspace_bytes(cfg, tokens, args.max_num_seqs, max_len, dtype),
            budget=budget,
            max_model_len=max_len,
            max_num_seqs=args.max_num_seqs,
            prefetch_depth=args.prefetch_depth,
            streamed_block_bytes=source.nbytes(0),
            kv_block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_memory,
        )))
        _plan_kv_host_tier(plan, args, torch.device("cpu"), host_room, kv_per_token)
        release_pages = bool(plan.streamed_blocks) and index.total_bytes() > host_room - (256 << 20)
        types = sorted({t.qtype.name for t in index.entries.values()})
        plan.notes.append(f"GGUF tensor types {', '.join(types)}; compute "
                          + ("exact fp32 dequantization" if fmt.exact else f"packed kernels in {dtype}"))
        log.info("%s: %s (GGUF), %d layers, compute dtype %s\n%s", path, cfg.architecture, cfg.num_layers,
                 str(dtype).replace("torch.", ""), plan.describe())
        transport = PackedCpuTransport(source, fmt, release_pages=release_pages)
        if args.transport == "simulated":
            from ..simulated_transport import SimulatedTransport

            transport = SimulatedTransport(transport)
        bar = tqdm(total=len(plan.resident_blocks) + 1, desc="loading blocks", unit="block",
                   disable=not args.show_progress, leave=False)
        globals_ = {
            "embed": fmt.embedding(embed_t, index.raw(embed_t.name)),
            "norm": fmt.resident(norm_t, index.raw(norm_t.name)),
            "lm_head": fmt.resident(head_t, index.raw(head_t.name)),
        }
        bar.update(1)
        streamer = BlockStreamer(transport, plan.resident_blocks, plan.streamed_blocks, args.prefetch_depth,
                                 on_progress=lambda _i: bar.update(1))
        bar.close()
        kv = KVCache(cfg.num_layers, plan.num_kv_blocks, plan.kv_block_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype, torch.device("cpu"), num_host_blocks=plan.num_host_kv_blocks)
        runner = ModelRunner(cfg, plan, globals_, streamer, kv, torch.device("cpu"), dtype)
    except BaseException:
        if streamer is not None:
            streamer.close()
        elif transport is not None:
            transport.close()
        index.close()
        raise
    log.debug("GGUF resident blocks: %s", format_bytes(len(plan.resident_blocks) * block_bytes))
    return LoadedModel(cfg, index, plan, runner, dtype, path)
