"""Weights that stay packed in memory and are multiplied packed, or unpacked just before use.

The classes here are data: the packed bytes, their layout, and how they are made (from codes, from
GGUF blocks, by quantizing). engine.ops multiplies them (`ops.linear(x, w, bias)` takes a plain tensor or
one of these, told apart by `kind`), with the kernel chosen for the layout:

  GGUFWeight   GGML blocks as they lie in the file; dequantized to the compute dtype at each use.
               How a streamed GGUF block is computed in float32, the exact reference mode
               (bit-identical dequantization, then an fp32 matmul), on a GPU, and in fast mode
               without the VNNI kernels (with them, stream_repack.py repacks it like a resident one).
  Int4Weight   4-bit codes with a (scale, min) per 32-weight group, multiplied without unpacking by
               our AVX512-VNNI kernel (engine.kernels: int8 activations, integer dot products), or
               by aten's `_weight_int4pack_mm_for_cpu` where that kernel cannot run.
  Int8Weight   int8 codes with one scale per output row, multiplied by the same kernel's int8 twin, or
               by `_weight_int8pack_mm`.

Q4_0, Q4_1 and Q4_K carry exactly the kernel's information: a 4-bit code and, per 32 weights, a
scale and a min (Q4_K's are products of a super-block scale and a 6-bit sub-scale). Repacking
them keeps every code; only the scale and min are rounded to float16 (exact for Q4_0 and Q4_1,
whose file stores them in float16; one rounding of the product for Q4_K), or, in aten's layout, to
the compute dtype with the min rewritten as aten's zero for its centred codes:
  Q4_0  d * q - 8 d               -> scale d,      min -8 d
  Q4_1  d * q + m                 -> scale d,      min m
  Q4_K  (d sc) * q - (dmin mn)    -> scale d sc,   min -dmin mn
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from ... import ops
from .dequant import _f16, _nibbles, dequantize, k_scale_min

GROUP = 32  # weights per (scale, zero) group of the int4 kernel, and of every ggml 4-bit type
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
# what ggml_repack.cpp requantizes to int8 itself; any other type (MXFP4) takes the torch path
INT8_REPACK_TYPES = (Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)


class GGUFWeight:
    """GGML-packed rows, (rows, bytes_per_row) uint8, dequantized to `dtype` on use."""

    kind = "gguf"

    def __init__(self, data: torch.Tensor, qtype: Q, shape: tuple[int, int], dtype: torch.dtype):
        self.data, self.qtype, self.shape, self.dtype = data, qtype, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dense(self) -> torch.Tensor:
        # The dequantization is exact in fp32; the cast rounds once, like casting a fp32 checkpoint.
        return dequantize(self.data, self.qtype, self.shape).to(self.dtype)  # (out, in)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        # Only the looked-up rows are unpacked: (tokens, hidden).
        return dequantize(self.data[ids], self.qtype, (ids.shape[0], self.shape[1])).to(self.dtype)


LANES = 16  # rows per block of the VNNI layouts


# The k-quant layouts (KQuantWeight): code bytes per row block and group of 32, scale bytes per row block
# and super-block of 256.
KQUANT_BYTES = {"q4k": (256, 320), "q6k": (384, 288)}
KQUANT_TYPES = {Q.Q4_K: "q4k", Q.Q6_K: "q6k"}


def vnni_parts(kind: str, shape: tuple[int, int]) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    """(dtype, shape) of the codes and the scales of an (out, in) "int4", "int4s" (int4 in the symmetric
    form: scales only, Int4Weight.without_min), "int8", "q4k" or "q6k" weight in the VNNI layout
    (Int4Weight, Int8Weight, KQuantWeight below): what the C++ repack writes and the prepacked entry stores."""
    rows, inner = shape
    blocks, groups = -(-rows // LANES), inner // GROUP
    if kind == "int4":
        return (torch.uint8, (blocks, groups * 256)), (torch.float16, (blocks, groups, 2, LANES))
    if kind == "int4s":
        return (torch.uint8, (blocks, groups * 256)), (torch.float16, (blocks, groups, LANES))
    if kind in KQUANT_BYTES:
        code_bytes, super_bytes = KQUANT_BYTES[kind]
        return (torch.uint8, (blocks, groups * code_bytes)), (torch.uint8, (blocks, inner // 256, super_bytes))
    return (torch.uint8, (blocks, groups * 512)), (torch.float32, (blocks, LANES))


class Int4Weight:
    """4-bit codes q (0..15) with a (scale, min) per 32 weights of a row: w = scale * q + min.

    Stored in the layout of the int4 kernel this process uses (engine.ops.int4_layout()):
      "vnni"  rows in blocks of 16 (the last padded with zero rows), engine/kernels/int4_vnni.cpp:
              codes (out16 / 16, in / 32 * 256) uint8: per block and group of 32, four 64-byte vectors;
              in vector v, row j's 4 bytes hold q[8v + t] | q[8v + 4 + t] << 4 for t = 0..3;
              scales (out16 / 16, in / 32, 2, 16) float16: the block's 16 scales, then its 16 mins;
              or, symmetric (without_min: every min is -8 * scale, as in Q4_0), (out16 / 16, in / 32, 16)
              float16, the scales only: the kernel computes the min, 10% fewer bytes per weight.
              engine.kernels.int4_linear: activations quantized to int8 per 32, integer dot products.
      "aten"  aten's CPU int4 layout: codes (out, in / 2) uint8 from _convert_weight_to_int4pack_for_cpu,
              scales (in / 32, out, 2) (scale, zero) in the compute dtype meaning w = (q - 8) * scale + zero;
              _weight_int4pack_mm_for_cpu.
    """

    kind = "int4"
    group = GROUP  # weights per (scale, min)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], layout: str):
        self.codes, self.scales, self.shape, self.layout = codes, scales, tuple(shape), layout

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def vnni_args(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(codes, scales, out_features) for C++ callers of the VNNI kernel (engine/kernels/decode_block.cpp),
        or None in aten's layout."""
        return (self.codes, self.scales, self.shape[0]) if self.layout == "vnni" else None

    def without_min(self) -> "Int4Weight":
        """This weight in the symmetric vnni layout when every min is exactly -8 * its scale (Q4_0's
        d * q - 8 d), else itself: the same products (the kernel's -8 * scale is the stored min, bit
        for bit) from 0.5625 instead of 0.625 bytes per weight, which a memory-bound decode step reads."""
        if self.layout != "vnni" or self.scales.dim() != 4:
            return self
        scale, minimum = self.scales[:, :, 0], self.scales[:, :, 1]  # (blocks, in / 32, 16) float16
        if not torch.equal(minimum, scale * -8):  # float16 * -8 is exact where it does not overflow
            return self
        return Int4Weight(self.codes, scale.contiguous(), self.shape, self.layout)

    def clone(self) -> "Int4Weight":
        return Int4Weight(self.codes.clone(), self.scales.clone(), self.shape, self.layout)

    @classmethod
    def stack_rows(cls, parts: list["Int4Weight"]) -> "Int4Weight | None":
        """The parts' output rows stacked into one weight (engine.weights.packed.fuse), or None when this
        layout cannot stack them without repacking. Both layouts pack rows in tiles (vnni: blocks of
        16, the last padded; aten: BLOCK_N = 64), so the parts' packed bytes concatenate into the
        packing of the stacked rows exactly when every part but the last is whole tiles
        (tests/weights/test_fuse.py checks it against from_codes)."""
        layout = parts[0].layout
        tile = 16 if layout == "vnni" else 64
        if (any(p.shape[0] % tile for p in parts[:-1])
                or len({(p.layout, p.shape[1], p.scales.dtype, p.scales.dim()) for p in parts}) != 1):
            return None
        codes = torch.cat([p.codes for p in parts])  # vnni: (blocks, in / 32 * 256); aten: (out, in / 2)
        # vnni: (blocks, in / 32, 2, 16); aten: (in / 32, out, 2)
        scales = torch.cat([p.scales for p in parts], dim=0 if layout == "vnni" else 1)
        return cls(codes, scales, (sum(p.shape[0] for p in parts), parts[0].shape[1]), layout)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                   dtype: torch.dtype) -> "Int4Weight":
        """codes (out, in) in 0..15; scale, minimum (out, in / 32) meaning w = q * scale + minimum,
        packed for this process's int4 kernel (`dtype`: the compute dtype, which the aten layout
        keeps its scales in; the vnni layout keeps them in float16)."""
        out, inner = codes.shape
        if ops.int4_layout() == "vnni":
            return cls(*_vnni_layout(codes, scale, minimum), (out, inner), "vnni")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        zero = minimum + 8 * scale  # aten's kernel centres the codes: (q - 8) * scale + zero
        scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()  # (in/32, out, 2)
        return cls(packed, scale_zero, (out, inner), "aten")


def _vnni_layout(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of Int4Weight's "vnni" layout from codes (out, in) and scale, minimum (out, in / 32)."""
    out, inner = codes.shape
    groups, blocks = inner // GROUP, -(-out // 16)
    pad = blocks * 16 - out  # zero rows: code 0, scale 0, min 0
    q = F.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    q = q.reshape(blocks, 16, groups, 4, 2, 4)  # (block, row, group, v, low/high, t): k = 8 v + 4 half + t
    q = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # (block, group, v, row, t)
    sm = torch.stack([scale, minimum], dim=-1).float()  # (out, groups, 2)
    if not torch.isfinite(sm.half()).all():
        raise ValueError(f"int4: a group scale or minimum of a ({out}, {inner}) weight does not fit "
                         f"in float16 (|value| > 65504)")
    sm = F.pad(sm, (0, 0, 0, 0, 0, pad)).reshape(blocks, 16, groups, 2).permute(0, 2, 3, 1)  # (block, group, 2, row)
    return q.reshape(blocks, groups * 256).contiguous(), sm.half().contiguous()


class Int8Weight:
    """int8 codes with one scale per output row: w = q * scale. Like Int4Weight, in the layout of this
    process's kernel (engine.ops.int4_layout()):
      "vnni"  rows in blocks of 16 (the last padded with zero rows): codes (out16 / 16, in / 32 * 512)
              uint8 = q + 128, per block and group of 32 eight 64-byte vectors, vector v row j's 4 bytes
              being q[4v + t] + 128; scales (out16 / 16, 16) float32. engine.kernels.int8_linear.
      "aten"  codes (out, in) int8, scales (out,) in the compute dtype; `_weight_int8pack_mm`. Also
              used where the row is not a multiple of 32 (the activations are quantized per 32).
    """

    kind = "int8"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int] | None = None,
                 layout: str | None = None):
        # The layout is in the codes' type: the vnni layout's are offset to uint8.
        self.layout = layout or ("vnni" if codes.dtype == torch.uint8 else "aten")
        self.codes, self.scales = codes, scales
        self.shape = tuple(shape) if shape is not None else tuple(codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def vnni_args(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """As Int4Weight.vnni_args: float32 scales tell the int8 layout from the int4 one."""
        return (self.codes, self.scales, self.shape[0]) if self.layout == "vnni" else None

    def clone(self) -> "Int8Weight":
        return Int8Weight(self.codes.clone(), self.scales.clone(), self.shape, self.layout)

    @classmethod
    def stack_rows(cls, parts: list["Int8Weight"]) -> "Int8Weight | None":
        """The parts' output rows stacked into one weight (engine.weights.packed.fuse), or None when this
        layout cannot stack them without repacking: as for Int4Weight.stack_rows, the vnni layout's
        blocks of 16 rows concatenate when every part but the last is whole blocks; aten's rows always."""
        layout = parts[0].layout
        if ((layout == "vnni" and any(p.shape[0] % 16 for p in parts[:-1]))
                or len({(p.layout, p.shape[1], p.scales.dtype) for p in parts}) != 1):
            return None
        codes = torch.cat([p.codes for p in parts])  # vnni: (blocks, in / 32 * 512); aten: (out, in)
        scales = torch.cat([p.scales for p in parts])  # vnni: (blocks, 16); aten: (out,)
        return cls(codes, scales, (sum(p.shape[0] for p in parts), parts[0].shape[1]), layout)

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype) -> "Int8Weight":
        """Symmetric per-output-row int8 of a dense (out, in) weight."""
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
        codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        out, inner = w.shape
        if inner % GROUP == 0 and ops.int4_layout() == "vnni":
            blocks, pad = -(-out // 16), -out % 16
            q = (F.pad(codes, (0, 0, 0, pad)).to(torch.int16) + 128).to(torch.uint8)
            q = q.reshape(blocks, 16, inner // GROUP, 8, 4).permute(0, 2, 3, 1, 4)  # (block, group, v, row, t)
            s = F.pad(scales, (0, pad)).reshape(blocks, 16)
            return cls(q.reshape(blocks, -1).contiguous(), s.contiguous(), (out, inner), "vnni")
        return cls(codes.contiguous(), scales.to(dtype))


class KQuantWeight:
    """Q4_K ("q4k") or Q6_K ("q6k") rows with every stored bit kept, rearranged for the VNNI kernel
    (engine/kernels/int4_vnni.cpp, block_kernel_k; engine/kernels/ggml_repack.cpp, repack_kquant writes
    it): rows in blocks of 16 as Int4Weight's "vnni" layout, the codes' low nibbles in its arrangement
    (Q6_K's high bit pairs in two more vectors per group), and the 6- or 8-bit sub-scales left integers
    under each row's fp16 super-block scale. A decode step reads 4.625 bits a weight for Q4_K (Int4Weight's
    fp16 scale and min per 32 make it 5) and 6.5625 for Q6_K (the file's own; per-row int8 makes it 8).
      codes  (out16 / 16, in / 32 * 256 | 384) uint8
      scales (out16 / 16, in / 256, 320 | 288) uint8: per group of the super-block the 16 rows' sub-scales
             (Q4_K: scales then mins; Q6_K: those of weights 0..15 then 16..31), then the rows' fp16 d
             (Q4_K: then dmin): w = d sc q - dmin mn (Q4_K), d sc (q - 32) (Q6_K).
    Only made where the VNNI kernels and the C++ repack run (ops.gguf_repack())."""

    kind = "kquant"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], layout: str):
        self.codes, self.scales, self.shape, self.layout = codes, scales, tuple(shape), layout  # layout: q4k | q6k

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def vnni_args(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """As Int4Weight.vnni_args: uint8 scales tell the k-quant layouts apart from the others."""
        return self.codes, self.scales, self.shape[0]

    def clone(self) -> "KQuantWeight":
        return KQuantWeight(self.codes.clone(), self.scales.clone(), self.shape, self.layout)

    @classmethod
    def stack_rows(cls, parts: list["KQuantWeight"]) -> "KQuantWeight | None":
        """As Int4Weight.stack_rows: row blocks of 16 concatenate when every part but the last is whole blocks."""
        if (any(p.shape[0] % LANES for p in parts[:-1])
                or len({(p.layout, p.shape[1]) for p in parts}) != 1):
            return None
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                   (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].layout)


def kquant_nbytes(shape: tuple[int, int], layout: str) -> int:
    """Bytes of an (out, in) KQuantWeight."""
    (_, codes), (_, scales) = vnni_parts(layout, shape)
    return codes[0] * codes[1] + scales[0] * scales[1] * scales[2]


def int8_nbytes(shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Bytes of an (out, in) Int8Weight in this process's layout (`dtype`: the compute dtype)."""
    out, inner = shape
    if inner % GROUP == 0 and ops.int4_layout() == "vnni":
        out16 = -(-out // 16) * 16
        return out16 * inner + out16 * 4
    return out * inner + out * dtype.itemsize


def int4_nbytes(shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Bytes of an (out, in) Int4Weight in this process's layout (`dtype`: the compute dtype)."""
    out, inner = shape
    if ops.int4_layout() == "vnni":
        out, scale_bytes = -(-out // 16) * 16, 2  # rows padded to blocks of 16; float16 scales
    else:
        scale_bytes = dtype.itemsize
    return out * inner // 2 + out * (inner // GROUP) * 2 * scale_bytes


def int4_from_gguf(data: torch.Tensor, qtype: Q, shape: tuple[int, int], dtype: torch.dtype) -> Int4Weight:
    """Repack Q4_0 / Q4_1 / Q4_K rows for the int4 kernel: codes kept, scale and min rounded once."""
    out, inner = shape
    if inner % GROUP:
        raise ValueError(f"int4 repack needs rows that are a multiple of {GROUP}, got {inner}")
    if qtype == Q.Q4_K:
        blocks = data.reshape(-1, 144)  # (n_superblocks, 144)
        n = blocks.shape[0]
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1)
        sc, mn = k_scale_min(blocks[:, 4:16])  # (n, 8)
        scale = d * sc.float()  # (n, 8): one per 32 weights
        minimum = -(dmin * mn.float())
        codes = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)
    else:
        size = {Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
        blocks = data.reshape(-1, size)  # (n_blocks, size)
        n = blocks.shape[0]
        scale = _f16(blocks[:, :2])  # (n, 1)
        if qtype == Q.Q4_0:
            minimum, qs = -8 * scale, blocks[:, 2:]
        else:
            minimum, qs = _f16(blocks[:, 2:4]), blocks[:, 4:]
        codes = _nibbles(qs, 16)  # (n, 1, 32)
    groups = inner // GROUP
    return Int4Weight.from_codes(codes.reshape(out, inner), scale.reshape(out, groups),
                                 minimum.reshape(out, groups), dtype)
