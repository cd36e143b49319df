"""GGML block formats unpacked in plain torch, exactly as gguf-py's numpy reference does it.

Each function takes the packed bytes of whole blocks, `(n_blocks, type_size)` uint8, and returns
`(n_blocks, block_size)` float32. The arithmetic follows `gguf.quants` operation by operation
(scale and min converted from fp16 to fp32 first, then separate multiply and add, never a fused
multiply-add), so the results are bit-identical to `gguf.quants.dequantize`; tests check that.

Layouts (ggml-common.h): QK = 32 weights per block for the legacy types, QK_K = 256 for k-quants.
  Q4_0: d f16 | 16 B nibbles (low nibbles = weights 0..15, high = 16..31)    w = d * (q - 8)
  Q4_1: d f16 | m f16 | 16 B nibbles                                          w = d * q + m
  Q5_0: d f16 | qh u32 (5th bits) | 16 B nibbles                              w = d * (q - 16)
  Q5_1: d f16 | m f16 | qh u32 | 16 B nibbles                                 w = d * q + m
  Q8_0: d f16 | 32 x int8                                                     w = d * q
  Q4_K: d f16 | dmin f16 | 12 B 6-bit (scale, min) x 8 | 128 B nibbles        w = d*sc * q - dmin*m
  Q5_K: as Q4_K plus 32 B of 5th bits
  Q6_K: 128 B low nibbles | 64 B high 2 bits | 16 x int8 scales | d f16       w = d*sc * (q - 32)
  MXFP4: e u8 (E8M0 exponent) | 16 B nibbles (e2m1 codes)                    w = 2^(e-128) * E2M1_2X[q]
         (GPT-OSS's experts; OCP microscaling: the e2m1 values are kept doubled, so the scale is halved)
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian halves -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """(n, k) bytes -> (n, k // group, 2 * group): each group of `group` bytes gives its low
    nibbles, then its high nibbles (the order every ggml 4-bit format stores weights in)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return ((qs >> shifts) & 0x0F).reshape(n, -1, 2 * group)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count // 8) bytes -> (n, count) uint8 of single bits, bit i of byte j at j * 8 + i."""
    n = packed.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device).reshape(1, 1, 8)
    return ((packed.reshape(n, -1, 1) >> shifts) & 1).reshape(n, count)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return d * q + m


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Legacy 5-bit: 4 bytes of high bits (bit i = weight i) and 16 bytes of nibbles -> (n, 32)."""
    low = _nibbles(qs, 16).reshape(qs.shape[0], 32)
    return low | (_bits(qh, 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _five_bit(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _five_bit(b[:, 4:8], b[:, 8:]).float()
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes of packed 6-bit (scale, min) pairs -> two (n, 8) uint8."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 8, 1) scale and min of each 32-weight sub-block of a Q4_K/Q5_K super-block."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    return (d * sc.float()).reshape(n, 8, 1), (dmin * mn.float()).reshape(n, 8, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, mn = _k_scales(b)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (scale * q - mn).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, mn = _k_scales(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    low = _nibbles(qs, 32).reshape(n, 8, 32)
    # Bit j of qh byte i is the 5th bit of weight i of sub-block j.
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = (qh.reshape(n, 1, 32) >> shifts) & 1  # (n, 8, 32)
    q = (low | (high << 4)).float()
    return (scale * q - mn).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    scale = (_f16(d) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (scale * q).reshape(n, QK_K)


# e2m1 values doubled, by code (gguf-py's MXFP4.kvalues): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
E2M1_2X = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> float32 2^(e - 127) / 2, built from the bits as ggml_e8m0_to_fp32_half does
    (e < 2: the subnormals 2^-128 and 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(b[:, :1])  # (n, 1)
    q = _nibbles(b[:, 1:], 16).reshape(b.shape[0], 32).long()  # (n, 32) codes
    return d * torch.tensor(E2M1_2X, dtype=torch.float32, device=b.device)[q]


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def _f16_block(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


BLOCK_DEQUANTIZERS = {
    Q.F32: _f32, Q.F16: _f16_block, Q.BF16: _bf16,
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.MXFP4: _mxfp4,
}
SUPPORTED_TYPES = tuple(BLOCK_DEQUANTIZERS)


def dequantize(data: torch.Tensor, qtype: Q, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Packed rows `(..., bytes_per_row)` uint8 -> float32 `(..., row_len)` (or `shape`)."""
    fn = BLOCK_DEQUANTIZERS.get(qtype)
    if fn is None:
        raise ValueError(f"GGML type {Q(qtype).name} is not supported "
                         f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    if data.shape[-1] % type_size:
        raise ValueError(f"{Q(qtype).name}: row of {data.shape[-1]} bytes is not a whole number of "
                         f"{type_size}-byte blocks")
    lead = data.shape[:-1]
    blocks = data.reshape(-1, type_size)  # (n_blocks, type_size)
    out = fn(blocks)  # (n_blocks, block_size) float32
    row = data.shape[-1] // type_size * block_size
    return out.reshape(shape if shape is not None else (*lead, row))
