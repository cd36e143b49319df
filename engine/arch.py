"""Which architectures layerstream runs, and which weights (short names, shapes) each one needs.

FAMILIES is the one table of what runs: a row (Family) says how an architecture's block differs from
Llama's; ModelConfig holds one checkpoint's shapes and numbers. Adding a family: docs/usage/adding-a-family.md.

The Hugging Face config is read with transformers' own `AutoConfig`, which normalises the 4.x
(`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`) styles. Everything
the model math needs from it, RoPE's frequencies included, is computed here once, so the math never
reads transformers' config object. What a weight is called in a checkpoint is the weights package's
business (each format has its own names); here a weight is its short name ("wq", "embed").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """One row of the family table: how an architecture's decoder block differs from Llama's, as
    structure (which norms sit where, which activation, what is scaled by what rule). The numbers a
    checkpoint chooses (scales, caps, windows, RoPE) are read from its config into ModelConfig; the
    block math (engine.model) reads both and has no branch on the architecture's name.

    Norm short names: "attn_norm" normalises the attention's input, "post_attn_norm" its output (before
    the residual add), "mlp_norm" the MLP's input, "post_mlp_norm" its output."""

    gguf: str | None = None  # llama.cpp's general.architecture for this family; None: no GGUF support
    qkv_bias: bool = False
    qk_norm: str | None = None  # "head": an RMSNorm per head (Qwen3, Gemma 3); "whole": over the projection (OLMoE)
    norms: tuple[str, ...] = ("attn_norm", "mlp_norm")
    # RMSNorm multiplies by (norm_offset + w): Gemma's weights are the offset from 1 (initialised to zeros).
    norm_offset: float = 0.0
    activation: str = "silu"  # the gated MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale_sqrt_hidden: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    moe: bool = False  # the MLP is a routed mixture of experts (MoEConfig)
    # config fields this family reads beyond Llama's (keys of CONFIG_SCALARS), e.g. Gemma's soft-caps
    scalars: tuple[str, ...] = ()
    attention_bias_o: bool = True  # the config's attention_bias puts a bias on o too, not only q, k, v
    # The checkpoint stores q/k/v as one tensor ("wqkv", Phi-3) and gate/up as one ("w_gate_up", Phi-3, GLM-4).
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... (GLM-4) instead of the two halves of the rotated dims.
    rope_interleaved: bool = False
    # A learned logit per query head ("sinks", (heads,)) joins every attention softmax's denominator and
    # takes no value (GPT-OSS): the rows need not sum to 1 over the keys.
    attn_sinks: bool = False
    # The routed experts' MLP: "swiglu" (w_gate, w_up, w_down; Mixtral, Qwen-MoE, OLMoE) or "clamped_swiglu"
    # (GPT-OSS: gate and up interleaved by column in one (hidden, 2 * intermediate) tensor stored input-major,
    # biases on both products, gate clamped above and up on both sides at swiglu_limit, (up + 1) * gate *
    # sigmoid(alpha * gate)).
    expert_mlp: str = "swiglu"
    # GPT-OSS's router: a bias ("router_bias"), and the softmax over the k chosen logits only, where the
    # others take the softmax over every expert first ("softmax_topk" vs "topk_softmax").
    router_bias: bool = False
    router: str = "softmax_topk"
    # Multi-head latent attention (DeepSeek-V2/V3, MLAConfig): q and KV come through low-rank projections and
    # the KV cache holds each token's compressed latent and its one rotary key, not per-head K and V.
    mla: bool = False

    def __post_init__(self):
        assert self.activation in ACTIVATIONS and self.qk_norm in (None, "head", "whole"), self
        assert self.expert_mlp in EXPERT_MLPS and self.router in ("softmax_topk", "topk_softmax"), self
        assert set(self.norms) <= set(NORMS) and set(self.scalars) <= set(CONFIG_SCALARS), self


NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
ACTIVATIONS = ("silu", "gelu_tanh")
EXPERT_MLPS = ("swiglu", "clamped_swiglu")
_SANDWICH = NORMS  # Gemma 2/3: a norm before and after both attention and the MLP
# A transformers config field -> the ModelConfig field it sets, and how (a field left None keeps the default).
CONFIG_SCALARS = {
    "query_pre_attn_scalar": ("attn_scale", lambda v: float(v) ** -0.5),  # Gemma: 1/sqrt(this), not of head_dim
    "attention_multiplier": ("attn_scale", float),  # Granite: the scale itself
    "attn_logit_softcapping": ("attn_softcap", float),  # scores -> cap * tanh(scores / cap)
    "final_logit_softcapping": ("final_softcap", float),  # logits -> cap * tanh(logits / cap)
    "embedding_multiplier": ("embed_scale", float),
    "residual_multiplier": ("residual_scale", float),  # each block's attention and MLP outputs scaled before the add
    "logits_scaling": ("logits_divisor", float),  # logits divided by it
    "clip_qkv": ("clip_qkv", float),  # OLMoE: q, k, v clamped to [-clip, clip]
}
_GEMMA = dict(norms=_SANDWICH, norm_offset=1.0, activation="gelu_tanh", embed_scale_sqrt_hidden=True,
              scalars=("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"))

# architecture name in config.json -> its family: the one table of what layerstream runs
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(gguf="llama"),
    "MistralForCausalLM": Family(gguf="mistral"),
    "Qwen2ForCausalLM": Family(gguf="qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family(gguf="qwen3", qk_norm="head"),
    "Gemma2ForCausalLM": Family(gguf="gemma2", **_GEMMA),
    "Gemma3ForCausalLM": Family(gguf="gemma3", qk_norm="head", **_GEMMA),
    # OLMo 2: no norm before attention or the MLP, one after each (before the residual add); q/k norms
    # over the whole projections.
    "Olmo2ForCausalLM": Family(gguf="olmo2", qk_norm="whole", norms=("post_attn_norm", "post_mlp_norm")),
    "GraniteForCausalLM": Family(gguf="granite", scalars=("attention_multiplier", "embedding_multiplier",
                                                          "residual_multiplier", "logits_scaling")),
    "SmolLM3ForCausalLM": Family(gguf="smollm3"),  # Llama's block; every few layers without RoPE (no_rope_layers)
    # GLM-4: a norm before and after attention and the MLP, RoPE on half of each head in interleaved pairs.
    "Glm4ForCausalLM": Family(gguf="glm4", norms=_SANDWICH, attention_bias_o=False, fused_gate_up=True,
                              rope_interleaved=True),
    "Phi3ForCausalLM": Family(gguf="phi3", fused_qkv=True, fused_gate_up=True),
    # Mixtures of experts (MoEConfig below): the same attention, an MLP that is a routed set of experts.
    "MixtralForCausalLM": Family(moe=True),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, moe=True),
    "Qwen3MoeForCausalLM": Family(qk_norm="head", moe=True),
    # OLMoE normalises the whole q and k projections (not each head) and may clip q, k, v.
    "OlmoeForCausalLM": Family(qk_norm="whole", moe=True, scalars=("clip_qkv",)),
    # GPT-OSS: Llama's norms, biases on q/k/v/o (attention_bias), attention sinks, every block a mixture of
    # clamped-SwiGLU experts with biases behind a biased router; alternating sliding/full layers, YaRN.
    "GptOssForCausalLM": Family(gguf="gpt-oss", moe=True, attn_sinks=True, expert_mlp="clamped_swiglu",
                                router_bias=True, router="topk_softmax"),
    # DeepSeek-V2/V3: multi-head latent attention (MLAConfig) and a mixture with shared experts after the first
    # first_k_dense_replace dense blocks; V2 scores experts by softmax, V3 by sigmoid with a correction bias.
    "DeepseekV2ForCausalLM": Family(gguf="deepseek2", moe=True, mla=True, rope_interleaved=True),
    "DeepseekV3ForCausalLM": Family(gguf="deepseek2", moe=True, mla=True),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
MOE_ARCHITECTURES = tuple(a for a, f in FAMILIES.items() if f.moe)
# RoPE types the math implements: their frequencies are fixed at load, or (LongRoPE: Phi-3, Phi-4-mini) one of
# two tables chosen by the sequence's length. "dynamic" rescales with every length and is refused rather than
# run wrong.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def family(architecture: str) -> Family:
    """The family of a config.json architecture name; UnsupportedModelError naming it and listing the supported."""
    f = FAMILIES.get(architecture)
    if f is None:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return f


@dataclass(frozen=True)
class LayerAttention:
    """What differs between one block's attention and another's in the same model."""

    window: int | None  # a sliding-window layer sees the last `window` positions (itself included); None: all
    rope: str | None  # "global" or "local" (ModelConfig's two RoPE tables); None: no rotary at all (NoPE)


def expert_key(expert: int, short: str) -> str:
    """The short name of one expert's tensor inside a block's weights, e.g. "experts.3.w_up"."""
    return f"experts.{expert}.{short}"


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLP: each token goes to the top_k of num_experts experts its router scores
    highest, and their outputs are summed weighted by the router's softmax probabilities (renormalised
    over the chosen k when norm_topk_prob)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # blocks whose MLP is the mixture; the others keep a dense MLP
    # Qwen2-MoE: an always-on expert of this width whose output is scaled by sigmoid(shared_gate . x); 0 = none
    shared_expert_intermediate_size: int = 0
    expert_mlp: str = "swiglu"  # the family's (Family.expert_mlp): which tensors one expert has
    swiglu_alpha: float = 1.0  # "clamped_swiglu": gate * sigmoid(alpha * gate)
    swiglu_limit: float = float("inf")  # "clamped_swiglu": gate <= limit, -limit <= up <= limit
    # "clamped_swiglu": gate and up interleaved by column in one input-major tensor with one bias (GPT-OSS's
    # safetensors), or (False) apart as (out, in) tensors each with its bias (llama.cpp's GGUF)
    gate_up_interleaved: bool = True
    # DeepSeek's router (engine.model.router_topk): "softmax" (the others; V2 too) or "sigmoid" (V3) scores;
    # "greedy" top-k over every expert, "group_limited_greedy" (V2: the topk_group groups of the highest
    # expert score first) or "noaux_tc" (V3: groups by the sum of their two best scores plus the correction
    # bias, "router_bias", which steers the choice but not the weights).
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the chosen experts' weights are multiplied by it
    router_fp32: bool = False  # the router's product in fp32 whatever the compute dtype (DeepSeek)
    # DeepSeek: the always-on shared experts are one plain MLP of this width (no gate), beside the routed ones
    shared_mlp_intermediate_size: int = 0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok {self.top_k} must be between 1 and the number of experts {self.num_experts}")
        if self.scoring not in ("softmax", "sigmoid") or self.topk_method not in TOPK_METHODS:
            raise UnsupportedModelError(f"router scoring {self.scoring!r} / topk_method {self.topk_method!r} is not "
                                        f"supported; supported: softmax or sigmoid, {', '.join(TOPK_METHODS)}")
        if self.topk_method != "greedy":
            if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise UnsupportedModelError(f"n_group {self.n_group} / topk_group {self.topk_group} do not divide "
                                            f"{self.num_experts} experts into groups to choose from")
            if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
                raise UnsupportedModelError(f"{self.n_group} groups of {self.num_experts} experts: noaux_tc scores "
                                            "a group by its two best experts")
            if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
                raise UnsupportedModelError(f"topk_group {self.topk_group} of {self.n_group} groups holds fewer "
                                            f"than num_experts_per_tok {self.top_k} experts")

    def expert_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """One expert's tensors (short names) and shapes."""
        i = self.expert_intermediate_size
        if self.expert_mlp == "clamped_swiglu" and self.gate_up_interleaved:
            # Stored as GPT-OSS stores them, (in, out): x @ w. gate_up's columns alternate gate, up.
            return {"w_gate_up_t": (hidden, 2 * i), "b_gate_up": (2 * i,), "w_down_t": (i, hidden), "b_down": (hidden,)}
        if self.expert_mlp == "clamped_swiglu":
            return {"w_gate": (i, hidden), "w_up": (i, hidden), "w_down": (hidden, i),
                    "b_gate": (i,), "b_up": (i,), "b_down": (hidden,)}
        return {"w_gate": (i, hidden), "w_up": (i, hidden), "w_down": (hidden, i)}


TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3). Per head, q . k is over qk_nope_head_dim dims
    from the latent (through kv_b's K rows) and qk_rope_head_dim rotary dims shared by every head; V has
    v_head_dim dims from the latent. The cache holds per token kv_lora_rank latent values and the
    qk_rope_head_dim rotary key: one "head" of cache_width values."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: q is one full projection (V2-Lite); else down, norm, up
    rope_interleaved: bool  # RoPE on adjacent pairs (V2 always, V3 with rope_interleave) rather than halves
    # llama.cpp's files split kv_b into each head's K rows transposed, "wk_b" (heads, kv_lora_rank, qk_nope), and
    # its V rows, "wv_b" (heads, v_head_dim, kv_lora_rank): the absorbed form's two factors as they are used.
    kv_b_split: bool = False

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """One checkpoint's architecture: shapes, its family's row, and the numbers its config sets."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # RoPE, computed at load from the checkpoint's rope settings (scaling types included).
    # (head_dim / 2,) inverse frequencies, fp32 values (left out of repr: a log line is no place for them)
    rope_inv_freq: tuple[float, ...] = field(default=(), repr=False)
    rope_attention_scaling: float = 1.0
    o_bias: bool = False  # the output projection has a bias (OLMoE with attention_bias)
    qk_norm_whole: bool = False  # q_norm / k_norm span the whole projection, not one head (OLMoE)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] after projection (OLMoE)
    moe: MoEConfig | None = None
    family: Family | None = None  # None: FAMILIES[architecture]
    # Per layer: the sliding window of each block (None: full attention); () = `sliding_window` for every block.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE of the sliding-window layers where it differs from the global one (Gemma 3: base 10k vs 1M).
    local_rope_inv_freq: tuple[float, ...] = field(default=(), repr=False)
    local_rope_attention_scaling: float = 1.0
    # LongRoPE: a sequence longer than rope_long_after tokens (original_max_position_embeddings) rotates by
    # these frequencies (its long_factor) instead of rope_inv_freq (its short_factor); the scaling is shared.
    rope_long_inv_freq: tuple[float, ...] = field(default=(), repr=False)
    rope_long_after: int = 0
    nope_layers: tuple[int, ...] = ()  # blocks without rotary embedding (SmolLM3)
    attn_scale: float | None = None  # multiplies q . k; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    # RMSNorm weights are applied as (norm_offset + w); None: the family's convention. A format that stores
    # the offset folded into the weight (llama.cpp's Gemma files hold 1 + w) sets 0.
    norm_offset: float | None = None
    mla: MLAConfig | None = None  # multi-head latent attention's shapes (Family.mla)

    def __post_init__(self):
        if self.family is None:
            object.__setattr__(self, "family", family(self.architecture))
        if self.norm_offset is None:
            object.__setattr__(self, "norm_offset", self.family.norm_offset)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.layer_windows)} layer types for {self.num_layers} layers")

    def rope_switches_within(self, max_len: int) -> bool:
        """Whether a sequence of up to max_len tokens may switch RoPE tables as it grows (LongRoPE): K cached
        under one table is then not what the other would compute."""
        return bool(self.rope_long_inv_freq) and max_len > self.rope_long_after

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of one layer's KV cache per token: (num_kv_heads, head_dim, head_dim), or
        with latent attention one head holding the latent and the rotary key, and no V (the latent is V)."""
        if self.mla is not None:
            return 1, self.mla.cache_width, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    def layer_attention(self, layer: int) -> LayerAttention:
        window = self.layer_windows[layer] if self.layer_windows else self.sliding_window
        if layer in self.nope_layers:
            return LayerAttention(window, None)
        return LayerAttention(window, "local" if window is not None and self.local_rope_inv_freq else "global")

    def block_shapes(self, layer: int = 0) -> dict[str, tuple[int, ...]]:
        """Every tensor of block `layer`, experts included (short names; see expert_key)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        # Llama's order (attn_norm, wq, wk, wv, wo, mlp_norm) first: it fixes where a block's tensors lie
        # in the cache entries built from it.
        norms = self.family.norms
        shapes = {"attn_norm": (h,)} if "attn_norm" in norms else {}
        if self.mla is not None:
            shapes.update(self._mla_shapes())
        elif self.family.fused_qkv:
            shapes.update(wqkv=(q + 2 * kv, h), wo=(h, q))  # rows: q, then k, then v
        else:
            shapes.update(wq=(q, h), wk=(kv, h), wv=(kv, h), wo=(h, q))
        shapes.update({name: (h,) for name in NORMS if name in norms and name != "attn_norm"})
        if self.qkv_bias and self.mla is None:
            shapes.update(bqkv=(q + 2 * kv,)) if self.family.fused_qkv else shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
        if self.o_bias:
            shapes.update(bo=(h,))
        if self.family.attn_sinks:
            shapes.update(sinks=(self.num_heads,))
        if self.qk_norm:
            shapes.update(q_norm=(q,), k_norm=(kv,)) if self.qk_norm_whole else shapes.update(q_norm=(d,), k_norm=(d,))
        if not self.is_moe_layer(layer):
            i = self.intermediate_size
            if self.family.fused_gate_up:
                shapes.update(w_gate_up=(2 * i, h), w_down=(h, i))  # rows: gate, then up
            else:
                shapes.update(w_gate=(i, h), w_up=(i, h), w_down=(h, i))
            return shapes
        m = self.moe
        shapes["router"] = (m.num_experts, h)
        if self.family.router_bias or m.topk_method == "noaux_tc":  # GPT-OSS's logit bias; DeepSeek-V3's correction
            shapes["router_bias"] = (m.num_experts,)
        if m.shared_mlp_intermediate_size:
            s = m.shared_mlp_intermediate_size
            shapes.update({"shared.w_gate": (s, h), "shared.w_up": (s, h), "shared.w_down": (h, s)})
        if m.shared_expert_intermediate_size:
            s = m.shared_expert_intermediate_size
            shapes.update({"shared.w_gate": (s, h), "shared.w_up": (s, h), "shared.w_down": (h, s),
                           "shared_gate": (1, h)})
        for e in range(m.num_experts):
            shapes.update({expert_key(e, k): shape for k, shape in m.expert_shapes(h).items()})
        return shapes

    def _mla_shapes(self) -> dict[str, tuple[int, ...]]:
        """Latent attention's tensors: q through a low-rank pair (wq_a, its norm, wq_b) or one wq; the KV
        latent and rotary key from wkv_a, the latent's norm, wkv_b (each head's K rows, then its V rows)."""
        a, h, nh = self.mla, self.hidden_size, self.num_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        out = {}
        if a.q_lora_rank is None:
            out["wq"] = (nh * qk, h)
        else:
            out.update(wq_a=(a.q_lora_rank, h), q_a_norm=(a.q_lora_rank,), wq_b=(nh * qk, a.q_lora_rank))
        out.update(wkv_a=(a.cache_width, h), kv_a_norm=(a.kv_lora_rank,))
        if a.kv_b_split:
            out.update(wk_b=(nh, a.kv_lora_rank, a.qk_nope_head_dim), wv_b=(nh, a.v_head_dim, a.kv_lora_rank))
        else:
            out["wkv_b"] = (nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
        out["wo"] = (h, nh * a.v_head_dim)
        if self.qkv_bias:  # attention_bias: the down projections and o are biased, the up projections not
            out.update({"bq_a": (a.q_lora_rank,)} if a.q_lora_rank is not None else {})
            out["bkv_a"] = (a.cache_width,)
        return out

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Embeddings, final norm and (untied) head. A tied model reads its head from the embedding
        table, unless the checkpoint stores a head anyway (the weights package decides that)."""
        v, h = self.vocab_size, self.hidden_size
        out = {"embed": (v, h), "norm": (h,)}
        if not self.tie_word_embeddings:
            out["lm_head"] = (v, h)
        return out


def _torch_dtype(value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        d = getattr(torch, value.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
    return torch.float32


def load_model_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        named = " or ".join(archs) if archs else f"(model_type {raw.get('model_type')!r})"
        raise UnsupportedModelError(f"{cfg_path}: architecture {named} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    def make() -> ModelConfig:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(folder)
        ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or getattr(hf, "dtype", None)
        return config_from_hf(hf, arch, _torch_dtype(ckpt_dtype))

    from .config_cache import cached_model_config

    return cached_model_config(b"config.json\0" + cfg_path.read_bytes(), make, ModelConfig)


def config_from_hf(hf, arch: str, checkpoint_dtype: torch.dtype) -> ModelConfig:
    """ModelConfig from a transformers config (read from config.json, or from GGUF metadata)."""
    fam = family(arch)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    sliding = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    flags = dict(qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm is not None, qk_norm_whole=fam.qk_norm == "whole")
    if getattr(hf, "attention_bias", False):  # biases on q, k, v and (most families) o
        flags.update(qkv_bias=True, o_bias=fam.attention_bias_o)
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError(f"{arch} with mlp_bias=True is not supported (the MLP runs without biases)")
    quant = getattr(hf, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method == "mxfp4":  # GPT-OSS as released: its experts as uint8 blocks and scales beside the bf16 rest
        raise UnsupportedModelError(
            f"{arch} safetensors with MXFP4 experts (quantization_config quant_method 'mxfp4') are not supported; "
            "dequantize them to bf16 first (transformers: Mxfp4Config(dequantize=True), then save_pretrained)")
    scalars = {}
    for name in fam.scalars:
        value = getattr(hf, name, None)
        if value is not None:
            target, convert = CONFIG_SCALARS[name]
            scalars[target] = convert(value)
    if fam.embed_scale_sqrt_hidden:
        scalars["embed_scale"] = hf.hidden_size ** 0.5
    mla = _mla(hf, arch) if fam.mla else None
    if mla is not None:
        scalars["attn_scale"] = _mla_scale(hf, mla)
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        # latent attention caches one head (kv_cache_dims); DeepSeek's configs keep a meaningless default here
        num_kv_heads=1 if mla is not None else getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        checkpoint_dtype=checkpoint_dtype,
        sliding_window=sliding,
        eos_token_ids=eos_ids,
        **_ropes(hf, head_dim),
        **flags,
        moe=_moe(hf, arch),
        family=fam,
        layer_windows=_layer_windows(hf, sliding),
        nope_layers=_nope_layers(hf),
        mla=mla,
        **scalars,
    )


LAYER_TYPES = ("full_attention", "sliding_attention")


def _nope_layers(hf) -> tuple[int, ...]:
    """The blocks without rotary embedding: SmolLM3's `no_rope_layers` holds, per layer, 1 where RoPE is
    used and 0 where it is not."""
    uses_rope = getattr(hf, "no_rope_layers", None)
    return tuple(i for i, use in enumerate(uses_rope) if not use) if uses_rope else ()


def _layer_windows(hf, sliding: int | None) -> tuple[int | None, ...]:
    """Each block's window from the config's `layer_types` (Gemma 2/3 alternate sliding and full layers;
    Qwen2 slides from `max_window_layers` on), or () when every block has `sliding` (Mistral, or none)."""
    types = getattr(hf, "layer_types", None)
    if not types or sliding is None:
        return ()
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return tuple(sliding if t == "sliding_attention" else None for t in types)


def _mla(hf, arch: str) -> MLAConfig:
    """Latent attention's shapes. V2 always rotates adjacent pairs (transformers' complex product); V3 as its
    rope_interleave says."""
    interleaved = True if arch == "DeepseekV2ForCausalLM" else bool(getattr(hf, "rope_interleave", True))
    return MLAConfig(kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                     qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                     q_lora_rank=getattr(hf, "q_lora_rank", None) or None, rope_interleaved=interleaved)


def _mla_scale(hf, mla: MLAConfig) -> float:
    """q . k's scale: 1 / sqrt(qk_nope + qk_rope), times YaRN's mscale(factor, mscale_all_dim) squared, which
    DeepSeek applies to every dim of the score (the rotary table's own attention factor covers only the rotary
    dims), as transformers' yarn_apply_mscale does."""
    import math

    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", params.get("type", "default")) != "default" and all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def _moe(hf, arch: str) -> MoEConfig | None:
    """The mixture's shape from the config; which blocks are sparse follows transformers: Qwen2/3-MoE
    skip `mlp_only_layers` and keep every `decoder_sparse_step`-th block; Mixtral and OLMoE are sparse
    everywhere."""
    if arch not in MOE_ARCHITECTURES:
        return None
    layers = range(hf.num_hidden_layers)
    fam = family(arch)
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return _deepseek_moe(hf, arch)
    if arch == "MixtralForCausalLM":
        experts, width, norm_topk = hf.num_local_experts, hf.intermediate_size, True
    elif arch == "GptOssForCausalLM":  # the softmax over the top k already sums to 1
        experts, width, norm_topk = hf.num_local_experts, hf.intermediate_size, False
    else:
        experts = hf.num_experts
        width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        norm_topk = bool(getattr(hf, "norm_topk_prob", False))
    sparse = tuple(layers)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step, dense = getattr(hf, "decoder_sparse_step", 1) or 1, set(getattr(hf, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0)
    shared = getattr(hf, "shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
    if experts < 1:
        raise UnsupportedModelError(f"{arch} with {experts} experts has no mixture to route to")
    swiglu = {}
    if fam.expert_mlp == "clamped_swiglu":
        swiglu = dict(swiglu_alpha=float(hf.swiglu_alpha), swiglu_limit=float(hf.swiglu_limit))
    return MoEConfig(num_experts=experts, top_k=hf.num_experts_per_tok, expert_intermediate_size=width,
                     norm_topk_prob=norm_topk, sparse_layers=sparse, shared_expert_intermediate_size=shared or 0,
                     expert_mlp=fam.expert_mlp, **swiglu)


def _deepseek_moe(hf, arch: str) -> MoEConfig:
    """DeepSeek's mixture as transformers runs it: blocks from first_k_dense_replace on are sparse; V3 scores
    by sigmoid and chooses by the corrected scores in its best groups, renormalising when norm_topk_prob; V2
    scores by softmax, chooses greedily or within its best groups (topk_method), and never renormalises. Both
    scale the chosen weights by routed_scaling_factor and add n_shared_experts' one shared MLP."""
    v3 = arch == "DeepseekV3ForCausalLM"
    experts = hf.n_routed_experts
    if experts is None or experts < 1:
        raise UnsupportedModelError(f"{arch} with n_routed_experts={experts} has no mixture to route to")
    norm_topk = bool(getattr(hf, "norm_topk_prob", False))
    method = "noaux_tc" if v3 else (getattr(hf, "topk_method", None) or "greedy")
    if not v3 and norm_topk:
        # DeepSeek's own V2 code renormalises then; transformers' V2 router (the reference here) does not.
        raise UnsupportedModelError(f"{arch} with norm_topk_prob=True is not supported: transformers and "
                                    "DeepSeek's V2 code disagree on it")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"{arch} topk_method {method!r} is not supported; supported: greedy, "
                                    "group_limited_greedy")
    first_dense = getattr(hf, "first_k_dense_replace", 0) or 0
    width = hf.moe_intermediate_size
    return MoEConfig(num_experts=experts, top_k=hf.num_experts_per_tok, expert_intermediate_size=width,
                     norm_topk_prob=norm_topk and v3, sparse_layers=tuple(range(first_dense, hf.num_hidden_layers)),
                     scoring="sigmoid" if v3 else "softmax", topk_method=method,
                     n_group=getattr(hf, "n_group", None) or 1, topk_group=getattr(hf, "topk_group", None) or 1,
                     routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0), router_fp32=True,
                     shared_mlp_intermediate_size=width * (getattr(hf, "n_shared_experts", 0) or 0))


def _ropes(hf, head_dim: int) -> dict:
    """The global RoPE table and, where sliding-window layers have their own (Gemma 3's
    `rope_parameters` keyed by layer type), the local one."""
    # transformers 5 normalises both config styles into rope_parameters; 4.x keeps rope_scaling.
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if "full_attention" not in params:
        inv_freq, scaling = _rope(hf, head_dim, params)
        out = dict(rope_inv_freq=inv_freq, rope_attention_scaling=scaling)
        if params.get("rope_type", params.get("type")) == "longrope":
            out.update(_long_rope(hf, params))
        return out
    inv_freq, scaling = _rope(hf, head_dim, params["full_attention"], "full_attention")
    out = dict(rope_inv_freq=inv_freq, rope_attention_scaling=scaling)
    local = params.get("sliding_attention")
    if local is not None:
        local_freq, local_scaling = _rope(hf, head_dim, local, "sliding_attention")
        if (local_freq, local_scaling) != (inv_freq, scaling):
            out.update(local_rope_inv_freq=local_freq, local_rope_attention_scaling=local_scaling)
    return out


def _long_rope(hf, params: dict) -> dict:
    """LongRoPE's long table (long_factor), used past original_max_position_embeddings, as transformers
    computes it for a sequence one token longer than that."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = params.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings", None)
    if not original:
        raise UnsupportedModelError("rope type 'longrope' without original_max_position_embeddings is not supported")
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, torch.device("cpu"), seq_len=int(original) + 1)
    return dict(rope_long_inv_freq=tuple(inv_freq.float().tolist()), rope_long_after=int(original))


def _rope(hf, head_dim: int, params: dict, layer_type: str | None = None) -> tuple[tuple[float, ...], float]:
    """RoPE inverse frequencies (head_dim / 2 values) and attention scaling, with the rope scaling applied."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kw = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **kw)
        return tuple(inv_freq.float().tolist()), float(scaling)
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    # Partial rotary (Phi-3/4, GLM-4): only the first `dim` of each head's dims rotate; the table's length
    # says how many (the math rotates 2 * len(inv_freq) dims).
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return tuple(inv_freq.tolist()), 1.0
