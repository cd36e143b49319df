"""Fusing a resident block's projections that read the same input into one weight each:
q/k/v -> "wqkv" (and their biases -> "bqkv"), gate/up -> "w_gate_up".

A decode step on a small model is bound by per-op overhead as much as by the matmuls (SmolLM2-135M:
~30 blocks x ~100 small ops per token), so 5 matmuls per block become 2, and attention can rotate q
and k together (they are adjacent in wqkv's output). Stacking output rows changes no arithmetic:
each output element is still the same dot product over the same input, in the same kernel.

Resident blocks are fused here, once at load. A streamed block is a zero-copy view of the mapped file
(or its packed bytes), and stacking it would cost a copy of the block on every step; except streamed
GGUF blocks in CPU fast mode, which are copied anyway (repacked for the VNNI kernels) and so are
stacked by the same rules as they are written (stream_repack.py). Model math takes either form
(engine.model.attention / mlp look for the fused names first).

Fused only where the parts are the same kind of weight with the same packing (a Q4_K_M file mixes
Q4_K and Q6_K rows: those parts stay apart).
"""

from __future__ import annotations

import torch

from .weights import GGUFWeight, Int4Weight, Int8Weight, KQuantWeight

# fused name -> the parts, stacked in this order along the output rows
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
FUSED_BIAS = {"wqkv": ("bqkv", ("bq", "bk", "bv"))}


def stack_rows(parts: list):
    """One (sum of rows, in) weight computing what the parts compute, or None when they cannot be
    stacked (different kinds, packings, dtypes or input sizes)."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts) or len({p.shape[1] for p in parts}) != 1:
        return None
    if kind is torch.Tensor:
        if len({(p.dtype, p.device) for p in parts}) != 1:
            return None
        return torch.cat(parts)  # (sum out, in)
    if kind is Int4Weight:
        return Int4Weight.stack_rows(parts)
    if kind is Int8Weight:
        return Int8Weight.stack_rows(parts)
    if kind is KQuantWeight:
        return KQuantWeight.stack_rows(parts)
    if kind is GGUFWeight:
        if len({(p.qtype, p.dtype, p.data.shape[1]) for p in parts}) != 1:
            return None
        # (rows, bytes per row): a GGML row never shares a block with the next row.
        data = torch.cat([p.data for p in parts])
        return GGUFWeight(data, parts[0].qtype, (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].dtype)
    return None


def fuse_projections(w: dict) -> dict:
    """A block's weights with q/k/v and gate/up stacked where they can be; the rest as it was."""
    out = dict(w)
    for fused, names in FUSED.items():
        if not all(n in w for n in names):
            continue
        bias_name, bias_names = FUSED_BIAS.get(fused, (None, ()))
        biases = [w[b] for b in bias_names if b in w]
        if biases and (len(biases) != len(bias_names) or len({(b.dtype, b.device) for b in biases}) != 1):
            continue  # some projections biased and others not: keep them apart
        stacked = stack_rows([w[n] for n in names])
        if stacked is None:
            continue
        for n in (*names, *(bias_names if biases else ())):
            del out[n]
        out[fused] = stacked
        if biases:
            out[bias_name] = torch.cat(biases)  # (sum out,)
    return out


def drop_symmetric_mins(w: dict) -> dict:
    """A resident block's weights with every int4 weight whose mins are all -8 * scale (Q4_0) in the
    symmetric layout (Int4Weight.without_min): the same products from 10% fewer bytes, which a
    memory-bound decode step reads. Streamed blocks keep the stored mins (stream_repack.py fills
    fixed slots); both compute the same bits."""
    return {k: v.without_min() if isinstance(v, Int4Weight) else v for k, v in w.items()}
