"""Weight-only quantization at load time for bf16/fp16/fp32 safetensors checkpoints.

  int8: symmetric, one scale per output row (the group is the whole row: aten's int8 weight-only
        kernel takes exactly one scale per output channel). 1 byte per weight + 2 per row.
  int4: asymmetric, one (scale, min) per group of 32 consecutive weights of a row, codes 0..15,
        in the int4 kernel's layout (packed.Int4Weight). 0.5 byte per weight + 4 bytes per 32
        weights (float16 scale and min; aten's layout: the compute dtype).
Policy: the block projections (q, k, v, o, gate, up, down) are quantized; norms and biases stay in
the compute dtype; the embedding table stays as it is in the checkpoint (it is only gathered from);
the LM head is int8 in both modes (a 4-bit head costs more accuracy than it saves time).

quant_cache.QuantizedBlocks quantizes every block once per checkpoint (progress bar) into a cache entry
that later loads map; transports/quantized.py serves the packed weights to compute; the streamer's
counters and the plan count their packed bytes.
"""

from __future__ import annotations

import math

import torch

from .weights import GROUP, Int4Weight, Int8Weight, int4_nbytes, int8_nbytes

QUANTIZATIONS = ("int8", "int4")
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_int4(w: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """(out, in) dense -> Int4Weight with per-32 asymmetric (scale, zero)."""
    out, inner = w.shape
    if inner % GROUP:
        raise ValueError(f"int4 quantization needs rows that are a multiple of {GROUP}, got {inner}")
    g = w.float().reshape(out, inner // GROUP, GROUP)  # (out, groups, 32)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # (out, groups)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Weight.from_codes(codes.reshape(out, inner), scale, lo, dtype)


def quantize_weight(w: torch.Tensor, mode: str, dtype: torch.dtype):
    if mode == "int8":
        return Int8Weight.quantize(w, dtype)
    if mode == "int4":
        return quantize_int4(w, dtype)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")


def quantized_bytes(shape: tuple[int, ...], mode: str, dtype: torch.dtype) -> int:
    if mode == "int8":
        return int8_nbytes(shape, dtype)
    return int4_nbytes(shape, dtype)


def quantize_block(weights: dict[str, torch.Tensor], mode: str, dtype: torch.dtype) -> dict[str, object]:
    return {k: quantize_weight(v, mode, dtype) if k in PROJECTIONS else v for k, v in weights.items()}


def quantize_head(w: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    return Int8Weight.quantize(w, dtype)


def quantized_plan_bytes(cfg, embed_bytes: int, mode: str, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one quantized block, bytes of embeddings + norm + int8 head) for the memory plan;
    embed_bytes: the embedding table as stored (kept as the checkpoint's view)."""
    shapes = cfg.block_shapes()
    block = sum(quantized_bytes(shapes[k], mode, dtype) if k in PROJECTIONS
                else math.prod(shapes[k]) * dtype.itemsize for k in shapes)
    v, h = cfg.vocab_size, cfg.hidden_size
    return block, embed_bytes + h * dtype.itemsize + quantized_bytes((v, h), "int8", dtype)
