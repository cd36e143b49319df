"""The two configurations #15 found refused now start, with the flags a new user would give.

- SmolLM2-135M's shape (30 layers, hidden 576, vocabulary 49152, 8192 positions) at 60% of its fp32
  weights: the default context's KV cache for --max-num-seqs sequences did not fit.
- The benchmark model (~241M parameters, bf16) at 25% of its fp32 weights, `serve`'s default flags:
  the KV cache and the workspace of a 512-token chunk over the default context did not fit.

The checkpoints are real safetensors files whose data is a hole (a sparse file): the headers are
what planning and validation read, loading maps zero pages, and a step computes on zeros. So the
test loads the real engine at the real sizes in seconds and without the disk space.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.planner import PlanError
from engine.sampling_params import SamplingParams


def llama_tensors(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a Llama checkpoint."""
    h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def sparse_checkpoint(folder: Path, cfg: LlamaConfig) -> Path:
    """config.json + one bf16 model.safetensors whose data is all a hole (reads as zeros)."""
    folder.mkdir(parents=True)
    cfg.save_pretrained(folder)
    header, offset = {}, 0
    for name, shape in llama_tensors(cfg).items():
        n = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return folder


def fp32_bytes(cfg: LlamaConfig) -> int:
    return 4 * sum(int(torch.Size(s).numel()) for s in llama_tensors(cfg).values())


SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True)
BENCH_SHAPE = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                   tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("shape, fraction", [(SMOLLM2_SHAPE, 0.60), (BENCH_SHAPE, 0.25)],
                         ids=["smollm2-135m-at-60pct", "bench-241m-at-25pct"])
def test_a_budget_that_was_refused_starts_with_the_context_that_fits(tmp_path, tokenizer, shape, fraction):
    cfg = LlamaConfig(rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", **shape)
    folder = sparse_checkpoint(tmp_path / "model", cfg)
    budget = int(fraction * fp32_bytes(cfg))
    engine = LLMEngine(EngineArgs(model=str(folder), max_device_memory=budget, show_progress=False),
                       tokenizer=tokenizer)
    try:
        plan = engine.plan
        assert plan.device_bytes <= budget and plan.streamed_blocks
        # The step shrinks before the context does: attention calls bounded by the budget, then fewer
        # tokens per step; the context is lowered only from the smallest step.
        assert plan.attn_chunk_bytes == budget // 8
        assert plan.max_model_len == min(cfg.max_position_embeddings, 4096) or plan.max_num_batched_tokens == 32
        assert any("lowered" in n for n in plan.notes)
        # The pool holds at least one sequence of the context it started with ...
        assert plan.num_kv_blocks * plan.kv_block_size >= plan.max_model_len >= 256
        # ... where the slot cache reserved max_num_seqs x max_model_len: more than the whole budget.
        per_token = plan.kv_cache_bytes // (plan.num_kv_blocks * plan.kv_block_size)
        assert 16 * min(cfg.max_position_embeddings, 4096) * per_token > budget
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True), "r")
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert [o.finish_reason for o in outs if o.finished] == ["length"]
    finally:
        engine.close()


def test_a_budget_too_small_for_any_context_says_what_would_do(tmp_path, tokenizer):
    cfg = LlamaConfig(rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", **BENCH_SHAPE)
    folder = sparse_checkpoint(tmp_path / "model", cfg)
    with pytest.raises(PlanError, match=r"too small even for a context of 256 tokens: that needs at least"):
        LLMEngine(EngineArgs(model=str(folder), max_device_memory=int(0.1 * fp32_bytes(cfg)), show_progress=False),
                  tokenizer=tokenizer)
