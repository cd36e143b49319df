"""Tiny random checkpoints of the families beyond Llama's block, built with transformers' own config
classes (attention sharpened so that a window or a scale applied wrongly shows): shared by the family
tests and the KV-group tests."""

from __future__ import annotations

import zlib

import torch

from engine.demo import build_random_model

WINDOW = 8  # sliding window of the tiny models: the prompt alone runs past it
LONGROPE_AFTER = 8  # the LongRoPE model's original context: the prompt alone runs past it
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def make_config(arch: str):
    from transformers import (Gemma2Config, Gemma3TextConfig, Glm4Config, GptOssConfig, GraniteConfig, Olmo2Config,
                              Phi3Config, SmolLM3Config)

    if arch == "gemma3":  # 2 local : 1 global, both RoPE tables (the global one scaled), a scale not of head_dim
        return Gemma3TextConfig(
            **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
            architectures=["Gemma3ForCausalLM"])
    if arch == "gemma2":  # alternating layers, soft-caps small enough to bend these weights' scores and logits
        return Gemma2Config(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=16, attention_bias=True,
                            attn_logit_softcapping=0.5, final_logit_softcapping=2.0, tie_word_embeddings=False,
                            architectures=["Gemma2ForCausalLM"])
    if arch == "olmo2":  # norms after attention and the MLP only; q/k norms over the whole projections
        return Olmo2Config(**COMMON, attention_bias=True, architectures=["Olmo2ForCausalLM"])
    if arch == "granite":  # every Granite multiplier away from 1
        return GraniteConfig(**COMMON, embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5,
                             logits_scaling=4.0, architectures=["GraniteForCausalLM"])
    if arch == "smollm3":  # NoPE every third layer (1 = RoPE), and a sliding window on the NoPE ones
        return SmolLM3Config(**COMMON, no_rope_layers=[1, 1, 0, 1, 1, 0], use_sliding_window=True,
                             sliding_window=WINDOW, architectures=["SmolLM3ForCausalLM"])
    if arch == "glm4":  # four norms, q/k/v biases (no o bias), RoPE on half of each head in pairs, gate_up stored
        return Glm4Config(**COMMON, attention_bias=True, partial_rotary_factor=0.5, architectures=["Glm4ForCausalLM"])
    if arch == "phi3":  # qkv and gate_up stored stacked, RoPE on 3/4 of each head, a sliding window on every layer
        return Phi3Config(**COMMON, partial_rotary_factor=0.75, sliding_window=WINDOW, pad_token_id=0,
                          architectures=["Phi3ForCausalLM"])
    if arch == "phi4mini":  # Phi-4-mini's shape: LongRoPE past a short original context, tied embeddings
        return Phi3Config(**COMMON, partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=0,
                          original_max_position_embeddings=LONGROPE_AFTER,
                          rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0, 2.5, 3.0],
                                        "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 14.0]},
                          architectures=["Phi3ForCausalLM"])
    if arch == "gpt_oss":
        return GptOssConfig(**gpt_oss_settings(), num_local_experts=4, num_experts_per_tok=2)
    if arch in ("deepseek_v3", "deepseek_v2"):
        return deepseek_config(arch)
    raise ValueError(arch)


def gpt_oss_settings() -> dict:
    """GPT-OSS's tiny shape: sliding and full layers alternating (the config's default layer_types), YaRN as the
    released config has it (factor 32 over the original context: here 8 of 256 positions, so the prompt runs
    past it), biases on q/k/v/o, and a SwiGLU limit small enough that both clamps bite on these weights."""
    return dict(**COMMON, sliding_window=WINDOW, attention_bias=True, swiglu_limit=0.15,
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 8, "rope_theta": 150000.0},
                architectures=["GptOssForCausalLM"])


# DeepSeek's mixture and latent attention, small: 8 experts in 4 groups, the first block dense, V's head
# narrower than q/k's non-rotary part (a mix-up of the two shows), YaRN with mscale as the real configs set it.
DEEPSEEK_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
                    first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                    attention_bias=True)


def deepseek_config(arch: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    # num_key_value_heads as the real configs set it (= heads; llama.cpp's converter splits kv_b by it)
    common = {k: v for k, v in COMMON.items() if k != "head_dim"}
    common["num_key_value_heads"] = common["num_attention_heads"]
    if arch == "deepseek_v3":  # q through its low-rank pair, sigmoid routing with a correction bias, pairs rotated
        return DeepseekV3Config(
            **common, **DEEPSEEK_MOE, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1},
            architectures=["DeepseekV3ForCausalLM"])
    # V2: one q projection (V2-Lite's), softmax routing limited to the best group: 3 experts from 1 of 2 groups
    # (with top_k <= topk_group the limit could never change a choice)
    return DeepseekV2Config(
        **{**common, **DEEPSEEK_MOE, "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1}, q_lora_rank=None,
        n_shared_experts=2, routed_scaling_factor=1.5, topk_method="group_limited_greedy",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1},
        architectures=["DeepseekV2ForCausalLM"])


FAMILY_ARCHS = ["gemma3", "gemma2", "olmo2", "granite", "smollm3", "glm4", "phi3", "phi4mini", "gpt_oss",
                "deepseek_v3", "deepseek_v2"]


def sharpen_attention(model: torch.nn.Module, scale: float = 4.0) -> None:
    """Scale q and k up so that attention is far from uniform: a window or a scale applied wrongly then
    moves the logits well past the tolerance."""
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.mul_(scale)


def sharpen_gpt_oss(model: torch.nn.Module) -> None:
    """Attention sharpened, then tests/support/moe_models.py's GPT-OSS adjustments (routers with clear margins,
    so rounding flips no choice; embeddings that tell tokens apart; sinks that take a real share of the softmax)."""
    from tests.support import moe_models

    sharpen_attention(model)
    moe_models.sharpen_gpt_oss(model, seed=5)


def sharpen_deepseek(model: torch.nn.Module, seed: int = 0) -> None:
    """Latent attention's q and k sharpened (q's projection, the latent's K rows and the rotary key), routers
    scaled so that each token's experts win by clear margins, and V3's correction bias (a buffer, which
    build_random_model does not perturb) moved far enough to change some choices."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "kv_a_proj_with_mqa.weight")):
            p.mul_(3.0)
        elif name.endswith("mlp.gate.weight"):
            p.mul_(10.0)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.add_(torch.randn(b.shape, generator=g) * 0.3)


def build(folder, arch: str):
    adjust = {"gpt_oss": sharpen_gpt_oss}.get(arch, sharpen_deepseek if arch.startswith("deepseek") else sharpen_attention)
    return build_random_model(folder, make_config(arch), seed=zlib.crc32(arch.encode()) % 1000, adjust=adjust)


def build_gpt_oss_for_gguf(folder, mxfp4: bool = False):
    """The GPT-OSS row as llama.cpp can represent it: its SwiGLU limit is llama.cpp's constant (7.0, also
    GptOssConfig's default), which the metadata cannot change. mxfp4: the experts' weights rounded to MXFP4's grid
    (gguf-py's quantizer, 32-value blocks along each output row's inputs, as llama.cpp's converter lays them out),
    so that a file with those tensors in MXFP4 (gguf_models.experts_to_mxfp4) holds exactly this checkpoint."""
    from transformers import GptOssConfig

    cfg = GptOssConfig(**{**gpt_oss_settings(), "swiglu_limit": 7.0}, num_local_experts=4, num_experts_per_tok=2)

    def adjust(model: torch.nn.Module) -> None:
        sharpen_gpt_oss(model)
        if mxfp4:
            for name, p in model.named_parameters():
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (experts, in, out)
                    p.copy_(mxfp4_rounded(p.transpose(-1, -2)).transpose(-1, -2))

    return build_random_model(folder, cfg, seed=zlib.crc32(b"gpt_oss-gguf") % 1000, adjust=adjust)


def mxfp4_rounded(w: torch.Tensor) -> torch.Tensor:
    """w (..., cols) through gguf-py's MXFP4 quantizer and back: blocks of 32 along the last dimension."""
    from gguf import GGMLQuantizationType as Q, quants

    data = w.detach().float().numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(data, Q.MXFP4), Q.MXFP4).reshape(data.shape))
