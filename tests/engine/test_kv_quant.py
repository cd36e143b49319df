"""The quantized KV format (engine/kv_quant.py): int8 against gguf-py's reference Q8_0 (the format llama.cpp's
--cache-type-k q8_0 uses), int4 against a plain re-statement of its scale search and against Q4_0's error,
the Hadamard rotation's algebra, and the limits' errors.

One stated difference for int8: gguf-py computes the codes with the fp32 scale and then stores it as
float16; ours rounds the scale to float16 first, so a code times the stored scale is the value rounding
chose. A code may then differ by one step, rarely."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.args import EngineArgs
from engine.kv_quant import (INT4_LEVELS, INT4_TOPS, KVQuant, dequantize, hadamard, kv_bytes_per_token, quantize,
                              rotate)


def _reference(x: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(quants.quantize(x.numpy(), kind), kind).copy())


def test_int8_with_a_32_value_head_is_gguf_q8_0():
    x = torch.randn(50, 4, 32) * 3  # (tokens, kv_heads, head_dim): one scale per head = one Q8_0 block
    quant = KVQuant(8, 32)
    codes, scales = quantize(x, quant)
    assert codes.dtype == torch.int8 and codes.shape == (50, 4, 32) and scales.shape == (50, 4, 1)
    ours, ref = dequantize(codes, scales, quant, torch.float32), _reference(x, GGMLQuantizationType.Q8_0)
    assert (ours != ref).float().mean() < 0.02
    step = scales.float()  # (tokens, kv_heads, 1): one code step
    assert ((ours - ref).abs() <= step * 1.001).all()


def _int4_by_hand(x: np.ndarray) -> np.ndarray:
    """One int4 group (n values) dequantized the slow, plain way: for each candidate top, each value's
    nearest level after scaling the absmax to the top, the least-squares scale for those levels; the
    candidate of least squared error, its scale rounded to float16."""
    levels = np.array(INT4_LEVELS, dtype=np.float64)
    amax = np.abs(x).max()
    best, best_err = None, np.inf
    for top in INT4_TOPS:
        v = x.astype(np.float64) * (top / amax if amax > 0 else 0.0)
        lv = levels[np.abs(v[:, None] - levels[None, :]).argmin(1)]
        d = (x @ lv) / (lv @ lv)
        err = ((x - d * lv) ** 2).sum()
        if err < best_err - 1e-9 * (x @ x):
            best, best_err = np.float16(np.float32(d)).astype(np.float64) * lv, err  # as torch rounds it
    return best


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_int4_keeps_the_candidate_scale_of_least_error(head_dim):
    x = torch.randn(40, 3, head_dim, generator=torch.Generator().manual_seed(2)) * 5
    quant = KVQuant(4, head_dim)
    codes, scales = quantize(x, quant)
    assert codes.dtype == torch.uint8 and codes.shape == (40, 3, head_dim // 2)
    assert scales.shape == (40, 3, head_dim // quant.group)
    ours = dequantize(codes, scales, quant, torch.float64).reshape(-1, quant.group).numpy()
    groups = x.reshape(-1, quant.group).numpy()
    ref = np.stack([_int4_by_hand(g) for g in groups])
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def test_int4_errs_less_than_gguf_q4_0_on_rotated_values():
    """The format's reason: on near-Gaussian groups (what the rotation makes of a head) its levels and
    searched scale lose clearly less than Q4_0's 16 even steps scaled by the absmax."""
    g = torch.Generator().manual_seed(0)
    x = rotate(torch.randn(512, 64, generator=g) * torch.linspace(0.2, 3, 64))  # (tokens, head_dim)
    quant = KVQuant(4, 64)
    ours = (dequantize(*quantize(x, quant), quant, torch.float32) - x).pow(2).mean()
    q4_0 = (_reference(x, GGMLQuantizationType.Q4_0) - x).pow(2).mean()
    assert ours < 0.85 * q4_0, (ours, q4_0)


def test_zero_and_extreme_vectors_round_trip_without_nan():
    x = torch.zeros(2, 1, 64)
    x[1, 0, 5] = 1e6  # beyond float16's scale range: clamped, never inf
    for bits in (8, 4):
        quant = KVQuant(bits, 64)
        y = dequantize(*quantize(x, quant), quant, torch.float32)
        assert torch.isfinite(y).all() and (y[0] == 0).all()


@pytest.mark.parametrize("n", [64, 128, 96, 80])
def test_hadamard_is_orthonormal_so_rotated_q_dot_rotated_k_is_q_dot_k(n):
    h = hadamard(n).double()
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, h.T)  # its own inverse: the output's rotation back is the same product
    q, k = torch.randn(5, n), torch.randn(7, n)
    torch.testing.assert_close(rotate(q) @ rotate(k).T, q @ k.T, atol=1e-4, rtol=1e-4)


def test_rotation_spreads_an_outlier_channel_so_int4_error_shrinks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, 3] *= 30  # one outlier channel, as real keys have
    quant = KVQuant(4, 64)
    plain = (dequantize(*quantize(x, quant), quant, torch.float32) - x).pow(2).mean()
    rotated = (rotate(dequantize(*quantize(rotate(x), quant), quant, torch.float32)) - x).pow(2).mean()
    assert rotated < plain / 2


def test_bytes_per_token_give_the_capacity_the_issue_asks():
    bf16 = kv_bytes_per_token(30, 3, 64, torch.bfloat16, None)
    assert bf16 / kv_bytes_per_token(30, 3, 64, torch.bfloat16, KVQuant(8, 64)) >= 1.9
    assert bf16 / kv_bytes_per_token(30, 3, 64, torch.bfloat16, KVQuant(4, 64)) >= 3.5
    llama8b = kv_bytes_per_token(32, 8, 128, torch.bfloat16, None)
    assert llama8b == 128 << 10  # the issue's figure: 128 KiB per token
    assert llama8b / kv_bytes_per_token(32, 8, 128, torch.bfloat16, KVQuant(8, 128)) >= 1.9
    assert llama8b / kv_bytes_per_token(32, 8, 128, torch.bfloat16, KVQuant(4, 128)) >= 3.5


def test_bad_formats_are_clear_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, int4, got 'fp8'"):
        KVQuant.of("fp8", 64)
    with pytest.raises(ValueError, match="multiple of 16, got 40"):
        KVQuant(4, 40)
    assert KVQuant(4, 48).group == 16 and KVQuant(4, 96).group == 32 and KVQuant(8, 48).group == 48
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model="demo", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_disk_bytes must be >= 0"):
        EngineArgs(model="demo", kv_disk_bytes=-1)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineArgs(model="demo", kv_disk_bytes="1GiB", enable_prefix_caching=False)
    assert KVQuant.of("auto", 64) is None and KVQuant.of("int8", 64, rotate=False).rotate is False
    np.testing.assert_equal(EngineArgs(model="demo", kv_disk_bytes="1KiB").kv_disk_bytes, 1024)
