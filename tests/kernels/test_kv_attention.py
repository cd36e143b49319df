"""The attention over the quantized cache (engine/kernels/kv_attention.cpp) against the torch path it
replaces (engine.ops.attend_quantized: dequantize, then SDPA over the padded batch), in fp32: the same
codes and scales, so the two agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_attention import kv_attention
from engine.kv_quant import KVQuant, QuantizedKV, dequantize

kernel = kv_attention()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the kv_attention kernel could not be built here")


def _case(bits, rows=5, ctx=70, nh=6, nkv=2, hd=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-ctx // bs)
    nblocks = rows * max_blocks + 2
    quant = KVQuant(bits, hd)
    k, v = QuantizedKV(quant, nblocks, bs, nkv), QuantizedKV(quant, nblocks, bs, nkv)
    slots = torch.arange(nblocks * bs)
    k.write(slots, torch.randn(nblocks * bs, nkv, hd, generator=g) * 2)
    v.write(slots, torch.randn(nblocks * bs, nkv, hd, generator=g))
    tables = torch.randperm(nblocks, generator=g)[:rows * max_blocks].view(rows, max_blocks)
    positions = torch.randint(0, ctx, (rows,), generator=g)
    positions[0] = ctx - 1
    q = torch.randn(rows, nh, hd, generator=g)
    return q, k, v, tables, positions


def _reference(q, k, v, tables, positions, window, scale):
    """Each row over its dequantized keys [lo, pos], in float64."""
    rows, nh, hd = q.shape
    nkv = k.codes.shape[2]
    out = torch.empty(rows, nh, hd, dtype=torch.float64)
    for r in range(rows):
        pos = int(positions[r])
        lo = max(0, pos - window + 1) if window else 0
        keys = dequantize(*k.gather(tables[r:r + 1], pos + 1), k.quant, torch.float64)[0, :, lo:]  # (kv, ctx, hd)
        vals = dequantize(*v.gather(tables[r:r + 1], pos + 1), v.quant, torch.float64)[0, :, lo:]
        qr = q[r].double().view(nkv, nh // nkv, hd)
        p = torch.softmax(qr @ keys.transpose(-1, -2) * scale, dim=-1)  # (kv, group, ctx)
        out[r] = (p @ vals).reshape(nh, hd)
    return out


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("hd", [64, 128, 48], ids=["avx512-64", "avx512-128", "generic-48"])
def test_kernel_reads_the_codes_as_the_dequantized_reference_does(bits, window, hd):
    """head_dim 64 and 128 take the AVX-512 loops where the CPU has them; 48 the generic ones everywhere."""
    q, k, v, tables, positions = _case(bits, hd=hd)
    scale = hd ** -0.5
    out = kernel.attention(q, k.codes, k.scales, v.codes, v.scales, tables, positions, window, bits, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(q, k, v, tables, positions, window, scale), atol=2e-5, rtol=1e-4)


@needs_kernel
def test_kernel_checks_its_indices():
    q, k, v, tables, positions = _case(8)
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.attention(q, k.codes, k.scales, v.codes, v.scales, bad, positions, 0, 8, 0.125)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        kernel.attention(q, k.codes, k.scales, v.codes, v.scales, tables, positions, 0, 2, 0.125)
    with pytest.raises(RuntimeError, match="codes must be contiguous"):
        kernel.attention(q, k.codes, k.scales, v.codes, v.scales, tables, positions, 0, 4, 0.125)


@needs_kernel
@pytest.mark.parametrize("bits,hd", [(8, 64), (4, 64), (4, 48), (8, 48)])
def test_the_kernels_write_stores_the_codes_and_scales_torch_stores(bits, hd):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 3, hd, generator=g) * torch.rand(37, 3, 1, generator=g) * 10
    x[0, 0] = 0  # a zero head: scale 0, codes 0
    x[1, 1, 7] = 1e6  # a scale float16 cannot hold: clamped
    ours, ref = QuantizedKV(KVQuant(bits, hd), 5, 16, 3), QuantizedKV(KVQuant(bits, hd), 5, 16, 3)
    slots = torch.randperm(80, generator=g)[:37]
    kernel.write(x, ours.codes, ours.scales, slots, bits)
    ref.write(slots, x)
    assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scales, ref.scales)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write(x[:1], ours.codes, ours.scales, torch.tensor([80]), bits)
