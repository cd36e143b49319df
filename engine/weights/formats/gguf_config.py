"""A GGUF file's config, tokenizer and chat template, read from its metadata through transformers
(`AutoConfig` / `AutoTokenizer.from_pretrained(folder, gguf_file=...)`) and cached."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch

from ...arch import FAMILIES, ModelConfig, UnsupportedModelError, config_from_hf
from ...cache import build_once, cache_root
from ...config_cache import cached_model_config
from ...tokenizer_files import save_tokenizer

log = logging.getLogger("layerstream")

# llama.cpp's general.architecture -> the architecture the engine runs (the family table's gguf column)
MODEL_TYPES = {f.gguf: arch for arch, f in FAMILIES.items() if f.gguf is not None}

# Gemma's turn format (the template Google ships with its instruction-tuned models; a system message
# opens the first user turn), for the Gemma files whose metadata carries no template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + message['content']) | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# GGUF architecture -> (chat template, the token that ends a turn) for files that carry no template
DEFAULT_CHAT = {"gemma2": (GEMMA_CHAT_TEMPLATE, "<end_of_turn>"), "gemma3": (GEMMA_CHAT_TEMPLATE, "<end_of_turn>")}

# llama.cpp architectures whose config transformers' GGUF reader does not know: read here (_config_from_metadata),
# the tokenizer still through transformers (its GGUF tokenizer reader takes any architecture).
OWN_READER = {"olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "glm4": "glm4",  # -> model_type
              "gpt-oss": "gpt_oss",
              "deepseek2": "deepseek_v2"}  # V3 when the file has V3's router correction bias (_deepseek2)

METADATA_VERSION = 3  # bump when what is saved changes: older folders are then left alone
METADATA_MARKER = "layerstream-gguf-metadata.json"  # in every metadata folder: what built it, from which file


def metadata_folder(path: Path, header_digest: str, architecture: str | None = None, metadata: dict | None = None,
                    tensor_names: set[str] | frozenset[str] = frozenset()) -> Path:
    """A folder with the transformers config and tokenizer that the GGUF metadata describes.

    transformers reads them with gguf-py's GGUFReader, which takes seconds for a real vocabulary
    (40-130 s for SmolLM2 on a busy 2-core machine), twice (config, tokenizer). So the first load
    saves them under the layerstream cache, keyed by a hash of the file's header (metadata and
    tensor table: the same file anywhere hits the same entry), and later loads read that folder.
    Nothing is written beside the model file. A file of a family in DEFAULT_CHAT without a chat
    template gets that family's, and its turn-end token as a stop token. metadata and tensor_names (the
    file's): what an architecture in OWN_READER reads its config from.
    """
    folder = cache_root() / f"gguf-metadata-v{METADATA_VERSION}" / f"{path.stem}-{header_digest[:20]}"

    def build(tmp: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        log.info("%s: reading config and tokenizer from the GGUF metadata (once; cached in %s)", path, folder)
        if architecture in OWN_READER:
            from transformers import PreTrainedTokenizerFast

            config = _config_from_metadata(architecture, metadata or {}, tensor_names)
            tok = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
        else:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        default = DEFAULT_CHAT.get(architecture or "")
        if default is not None and not getattr(tok, "chat_template", None):
            template, turn_end = default
            tok.chat_template = template
            end = tok.convert_tokens_to_ids(turn_end)
            eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
            if end is not None and end != tok.unk_token_id and end not in eos:
                config.eos_token_id = [e for e in eos if e is not None] + [end]
            log.info("%s: no chat template in the metadata; using %s's", path, architecture)
        config.save_pretrained(tmp)
        save_tokenizer(tok, tmp)

    return build_once(folder, METADATA_MARKER, {"file": str(path), "header_sha256": header_digest},
                      build)


def _config_from_metadata(architecture: str, meta: dict, tensor_names: set[str] | frozenset[str]):
    """The transformers config of a file whose architecture transformers' GGUF reader does not know, from the
    keys llama.cpp's converter writes (and what llama.cpp assumes beside them: SmolLM3 leaves RoPE out of
    every 4th layer). Tied embeddings: the file has no output.weight."""
    from transformers import AutoConfig

    if "general.architecture" not in meta:
        raise UnsupportedModelError(f"GGUF architecture {architecture!r}: its config needs the file's metadata")
    tied, biased = "output.weight" not in tensor_names, "blk.0.attn_q.bias" in tensor_names

    def get(key: str, default=None):
        return meta.get(f"{architecture}.{key}", default)

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    rotary = get("rope.dimension_count")
    if rotary and int(rotary) != head_dim:
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    kw = dict(vocab_size=int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"])), hidden_size=hidden,
              intermediate_size=int(get("feed_forward_length")), num_hidden_layers=int(get("block_count")),
              num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv") or heads),
              rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
              max_position_embeddings=int(get("context_length")), tie_word_embeddings=tied, attention_bias=biased,
              rope_parameters=rope, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
              eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
              pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
              architectures=[MODEL_TYPES[architecture]])
    if architecture == "granite":
        kw.update(attention_multiplier=get("attention.scale"), embedding_multiplier=get("embedding_scale"),
                  residual_multiplier=get("residual_scale"), logits_scaling=get("logit_scale"))
    if architecture == "smollm3":
        kw.update(no_rope_layer_interval=4, use_sliding_window=False)  # llama.cpp's n_no_rope_layer_step
    if architecture == "gpt-oss":
        kw.update(_gpt_oss_metadata(get, rope))
    if "partial_rotary_factor" in rope:
        kw["partial_rotary_factor"] = rope["partial_rotary_factor"]
    model_type = OWN_READER[architecture]
    if architecture == "deepseek2":
        model_type = _deepseek2(kw, get, tensor_names)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in kw.items() if v is not None})
    if architecture != "deepseek2":  # DeepSeek's config derives its own (the rotary dims)
        config.head_dim = head_dim
    else:  # None (one q projection, V2-Lite) is dropped above with the unset keys; the class default is a rank
        config.q_lora_rank = get("attention.q_lora_rank")
    return config


def _gpt_oss_metadata(get, rope: dict) -> dict:
    """GPT-OSS's config fields from llama.cpp's keys, and what its runtime assumes beside them: the SwiGLU's alpha
    1.702 and limit 7.0 (constants in llama-graph.cpp; GptOssConfig's defaults), sliding layers first and every
    other one after (its swa pattern 2; GptOssConfig's default layer_types). YaRN is taken as the released
    config.json has it, truncate false: the metadata does not say, and this is what transformers computes."""
    if get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")), truncate=False,
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)))
    return dict(num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                intermediate_size=int(get("expert_feed_forward_length")),
                sliding_window=int(get("attention.sliding_window")), swiglu_alpha=1.702, swiglu_limit=7.0)


def _deepseek2(kw: dict, get, tensor_names: set[str] | frozenset[str]) -> str:
    """DeepSeek-V2/V3's config from deepseek2 metadata (kw: the common keys, updated): "deepseek_v3" when the file
    holds V3's router correction bias (exp_probs_b; llama.cpp's converter writes no gating function for a
    transformers-style config, V3's sigmoid included), else "deepseek_v2". The latent's shapes; the MLA head's
    q/k width (key_length_mla) minus the rotary dims is the non-rotary part; YaRN's mscale and mscale_all_dim
    both from yarn_log_multiplier (0.1 * mscale_all_dim), as llama.cpp assumes them equal (the released configs
    have them equal)."""
    v3 = any(n.endswith("exp_probs_b.bias") for n in tensor_names)
    gating = get("expert_gating_func")  # llama.cpp's: 1 softmax, 2 sigmoid; absent in a transformers-style file
    if gating is not None and int(gating) != (2 if v3 else 1):
        raise UnsupportedModelError(f"deepseek2 expert_gating_func {gating} with{'' if v3 else 'out'} a router "
                                    "correction bias (exp_probs_b) is neither DeepSeek-V2 (softmax, no bias) nor V3 "
                                    "(sigmoid, bias)")
    rope_dims = int(get("rope.dimension_count"))
    groups, groups_used = get("expert_group_count"), get("expert_group_used_count")
    # Files converted before kv_b was split give the per-head widths as key_length / value_length, later ones as
    # key_length_mla / value_length_mla (key_length then being the cached latent's).
    qk_width = int(get("attention.key_length_mla") or get("attention.key_length"))
    v_width = int(get("attention.value_length_mla") or get("attention.value_length"))
    kw.update(num_key_value_heads=kw["num_attention_heads"], attention_bias="blk.0.attn_kv_a_mqa.bias" in tensor_names,
              kv_lora_rank=int(get("attention.kv_lora_rank")), q_lora_rank=get("attention.q_lora_rank"),
              qk_rope_head_dim=rope_dims, qk_nope_head_dim=qk_width - rope_dims, v_head_dim=v_width,
              n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
              moe_intermediate_size=int(get("expert_feed_forward_length")),
              n_shared_experts=int(get("expert_shared_count", 0)),
              first_k_dense_replace=int(get("leading_dense_block_count", 0)),
              routed_scaling_factor=float(get("expert_weights_scale", 1.0)), n_group=groups, topk_group=groups_used)
    if v3:
        kw.update(norm_topk_prob=bool(get("expert_weights_norm", False)), rope_interleave=True)
    else:
        kw.update(topk_method="group_limited_greedy" if groups and groups > 1 else "greedy")
    rope = kw["rope_parameters"]
    rope.pop("partial_rotary_factor", None)
    kw.pop("partial_rotary_factor", None)
    if get("rope.scaling.type") == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)), mscale=mscale, mscale_all_dim=mscale)
    kw["architectures"] = ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"]
    return "deepseek_v3" if v3 else "deepseek_v2"


def load_gguf_config(path: Path, architecture: str, header_digest: str, metadata: dict | None = None,
                     rope_factors: dict[str, list[float]] | None = None,
                     tensor_names: set[str] | frozenset[str] = frozenset()) -> ModelConfig:
    """rope_factors: the file's LongRoPE factor tensors by name (rope_factors_short/long.weight), if any;
    tensor_names: every tensor the file (all its splits) holds."""
    if architecture not in MODEL_TYPES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
                                    f"{', '.join(sorted(MODEL_TYPES))}")

    def make() -> ModelConfig:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(metadata_folder(path, header_digest, architecture, metadata, tensor_names))
        if not (architecture in OWN_READER and (hf.architectures or [None])[0] in FAMILIES):  # DeepSeek: V2 or V3
            hf.architectures = [MODEL_TYPES.get(hf.model_type, MODEL_TYPES[architecture])]
        # GGUF holds packed blocks; the compute dtype is chosen by PackedFormat (bf16 unless float32).
        cfg = config_from_hf(hf, hf.architectures[0], torch.bfloat16)
        conventions = _llama_cpp_conventions(cfg, architecture, metadata or {}, tensor_names)
        if architecture == "phi3":
            conventions.update(_phi3_rope(cfg, metadata or {}, rope_factors or {}))
        return dataclasses.replace(cfg, **conventions)

    # The header digest covers the metadata the conventions read; LongRoPE's factors are tensors, not header.
    factors = json.dumps(sorted((rope_factors or {}).items()))
    return cached_model_config(f"gguf\0{header_digest}\0{architecture}\0{factors}".encode(), make, ModelConfig)


def _phi3_rope(cfg: ModelConfig, metadata: dict, factors: dict[str, list[float]]) -> dict:
    """Phi-3's RoPE and window from the metadata, which transformers' reader leaves at its defaults: the rotary
    dims (Phi-4-mini rotates 3/4 of each head), LongRoPE's factor tensors, original context and attention
    factor (transformers' formulas: inv_freq = 1 / (factor * base^(2i / dims))), and the sliding window."""
    dims = int(metadata.get("phi3.rope.dimension_count") or cfg.head_dim)
    base = float(metadata.get("phi3.rope.freq_base") or 10000.0)
    powers = base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims)  # (dims / 2,)

    def table(name: str) -> tuple[float, ...]:
        scale = torch.tensor(factors[name], dtype=torch.float32) if name in factors else torch.ones_like(powers)
        if scale.shape != powers.shape:
            raise UnsupportedModelError(f"{name} holds {scale.numel()} factors for {dims} rotary dims")
        return tuple((1.0 / (scale * powers)).tolist())

    window = metadata.get("phi3.attention.sliding_window")
    out = dict(rope_inv_freq=table("rope_factors_short.weight"), sliding_window=int(window) if window else None)
    original = metadata.get("phi3.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in factors and original:
        factor = cfg.max_position_embeddings / original
        default = (1 + math.log(factor) / math.log(original)) ** 0.5 if factor > 1 else 1.0
        out.update(rope_long_inv_freq=table("rope_factors_long.weight"), rope_long_after=int(original),
                   rope_attention_scaling=float(metadata.get("phi3.rope.scaling.attn_factor") or default))
    return out


_GEMMA_27B = {("gemma2", 46), ("gemma3", 62)}  # llama.cpp's LLM_TYPE_27B for these architectures


def _llama_cpp_conventions(cfg: ModelConfig, architecture: str, metadata: dict,
                           tensor_names: set[str] | frozenset[str] = frozenset()) -> dict:
    """Where llama.cpp's files and runtime differ from transformers' config defaults: ModelConfig fields."""
    out = {}
    if cfg.mla is not None:
        # Its converter splits kv_b (attn_k_b / attn_v_b; files converted before that hold attn_kv_b whole), and
        # llama.cpp rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM).
        split = "blk.0.attn_kv_b.weight" not in tensor_names
        out["mla"] = dataclasses.replace(cfg.mla, kv_b_split=split, rope_interleaved=True)
    if cfg.norm_offset:
        out["norm_offset"] = 0.0  # its converter stores Gemma's norms as 1 + w (convert_hf_to_gguf.py)
    if (architecture, cfg.num_layers) in _GEMMA_27B:
        # query_pre_attn_scalar is not in the metadata (transformers' reader leaves its default, 256); llama.cpp
        # scales by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the 27B models, known by their depth.
        out["attn_scale"] = (cfg.hidden_size / cfg.num_heads) ** -0.5
    elif architecture in ("gemma2", "gemma3"):
        out["attn_scale"] = cfg.head_dim ** -0.5
    if cfg.moe is not None and cfg.moe.expert_mlp == "clamped_swiglu":
        # its converter splits GPT-OSS's interleaved gate_up into gate and up, (out, in), with their biases
        out["moe"] = dataclasses.replace(cfg.moe, gate_up_interleaved=False)
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        value = metadata.get(f"{architecture}.{key}")
        if value is not None:  # Gemma 2's caps are in the metadata; transformers' reader leaves them at defaults
            out[field] = float(value) or None
    return out
