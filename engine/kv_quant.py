"""The quantized KV cache's number format: int8 or int4 codes with a float16 scale per group of values,
after an orthogonal (Hadamard) rotation of each head. Plain torch; the CPU attention kernel that reads
these codes directly is engine/kernels/kv_attention.cpp (chosen by engine.ops).

- int8: one scale per (token, KV head): absmax / 127, codes in [-127, 127] (llama.cpp's q8_0 rounding,
  over the whole head instead of 32 values: the rotation spreads a head's outliers over all of it, and
  2 scale bytes per head keep the cache at 1.94x fewer bytes than bf16 for head_dim 64).
- int4: one scale per 32 values (16 for a head_dim that 32 does not divide), codes two to a byte (even
  dimension in the low nibble), each an index into 16 levels (INT4_LEVELS: a Gaussian's Lloyd-Max levels,
  as integers), not llama.cpp's q4_0 even steps: the rotation makes each group near-Gaussian, where levels
  denser near zero err less. The scale is searched, not absmax / 8: for each of INT4_TOPS the codes of the
  group scaled so that its largest magnitude lands on that top, and the least-squares scale for those
  codes; the candidate with the least squared error is kept (llama.cpp's make_qx_quants does the same
  for its k-quants). Four bits leave too few levels for one scale over a whole head. The levels and the
  search bring int4 within issue #37's perplexity target on SmolLM2-135M (docs/benchmarks/kv-cache.md).
- int8's scale is rounded to float16 before the codes are computed from it, so a code times its stored
  scale is the value the rounding chose; int4's codes are chosen first and its scale fitted to them.
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
# int4's 16 levels, a code's value in units of its group's scale: the Lloyd-Max quantizer of a Gaussian
# (+-0.1284 ... +-2.7326 standard deviations), the outermost at 127, rounded to integers. The rotation
# leaves each group near-Gaussian, where these levels, denser near zero, err less than 16 evenly spaced
# ones. No level is zero, so the two halves mirror each other (quantize relies on it).
# kv_attention.cpp holds the same table.
INT4_LEVELS = (-127, -96, -75, -58, -44, -31, -18, -6, 6, 18, 31, 44, 58, 75, 96, 127)
# The values a group's largest magnitude is scaled to before rounding, one candidate scale each
# (quantize keeps the one with least squared error): below 127 every value keeps its own level, above it
# the largest few share the outermost level and the rest get finer steps.
INT4_TOPS = tuple(float(t) for t in range(100, 165, 4))
_INT4_PASS = 1 << 21  # values times candidates quantize's int4 search holds at once (~28 bytes each)
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
    def levels(self) -> tuple[int, ...]:
        """The values int4's codes stand for (an index each); int8's codes are their values: ()."""
        return INT4_LEVELS if self.bits == 4 else ()

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       quant: KVQuant | None, v_head_dim: int | None = None) -> int:
    """K and V of one token over every layer, in the compute dtype or quantized. v_head_dim: V's width where it
    is not K's (latent attention caches no V: 0)."""
    if v_head_dim is not None and v_head_dim != head_dim:
        assert quant is None, "a quantized KV cache has K and V of one width"
        return num_layers * num_kv_heads * (head_dim + v_head_dim) * dtype.itemsize
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
def _levels_on(device: torch.device) -> torch.Tensor:
    return torch.tensor(INT4_LEVELS, dtype=torch.float32, device=device)  # (16,)


@functools.cache
def _midpoints_on(device: torch.device) -> torch.Tensor:
    levels = _levels_on(device)[8:]  # the positive half; the negative mirrors it
    return (levels[1:] + levels[:-1]) / 2  # (7,): halves, exact in fp32


@functools.cache
def _tops_on(device: torch.device) -> torch.Tensor:
    return torch.tensor(INT4_TOPS, dtype=torch.float32, device=device)  # (candidates,)


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
    # The search holds every candidate's codes of a vector at once: a bounded number of vectors a pass.
    rows = xf.reshape(-1, quant.groups, quant.group)  # (vectors, groups, group)
    step = max(1, _INT4_PASS // (quant.head_dim * len(INT4_TOPS)))
    parts = [_quantize_int4(rows[i:i + step], quant) for i in range(0, rows.shape[0], step)]
    codes, scales = (torch.cat(p) for p in zip(*parts)) if parts else _quantize_int4(rows, quant)
    return codes.reshape(*x.shape[:-1], quant.code_width), scales.reshape(*x.shape[:-1], quant.groups)


def _quantize_int4(xf: torch.Tensor, quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """xf (..., groups, group) fp32 -> codes (..., head_dim / 2), scales (..., groups): for each candidate
    top, the codes of x scaled so that its absmax lands on that top, then the least-squares scale for
    those codes, sum(x l) / sum(l l); the candidate with the least squared error, sum(x x) - sum(x l)^2 /
    sum(l l), wins. The levels are integers, so these sums are exact in float64 and kv_attention.cpp's
    write, which sums in another order, picks the same codes and scale. A value halfway between two levels
    takes the smaller magnitude, the same rule on both sides of zero."""
    table = _levels_on(xf.device).double()
    amax = xf.abs().amax(-1, keepdim=True)  # (..., groups, 1)
    tops = _tops_on(xf.device)  # (candidates,)
    iscale = torch.where(amax > 0, tops / amax, torch.zeros((), device=xf.device))  # (..., groups, candidates)
    v = xf[..., None, :] * iscale[..., :, None]  # (..., groups, candidates, group)
    j = torch.bucketize(v.abs(), _midpoints_on(xf.device))  # the nearest magnitude; a tie to the smaller
    idx = torch.where(v < 0, 7 - j, 8 + j)  # (..., groups, candidates, group): the level's index
    lv = table[idx]  # float64
    sxl = (xf.double()[..., None, :] * lv).sum(-1)  # (..., groups, candidates): exact
    sll = (lv * lv).sum(-1)  # > 0: no level is zero
    best = (sxl * sxl / sll).argmax(-1, keepdim=True)  # (..., groups, 1): the first of equal errors
    scale = (sxl / sll).gather(-1, best).squeeze(-1).float().clamp(max=_FP16_MAX).to(SCALE_DTYPE)  # (..., groups)
    idx = idx.gather(-2, best[..., None].expand(*best.shape, quant.group)).squeeze(-2)  # (..., groups, group)
    q = idx.to(torch.uint8).reshape(*xf.shape[:-2], quant.head_dim // 2, 2)
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
        idx = torch.stack((lo, hi), dim=-1).reshape(*lead, quant.head_dim).long()  # (..., head_dim) in [0, 15]
        v = _levels_on(codes.device)[idx]  # (..., head_dim) fp32
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
