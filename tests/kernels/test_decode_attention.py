"""The fused decode attention (engine/kernels/fused_ops.cpp `decode_attention`) against the torch path
it replaces in engine/model.attention: the KV write (index_copy_), the gather through the block table
and SDPA.

Stated tolerances: the KV write is exact; fp32 outputs within 1e-5 of a float64 reference (the same
sums in another order); in bf16 / fp16 the output is as accurate as SDPA's flash kernel: its error
against the float64 reference is at most 1.25x SDPA's (plus one ulp at the output's scale), and the two
agree within the dtype's rounding.
"""

from __future__ import annotations

import pytest
import torch

from engine import model as M
from engine import ops as dispatch
from engine.arch import ModelConfig
from engine.kernels import fused_ops as fo
from engine.ops import attend

ops = fo.fused_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="the fused CPU ops could not be built here")


def _case(seqs, ctx, nh=9, nkv=3, hd=64, bs=16, dtype=torch.bfloat16, seed=0):
    """A decode step's attention inputs over a paged cache with shuffled blocks: q, k, v as views of one
    stacked qkv row (as attention() makes them), the caches, slots, block tables and positions (the
    first sequence at ctx - 1, the others shorter)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-ctx // bs)
    nblocks = seqs * max_blocks + 3
    k_cache = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)  # (blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    tables = torch.randperm(nblocks, generator=g)[:seqs * max_blocks].view(seqs, max_blocks)
    positions = torch.randint(0, ctx, (seqs,), generator=g)
    positions[0] = ctx - 1
    slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
    qkv = (torch.randn(seqs, (nh + 2 * nkv) * hd, generator=g) * 2).to(dtype)  # (seqs, (heads + 2 kv) * hd)
    q = qkv[:, :nh * hd].view(seqs, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(seqs, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(seqs, nkv, hd)
    return q, k, v, k_cache, v_cache, slots, tables, positions


def _mask(positions, window):
    keys = torch.arange(int(positions.max()) + 1)
    mask = keys[None, :] <= positions[:, None]  # (seqs, context)
    if window:
        mask &= keys[None, :] > positions[:, None] - window
    return mask[:, None, None, :]  # (seqs, 1, 1, context)


def _torch_path(q, k, v, k_cache, v_cache, slots, tables, positions, window=0, dtype=None):
    """engine/model.attention's code for the same step (in `dtype` if given, else the inputs')."""
    seqs, nh, hd = q.shape
    nkv = k.shape[1]
    if dtype is not None:
        q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache.view(-1, nkv, hd).index_copy_(0, slots, k)
    v_cache.view(-1, nkv, hd).index_copy_(0, slots, v)
    ctx = int(positions.max()) + 1
    keys, values = M.gather_blocks(k_cache, tables, ctx), M.gather_blocks(v_cache, tables, ctx)
    out = attend(q.view(seqs, 1, nh, hd).transpose(1, 2), keys, values, _mask(positions, window))
    return out.transpose(1, 2).reshape(seqs, nh * hd), k_cache, v_cache


def _fused(q, k, v, k_cache, v_cache, slots, tables, positions, window=0):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = ops.decode_attention(q, k, v, k_cache, v_cache, slots, tables, positions, window)
    return out, k_cache, v_cache


@needs_ops
@pytest.mark.parametrize("seqs,ctx,nh,nkv,window,hd", [
    (1, 1, 9, 3, 0, 64),       # the first token: one key
    (1, 37, 9, 3, 0, 64),      # SmolLM2's heads, a short decode
    (4, 100, 8, 8, 0, 64),     # no GQA
    (3, 300, 8, 2, 64, 64),    # sliding window
    (2, 1300, 4, 1, 0, 64),    # past one flash tile of 512 keys
    (1, 2000, 24, 8, 0, 128),  # Llama-3.2-3B's heads at a long context: bf16 on AVX-512 merges 4 chunks
    (2, 1500, 8, 2, 700, 128),  # a sliding window across chunks
    (3, 200, 8, 2, 0, 128),    # bf16 on AVX-512: 8 vectors a row
    (2, 700, 16, 2, 0, 256),   # groups of 8 heads of 256: p . V in two-column tiles
    (2, 530, 14, 2, 333, 80),  # groups of 7, a head_dim of 5 vectors, a window starting inside a block
    (2, 90, 6, 3, 0, 40),      # a head_dim the AVX-512 bf16 loops do not take: the generic ones
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_attention_matches_the_sdpa_path(seqs, ctx, nh, nkv, window, hd, dtype):
    args = _case(seqs, ctx, nh=nh, nkv=nkv, hd=hd, dtype=dtype, seed=ctx)
    out, kc, vc = _fused(*args, window)
    ref, rkc, rvc = _torch_path(*args, window)
    assert torch.equal(kc, rkc) and torch.equal(vc, rvc)  # the KV write is a copy
    exact, _, _ = _torch_path(*args, window, dtype=torch.float64)
    err = (out.double() - exact).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5
        return
    sdpa_err = (ref.double() - exact).abs().max().item()
    ulp = exact.abs().max().item() * torch.finfo(dtype).eps
    assert err <= 1.25 * sdpa_err + ulp, (err, sdpa_err)
    torch.testing.assert_close(out, ref, atol=2 * ulp, rtol=0)


@needs_ops
@pytest.mark.parametrize("ctx", [300, 1300])
def test_decode_attention_does_not_depend_on_the_threads(ctx):
    """bf16 on AVX-512 splits a context into chunks and chunks into spans of keys, which the threads share:
    both depend on the context alone and the spans' sums are added in span order, so the bits are the same
    on any number of threads."""
    args = _case(3, ctx, nh=24, nkv=8, hd=128, seed=ctx)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _, _ = _fused(*(a.clone() for a in args))
        torch.set_num_threads(max(2, threads))
        many, _, _ = _fused(*(a.clone() for a in args))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_attention_takes_the_fused_path_for_16_bit_decode_steps(monkeypatch, dtype):
    """engine.model.attention with a decode step in bf16 takes decode_attention and agrees with its own
    SDPA path for the same step; fp32 (the exact mode) stays on SDPA."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                      checkpoint_dtype=dtype, rope_inv_freq=tuple((1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)).tolist()))
    taken = []
    tables_for = dispatch.token_by_token
    monkeypatch.setattr(dispatch, "token_by_token", lambda *a: taken.append(tables_for(*a) is not None) or tables_for(*a))
    g = torch.Generator().manual_seed(1)
    w = {"wqkv": (torch.randn((4 + 2 * 2) * 16, 64, generator=g) / 8).to(dtype),  # (q + k + v rows, hidden)
         "wo": (torch.randn(64, 64, generator=g) / 8).to(dtype)}
    x = torch.randn(2, 64, generator=g).to(dtype)  # (seqs, hidden): two sequences, one token each
    k_cache = torch.randn(6, 16, 2, 16, generator=g).to(dtype)  # (blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(6, 16, 2, 16, generator=g).to(dtype)
    positions, tables = torch.tensor([20, 5]), torch.tensor([[4, 1], [2, 0]])
    slots = tables.gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    cos, sin = M.rotary_cos_sin(positions, *M.rotary_inv_freq(cfg), dtype)
    step = M.StepInputs(input_ids=torch.zeros(2, dtype=torch.long), positions=positions, cos=cos, sin=sin,
                        slot_mapping=slots, block_tables=tables, pad_rows=None, max_query=1, context_len=21,
                        attn_mask=_mask(positions, 0), logits_index=torch.arange(2))
    kc, vc = k_cache.clone(), v_cache.clone()
    out = M.attention(x, w, kc, vc, step, cfg)
    assert taken == [dtype == torch.bfloat16]
    monkeypatch.setattr(dispatch, "token_by_token", lambda *a: None)  # the SDPA path for the same step
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref = M.attention(x, w, kc2, vc2, step, cfg)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(out, ref, atol=2e-2 if dtype == torch.bfloat16 else 0, rtol=0)


@needs_ops
def test_decode_attention_refuses_bad_input():
    q, k, v, kc, vc, slots, tables, positions = _case(2, 40, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="slot 9999 outside the cache"):
        ops.decode_attention(q, k, v, kc, vc, torch.tensor([9999, 0]), tables, positions)
    with pytest.raises(RuntimeError, match="position 48 beyond the block table"):
        ops.decode_attention(q, k, v, kc, vc, slots, tables, torch.tensor([48, 3]))
    bad_tables = tables.clone()
    bad_tables[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="block 10000 outside the cache"):
        ops.decode_attention(q, k, v, kc, vc, slots, bad_tables, positions)
    with pytest.raises(RuntimeError, match="must have dtype"):
        ops.decode_attention(q, k, v, kc.bfloat16(), vc, slots, tables, positions)
    with pytest.raises(RuntimeError, match="must be int64"):
        ops.decode_attention(q, k, v, kc, vc, slots.int(), tables, positions)
    with pytest.raises(RuntimeError, match="do not group"):
        ops.decode_attention(q[:, :8], k[:, :3], v[:, :3], kc, vc, slots, tables, positions)
