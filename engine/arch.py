"""Which architectures layerstream runs, and which weights (short names, shapes) each one needs.

The Hugging Face config is read with transformers' own `AutoConfig`, which normalises the 4.x
(`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`) styles. Everything
the model math needs from it, RoPE's frequencies included, is computed here once, so the math never
reads transformers' config object. What a weight is called in a checkpoint is the weights package's
business (each format has its own names); here a weight is its short name ("wq", "embed").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, UnsupportedModelError

# architecture name in config.json -> family flags
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    # Mixtures of experts (MoEConfig below): the same attention, an MLP that is a routed set of experts.
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3MoeForCausalLM": dict(qkv_bias=False, qk_norm=True),
    # OLMoE normalises the whole q and k projections (not each head) and may clip q, k, v.
    "OlmoeForCausalLM": dict(qkv_bias=False, qk_norm=True, qk_norm_whole=True),
}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # one routed expert: a SwiGLU MLP of its own


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

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok {self.top_k} must be between 1 and the number of experts {self.num_experts}")

    def expert_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        i = self.expert_intermediate_size
        return {"w_gate": (i, hidden), "w_up": (i, hidden), "w_down": (hidden, i)}


@dataclass(frozen=True)
class ModelConfig:
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
    rope_inv_freq: tuple[float, ...] = ()  # (head_dim / 2,) inverse frequencies, fp32 values
    rope_attention_scaling: float = 1.0
    o_bias: bool = False  # the output projection has a bias (OLMoE with attention_bias)
    qk_norm_whole: bool = False  # q_norm / k_norm span the whole projection, not one head (OLMoE)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] after projection (OLMoE)
    moe: MoEConfig | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    def block_shapes(self, layer: int = 0) -> dict[str, tuple[int, ...]]:
        """Every tensor of block `layer`, experts included (short names; see expert_key)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes = {
            "attn_norm": (h,),
            "wq": (q, h),
            "wk": (kv, h),
            "wv": (kv, h),
            "wo": (h, q),
            "mlp_norm": (h,),
        }
        if self.qkv_bias:
            shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
        if self.o_bias:
            shapes.update(bo=(h,))
        if self.qk_norm:
            shapes.update(q_norm=(q,), k_norm=(kv,)) if self.qk_norm_whole else shapes.update(q_norm=(d,), k_norm=(d,))
        if not self.is_moe_layer(layer):
            i = self.intermediate_size
            shapes.update(w_gate=(i, h), w_up=(i, h), w_down=(h, i))
            return shapes
        m = self.moe
        shapes["router"] = (m.num_experts, h)
        if m.shared_expert_intermediate_size:
            s = m.shared_expert_intermediate_size
            shapes.update({"shared.w_gate": (s, h), "shared.w_up": (s, h), "shared.w_down": (h, s),
                           "shared_gate": (1, h)})
        for e in range(m.num_experts):
            shapes.update({expert_key(e, k): shape for k, shape in m.expert_shapes(h).items()})
        return shapes

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
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{cfg_path}: architecture {archs or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or getattr(hf, "dtype", None)
    return config_from_hf(hf, arch, _torch_dtype(ckpt_dtype))


def config_from_hf(hf, arch: str, checkpoint_dtype: torch.dtype) -> ModelConfig:
    """ModelConfig from a transformers config (read from config.json, or from GGUF metadata)."""
    flags = SUPPORTED_ARCHITECTURES[arch]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    sliding = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    attention_bias = bool(getattr(hf, "attention_bias", False)) and arch in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM")
    if attention_bias:
        flags = {**flags, "qkv_bias": True, "o_bias": True}
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        checkpoint_dtype=checkpoint_dtype,
        sliding_window=sliding,
        eos_token_ids=eos_ids,
        **_rope(hf, head_dim),
        **flags,
        clip_qkv=getattr(hf, "clip_qkv", None) if arch == "OlmoeForCausalLM" else None,
        moe=_moe(hf, arch),
    )


def _moe(hf, arch: str) -> MoEConfig | None:
    """The mixture's shape from the config; which blocks are sparse follows transformers: Qwen2/3-MoE
    skip `mlp_only_layers` and keep every `decoder_sparse_step`-th block; Mixtral and OLMoE are sparse
    everywhere."""
    if arch not in MOE_ARCHITECTURES:
        return None
    layers = range(hf.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        experts, width, norm_topk = hf.num_local_experts, hf.intermediate_size, True
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
    return MoEConfig(num_experts=experts, top_k=hf.num_experts_per_tok, expert_intermediate_size=width,
                     norm_topk_prob=norm_topk, sparse_layers=sparse, shared_expert_intermediate_size=shared or 0)


def _rope(hf, head_dim: int) -> dict:
    """RoPE inverse frequencies and attention scaling, with the checkpoint's rope scaling applied."""
    # transformers 5 normalises both config styles into rope_parameters; 4.x keeps rope_scaling.
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
        return dict(rope_inv_freq=tuple(inv_freq.float().tolist()), rope_attention_scaling=float(scaling))
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return dict(rope_inv_freq=tuple(inv_freq.tolist()), rope_attention_scaling=1.0)
