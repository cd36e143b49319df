"""The quantized KV cache's number format: int8 or int4 codes with a float16 scale per group of values,
after an orthogonal (Hadamard) rotation of each head. Plain torch; the CPU attention kernel that reads
these codes directly is engine/kernels/kv_attention.cpp (chosen by engine.ops).

- int8: one scale per (token, KV head): absmax / 127, codes in [-127, 127] (llama.cpp's q8_0 rounding,
  over the whole head instead of 32 values: the rotation spreads a head's outliers over all of it, and
  2 scale bytes per head keep the cache at 1.94x fewer bytes than bf16 for head_dim 64).
- int4: one scale per 32 values (16 for a head_dim that 32 does not divide; llama.cpp's q4_0): d = m / -8 where m is the group's value of largest
  magnitude, codes round(x / d) clamped to [-8, 7] and stored + 8, two to a byte (even dimension in the
  low nibble). Four bits leave too few levels for one scale over a whole head.
- The scale is rounded to float16 before the codes are computed from it, so a code times its stored
  scale is the value the rounding chose.
- Rotation: each head's K (and V) is multiplied by H, an orthonormal Hadamard matrix (block-diagonal
  Sylvester blocks when head_dim is not a power of two). Outlier channels, which decide a group's scale,
  are spread over the group, so the rounding error of the other values shrinks. Q is rotated the same
  way, so Q.K' = Q H (K H)^T = Q K^T needs no inverse; the attention output, a mix of rotated V rows,
  is rotated back once per query (out H^T), never per key.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "int4")
INT4_GROUP = 32
SCALE_DTYPE = torch.float16
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class KVQuant:
    """How a quantized KV cache stores one head's vector of head_dim values."""

    bits: int  # 8 or 4
    head_dim: int
    rotate: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"KV quantization bits must be 8 or 4, got {self.bits}")
        if self.bits == 4 and self.head_dim % 16:
            raise ValueError(f"an int4 KV cache needs head_dim a multiple of 16, got {self.head_dim}")
        if self.head_dim % 2:
            raise ValueError(f"a quantized KV cache needs an even head_dim, got {self.head_dim}")

    @staticmethod
    def of(kv_cache_dtype: str, head_dim: int, rotate: bool = True) -> KVQuant | None:
        """The format of --kv-cache-dtype ("auto": None, the compute dtype)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        return None if kv_cache_dtype == "auto" else KVQuant(8 if kv_cache_dtype == "int8" else 4, head_dim, rotate)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def group(self) -> int:
        """Values per scale."""
        if self.bits == 8:
            return self.head_dim
        return INT4_GROUP if self.head_dim % INT4_GROUP == 0 else 16

    @property
    def code_width(self) -> int:
        """Bytes of codes per head vector."""
        return self.head_dim * self.bits // 8

    @property
    def groups(self) -> int:
        return self.head_dim // self.group

    @property
    def bytes_per_head(self) -> int:
        """Bytes one head's vector takes: codes and scales."""
        return self.code_width + self.groups * SCALE_DTYPE.itemsize

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       quant: KVQuant | None) -> int:
    """K and V of one token over every layer, in the compute dtype or quantized."""
    per_head = head_dim * dtype.itemsize if quant is None else quant.bytes_per_head
    return 2 * num_layers * num_kv_heads * per_head


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """(n, n) fp32 orthonormal: Sylvester's Hadamard matrix / sqrt(size) for n a power of two, else
    block-diagonal with the largest power-of-two block dividing n. Symmetric, so H^T = H = H^-1."""
    size = n & -n  # the largest power of two dividing n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / size ** 0.5
    return torch.block_diag(*[h] * (n // size)).float()


@functools.cache
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    return hadamard(n).to(device)  # once per device: not a host-to-device copy per layer and step


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) times the Hadamard matrix, in fp32: (..., head_dim) fp32."""
    return torch.matmul(x.float(), _hadamard_on(x.shape[-1], x.device))


def quantize(x: torch.Tensor, quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim), any float dtype -> codes (..., code_width) int8 / uint8, scales (..., groups) fp16."""
    xf = x.float().reshape(*x.shape[:-1], quant.groups, quant.group)  # (..., groups, group)
    if quant.bits == 8:
        scale = (xf.abs().amax(-1) / 127).clamp(max=_FP16_MAX).to(SCALE_DTYPE)  # (..., groups)
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        codes = (xf * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return codes.reshape(*x.shape[:-1], quant.code_width), scale
    idx = xf.abs().argmax(-1, keepdim=True)
    m = xf.gather(-1, idx).squeeze(-1)  # (..., groups): the signed value of largest magnitude
    scale = (m / -8).clamp(-_FP16_MAX, _FP16_MAX).to(SCALE_DTYPE)
    s = scale.float()
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    q = ((xf * inv[..., None]).round().clamp(-8, 7) + 8).to(torch.uint8)  # (..., groups, group) in [0, 15]
    q = q.reshape(*x.shape[:-1], quant.head_dim // 2, 2)
    codes = q[..., 0] | (q[..., 1] << 4)  # (..., head_dim / 2)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, quant: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., code_width), scales (..., groups) -> (..., head_dim) in dtype (code x scale in fp32,
    rounded once)."""
    lead = codes.shape[:-1]
    if quant.bits == 8:
        v = codes.float()
    else:
        lo, hi = (codes & 0xF), (codes >> 4)
        v = torch.stack((lo, hi), dim=-1).reshape(*lead, quant.head_dim).float() - 8  # (..., head_dim)
    v = v.reshape(*lead, quant.groups, quant.group) * scales.float()[..., None]
    return v.reshape(*lead, quant.head_dim).to(dtype)


class QuantizedKV:
    """One layer's K (or V) pool stored quantized: codes (blocks, block_size, kv_heads, code_width) and
    scales (blocks, block_size, kv_heads, groups), indexed by block like the compute-dtype pool."""

    def __init__(self, quant: KVQuant, num_blocks: int, block_size: int, num_kv_heads: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False):
        self.quant = quant
        lead = (num_blocks, block_size, num_kv_heads)
        self.codes = torch.zeros((*lead, quant.code_width), dtype=quant.code_dtype, device=device, pin_memory=pin_memory)
        self.scales = torch.zeros((*lead, quant.groups), dtype=SCALE_DTYPE, device=device, pin_memory=pin_memory)

    @property
    def shape(self) -> torch.Size:
        """(blocks, block_size, kv_heads, head_dim) as the compute-dtype pool would be."""
        return torch.Size((*self.codes.shape[:3], self.quant.head_dim))

    @property
    def block_nbytes(self) -> int:
        return self.codes[0].numel() * self.codes.element_size() + self.scales[0].numel() * self.scales.element_size()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """x (tokens, kv_heads, head_dim), already rotated when the format rotates, quantized into the
        slots (rows of (blocks * block_size, kv_heads, ...))."""
        codes, scales = quantize(x, self.quant)
        nkv = self.codes.shape[2]
        self.codes.view(-1, nkv, self.quant.code_width).index_copy_(0, slot_mapping, codes)
        self.scales.view(-1, nkv, self.quant.groups).index_copy_(0, slot_mapping, scales)

    def gather(self, block_tables: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of each sequence's first context_len positions, still quantized:
        (seqs, kv_heads, context, code_width), (seqs, kv_heads, context, groups)."""
        return gather_blocks(self.codes, block_tables, context_len), gather_blocks(self.scales, block_tables, context_len)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """cache (blocks, block_size, kv_heads, width), block_tables (seqs, max_blocks) -> (seqs, kv_heads,
    context_len, width): whole blocks by index_select, as model.gather_blocks does."""
    seqs, max_blocks = block_tables.shape
    _, bs, nkv, width = cache.shape
    x = cache.index_select(0, block_tables.flatten()).view(seqs, max_blocks * bs, nkv, width)[:, :context_len]
    return x.transpose(1, 2)
