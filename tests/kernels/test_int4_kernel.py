"""The AVX512-VNNI int4 kernel (engine/kernels/int4_vnni.cpp) against the same math in torch, and
against the plain matmul with the dequantized weight; its fallback to aten's kernel.

Where the kernel cannot run (no AVX512-VNNI, no compiler) the kernel tests skip and the fallback
tests still run. The first run of a fresh cache compiles the kernel (~1 min)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import kernels, ops
from engine.weights.packed.weights import GROUP, Int4Weight, Int8Weight
from engine.weights.packed.quantize import quantize_int4

vnni = pytest.mark.skipif(kernels.int4_backend() != "vnni", reason="the int4 VNNI kernel is not available here")


def random_int4(out: int, inner: int, seed: int):
    """codes (out, in) 0..15, scale and min (out, in / 32) exactly representable in float16."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inner), generator=g, dtype=torch.uint8)
    scale = (torch.rand(out, inner // GROUP, generator=g) * 0.02 + 1e-3).half().float()
    minimum = (-8 * scale * (1 + 0.2 * torch.randn(out, inner // GROUP, generator=g))).half().float()
    return codes, scale, minimum


def dequantized(codes, scale, minimum) -> torch.Tensor:
    out, inner = codes.shape
    w = codes.float().reshape(out, -1, GROUP) * scale[..., None] + minimum[..., None]
    return w.reshape(out, inner)  # (out, in)


def reference(x: torch.Tensor, codes, scale, minimum, two_pass: bool = True) -> torch.Tensor:
    """The kernel's math in float64: x quantized per 32 to int8 codes q (step max|x| / 127, round half
    to even) and, in two passes, the rounding residual r in 1/256ths of a step (int8 too), so that
    x ~ step * (q + r / 256); exact integer dot products per group; then scale * step * dot + min * sum(x)."""
    m, inner = x.shape
    xg = x.float().reshape(m, -1, GROUP)  # (tokens, groups, 32)
    amax = xg.abs().amax(-1)  # (tokens, groups)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    t = xg * inv[..., None]  # float32, as the kernel rounds it
    xq = torch.round(t).clamp(-128, 127)
    step = (amax / 127.0).double()
    if two_pass:
        xq = xq * 256 + torch.round((t - xq) * 256).clamp(-128, 127)
        step = step / 256
    q = codes.double().reshape(codes.shape[0], -1, GROUP)  # (out, groups, 32)
    dots = torch.einsum("mgi,ngi->mng", xq.double(), q)  # (tokens, out, groups)
    y = (dots * (scale.double()[None] * step[:, None])).sum(-1)
    return y + torch.einsum("mg,ng->mn", xg.double().sum(-1), minimum.double())  # (tokens, out)


# K = 576 (18 groups: not a multiple of 4 or of 256), 1536, 96 (3 groups: only the masked tail),
# 32 (one group); M from 1 (decode) past the 8-row tile (prefill).
SHAPES = [(576, 576), (1536, 576), (576, 1536), (40, 96), (24, 32), (17, 160)]


@vnni
@pytest.mark.parametrize("out,inner", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 40])
def test_kernel_matches_the_same_math(out, inner, m):
    codes, scale, minimum = random_int4(out, inner, seed=out + inner + m)
    w = Int4Weight.from_codes(codes, scale, minimum, torch.float32)
    assert w.layout == "vnni"
    x = torch.randn(m, inner, generator=torch.Generator().manual_seed(m))
    ref = reference(x, codes, scale, minimum)
    got = ops.linear(x, w)
    assert got.shape == (m, out) and got.dtype == torch.float32
    # fp32 accumulation of exact integer sums: rounding only.
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    # Against the dequantized weight and the unquantized x: two int8 passes leave an activation
    # rounding error of max|x| / 65024 per value.
    dense = x @ dequantized(codes, scale, minimum).T
    assert (got - dense).abs().max() < 1e-4 * dense.abs().max()


def int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's math in float64: the per-row int8 codes and scales of Int8Weight.quantize,
    x as `reference` quantizes it (two passes)."""
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127)
    m, inner = x.shape
    xg = x.float().reshape(m, -1, GROUP)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    t = xg * inv[..., None]
    xq = torch.round(t).clamp(-128, 127)
    xq = xq * 256 + torch.round((t - xq) * 256).clamp(-128, 127)
    xd = (xq.double() * (amax.double() / 127 / 256)[..., None]).reshape(m, inner)  # x as the kernel sees it
    return (xd @ codes.double().T) * scales.double()  # (tokens, out)


@vnni
@pytest.mark.parametrize("out,inner", [(576, 576), (49, 96), (24, 32)])
@pytest.mark.parametrize("m", [1, 5, 13])
def test_int8_kernel_matches_the_same_math(out, inner, m):
    w = torch.randn(out, inner, generator=torch.Generator().manual_seed(out + m)) * 0.05
    q = Int8Weight.quantize(w, torch.bfloat16)
    assert q.layout == "vnni" and q.shape == (out, inner)
    x = torch.randn(m, inner, generator=torch.Generator().manual_seed(m))
    ref = int8_reference(x, w)
    got = ops.linear(x, q)
    assert got.shape == (m, out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    assert (got - x @ w.T).abs().max() < 0.02 * (x @ w.T).abs().max()  # the int8 weights' own rounding
    bias, xb = torch.randn(out).bfloat16(), x.bfloat16()
    ref = int8_reference(xb.float(), w) + bias.double()
    # One rounding of the output to bf16.
    torch.testing.assert_close(ops.linear(xb, q, bias).double(), ref, atol=4e-3 * ref.abs().max().item(), rtol=1e-2)


def test_int8_rows_not_a_multiple_of_32_use_aten():
    q = Int8Weight.quantize(torch.randn(8, 40), torch.float32)
    assert q.layout == "aten" and q.shape == (8, 40)
    x = torch.randn(2, 40)
    ref = x @ (q.codes.float() * q.scales[:, None]).T
    torch.testing.assert_close(ops.linear(x, q), ref, atol=1e-4, rtol=1e-4)


@vnni
@pytest.mark.parametrize("out,inner,m", [(576, 576, 1), (40, 96, 5), (17, 160, 13)])
def test_one_pass_matches_its_math(out, inner, m):
    """One int8 pass (llama.cpp's Q8 activations): the same math without the residual, and an
    activation rounding error of max|x| / 254 per value (~1% of the largest output at K = 96)."""
    codes, scale, minimum = random_int4(out, inner, seed=7)
    w = Int4Weight.from_codes(codes, scale, minimum, torch.float32)
    x = torch.randn(m, inner, generator=torch.Generator().manual_seed(m))
    got = kernels.int4_linear(x, w.codes, w.scales, out, None, two_pass=False)
    ref = reference(x, codes, scale, minimum, two_pass=False)
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    dense = x @ dequantized(codes, scale, minimum).T
    assert (got - dense).abs().max() < 0.02 * dense.abs().max()
    assert (got - dense).abs().max() > 10 * (ops.linear(x, w) - dense).abs().max()  # two passes are finer


@vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_takes_half_activations_with_leading_dims_and_bias(dtype):
    codes, scale, minimum = random_int4(64, 256, seed=1)
    w = Int4Weight.from_codes(codes, scale, minimum, dtype)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(2)).to(dtype)  # (batch, tokens, in)
    bias = torch.randn(64).to(dtype)
    got = ops.linear(x, w, bias)
    assert got.shape == (2, 3, 64) and got.dtype == dtype
    ref = reference(x.reshape(6, 256).float(), codes, scale, minimum).reshape(2, 3, 64) + bias.double()
    # One rounding of the output to the half type.
    torch.testing.assert_close(got.double(), ref, atol=4e-3 * ref.abs().max().item(), rtol=1e-2)


@vnni
def test_threads_split_rows_without_changing_a_bit():
    """With several torch threads the row blocks are shared out (at::parallel_for); each output is
    computed by one thread in the same order, so the result is bit-identical to one thread's."""
    codes, scale, minimum = random_int4(1000, 1536, seed=9)  # 63 row blocks, the last one partial
    w = Int4Weight.from_codes(codes, scale, minimum, torch.bfloat16)
    x = torch.randn(3, 1536).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x, w)
        torch.set_num_threads(2)
        two = ops.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@vnni
@pytest.mark.parametrize("out", [40, 48, 1000])  # row blocks: 3 (the last padded), 3, 63 (the last padded)
@pytest.mark.parametrize("inner", [576, 4096])  # row blocks of a few KiB (walked one at a time) and of 32-64 KiB
def test_a_decode_row_gets_the_bits_it_gets_among_other_rows(out, inner):
    """One row (decode) walks two long row blocks side by side, short ones one at a time; several rows walk
    one at a time in tiles. Each output is the same sums in the same order every way: the same bits, for
    every weight form, with a bias."""
    codes, scale, minimum = random_int4(out, inner, seed=out)
    dense = dequantized(codes, scale, minimum)
    forms = {"int4": Int4Weight.from_codes(codes, scale, minimum, torch.bfloat16),
             "int4 symmetric": Int4Weight.from_codes(codes, scale, -8 * scale, torch.bfloat16).without_min(),
             "int8": Int8Weight.quantize(dense, torch.bfloat16)}
    x = torch.randn(3, inner, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(out, generator=torch.Generator().manual_seed(4)).bfloat16()
    for name, w in forms.items():
        rows = ops.linear(x, w, bias)
        for m in range(3):
            assert torch.equal(ops.linear(x[m:m + 1], w, bias), rows[m:m + 1]), (name, m)


@vnni
def test_kernel_zero_and_constant_groups():
    """A group of x that is all zero (scale 0) and a weight group whose codes are all equal (range 0,
    as quantize_int4 makes of a constant group) multiply exactly."""
    w = torch.randn(8, 64)
    w[:, :32] = 0.25  # constant group: scale clamps, codes 0, min 0.25
    q = quantize_int4(w, torch.float32)
    x = torch.randn(3, 64)
    x[:, 32:] = 0
    got = ops.linear(x, q)
    torch.testing.assert_close(got, x[:, :32].sum(-1, keepdim=True).expand(3, 8) * 0.25, atol=1e-5, rtol=1e-5)


@vnni
def test_kernel_rejects_bad_input():
    codes, scale, minimum = random_int4(16, 64, seed=0)
    w = Int4Weight.from_codes(codes, scale, minimum, torch.float32)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        ops.linear(torch.randn(1, 32), w)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.linear(torch.randn(1, 64).double(), w)
    with pytest.raises(RuntimeError, match="bias has 3 values, expected 16"):
        ops.linear(torch.randn(1, 64), w, torch.randn(3))


def test_scales_that_overflow_float16_are_refused():
    if kernels.int4_backend() != "vnni":
        pytest.skip("the aten layout keeps scales in the compute dtype")
    w = torch.zeros(2, 32)
    w[0, 0] = 1e6
    with pytest.raises(ValueError, match="does not fit in float16"):
        quantize_int4(w, torch.bfloat16)


@pytest.fixture
def backend(monkeypatch):
    """Choose the int4 backend again under this test's environment; restore the process's after."""
    kernels.int4_backend.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    kernels.int4_backend.cache_clear()
    kernels.int4_backend()


def test_forced_fallback_uses_aten_and_agrees(backend, caplog):
    backend.setenv("LAYERSTREAM_INT4_KERNEL", "aten")
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert kernels.int4_backend() == "aten"
    assert "using aten's _weight_int4pack_mm_for_cpu" in caplog.text and "LAYERSTREAM_INT4_KERNEL=aten" in caplog.text
    assert Int8Weight.quantize(torch.randn(16, 64), torch.float32).layout == "aten"
    codes, scale, minimum = random_int4(48, 576, seed=5)
    w = Int4Weight.from_codes(codes, scale, minimum, torch.float32)
    assert w.layout == "aten"
    x = torch.randn(3, 576)
    dense = x @ dequantized(codes, scale, minimum).T
    torch.testing.assert_close(ops.linear(x, w), dense, atol=1e-4 * dense.abs().max().item(), rtol=1e-4)


def test_a_kernel_that_does_not_build_falls_back(backend, caplog, tmp_path):
    if kernels._why_not_vnni() is not None:
        pytest.skip("the kernel is not attempted on this CPU")
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not compile\n")
    backend.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    backend.setattr(kernels, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert kernels.int4_backend() == "aten"
    assert "could not be built" in caplog.text


def test_bad_backend_name(backend):
    backend.setenv("LAYERSTREAM_INT4_KERNEL", "avx9")
    with pytest.raises(ValueError, match="auto, vnni or aten, got 'avx9'"):
        kernels.int4_backend()


@vnni
@pytest.mark.parametrize("m", [1, 13])
def test_symmetric_layout_drops_the_mins_and_no_bit(m):
    """Int4Weight.without_min (Q4_0: every min -8 * scale): scales only, 10% fewer bytes, and the kernel's
    own -8 * scale gives the asymmetric layout's results bit for bit, stacked (fuse) or not; weights
    with other mins keep them (fuse.drop_symmetric_mins leaves them alone)."""
    from engine.weights.packed.fuse import drop_symmetric_mins, stack_rows

    codes, scale, _ = random_int4(40, 576, seed=m)  # 40 rows: the last block padded
    w = Int4Weight.from_codes(codes, scale, -8 * scale, torch.bfloat16)
    sym = w.without_min()
    assert sym.scales.shape == (3, 18, 16) and sym.nbytes == w.nbytes - 3 * 18 * 16 * 2
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(40).bfloat16()
    assert torch.equal(ops.linear(x, sym, bias), ops.linear(x, w, bias))
    other = Int4Weight.from_codes(*random_int4(48, 576, seed=2), torch.bfloat16)
    assert other.without_min() is other
    assert stack_rows([sym, other]) is None  # one layout per stacked weight
    part = Int4Weight.from_codes(codes[:32], scale[:32], -8 * scale[:32], torch.bfloat16).without_min()
    stacked = stack_rows([part, sym])
    assert torch.equal(ops.linear(x, stacked), torch.cat([ops.linear(x, part), ops.linear(x, sym)], dim=-1))
    block = drop_symmetric_mins({"wo": w, "w_down": other, "attn_norm": bias})
    assert block["wo"].scales.dim() == 3 and block["w_down"] is other and block["attn_norm"] is bias
    with pytest.raises(RuntimeError, match=r"or, symmetric, \(N16/16, K/32, 16\)"):
        kernels.int4_linear(x, sym.codes, sym.scales[..., :8].contiguous(), 40)
