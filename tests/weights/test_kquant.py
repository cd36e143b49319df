"""The k-quant layouts (KQuantWeight: Q4_K and Q6_K rows rearranged for the VNNI kernel, every stored bit
kept) against the gguf package's dequantizer: the C++ repack (ggml_repack.cpp, repack_kquant) and the
kernel (int4_vnni.cpp, block_kernel_k) together compute x @ W.T for the W that gguf dequantizes, up to the
kernel's own quantization of the activations (int8 per 32, two passes), which the reference applies too.

Skipped where the VNNI kernels or the C++ repack do not run (the int4 / int8 forms are used there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from engine import ops
from engine.weights.packed.compute_form import PackedFormat, kquant_layout
from engine.weights.packed.weights import KQuantWeight

pytestmark = pytest.mark.skipif(ops.gguf_repack() is None, reason="the VNNI kernels / C++ repack do not run here")

BLOCK = {Q.Q4_K: 144, Q.Q6_K: 210}  # bytes per super-block of 256


def stored_rows(q: Q, out: int, inner: int, seed: int) -> torch.Tensor:
    """(out, bytes per row) uint8: random k-quant super-blocks with small finite fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    n = inner // 256
    b = torch.randint(0, 256, (out, n, BLOCK[q]), generator=g, dtype=torch.uint8)
    def f16(scale: float) -> torch.Tensor:
        return (torch.rand(out, n, generator=g) * scale + scale / 10).half().view(torch.uint8).reshape(out, n, 2)
    if q == Q.Q4_K:
        b[..., 0:2], b[..., 2:4] = f16(0.01), f16(0.01)  # d, dmin
    else:
        b[..., 208:210] = f16(0.01)  # d
    return b.reshape(out, -1)


def gguf_weight(rows: torch.Tensor, q: Q, shape) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(rows.numpy(), q).reshape(shape).astype(np.float64))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 values, step max|x| / 127, codes round-half-even in int8 and the
    residual in 1/256ths of a step (two passes): step * (q + r / 256), float64."""
    m, inner = x.shape
    xg = x.float().reshape(m, -1, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    t = xg * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(t).clamp(-128, 127)
    r = torch.round((t - q) * 256).clamp(-128, 127)
    return ((q * 256 + r).double() * (amax.double() / 127 / 256)).reshape(m, inner)


def reference(x: torch.Tensor, rows: torch.Tensor, q: Q, shape) -> torch.Tensor:
    """Q6_K: w = d sc (q - 32), every term of it meets the quantized activations. Q4_K: w = d sc q - dmin mn,
    whose min term meets each group's exact sum of x (as llama.cpp's Q4_K dot product)."""
    w = gguf_weight(rows, q, shape)
    xq = quantized_activations(x)
    if q == Q.Q6_K:
        return xq @ w.T
    no_codes = rows.clone().reshape(shape[0], -1, 144)
    no_codes[..., 16:] = 0
    mins = gguf_weight(no_codes.reshape(shape[0], -1), q, shape)  # -dmin mn, per weight
    sums = x.double().reshape(x.shape[0], -1, 32).sum(-1)  # (tokens, groups)
    return xq @ (w - mins).T + sums @ mins.reshape(shape[0], -1, 32)[..., 0].T


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q6_K], ids=["Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(64, 3072), (40, 512), (17, 256)])  # rows past / short of a 16-row block
@pytest.mark.parametrize("tokens", [1, 3, 9])  # decode; past the kernel's 8-row tile
def test_kquant_product_matches_the_gguf_dequantizer(q, shape, tokens):
    rows = stored_rows(q, *shape, seed=shape[0] + tokens)
    w = PackedFormat(torch.bfloat16).resident(_info(q, shape), rows)
    assert isinstance(w, KQuantWeight) and w.layout == kquant_layout(q, shape)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))
    y = ops.linear(x, w).double()
    ref = reference(x, rows, q, shape)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), float((y - ref).abs().max())
    # And against the plain product with gguf's weights: only the activations' int8 rounding apart.
    plain = x.double() @ gguf_weight(rows, q, shape).T
    assert float((y - plain).abs().max()) < 1e-3 * float(plain.abs().max())


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q6_K], ids=["Q4_K", "Q6_K"])
@pytest.mark.parametrize("out", [40, 64])  # row blocks: 3 (a pair and one, the last padded), 4 (two pairs)
@pytest.mark.parametrize("inner", [512, 4096])  # row blocks of a few KiB (walked one at a time) and of 32-48 KiB
def test_a_decode_row_gets_the_bits_it_gets_among_other_rows(q, out, inner):
    """One row (decode) walks two long row blocks side by side, short ones one at a time, several rows one
    block at a time: the same sums in the same order for each output, so the same bits."""
    shape = (out, inner)
    w = PackedFormat(torch.bfloat16).resident(_info(q, shape), stored_rows(q, *shape, seed=out))
    x = torch.randn(3, inner, generator=torch.Generator().manual_seed(5)).bfloat16()
    rows = ops.linear(x, w)
    for m in range(3):
        assert torch.equal(ops.linear(x[m:m + 1], w), rows[m:m + 1]), m


@pytest.mark.parametrize("q, bits", [(Q.Q4_K, 4.625), (Q.Q6_K, 6.5625)], ids=["Q4_K", "Q6_K"])
def test_kquant_weight_reads_the_files_bits_per_weight(q, bits):
    """What a decode step reads of the weight: Q6_K exactly the file's 6.5625 bits, Q4_K 4.625 (the file's
    4.5 with the 6-bit sub-scales in bytes), not the 5 and 8 bits of the int4 / int8 forms."""
    shape = (256, 1024)
    w = PackedFormat(torch.bfloat16).resident(_info(q, shape), stored_rows(q, *shape, seed=1))
    assert w.nbytes * 8 / (shape[0] * shape[1]) == bits
    assert PackedFormat(torch.bfloat16).resident_bytes(_info(q, shape)) == w.nbytes


def test_stacked_kquant_weights_compute_their_parts():
    """q/k/v or gate/up stacked (fuse.py) give each part's own products."""
    from engine.weights.packed.fuse import stack_rows
    parts_rows = [stored_rows(Q.Q4_K, 32, 512, seed=s) for s in (1, 2)]
    parts = [PackedFormat(torch.bfloat16).resident(_info(Q.Q4_K, (32, 512)), r) for r in parts_rows]
    stacked = stack_rows(parts)
    assert isinstance(stacked, KQuantWeight) and stacked.shape == (64, 512)
    x = torch.randn(2, 512)
    assert torch.equal(ops.linear(x, stacked), torch.cat([ops.linear(x, p) for p in parts], dim=-1))


def _info(q: Q, shape):
    from engine.weights.formats.reader import TensorInfo
    nbytes = shape[0] * shape[1] // 256 * BLOCK[q] if q in BLOCK else shape[0] * shape[1] // 32 * 18
    return TensorInfo("w", None, None, tuple(shape), 0, nbytes, quant=q.name)


@pytest.mark.parametrize("q", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantized_bf16_rows_are_the_gguf_weights(q):
    """dequantize_bf16_t (the dense product of prompt chunks on AMX) writes gguf's exact weights rounded to
    bf16, transposed, for any range of row blocks; the padding rows of the last block are zeros."""
    from engine import kernels
    shape = (40, 512)
    rows = q4_0_rows(*shape) if q == Q.Q4_0 else stored_rows(q, *shape, seed=3)
    w = PackedFormat(torch.bfloat16).resident(_info(q, shape), rows)
    ref = gguf_weight(rows, q, shape).to(torch.bfloat16)  # (out, in)
    out = torch.full((shape[1], 32), 7.0, dtype=torch.bfloat16)
    kernels.dequantize_bf16_t(w.codes, w.scales, shape[1], 1, 3, out)  # rows 16..47 of 40
    assert torch.equal(out[:, :24].T, ref[16:40])
    assert torch.equal(out[:, 24:], torch.zeros(shape[1], 8, dtype=torch.bfloat16))
    # Split: the rounding's remainder below it, the two summing to the weight as stored (the float32 of
    # gguf's dequantization) within bf16's rounding of the remainder.
    split = torch.full((2 * shape[1], 32), 7.0, dtype=torch.bfloat16)
    kernels.dequantize_bf16_t(w.codes, w.scales, shape[1], 1, 3, split)
    assert torch.equal(split[:shape[1]], out)
    exact = gguf_weight(rows, q, shape)[16:40].T  # (in, 24) float64
    total = split[:shape[1], :24].double() + split[shape[1]:, :24].double()
    assert float((total - exact).abs().max()) <= 2 ** -16 * float(exact.abs().max())


def test_prompt_chunk_products_run_dense_on_amx_and_match():
    """A product of many bf16 rows takes the dense path exactly where the CPU has AMX (ops.amx_prefill); either
    way it is x times gguf's weights up to bf16 roundings, and the plan's workspace counts its buffers."""
    shape = (4100, 1024)  # more row blocks than one chunk holds, the last chunk partial, rows past a multiple of 16
    assert -(-shape[0] // 16) > ops._chunk_blocks(shape[1])
    rows = stored_rows(Q.Q4_K, *shape, seed=4)
    w = PackedFormat(torch.bfloat16).resident(_info(Q.Q4_K, shape), rows)
    x = torch.randn(ops.DENSE_PRODUCT_ROWS, shape[1], generator=torch.Generator().manual_seed(5)).bfloat16()
    assert ops._dense_rows(x, w) == ops.amx_prefill()
    assert not ops._dense_rows(x[:ops.DENSE_PRODUCT_ROWS - 1], w)  # fewer rows: the integer kernel
    plain = x.double() @ gguf_weight(rows, Q.Q4_K, shape).T
    for y in (ops.linear(x, w), ops._dense_product(x, w, None)):
        assert y.shape == (x.shape[0], shape[0])
        # the output's bf16 rounding (2^-9 of its size) and not the weight's: the dense path keeps its bits
        assert float((y.double() - plain).abs().max()) < 4e-3 * float(plain.abs().max())
    rows_per_chunk = 16 * ops._chunk_blocks(shape[1])
    expected = ops.amx_prefill() * 2 * (2 * shape[1] * rows_per_chunk + 512 * rows_per_chunk + 512 * 2 * shape[1])
    assert ops.dense_product_workspace_bytes(512, shape[1]) == expected


def q4_0_rows(out: int, inner: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    b = torch.randint(0, 256, (out, inner // 32, 18), generator=g, dtype=torch.uint8)
    b[..., 0:2] = (torch.rand(out, inner // 32, generator=g) * 0.01 + 0.001).half().view(torch.uint8).reshape(out, -1, 2)
    return b.reshape(out, -1)
