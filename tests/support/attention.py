"""Attention problems as the runner forms them, and the float64 reference they are checked against."""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, mask):
    """Plain softmax(q k^T / sqrt(d)) v in float64, K/V repeated per query head (repeat_interleave order)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (seqs, heads, query, context)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def padded_problem(counts: list[int], starts: list[int], heads: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype, seed: int = 0):
    """Random q/k/v and the runner's mask for chunks of `counts` tokens starting at `starts`:
    causal, shorter chunks padded to the longest (padding rows see key 0 only)."""
    g = torch.Generator().manual_seed(seed)
    seqs, mq, ctx = len(counts), max(counts), max(s + n for s, n in zip(starts, counts))
    q = torch.randn(seqs, heads, mq, head_dim, generator=g).to(dtype)  # (seqs, heads, max_query, head_dim)
    k = torch.randn(seqs, kv_heads, ctx, head_dim, generator=g).to(dtype)  # (seqs, kv_heads, context, head_dim)
    v = torch.randn(seqs, kv_heads, ctx, head_dim, generator=g).to(dtype)
    t, keys = torch.arange(mq), torch.arange(ctx)
    q_pos = torch.tensor(starts)[:, None] + t[None, :]  # (seqs, max_query)
    mask = keys[None, None, :] <= q_pos[:, :, None]  # (seqs, max_query, context)
    mask[..., 0] |= ~(t[None, :] < torch.tensor(counts)[:, None])
    return q, k, v, mask[:, None]
