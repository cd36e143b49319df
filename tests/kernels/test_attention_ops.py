"""engine/kernels/attention_ops.cpp's softmax_ against torch's scale + masked_fill + softmax (what
attention_backend runs without it), and attend's results with and without it.

Tolerance, stated: atol 2e-6 on probabilities in [0, 1]: the exponential is ATen's exp_u20 (within
20 ulp, as in SDPA's CPU flash kernel) where torch's softmax uses Sleef's (1 ulp)."""

from __future__ import annotations

import pytest
import torch

from engine import ops as dispatch
from engine.kernels.attention_ops import attention_ops
from tests.support.attention import padded_problem

ops = attention_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the attention ops are not built or the CPU lacks AVX-512")


def torch_softmax(s, scale, open_keys, hidden):
    s = s * scale
    if hidden is not None:
        s[..., open_keys:] = s[..., open_keys:].masked_fill(hidden, float("-inf"))
    return torch.softmax(s, dim=-1)


# (seqs, heads, rows, keys, open_keys): keys and open_keys on and off the 16-float vector width
SHAPES = [(1, 4, 8, 2032, 1904), (2, 2, 5, 37, 0), (3, 1, 4, 32, 16), (2, 4, 3, 100, 41), (1, 1, 1, 7, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[3]}keys-open{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("masked", [True, False], ids=["hidden", "no-hidden"])
def test_softmax_equals_torch(shape, masked):
    seqs, heads, rows, keys, open_keys = shape
    g = torch.Generator().manual_seed(keys)
    s = torch.randn(seqs, heads, rows, keys, generator=g) * 8
    full = torch.rand(seqs, 1, 2 * rows, keys - open_keys, generator=g) < 0.3  # strided rows, as attend slices
    full[..., -1] = False  # every row keeps a key
    hidden = full[:, :, ::2] if masked else None
    want = torch_softmax(s, 0.125, open_keys, hidden)
    got = s.clone()
    ops.softmax_(got, 0.125, open_keys, hidden)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    if masked:
        assert (got[..., open_keys:].masked_select(hidden.expand(seqs, heads, rows, -1)) == 0).all()
        assert hidden.any()


def test_softmax_rejects_bad_input():
    s = torch.randn(1, 2, 3, 20)
    with pytest.raises(RuntimeError, match="contiguous .* float32"):
        ops.softmax_(s.double(), 1.0, 0, None)
    with pytest.raises(RuntimeError, match="open_keys 21 outside"):
        ops.softmax_(s, 1.0, 21, None)
    with pytest.raises(RuntimeError, match="hidden must be a"):
        ops.softmax_(s, 1.0, 4, torch.zeros(1, 1, 3, 20, dtype=torch.bool))


def test_attend_same_with_the_torch_softmax(monkeypatch):
    """attend's bf16 matmul path gives the same result with the C++ softmax and with torch's."""
    q, k, v, mask = padded_problem([64, 32, 1], [900, 1500, 40], heads=16, kv_heads=4, head_dim=64,
                                   dtype=torch.bfloat16)
    monkeypatch.setattr(dispatch, "bf16_matmul_attention", lambda: True)
    with torch.inference_mode():
        fused = dispatch.attend(q, k, v, mask, open_keys=40)
        monkeypatch.setattr(dispatch, "attention_ops", lambda: None)
        plain = dispatch.attend(q, k, v, mask, open_keys=40)
    torch.testing.assert_close(fused, plain, atol=1e-2, rtol=1e-2)  # bf16 outputs: at most an ulp apart
    assert (fused.float() - plain.float()).abs().max() <= 2 ** -7 * plain.float().abs().max()
