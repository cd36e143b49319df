"""Tiny random-weight mixture-of-experts checkpoints of every supported MoE family, saved with
transformers' save_pretrained (one tensor per expert, as on the hub).

Routers are scaled up so each token's top-k is decided by clear margins: with the default init the
router's softmax is nearly uniform and rounding (ours vs the reference's op order) could flip a choice.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

from engine.demo import build_random_model

# 8 experts, top-2, in 4 blocks: enough that a cache of a few experts must evict.
_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, num_experts_per_tok=2, tie_word_embeddings=False)
NUM_EXPERTS = 8


def make_config(arch: str):
    from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":  # a dense first block (mlp_only_layers), renormalised top-k
        return Qwen3MoeConfig(**_COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                              num_experts=NUM_EXPERTS, norm_topk_prob=True, mlp_only_layers=[0],
                              architectures=["Qwen3MoeForCausalLM"])
    if arch == "mixtral":
        return MixtralConfig(**_COMMON, intermediate_size=32, num_local_experts=NUM_EXPERTS,
                             architectures=["MixtralForCausalLM"])
    if arch == "olmoe":  # biases everywhere in attention, whole-projection q/k norms, clipped q/k/v
        return OlmoeConfig(**_COMMON, intermediate_size=32, num_experts=NUM_EXPERTS, attention_bias=True,
                           clip_qkv=0.2, architectures=["OlmoeForCausalLM"])
    if arch == "qwen2_moe":  # a shared expert with its gate; every second block sparse; top-k not renormalised
        return Qwen2MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_experts=NUM_EXPERTS, decoder_sparse_step=2,
                              norm_topk_prob=False, architectures=["Qwen2MoeForCausalLM"])
    if arch == "gpt_oss":  # biased router, softmax over the top k; clamped SwiGLU experts with biases; sinks
        return GptOssConfig(**_COMMON, head_dim=16, intermediate_size=32, num_local_experts=NUM_EXPERTS,
                            sliding_window=4, swiglu_limit=0.15, architectures=["GptOssForCausalLM"],
                            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 8,
                                             "rope_theta": 150000.0})
    raise ValueError(arch)


MOE_ARCHS = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"]


def sharpen_routers(model: torch.nn.Module, scale: float = 40.0) -> None:
    for name, p in model.named_parameters():
        if name.endswith((".gate.weight", ".router.weight")):  # the router (mlp.gate / block_sparse_moe.gate / router)
            p.mul_(scale)


def sharpen_gpt_oss(model: torch.nn.Module, seed: int = 3) -> None:
    """Routers sharpened; embeddings scaled up, or the perturbed v and o biases (the same for every token) would
    dominate the hidden states and every token would pick the same experts; attention sinks drawn large enough to
    take a real share of each softmax (their init is ~0.02)."""
    sharpen_routers(model)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.mul_(10.0)
        elif name.endswith(".sinks"):
            p.copy_(torch.randn(p.shape, generator=g) * 2.0)


def build(folder: Path, arch: str, dtype: torch.dtype = torch.float32) -> Path:
    adjust = sharpen_gpt_oss if arch == "gpt_oss" else sharpen_routers
    return build_random_model(folder, make_config(arch), dtype=dtype, seed=zlib.crc32(arch.encode()) % 1000,
                              adjust=adjust)


def expert_budget(folder, slots: int, max_num_seqs: int = 4, **kw) -> int:
    """A device budget whose plan streams every block without its experts and caches `slots` experts (and half
    of one more: the plan may find room for one), for LLM(folder, max_model_len=128, max_num_seqs, **kw)."""
    from engine import LLM
    from engine.args import EngineArgs
    from engine.loader import expert_inputs
    from engine.weights import ModelCheckpoint

    probe = LLM(str(folder), max_model_len=128, max_num_seqs=max_num_seqs, show_progress=False, **kw)
    p, cfg = probe.plan, probe.engine.model.cfg
    probe.close()
    checkpoint = ModelCheckpoint(folder, cfg)
    sizes = checkpoint.sizes(torch.float32)
    checkpoint.close()
    inputs = expert_inputs(EngineArgs(model=str(folder)), cfg, sizes, torch.float32)
    return (p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + inputs["predictor_bytes"]
            + (p.prefetch_depth + 1) * sizes.dense_block_bytes + slots * sizes.expert_bytes + sizes.expert_bytes // 2)


def group_budget(folder, off_bytes: int, max_num_seqs: int = 3, **kw) -> int:
    """A device budget `off_bytes` short of what per-group placement needs to keep every tensor group on the device
    (LAYERSTREAM_PLACEMENT=groups: blocks counted by their groups' own bytes, not as many largest blocks), for
    LLM(folder, max_model_len=128, max_num_seqs, **kw)."""
    from engine import LLM
    from engine.loader import tensor_groups

    placement = os.environ.pop("LAYERSTREAM_PLACEMENT", None)  # the probe places whole blocks, on the CPU itself
    try:
        probe = LLM(str(folder), max_model_len=128, max_num_seqs=max_num_seqs, show_progress=False, **kw)
    finally:
        if placement is not None:
            os.environ["LAYERSTREAM_PLACEMENT"] = placement
    p, cfg = probe.plan, probe.engine.model.cfg
    probe.close()
    groups = sum(g.nbytes for g in tensor_groups(cfg, torch.float32))
    return p.device_bytes - p.num_layers * p.block_bytes + groups - off_bytes
