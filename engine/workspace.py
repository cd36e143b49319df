"""The step workspace estimate: peak activation memory of the largest step the scheduler may form,
one of the memory plan's inputs. Its attention part is attention_backend's own bound, so the plan and
the kernel agree."""

from __future__ import annotations

import torch

from . import attention_backend, ops
from .arch import ModelConfig


MIN_ATTN_CHUNK_BYTES = 8 << 20


def attention_chunk_bytes(budget: int | None) -> int | None:
    """The bound on one attention call's temporaries under a device budget: attention_backend's
    default (None), or an eighth of a budget too small for it (at least MIN_ATTN_CHUNK_BYTES), so
    that a small budget is not spent on the attention of one step; more, smaller calls instead.
    The plan records it; the workspace estimate and the runner's calls both use it."""
    if budget is None or budget // 8 >= attention_backend.CHUNK_BYTES:
        return None
    return max(MIN_ATTN_CHUNK_BYTES, budget // 8)


def workspace_bytes(cfg: ModelConfig, tokens: int, seqs: int, max_len: int, dtype: torch.dtype,
                    logits_rows: int | None = None, attn_chunk_bytes: int | None = None) -> int:
    """Peak activations of the largest step the scheduler may form (`tokens` tokens over up to
    `seqs` sequences, contexts up to max_len): hidden states and MLP intermediates, logits, and
    attention in its padded layout. A step of s sequences pads every query to the longest chunk, and
    a step of s - 1 decodes and one prefill chunk of tokens - s + 1 gives s * (tokens - s + 1) padded
    rows, far more than `tokens`. Attention holds: the padded query and its output (a few copies),
    the boolean mask and its GQA-folded copy, K and V gathered for each sequence, and the
    temporaries of the largest attend() call (bounded by attention_backend's chunking); and where a prompt
    chunk's packed products run dense on AMX, one chunk of a dequantized weight and its product (ops)."""
    isz = dtype.itemsize
    act = tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * isz
    logits = (logits_rows or seqs) * cfg.vocab_size * 4 * 3  # rows: k + 1 per sequence when verifying drafts
    # Latent attention (kv_cache_dims): every head's query, of the cache's width, over its one cached head.
    nkv, hd, _ = cfg.kv_cache_dims
    group = cfg.num_heads // nkv
    attn = 0
    for s in range(1, min(seqs, tokens) + 1):
        mq = min(tokens - s + 1, max_len)
        padded = s * mq * cfg.num_heads * hd * isz * 4
        masks = s * mq * max_len * (1 + group)
        gathered = 2 * s * nkv * max_len * hd * isz
        call = attention_backend.workspace_bytes(s, group * mq, max_len, nkv, hd, isz, attn_chunk_bytes)
        attn = max(attn, padded + masks + gathered + call)
    dense = ops.dense_product_workspace_bytes(tokens, max(cfg.hidden_size, cfg.intermediate_size))
    return act + attn + logits + dense
