"""Transformer math as plain functions of (weights, activations, KV cache, step metadata).

Nothing here knows where weights live: a block's weights arrive as a dict of tensors from the streamer.
Nothing here knows which kernel runs an operation: engine.ops chooses (products, norms, rotary,
SwiGLU, attention, a whole block in one call). Nothing here branches on an architecture's name either:
how a family's block differs from Llama's (norm placement, activation, scales, caps) is its row of the
family table (arch.Family) and the numbers its config sets (arch.ModelConfig); what differs between the
blocks of one model (sliding window, RoPE table) arrives with the block's step inputs
(StepInputs.window, attn_mask, cos, sin).

Tokens of every sequence in a step are packed into one flat (tokens, hidden) matrix so that each
projection is a single matmul over the whole batch; only attention unpacks them into a padded
(seqs, heads, query_len, head_dim) layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import kv_quant, ops
from .arch import Family, ModelConfig, MoEConfig
from .kv_quant import QuantizedKV

if TYPE_CHECKING:
    from .attention_backend import AttentionScratch
    from .lora_serving import LoRARows


@dataclass
class StepInputs:
    """Everything about one batched step that is the same for every block; built once per step."""

    input_ids: torch.Tensor  # (tokens,) int64
    positions: torch.Tensor  # (tokens,) int64, position of each token in its sequence
    # (tokens, 1, head_dim) compute dtype, of the block's RoPE table; None for a block without rotary (NoPE)
    cos: torch.Tensor | None
    sin: torch.Tensor | None  # (tokens, 1, head_dim), its first half negated (rotary_cos_sin)
    # (tokens,) int64: where each token's K/V goes in a layer's pool viewed as (blocks * block_size,
    # kv_heads, head_dim): block_table[position // block_size] * block_size + position % block_size
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # (seqs, max_blocks) int64 KV blocks of each sequence, padded with 0
    # (tokens,) int64: the row of the padded (seqs * max_query) query layout that holds each token,
    # or None when every chunk has max_query tokens and the packed tokens already are that layout.
    # Integer rows, built on the host once per step: a boolean mask would cost a nonzero(), a host
    # sync, twice per block.
    pad_rows: torch.Tensor | None
    max_query: int
    context_len: int  # keys attended to: max over sequences of (last position + 1)
    attn_mask: torch.Tensor  # (seqs, 1, max_query, context_len) bool, True = may attend
    logits_index: torch.Tensor  # (rows,) flat index of each token whose logits are needed
    attn_chunk_bytes: int | None = None  # bound on one attention call's temporaries (None: the default)
    # Keys [0, open_keys) may be attended by every row of attn_mask (the cached prefix before the
    # earliest chunk's start, when no sliding window cuts it): attention skips their mask.
    open_keys: int = 0
    attn_scratch: AttentionScratch | None = None  # memory attention reuses across calls (the runner's)
    # (tokens, max_blocks) int64: each token's row of block_tables, when the runner chose token-by-token
    # attention for a step with several tokens in some sequence (tokenwise_attention_pays); else None.
    token_tables: torch.Tensor | None = None
    # The block's sliding window (attn_mask already applies it; the token-by-token kernel takes it as a number).
    window: int | None = None
    # The gather reads each table from this block on (the first a sliding window needs this step); attn_mask
    # covers keys from first_block * block_size to context_len. block_tables and token_tables stay whole.
    first_block: int = 0
    # Served LoRA adapters (engine.lora_serving): the adapter of each token and the rows of each adapter, or
    # None when every row is the base model's. The block's weights carry the adapters (RowLoRAWeight).
    lora: LoRARows | None = None


def norm(x: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The family's RMSNorm: x / rms(x) * (norm_offset + weight)."""
    return ops.rms_norm(x, norm_weight(weight, cfg), cfg.rms_norm_eps)


def norm_weight(weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The factor a norm multiplies by. Gemma stores w for (1 + w): the sum is formed here, in the weight's
    dtype (fp32 in the exact mode, as the reference forms it), rather than stored: a streamed block is a
    view of the file."""
    return weight if not cfg.norm_offset else weight + cfg.norm_offset


def rotary_inv_freq(cfg: ModelConfig, table: str = "global") -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim / 2,) fp32 and attention scaling of RoPE table "global", "local" (the
    sliding-window layers' own, where the model has one) or "long" (LongRoPE's, for sequences longer than
    cfg.rope_long_after), as computed at load (arch)."""
    if table == "local" and cfg.local_rope_inv_freq:
        return torch.tensor(cfg.local_rope_inv_freq, dtype=torch.float32), cfg.local_rope_attention_scaling
    if table == "long":
        return torch.tensor(cfg.rope_long_inv_freq, dtype=torch.float32), cfg.rope_attention_scaling
    return torch.tensor(cfg.rope_inv_freq, dtype=torch.float32), cfg.rope_attention_scaling


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (tokens, 1, head_dim) in `dtype` for apply_rotary, once per step; sin's first half
    is negated so that apply_rotary needs no negation per block."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # (tokens, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (tokens, head_dim)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    half = freqs.shape[-1]
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # negating after the cast: exact
    return cos[:, None], sin[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig,
           interleaved: bool | None = None) -> torch.Tensor:
    """RoPE in the family's form. x: (tokens, heads, head_dim); cos, sin: (tokens, 1, rotary_dim) from
    rotary_cos_sin. Only the first rotary_dim dims of each head rotate (partial rotary: Phi-3/4, GLM-4),
    as halves (ops.apply_rotary) or as adjacent pairs (GLM-4's interleaved form; `interleaved` overrides the
    family's choice where the config makes it: DeepSeek-V3's rope_interleave)."""
    rot = cos.shape[-1]
    interleaved = cfg.family.rope_interleaved if interleaved is None else interleaved
    if rot == x.shape[-1] and not interleaved:
        return ops.apply_rotary(x, cos, sin)
    xr = x[..., :rot]  # (tokens, heads, rotary_dim), a view
    if interleaved:
        half = rot // 2
        c, s = cos[..., :half], sin[..., half:]  # (tokens, 1, rotary_dim / 2): pair j's cos and sin
        x0, x1 = xr[..., 0::2], xr[..., 1::2]  # (tokens, heads, rotary_dim / 2)
        # The reference's x * cos + rotate_half(x) * sin with rotate_half(x)[2j] = -x[2j + 1]: the same
        # products and sums (a + (-b) * s is a - b * s exactly).
        out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)  # (tokens, heads, rotary_dim)
    else:
        out = xr * cos + xr.roll(rot // 2, -1) * sin
    return torch.cat((out, x[..., rot:]), dim=-1) if rot < x.shape[-1] else out


def scale_embeddings(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x (tokens, hidden) times the family's embedding scale (Gemma: sqrt(hidden); Granite: its multiplier).
    A Python float: fp32 multiplies by it as the fp32 reference does; bf16 in fp32 with one rounding, as
    llama.cpp does (transformers' bf16 Gemma rounds the scale to bf16 first: sqrt(640) becomes 25.25)."""
    return x if cfg.embed_scale == 1.0 else x * cfg.embed_scale


def attention(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepInputs,
    cfg: ModelConfig,
) -> torch.Tensor:
    """Self-attention of the normed x (tokens, hidden) over the block's KV cache -> (tokens, hidden)."""
    if cfg.mla is not None:
        return latent_attention(x, w, k_cache, step, cfg)
    tokens = x.shape[0]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    fused = "wqkv" in w  # resident blocks: q, k, v stacked at load (engine.weights.packed.fuse)
    if fused:
        qkv = ops.linear(x, w["wqkv"], w.get("bqkv"))  # (tokens, (heads + 2 kv_heads) * head_dim)
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)  # views
    else:
        q = ops.linear(x, w["wq"], w.get("bq"))  # (tokens, heads*head_dim)
        k = ops.linear(x, w["wk"], w.get("bk"))  # (tokens, kv_heads*head_dim)
        v = ops.linear(x, w["wv"], w.get("bv"))
    if fused and not cfg.qk_norm and cfg.clip_qkv is None and step.cos is not None:
        # q's and k's heads are adjacent in each row of qkv: one rotary over both.
        qk = rotate(qkv.view(tokens, nh + 2 * nkv, hd)[:, :nh + nkv], step.cos, step.sin, cfg)
        q, k, v = qk[:, :nh], qk[:, nh:], v.view(tokens, nkv, hd)  # (tokens, heads | kv_heads, head_dim)
    else:
        if cfg.qk_norm and cfg.qk_norm_whole:  # OLMoE: one norm over all heads, before the clip
            q = norm(q, w["q_norm"], cfg)
            k = norm(k, w["k_norm"], cfg)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(tokens, nh, hd), k.view(tokens, nkv, hd), v.view(tokens, nkv, hd)
        if cfg.qk_norm and not cfg.qk_norm_whole:
            q = norm(q, w["q_norm"], cfg)
            k = norm(k, w["k_norm"], cfg)
        if step.cos is not None:
            q = rotate(q, step.cos, step.sin, cfg)
            k = rotate(k, step.cos, step.sin, cfg)

    sinks = w.get("sinks")  # (heads,) GPT-OSS: a logit per head in every softmax's denominator
    if isinstance(k_cache, QuantizedKV):
        out = quantized_attention(q, k, v, k_cache, v_cache, step, cfg, sinks)  # (tokens, heads*head_dim)
        return ops.linear(out, w["wo"], w.get("bo"))
    # The token-by-token kernel takes neither a soft-cap nor sinks.
    tables = ops.token_by_token(step, q, k, v, k_cache) if cfg.attn_softcap is None and sinks is None else None
    if tables is not None:
        factor = 1.0 if cfg.attn_scale is None else cfg.attn_scale * hd ** 0.5
        if factor != 1.0:
            # The kernel scales by 1/sqrt(head_dim); the family's own scale goes into q (16-bit only: the
            # exact fp32 mode takes the path below, which passes the scale to the attention call).
            q = q * factor
        out = ops.decode_attention(q, k, v, k_cache, v_cache, step, tables)  # (tokens, heads*head_dim)
        return ops.linear(out, w["wo"], w.get("bo"))
    # k_cache: (blocks, block_size, kv_heads, head_dim); flattened, one row per token position.
    # index_copy_ rather than indexed assignment: the same copy without advanced indexing's setup.
    k_cache.view(-1, nkv, hd).index_copy_(0, step.slot_mapping, k)
    v_cache.view(-1, nkv, hd).index_copy_(0, step.slot_mapping, v)

    qp = padded_queries(q, step)  # (seqs, heads, max_query, head_dim)
    first = step.first_block
    tables, ctx = step.block_tables[:, first:], step.context_len - first * k_cache.shape[1]
    keys = gather_blocks(k_cache, tables, ctx)  # (seqs, kv_heads, context from the first block, head_dim)
    values = gather_blocks(v_cache, tables, ctx)
    # (seqs, heads, max_query, head_dim)
    out = ops.attend(qp, keys, values, step.attn_mask, step.attn_chunk_bytes, step.open_keys, step.attn_scratch,
                     scale=cfg.attn_scale, softcap=cfg.attn_softcap, sinks=sinks)
    out = unpadded_outputs(out, step).reshape(-1, nh * hd)  # (tokens, heads*head_dim)
    return ops.linear(out, w["wo"], w.get("bo"))


def latent_attention(x: torch.Tensor, w: dict[str, torch.Tensor], cache: torch.Tensor, step: StepInputs,
                     cfg: ModelConfig) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3) of the normed x (tokens, hidden) -> (tokens, hidden).

    The cache (blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim) holds each token's normed latent c and
    its rotated key k_r, shared by every head. Head h's key is [W_UK[h] c, k_r] and its value W_UV[h] c (W_UK,
    W_UV: the K and V rows of wkv_b), so q . k = (q_nope W_UK[h]) . c + q_rope . k_r: each head's q_nope is
    taken into latent space once (weight absorption), attention runs over [c, k_r] with c as its values,
    and W_UV takes each head's output out of latent space. The per-head K and V are never formed; the
    reference forms them, so the two agree to rounding, not bit for bit."""
    a, tokens, nh = cfg.mla, x.shape[0], cfg.num_heads
    r, dn, dr, dv = a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    if a.q_lora_rank is None:
        q = ops.linear(x, w["wq"])  # (tokens, heads * (dn + dr))
    else:
        q = ops.linear(norm(ops.linear(x, w["wq_a"], w.get("bq_a")), w["q_a_norm"], cfg), w["wq_b"])
    q_nope, q_rope = q.view(tokens, nh, dn + dr).split((dn, dr), dim=-1)  # (tokens, heads, dn | dr) views
    latent, k_rope = ops.linear(x, w["wkv_a"], w.get("bkv_a")).split((r, dr), dim=-1)  # (tokens, r | dr)
    latent = norm(latent, w["kv_a_norm"], cfg)  # (tokens, r)
    if step.cos is not None:
        q_rope = rotate(q_rope, step.cos, step.sin, cfg, a.rope_interleaved)  # (tokens, heads, dr)
        k_rope = rotate(k_rope.view(tokens, 1, dr), step.cos, step.sin, cfg, a.rope_interleaved)
    entry = torch.cat((latent, k_rope.view(tokens, dr)), dim=-1)[:, None]  # (tokens, 1, r + dr): the one cached head
    cache.view(-1, 1, r + dr).index_copy_(0, step.slot_mapping, entry)
    if "wkv_b" in w:
        wkv_b = w["wkv_b"].view(nh, dn + dv, r)  # (heads, dn + dv, r): each head's K rows, then its V rows
        w_uk, w_uv = wkv_b[:, :dn], wkv_b[:, dn:]  # (heads, dn, r), (heads, dv, r)
    else:  # llama.cpp's files store them apart, K's transposed (MLAConfig.kv_b_split)
        w_uk, w_uv = w["wk_b"].transpose(1, 2), w["wv_b"]  # (heads, dn, r), (heads, dv, r)
    q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # (tokens, heads, r)
    qp = padded_queries(torch.cat((q_latent, q_rope), dim=-1), step)  # (seqs, heads, max_query, r + dr)
    first = step.first_block
    tables, ctx = step.block_tables[:, first:], step.context_len - first * cache.shape[1]
    keys = gather_blocks(cache, tables, ctx)  # (seqs, 1, context, r + dr)
    out = ops.attend_latent(qp, keys, r, step.attn_mask, cfg.attn_scale, step.attn_chunk_bytes)  # (seqs, heads, mq, r)
    out = unpadded_outputs(out, step)  # (tokens, heads, r)
    out = torch.einsum("thr,hvr->thv", out, w_uv)  # (tokens, heads, dv)
    return ops.linear(out.reshape(tokens, nh * dv), w["wo"], w.get("bo"))


def padded_queries(q: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """q (tokens, heads, head_dim) -> (seqs, heads, max_query, head_dim): each sequence's queries in a row of
    max_query, prompt chunks shorter than it padded with zeros (step.pad_rows: each token's padded row)."""
    seqs, mq = step.block_tables.shape[0], step.max_query
    if step.pad_rows is not None:
        qp = q.new_zeros(seqs * mq, *q.shape[1:])
        qp[step.pad_rows] = q
    else:
        qp = q
    return qp.view(seqs, mq, *q.shape[1:]).transpose(1, 2)


def unpadded_outputs(out: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """padded_queries' inverse for attention's output (seqs, heads, max_query, head_dim) -> (tokens, heads,
    head_dim), the padding rows dropped."""
    seqs, nh, mq, hd = out.shape
    out = out.transpose(1, 2).reshape(seqs * mq, nh, hd)
    return out if step.pad_rows is None else out[step.pad_rows]


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedKV,
                        v_cache: QuantizedKV, step: StepInputs, cfg: ModelConfig,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a quantized KV cache (engine.kv_quant). q (tokens, heads, head_dim), k, v (tokens,
    kv_heads, head_dim) after RoPE -> (tokens, heads*head_dim) in q's dtype. With the format's rotation, Q,
    K and V are rotated by the same orthonormal H: scores need no inverse, and the output, a mix of
    rotated V rows, is rotated back once per query. The step's own K/V are written quantized first, so
    a token attends to its own key as later tokens will see it. sinks: (heads,) attention sinks or None."""
    tokens, nh, hd = q.shape
    quant, dtype = k_cache.quant, q.dtype
    if quant.rotate:
        q, k, v = kv_quant.rotate(q), kv_quant.rotate(k), kv_quant.rotate(v)  # fp32
    ops.write_quantized(k_cache, step.slot_mapping, k)
    ops.write_quantized(v_cache, step.slot_mapping, v)
    scale = hd ** -0.5 if cfg.attn_scale is None else cfg.attn_scale
    tables = ops.quantized_kv_tables(step, q) if cfg.attn_softcap is None and sinks is None else None
    if tables is not None:
        out = ops.quantized_decode_attention(q, k_cache, v_cache, step, tables, scale)  # (tokens, heads, hd) fp32
    else:
        qp = padded_queries(q.to(dtype), step)  # (seqs, heads, max_query, head_dim)
        out = ops.attend_quantized(qp, k_cache, v_cache, step, scale, cfg.attn_softcap, sinks)  # (seqs, heads, mq, hd)
        out = unpadded_outputs(out, step)  # (tokens, heads, head_dim)
    if quant.rotate:
        out = kv_quant.rotate(out)  # H is symmetric and orthonormal: its own inverse
    return out.to(dtype).reshape(tokens, nh * hd)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first context_len positions of each sequence, through its block table.
    cache: (blocks, block_size, kv_heads, head_dim); block_tables: (seqs, max_blocks)
    -> (seqs, kv_heads, context_len, head_dim), the layout SDPA takes."""
    seqs, max_blocks = block_tables.shape
    _, bs, nkv, hd = cache.shape
    # index_select over whole blocks, not cache[block_tables]: advanced indexing copies element by
    # element through TensorIterator, index_select a block (block_size * kv_heads * head_dim values)
    # at a time: several times faster for the steps the engine forms.
    x = cache.index_select(0, block_tables.flatten())  # (seqs * max_blocks, block_size, kv_heads, head_dim), a copy
    x = x.view(seqs, max_blocks * bs, nkv, hd)[:, :context_len]  # (seqs, context, kv_heads, head_dim)
    return x.transpose(1, 2)


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str = "", activation: str = "silu") -> torch.Tensor:
    """Gated MLP over w[prefix + "w_gate" / "w_up" / "w_down"] (prefix "shared." for Qwen2-MoE's shared
    expert), or "w_gate_up" where gate and up were stacked at load (engine.weights.packed.fuse). activation:
    "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    gate_up = w.get(prefix + "w_gate_up")
    if gate_up is not None:
        gate, up = ops.linear(x, gate_up).chunk(2, dim=-1)  # (tokens, intermediate) views
    else:
        gate, up = ops.linear(x, w[prefix + "w_gate"]), ops.linear(x, w[prefix + "w_up"])
    if activation == "gelu_tanh":
        return ops.linear(F.gelu(gate, approximate="tanh") * up, w[prefix + "w_down"])
    return ops.linear(ops.silu_mul(gate, up), w[prefix + "w_down"])


def attention_residual(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepInputs,
    cfg: ModelConfig,
) -> torch.Tensor:
    """The first half of a block: x + attention(norm(x)), with the family's norms around attention and its
    residual scale. (tokens, hidden) -> (tokens, hidden)."""
    norms = cfg.family.norms
    a = attention(norm(x, w["attn_norm"], cfg) if "attn_norm" in norms else x, w, k_cache, v_cache, step, cfg)
    if "post_attn_norm" in norms:
        a = norm(a, w["post_attn_norm"], cfg)
    return x + _residual_scaled(a, cfg)


def mlp_residual(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The second half of a dense block: h + mlp(norm(h)), with the family's norms and activation."""
    return mlp_output(h, mlp(mlp_input(h, w, cfg), w, activation=cfg.family.activation), w, cfg)


def mlp_input(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """What a dense block's MLP reads: norm(h), or h in families without that norm. (tokens, hidden)"""
    return norm(h, w["mlp_norm"], cfg) if "mlp_norm" in cfg.family.norms else h


def mlp_output(h: torch.Tensor, m: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The block's output from its MLP's, m = mlp(mlp_input(h)): h + m, with the family's post-norm and
    residual scale. Split from mlp_residual so the MLP itself may compute where its weights lie (the CPU)
    while the norms around it stay with the block. (tokens, hidden)"""
    if "post_mlp_norm" in cfg.family.norms:
        m = norm(m, w["post_mlp_norm"], cfg)
    return h + _residual_scaled(m, cfg)


def _residual_scaled(r: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return r if cfg.residual_scale == 1.0 else r * cfg.residual_scale


@dataclass(frozen=True)
class Routing:
    """Which experts each token of a step goes to, and with what weight."""

    expert_ids: torch.Tensor  # (tokens, top_k) int64
    weights: torch.Tensor  # (tokens, top_k) fp32 routing weights
    counts: list[int]  # (num_experts,) tokens routed to each expert, on the host

    @property
    def chosen(self) -> list[int]:
        """The union of the experts the step's tokens chose, ascending: what must be fetched."""
        return [e for e, n in enumerate(self.counts) if n]


def router_topk(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """h: (tokens, hidden) normed hidden states; w: the block's "router" (experts, hidden) and, where the family
    has one, "router_bias" (experts,) -> ids, weights (tokens, top_k). GPT-OSS (Family.router "topk_softmax"):
    the top k of the biased logits, then the softmax over those k alone. The others score in fp32: a softmax
    over every expert (Mixtral, Qwen, OLMoE, DeepSeek-V2) or a sigmoid of each (DeepSeek-V3); the top k of
    them, or of those in the topk_group best groups (group_limited_greedy: a group by its best score;
    noaux_tc: by its two best with V3's correction bias, which decides the choice only); renormalised over
    the k chosen when norm_topk_prob; times routed_scaling_factor."""
    m = cfg.moe
    if cfg.family.router == "topk_softmax":
        logits = ops.linear(h, w["router"], w.get("router_bias"))  # (tokens, experts)
        top, ids = torch.topk(logits, m.top_k, dim=-1)  # (tokens, top_k)
        return ids, torch.softmax(top.float(), dim=-1)
    if m.router_fp32:  # DeepSeek's router multiplies in fp32 whatever the compute dtype
        logits = ops.linear(h.float(), w["router"].float())  # (tokens, experts)
    else:
        logits = ops.linear(h, w["router"]).float()
    scores = torch.sigmoid(logits) if m.scoring == "sigmoid" else torch.softmax(logits, dim=-1)  # (tokens, experts)
    if m.topk_method == "greedy":
        weights, ids = torch.topk(scores, m.top_k, dim=-1)  # (tokens, top_k)
    else:
        per_group = m.num_experts // m.n_group
        choice = scores + w["router_bias"].float() if m.topk_method == "noaux_tc" else scores
        grouped = choice.view(-1, m.n_group, per_group)  # (tokens, groups, per_group)
        if m.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (tokens, groups)
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, m.topk_group, dim=-1, sorted=False)[1]  # (tokens, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (tokens, groups)
        keep = keep[:, :, None].expand_as(grouped).reshape(-1, m.num_experts)  # (tokens, experts)
        if m.topk_method == "noaux_tc":
            ids = torch.topk(choice.masked_fill(~keep, float("-inf")), m.top_k, dim=-1)[1]  # (tokens, top_k)
            weights = scores.gather(1, ids)  # the uncorrected scores weigh the chosen experts
        else:
            weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), m.top_k, dim=-1)
    if m.norm_topk_prob:
        total = weights.sum(dim=-1, keepdim=True)
        # V3 guards its sum of sigmoids as transformers does; a softmax's top k never sum to 0
        weights = weights / (total + 1e-20 if m.scoring == "sigmoid" else total)
    if m.routed_scaling_factor != 1.0:
        weights = weights * m.routed_scaling_factor
    return ids, weights


def guess_experts(hidden: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The experts a MoE block's router (w: its "mlp_norm", "router" and any "router_bias") chooses for hidden
    (tokens, hidden) taken before the block's own attention: (tokens, top_k) int64. The expert tier's guess
    of the next block's experts from this block's residual stream, made while this block computes."""
    normed = ops.rms_norm(hidden, w["mlp_norm"], cfg.rms_norm_eps)  # (tokens, hidden)
    ids, _ = router_topk(normed, w, cfg)
    return ids


def route(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig) -> Routing:
    """The router's choice for every token. counts crosses to the host (one sync per MoE block): which
    experts to fetch is a host decision, and the same sync gives route_experts its split sizes."""
    ids, weights = router_topk(h, w, cfg)
    counts = torch.bincount(ids.flatten(), minlength=cfg.moe.num_experts).tolist()
    return Routing(ids, weights, counts)


def moe_experts(
    h: torch.Tensor, routing: Routing, experts: dict[int, dict[str, torch.Tensor]], out: torch.Tensor,
    moe: MoEConfig | None = None,
) -> None:
    """Add into out (tokens, hidden) the weighted outputs of the given experts ({expert: its tensors, w_gate,
    w_up, w_down unless moe says otherwise}) for the tokens routed to them. Called once per group of fetched experts, so a
    cache smaller than one block's experts still computes the whole mixture, group by group.

    At decode every expert sees a token or two, so the cost is per op, not per FLOP: the group's rows
    are gathered once, its weighted outputs added once (index_add_ accumulates a row's contributions
    in fp32 and rounds once), and only each expert's own MLP runs per expert."""
    if not experts:
        return
    top_k = routing.expert_ids.shape[1]
    # Stable sort by expert: each expert's (token, choice) pairs become one contiguous run.
    order = torch.argsort(routing.expert_ids.flatten(), stable=True)  # (tokens * top_k,)
    runs = torch.split(order, routing.counts)  # num_experts runs, run e of length counts[e]
    pairs = torch.cat([runs[e] for e in experts])  # (n,) the group's (token, choice) pairs, expert by expert
    tokens = pairs // top_k  # (n,)
    x = h[tokens]  # (n, hidden)
    ys, start = [], 0
    for e, ew in experts.items():
        n = routing.counts[e]
        ys.append(mlp(x[start:start + n], ew) if moe is None else expert_mlp(x[start:start + n], ew, moe))
        start += n
    y = torch.cat(ys) if len(ys) > 1 else ys[0]  # (n, hidden)
    gate = routing.weights.flatten()[pairs, None]  # (n, 1) fp32
    out.index_add_(0, tokens, (y.float() * gate).to(out.dtype))


def clamped_swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert, x (n, hidden) -> (n, hidden), in transformers' GptOssExperts order: gate_up = x @
    w_gate_up_t + b (its columns alternate gate, up), gate clamped above at limit and up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate), then @ w_down_t + b. Safetensors store the weights (in, out): .mT
    hands ops.linear its (out, in) view without a copy. llama.cpp's files hold gate, up and down apart, (out,
    in) with a bias each (MoEConfig.gate_up_interleaved): the same products, row by row."""
    if "w_gate_up_t" in w:
        gate_up = ops.linear(x, w["w_gate_up_t"].mT, w["b_gate_up"])  # (n, 2 * intermediate)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # (n, intermediate) strided views
        down, down_bias = w["w_down_t"].mT, w["b_down"]  # (hidden, intermediate) view
    else:
        gate, up = ops.linear(x, w["w_gate"], w["b_gate"]), ops.linear(x, w["w_up"], w["b_up"])  # (n, intermediate)
        down, down_bias = w["w_down"], w["b_down"]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return ops.linear((up + 1) * glu, down, down_bias)  # (n, hidden)


def expert_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], moe: MoEConfig) -> torch.Tensor:
    """One routed expert's MLP in the family's form (MoEConfig.expert_mlp): x (n, hidden) -> (n, hidden)."""
    if moe.expert_mlp == "clamped_swiglu":
        return clamped_swiglu(x, w, moe.swiglu_alpha, moe.swiglu_limit)
    return mlp(x, w)


def shared_expert(h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The always-on expert: Qwen2-MoE's scaled per token by sigmoid(shared_gate . h), DeepSeek's (its shared
    experts as one MLP) unscaled: (tokens, hidden)."""
    if "shared_gate" not in w:
        return mlp(h, w, "shared.")
    return torch.sigmoid(ops.linear(h, w["shared_gate"])) * mlp(h, w, "shared.")


def block_forward(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepInputs,
    cfg: ModelConfig,
) -> torch.Tensor:
    """One dense decoder block. x: (tokens, hidden) -> (tokens, hidden)."""
    if not _llama_block(cfg, step):
        return mlp_residual(attention_residual(x, w, k_cache, v_cache, step, cfg), w, cfg)
    out = ops.fused_block(x, w, k_cache, v_cache, step, cfg)  # the same ops in one call, where it runs
    if out is not None:
        return out
    a = attention(ops.rms_norm(x, w["attn_norm"], cfg.rms_norm_eps), w, k_cache, v_cache, step, cfg)
    h, hn = ops.add_rms_norm(x, a, w["mlp_norm"], cfg.rms_norm_eps)  # h = x + a, hn = norm(h)
    return h + mlp(hn, w)


_LLAMA = Family()


def _llama_block(cfg: ModelConfig, step: StepInputs) -> bool:
    """The block is Llama's (norms, activation, no scales or caps, RoPE over whole heads as halves): the fused
    paths (the residual add with the next norm in one call, the whole block in one C++ call) compute exactly it."""
    f = cfg.family
    return (f.norms == _LLAMA.norms and f.activation == "silu" and not f.mla and not cfg.norm_offset
            and cfg.attn_scale is None and not f.attn_sinks and cfg.attn_softcap is None
            and cfg.residual_scale == 1.0 and step.cos is not None and not f.rope_interleaved
            and step.cos.shape[-1] == cfg.head_dim)


def final_logits(
    x: torch.Tensor, final_norm: torch.Tensor, head_weight, step: StepInputs, cfg: ModelConfig
) -> torch.Tensor:
    """Logits only for the tokens in step.logits_index (sampled, or scored for prompt logprobs): (rows, vocab)
    fp32, after the family's logit scaling (Granite) and soft-cap (Gemma 2)."""
    logits = ops.linear(norm(x[step.logits_index], final_norm, cfg), head_weight)  # (rows, vocab) compute dtype
    if cfg.logits_divisor != 1.0:
        logits = logits / cfg.logits_divisor
    if cfg.final_softcap is not None:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits.float()
