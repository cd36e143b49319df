"""A decode step's block as one C++ call (engine/kernels/decode_block.cpp) against engine/model.py's
op-by-op block_forward: it calls the same functions in the same order, so outputs and KV caches must be
bit-identical (dense, int4 and int8 weights; Qwen2's q/k/v bias; a sliding window), and a whole fast-mode
run must give the same tokens and log-probabilities with it and without it."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import LLM, SamplingParams
from engine import kernels
from engine import model as M
from engine import ops
from engine.arch import ModelConfig
from engine.kernels import bf16_rows as br
from engine.kernels import decode_block as db
from engine.weights import Int4Weight, Int8Weight
from tests.support.gguf_models import tiny_gguf

module = db.decode_block()
needs_block = pytest.mark.skipif(module is None, reason="the C++ decode block is not available here")

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 96, 4, 2, 16, 16


def _cfg(window=None) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=HIDDEN, intermediate_size=INTER,
                       num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                       max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                       checkpoint_dtype=torch.bfloat16, sliding_window=window,
                       rope_inv_freq=tuple((1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)).tolist()))


def _weight(out, inner, kind, g):
    dense = torch.randn(out, inner, generator=g) / inner ** 0.5
    if kind == "dense":
        return dense.bfloat16()
    if kind == "int8":
        return Int8Weight.quantize(dense, torch.bfloat16)
    codes = torch.randint(0, 16, (out, inner), generator=g)
    scale = torch.rand(out, inner // 32, generator=g) / (4 * inner ** 0.5)
    return Int4Weight.from_codes(codes, scale, -8 * scale, torch.bfloat16)


def _block(kind, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    w = {"attn_norm": (1 + torch.randn(HIDDEN, generator=g) / 10).bfloat16(),
         "mlp_norm": (1 + torch.randn(HIDDEN, generator=g) / 10).bfloat16(),
         "wqkv": _weight(qkv_rows, HIDDEN, kind, g), "wo": _weight(HIDDEN, HEADS * HEAD_DIM, kind, g),
         "w_gate_up": _weight(2 * INTER, HIDDEN, kind, g), "w_down": _weight(HIDDEN, INTER, kind, g)}
    if bias:
        w["bqkv"] = torch.randn(qkv_rows, generator=g).bfloat16()
    return w


def _step(positions, tables, cfg):
    positions, tables = torch.tensor(positions), torch.tensor(tables)
    slots = tables.gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK + positions % BLOCK
    cos, sin = M.rotary_cos_sin(positions, *M.rotary_inv_freq(cfg), torch.bfloat16)
    ctx = int(positions.max()) + 1
    keys = torch.arange(ctx)
    mask = keys[None, :] <= positions[:, None]  # (seqs, context)
    if cfg.sliding_window:
        mask &= keys[None, :] > positions[:, None] - cfg.sliding_window
    return M.StepInputs(input_ids=torch.zeros(len(positions), dtype=torch.long), positions=positions, cos=cos,
                        sin=sin, slot_mapping=slots, block_tables=tables, pad_rows=None, max_query=1,
                        context_len=ctx, attn_mask=mask[:, None, None, :], logits_index=torch.arange(len(positions)),
                        window=cfg.sliding_window)


def assert_block_matches_op_by_op(monkeypatch, x, w, k_cache, v_cache, step, cfg) -> torch.Tensor:
    """The step runs as the one C++ block call, and its output and cache writes are bit for bit the
    op-by-op path's (which stays switched on afterwards); returns that output."""
    assert ops._decode_block_args(x, w, k_cache, v_cache, step, cfg) is not None
    kc, vc = k_cache.clone(), v_cache.clone()
    fast = M.block_forward(x, w, kc, vc, step, cfg)
    monkeypatch.setattr(ops, "decode_block", lambda: None)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref = M.block_forward(x, w, kc2, vc2, step, cfg)
    assert torch.equal(fast, ref)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    return ref


@needs_block
@pytest.mark.parametrize("kind,bias,window", [("int4", False, None), ("int8", True, None), ("dense", False, None),
                                              ("int4", True, 8), ("dense, F.linear", True, None)])
def test_block_is_bit_identical_to_the_op_by_op_path(monkeypatch, kind, bias, window):
    """Dense bf16 weights of 3 sequences take bf16_rows.cpp's kernel on both paths where it builds (also
    on an AMX CPU, whose engine leaves them to oneDNN); "dense, F.linear" turns it off for both (the
    block is told by its few_rows argument)."""
    if not kind.startswith("dense") and kernels.int4_backend() != "vnni":
        pytest.skip("VNNI layouts need the VNNI kernels")
    if kind == "dense":
        monkeypatch.setattr(ops, "bf16_rows", br.bf16_rows)
    if kind == "dense, F.linear":
        monkeypatch.setattr(ops, "bf16_rows", lambda: None)
        kind = "dense"
    cfg = _cfg(window)
    w = _block(kind, bias)
    step = _step([37, 3, 20], [[5, 2, 7], [0, 0, 0], [1, 6, 0]], cfg)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, HIDDEN, generator=g).bfloat16()  # (seqs, hidden)
    k_cache = torch.randn(8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    v_cache = torch.randn(8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    assert_block_matches_op_by_op(monkeypatch, x, w, k_cache, v_cache, step, cfg)


def _apart(w: dict) -> dict:
    """The block's q/k/v and gate/up as separate weights (and biases), as a bf16 checkpoint's resident blocks
    are kept: views of the mapping, which stacking would copy."""
    q, k, v = w["wqkv"].split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM))
    gate, up = w["w_gate_up"].chunk(2)
    out = {**{n: t for n, t in w.items() if n not in ("wqkv", "w_gate_up", "bqkv")}, "wq": q.contiguous(),
           "wk": k.contiguous(), "wv": v.contiguous(), "w_gate": gate.contiguous(), "w_up": up.contiguous()}
    if "bqkv" in w:
        out["bq"], out["bk"], out["bv"] = (b.contiguous() for b in
                                           w["bqkv"].split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)))
    return out


@needs_block
@pytest.mark.parametrize("seqs", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_projections_kept_apart_run_as_the_block_with_the_stacked_bits(monkeypatch, seqs, bias):
    """q/k/v and gate/up kept apart (dense bf16, one sequence on the one-row kernel, three on the rows
    kernel) run as the one C++ block call, bit-identical to op by op and to the same block stacked."""
    monkeypatch.setattr(ops, "bf16_rows", br.bf16_rows)
    cfg = _cfg()
    stacked = _block("dense", bias)
    step = _step([37, 3, 20][:seqs], [[5, 2, 7], [0, 0, 0], [1, 6, 0]][:seqs], cfg)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(seqs, HIDDEN, generator=g).bfloat16()  # (seqs, hidden)
    k_cache = torch.randn(8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    v_cache = torch.randn(8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    kc, vc = k_cache.clone(), v_cache.clone()
    whole = M.block_forward(x, stacked, kc, vc, step, cfg)
    apart = assert_block_matches_op_by_op(monkeypatch, x, _apart(stacked), k_cache, v_cache, step, cfg)
    assert torch.equal(apart, whole)


@needs_block
def test_prompt_chunks_attending_token_by_token_run_as_the_block(monkeypatch):
    """A step of prompt chunks whose attention goes token by token (StepInputs.token_tables: each token's
    sequence's block-table row) runs as the one C++ block call, bit-identical to op by op, causal within
    each chunk; without token tables (the padded path) it stays op by op."""
    cfg = _cfg()
    w = _block("dense", True)
    tables = torch.tensor([[5, 2, 7], [1, 6, 0]])  # two sequences' blocks
    rows = [0, 0, 0, 1, 1]  # each token's sequence: a 3-token chunk at 14-16, a 2-token one at 0-1
    per_token = _step([14, 15, 16, 0, 1], tables[rows].tolist(), cfg)
    step = M.StepInputs(**{**per_token.__dict__, "max_query": 3, "block_tables": tables,
                           "pad_rows": torch.arange(5), "token_tables": tables[rows]})
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, HIDDEN, generator=g).bfloat16()  # (tokens, hidden)
    k_cache = torch.randn(8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    v_cache = torch.randn(8, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    assert ops._decode_block_args(x, w, k_cache, v_cache, M.StepInputs(**{**step.__dict__, "token_tables": None}),
                                cfg) is None
    ref = assert_block_matches_op_by_op(monkeypatch, x, w, k_cache, v_cache, step, cfg)  # op by op from here
    # causal: the chunk's first token does not see the two after it (their K/V changed, its output not)
    kc3, vc3 = k_cache.clone(), v_cache.clone()
    later = x.clone()
    later[1:3] += 1
    assert torch.equal(M.block_forward(later, w, kc3, vc3, step, cfg)[0], ref[0])
    assert not torch.equal(M.block_forward(later, w, k_cache.clone(), v_cache.clone(), step, cfg)[2], ref[2])


@needs_block
def test_blocks_it_cannot_run_stay_op_by_op():
    cfg = _cfg()
    w = _block("dense", False)
    step = _step([5], [[0]], cfg)
    x = torch.randn(1, HIDDEN).bfloat16()
    kc = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    assert ops._decode_block_args(x, w, kc, kc, step, cfg) is not None
    assert ops._decode_block_args(x.float(), {k: v.float() for k, v in w.items()}, kc.float(), kc.float(), step,
                                cfg) is None  # float32: the exact mode
    assert ops._decode_block_args(x, {k: v for k, v in w.items() if k != "wqkv"}, kc, kc, step, cfg) is None
    two = _step([5, 6], [[0], [1]], cfg)
    prefill = M.StepInputs(**{**two.__dict__, "max_query": 2, "block_tables": two.block_tables[:1]})
    assert ops._decode_block_args(torch.randn(2, HIDDEN).bfloat16(), w, kc, kc, prefill, cfg) is None
    qk_norm = ModelConfig(**{**cfg.__dict__, "qk_norm": True})
    assert ops._decode_block_args(x, w, kc, kc, step, qk_norm) is None


@needs_block
@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_0), ("qwen2", Q.Q8_0)])
def test_fast_mode_run_is_the_same_with_and_without_it(monkeypatch, tmp_path, arch, qtype):
    """Tokens and their log-probabilities of a batched fast-mode (bf16) run of a tiny GGUF model, two
    sequences decoding side by side: equal with the C++ block and op by op; the C++ block ran."""
    path = tiny_gguf(tmp_path, arch, qtype)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    calls = []

    class Spy:
        def block(self, *args):
            calls.append(1)
            return module.block(*args)

    runs = []
    for block in (Spy(), None):
        monkeypatch.setattr(ops, "decode_block", lambda: block)
        llm = LLM(str(path), max_model_len=64, max_num_seqs=2)
        try:
            if qtype == Q.Q4_0 and kernels.int4_backend() == "vnni":
                weights = llm.engine.model.weights
                assert weights.acquire(0)["wqkv"].scales.dim() == 3  # resident Q4_0: the symmetric layout
                weights.release(0)
            outs = llm.generate(["The quick brown fox", "Hello"], params)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        finally:
            llm.close()
    assert calls
    assert runs[0] == runs[1]
