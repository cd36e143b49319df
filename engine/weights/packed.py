"""Weights that stay packed in memory and are multiplied packed, or unpacked just before use.

The model math calls `linear(x, w, bias)` and `embedding(ids, w)` (engine.model); `w` is either a
plain tensor or one of the classes here, each of which knows how to multiply itself:

  GGUFWeight   GGML blocks as they lie in the file; dequantized to the compute dtype at each use.
               This is how a streamed GGUF block is computed, and, in float32, the exact
               reference mode (bit-identical dequantization, then an fp32 matmul).
  Int4Weight   4-bit codes in aten's CPU int4 layout with a (scale, zero) per 32-weight group,
               multiplied by `_weight_int4pack_mm_for_cpu` without unpacking.
  Int8Weight   int8 codes with one scale per output row, multiplied by `_weight_int8pack_mm`.

Q4_0, Q4_1 and Q4_K carry exactly the kernel's information: a 4-bit code and, per 32 weights, a
scale and an offset (Q4_K's are products of a super-block scale and a 6-bit sub-scale). Repacking
them keeps every code; only the scale and offset are rounded to the compute dtype (the kernel
reads them in it), and the offset is rewritten for the kernel's centred codes:
  Q4_0  d * (q - 8)               -> scale d,      zero 0
  Q4_1  d * q + m                 -> scale d,      zero m + 8 d
  Q4_K  (d sc) * q - (dmin mn)    -> scale d sc,   zero 8 d sc - dmin mn
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from .dequant import _f16, _nibbles, dequantize, k_scale_min

GROUP = 32  # weights per (scale, zero) group of the int4 kernel, and of every ggml 4-bit type
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)


class GGUFWeight:
    """GGML-packed rows, (rows, bytes_per_row) uint8, dequantized to `dtype` on use."""

    def __init__(self, data: torch.Tensor, qtype: Q, shape: tuple[int, int], dtype: torch.dtype):
        self.data, self.qtype, self.shape, self.dtype = data, qtype, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dense(self) -> torch.Tensor:
        # The dequantization is exact in fp32; the cast rounds once, like casting a fp32 checkpoint.
        return dequantize(self.data, self.qtype, self.shape).to(self.dtype)  # (out, in)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.dense(), bias)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        # Only the looked-up rows are unpacked: (tokens, hidden).
        return dequantize(self.data[ids], self.qtype, (ids.shape[0], self.shape[1])).to(self.dtype)


class Int4Weight:
    """aten CPU int4 layout: (out, in / 2) uint8 codes, (in / 32, out, 2) scale-and-zero."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, shape: tuple[int, int]):
        self.packed, self.scale_zero, self.shape = packed, scale_zero, tuple(shape)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scale_zero)
        y = y.reshape(*lead, self.shape[0])  # (..., out)
        return y if bias is None else y + bias

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   dtype: torch.dtype) -> "Int4Weight":
        """codes (out, in) in 0..15; scale, zero (out, in / 32) meaning w = (q - 8) * scale + zero."""
        out, inner = codes.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()  # (in/32, out, 2)
        return cls(packed, scale_zero, (out, inner))


class Int8Weight:
    """(out, in) int8 codes and (out,) scales: w = q * scale."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales, self.shape = codes, scales, tuple(codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.codes, self.scales)
        y = y.reshape(*lead, self.shape[0])  # (..., out)
        return y if bias is None else y + bias

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype) -> "Int8Weight":
        """Symmetric per-output-row int8 of a dense (out, in) weight."""
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
        codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(codes.contiguous(), scales.to(dtype))


def int4_from_gguf(data: torch.Tensor, qtype: Q, shape: tuple[int, int], dtype: torch.dtype) -> Int4Weight:
    """Repack Q4_0 / Q4_1 / Q4_K rows for the int4 kernel: codes kept, scale/offset in `dtype`."""
    out, inner = shape
    if inner % GROUP:
        raise ValueError(f"int4 repack needs rows that are a multiple of {GROUP}, got {inner}")
    if qtype == Q.Q4_K:
        blocks = data.reshape(-1, 144)  # (n_superblocks, 144)
        n = blocks.shape[0]
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1)
        sc, mn = k_scale_min(blocks[:, 4:16])  # (n, 8)
        scale = d * sc.float()  # (n, 8): one per 32 weights
        offset = dmin * mn.float()
        codes = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)
        zero = 8 * scale - offset
    else:
        size = {Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
        blocks = data.reshape(-1, size)  # (n_blocks, size)
        n = blocks.shape[0]
        scale = _f16(blocks[:, :2])  # (n, 1)
        if qtype == Q.Q4_0:
            zero, qs = torch.zeros_like(scale), blocks[:, 2:]
        else:
            zero, qs = _f16(blocks[:, 2:4]) + 8 * scale, blocks[:, 4:]
        codes = _nibbles(qs, 16)  # (n, 1, 32)
    groups = inner // GROUP
    return Int4Weight.from_codes(codes.reshape(out, inner), scale.reshape(out, groups),
                                 zero.reshape(out, groups), dtype)
