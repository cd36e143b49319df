"""layerstream against transformers on the same weights (fp32): logits and greedy tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.support.models import ARCHS, build, to_v4_config_style
from tests.support.reference import (PROMPT, assert_matches_reference, prompt_logits, reference_greedy,
                                     stream_all_but_one_budget)


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
