"""The fused CPU ops (engine/kernels/fused_ops.cpp) against the torch code they replace in engine/ops.py.

Stated tolerances: fp32 within 1e-6 (absolute + relative: RMSNorm's fp32 sum runs in another order and
SiLU's expf may differ from torch's in the last bit); bf16 / fp16 results equal, or one ulp apart where
that fp32 difference crosses a rounding boundary (rare; counted below). Rotary is the same sequence of
roundings (no FMA) and must match exactly in every dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import model as M
from engine import ops as dispatch
from engine.kernels import fused_ops as fo

ops = fo.fused_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="the fused CPU ops could not be built here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: how many representable values of a's dtype lie between a and b (same signs here)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(bits).to(torch.int64) - b.view(bits).to(torch.int64)).abs()


def assert_matches(fused: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> None:
    assert fused.dtype == ref.dtype and fused.shape == ref.shape
    if exact:
        torch.testing.assert_close(fused, ref, atol=0, rtol=0)
    elif fused.dtype == torch.float32:
        torch.testing.assert_close(fused, ref, atol=1e-6, rtol=1e-6)
    else:
        apart = _ulps_apart(fused, ref)
        assert int(apart.max()) <= 1, f"{int(apart.max())} ulps apart"
        assert float((apart > 0).float().mean()) < 0.01  # one-ulp differences are rare, not systematic


def _torch_rotary(x, cos, sin):
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (5, 576), (3, 64), (2, 37), (16, 1024), (130, 40)])
def test_rms_norm_and_residual_add_match_torch(dtype, rows, n):
    x, r = _rand(rows, n, dtype=dtype, seed=1, scale=3.0), _rand(rows, n, dtype=dtype, seed=2)
    w = _rand(n, dtype=dtype, seed=3)
    assert_matches(ops.rms_norm(x, w, 1e-5), dispatch._rms_norm_torch(x, w, 1e-5))
    h, y = ops.add_rms_norm(x, r, w, 1e-5)
    assert_matches(h, x + r, exact=True)
    assert_matches(y, dispatch._rms_norm_torch(x + r, w, 1e-5))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_views_matches_torch(dtype):
    """Per-head q/k norms (Qwen3) see heads viewed out of a stacked qkv row: rows not evenly strided."""
    qkv = _rand(3, (4 + 2 * 2) * 16, dtype=dtype, seed=4)
    q = qkv[:, :64].view(3, 4, 16)  # (tokens, heads, head_dim), row stride 128 per token
    w = _rand(16, dtype=dtype, seed=5)
    assert_matches(ops.rms_norm(q, w, 1e-6), dispatch._rms_norm_torch(q, w, 1e-6))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch_on_stacked_and_separate_halves(dtype):
    gate_up = _rand(5, 2 * 1536, dtype=dtype, seed=6, scale=4.0)
    g, u = gate_up.chunk(2, dim=-1)  # views with row stride 3072, as mlp() makes them
    assert_matches(ops.silu_mul(g, u), F.silu(g) * u)
    g, u = g.contiguous(), u.contiguous()
    assert_matches(ops.silu_mul(g, u), F.silu(g) * u)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_exactly_the_torch_code(dtype):
    tokens, nh, nkv, hd = 4, 9, 3, 64
    qkv = _rand(tokens, (nh + 2 * nkv) * hd, dtype=dtype, seed=7)
    x = qkv.view(tokens, nh + 2 * nkv, hd)[:, :nh + nkv]  # q and k heads, as attention() rotates them
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = M.rotary_cos_sin(torch.tensor([0, 7, 100, 2047]), inv_freq, 1.0, dtype)
    assert_matches(ops.rotary(x, cos, sin), _torch_rotary(x, cos, sin), exact=True)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_over_threads_give_what_one_thread_gives(dtype):
    """A 16-sequence step or a prefill chunk is split over torch's threads (fused_ops.cpp's for_rows);
    each row is computed as on one thread, so the results are the same bits, and match torch."""
    x, r = _rand(128, 1024, dtype=dtype, seed=8, scale=3.0), _rand(128, 1024, dtype=dtype, seed=9)
    w = _rand(1024, dtype=dtype, seed=10)
    g, u = _rand(128, 2816, dtype=dtype, seed=11, scale=4.0).chunk(2, dim=-1)
    q = _rand(128, 16, 64, dtype=dtype, seed=12)
    cos, sin = _rand(128, 1, 64, dtype=dtype, seed=13), _rand(128, 1, 64, dtype=dtype, seed=14)

    def run():
        return (ops.rms_norm(x, w, 1e-5), *ops.add_rms_norm(x, r, w, 1e-5), ops.silu_mul(g, u), ops.rotary(q, cos, sin))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        split = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, split):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert_matches(split[0], dispatch._rms_norm_torch(x, w, 1e-5))
    assert_matches(split[3], F.silu(g) * u)
    assert_matches(split[4], _torch_rotary(q, cos, sin), exact=True)


@needs_ops
def test_bf16_nan_and_inf_come_out_as_torch_makes_them():
    """The AVX-512 bf16 rows round as c10::BFloat16 does, NaN included (the scalar loops' conversion)."""
    x = _rand(16, 64, dtype=torch.float32, seed=15)
    x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), -float("inf")
    x = x.bfloat16()
    u = _rand(16, 64, dtype=torch.bfloat16, seed=16)
    got, ref = ops.silu_mul(x, u), F.silu(x) * u
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert_matches(got.nan_to_num(), ref.nan_to_num())
    cos, sin = _rand(16, 1, 64, dtype=torch.bfloat16, seed=17), _rand(16, 1, 64, dtype=torch.bfloat16, seed=18)
    got, ref = ops.rotary(x.view(16, 1, 64), cos, sin), _torch_rotary(x.view(16, 1, 64), cos, sin)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got.nan_to_num(), ref.nan_to_num())


@needs_ops
def test_bad_input_is_refused():
    x = _rand(2, 8)
    with pytest.raises(RuntimeError, match="weight must have dtype"):
        ops.rms_norm(x, _rand(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \(8,\)"):
        ops.rms_norm(x, _rand(4), 1e-5)
    with pytest.raises(RuntimeError, match="up must have gate's shape"):
        ops.silu_mul(x, _rand(2, 4))
    with pytest.raises(RuntimeError, match="contiguous in its last dimension"):
        ops.silu_mul(x.t(), x.t())
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        ops.rotary(_rand(2, 3, 8), _rand(2, 8), _rand(2, 8))


@needs_ops
def test_model_functions_use_the_fused_ops_and_the_torch_code_alike(monkeypatch):
    """engine/ops.py's rms_norm / add_rms_norm / silu_mul / apply_rotary give the same with the ops
    and with LAYERSTREAM_FUSED_OPS=torch, which turns them off (logged)."""
    x, r, w = _rand(3, 96, seed=8), _rand(3, 96, seed=9), _rand(96, seed=10)
    cos, sin = M.rotary_cos_sin(torch.tensor([1, 2, 3]), torch.rand(16), 1.0, torch.float32)
    q = _rand(3, 2, 32, seed=11)

    def run():
        return (dispatch.rms_norm(x, w, 1e-5), *dispatch.add_rms_norm(x, r, w, 1e-5), dispatch.silu_mul(x, r),
                dispatch.apply_rotary(q, cos, sin))

    fused = run()
    fo.fused_ops.cache_clear()
    monkeypatch.setenv("LAYERSTREAM_FUSED_OPS", "torch")
    try:
        assert fo.fused_ops() is None
        for a, b in zip(fused, run(), strict=True):
            assert_matches(a, b)
    finally:
        monkeypatch.undo()
        fo.fused_ops.cache_clear()
        assert fo.fused_ops() is not None


@needs_ops
@pytest.mark.parametrize("sizes", [(1 << 20,), (1_000_003, 7, 512, 0), (513, 1023)])
def test_stream_read_reads_every_byte(sizes):
    """The bench probe's read (stream_read) reads each tensor's every byte, the tail past its 512-byte steps
    too: its xor is the xor of the bytes as numpy takes it, and a change in the largest tensor's last byte
    changes it."""
    import numpy as np

    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]

    def xor64(ts) -> int:
        total = 0
        for t in ts:
            b = t.numpy().tobytes()
            words = np.frombuffer(b[:len(b) // 8 * 8], dtype=np.uint64)
            total ^= int(np.bitwise_xor.reduce(words)) if len(words) else 0
            for byte in b[len(b) // 8 * 8:]:
                total ^= byte
        return total - (1 << 64) if total >= 1 << 63 else total  # as an int64

    before = ops.stream_read(tensors)
    assert before == xor64(tensors)
    big = max(tensors, key=lambda t: t.numel())
    big[big.numel() - 1] ^= 1  # the last byte: the tail, or a thread's share's end
    assert ops.stream_read(tensors) == xor64(tensors) != before
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.stream_read([torch.zeros(64, 64, dtype=torch.uint8)[:, ::2]])
