"""layerstream against transformers on the same weights (fp32): logits and greedy tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.support.models import ARCHS, build, to_v4_config_style

# fp32 on CPU: our attention runs over the KV cache and a different op order than the reference,
# so results agree to rounding, not bit for bit.
ATOL, RTOL = 1e-4, 1e-4
PROMPT = [5, 17, 99, 3, 250, 42, 7, 311, 128, 64]


def reference_greedy(folder, prompt, n):
    return greedy_with(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompt, n)


def greedy_with(model, prompt, n):
    """(n greedy tokens after prompt, prompt logits) from a transformers model."""
    ids = list(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
        # A plain greedy loop: generate() would stop at (or, with min_new_tokens, suppress) EOS,
        # while the engine side runs with ignore_eos and may pick it.
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):], logits


def stream_all_but_one_budget(llm_resident) -> int:
    """A budget that keeps exactly one block resident and streams the rest."""
    p = llm_resident.plan
    return (p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + p.block_bytes
            + (p.prefetch_depth + 1) * p.block_bytes)


def prompt_logits(llm, prompt):
    """Logits for every prompt position, through the engine's own runner (one prefill chunk)."""
    rows = []
    for end in range(1, len(prompt) + 1):  # prefill the prefix, sample its last token
        rows.append(llm.engine.prompt_logits(list(prompt[:end])))
    return torch.stack(rows)


def assert_matches_reference(llm, ref_tokens, ref_logits, max_tokens):
    """The engine's prompt logits within ATOL/RTOL of the reference's, and its greedy tokens identical;
    returns the completion for further checks."""
    torch.testing.assert_close(prompt_logits(llm, PROMPT), ref_logits, atol=ATOL, rtol=RTOL)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref_tokens
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streaming"])
def test_matches_transformers(model_dirs, arch, streaming):
    folder = model_dirs[arch]
    ref_tokens, ref_logits = reference_greedy(folder, PROMPT, 32)
    llm = LLM(str(folder), max_model_len=128, max_num_seqs=2)
    if streaming:
        budget = stream_all_but_one_budget(llm)
        llm.close()
        llm = LLM(str(folder), max_model_len=128, max_num_seqs=2, max_device_memory=budget)
        assert len(llm.plan.resident_blocks) == 1
        assert len(llm.plan.streamed_blocks) == llm.engine.model.cfg.num_layers - 1
    try:
        out = assert_matches_reference(llm, ref_tokens, ref_logits, 32)
        assert out.finish_reason == "length"
        if streaming:
            stats = llm.telemetry().total
            assert stats.blocks_streamed >= 32 * len(llm.plan.streamed_blocks)
    finally:
        llm.close()


def test_transformers_v4_config_style(tmp_path):
    """Checkpoints saved by transformers 4.x (rope_theta / rope_scaling / torch_dtype) load the same."""
    folder = build(tmp_path / "v4", "llama3")
    to_v4_config_style(folder)
    ref_tokens, ref_logits = reference_greedy(folder, PROMPT, 16)
    llm = LLM(str(folder), max_model_len=128, max_num_seqs=1)
    try:
        assert_matches_reference(llm, ref_tokens, ref_logits, 16)
    finally:
        llm.close()


def test_bf16_checkpoint_loads_and_generates(tmp_path):
    folder = build(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    llm = LLM(str(folder), max_model_len=128, max_num_seqs=1)
    try:
        assert llm.engine.model.dtype == torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        with torch.no_grad():
            ref_bf16 = model(torch.tensor([PROMPT])).logits[0, -1].float()
        ours = prompt_logits(llm, PROMPT)[-1]
        # bf16 keeps 8 bits of mantissa; two orderings of the same sums differ by a few ulps.
        torch.testing.assert_close(ours, ref_bf16, atol=0.05, rtol=0.05)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 8
    finally:
        llm.close()
