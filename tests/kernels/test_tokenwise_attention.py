"""Prompt chunks attended token by token (engine.ops.token_by_token, chosen by the runner through
ops.tokenwise_attention_pays): in bf16 on the CPU, steps with short prompt chunks, alone
or beside decodes, go to the fused decode-attention kernel, one query token at a time over its own
sequence's cache. Checked end to end against transformers on the same bf16 weights and against the
padded path the same steps took before, with chunked prefill, batching and a shared prefix."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine import ops
from engine.kernels.fused_ops import fused_ops
from tests.support.models import build

pytestmark = pytest.mark.skipif(fused_ops() is None, reason="the fused CPU ops could not be built here")

PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(23)],
           [(7 * i + 3) % 500 + 1 for i in range(12)] + [(5 * i + 2) % 500 + 1 for i in range(9)],  # shares 12
           [(11 * i + 5) % 500 + 1 for i in range(6)]]


def scored(folder, monkeypatch, max_keys: int) -> tuple[list[list[float]], list[list[int]], int]:
    """Prompt logprobs and greedy tokens of PROMPTS in one batch (chunks of 5 tokens a step, so prompts
    are prefilled in pieces beside each other's decodes), with TOKENWISE_MAX_KEYS = max_keys; and how
    many multi-token steps attended token by token."""
    monkeypatch.setattr(ops, "TOKENWISE_MAX_KEYS", max_keys)
    taken = []
    tables_for = ops.token_by_token

    def spy(step, *tensors):
        tables = tables_for(step, *tensors)
        if step.max_query > 1:
            taken.append(tables is not None)
        return tables

    monkeypatch.setattr(ops, "token_by_token", spy)
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=3, max_num_batched_tokens=5)
    try:
        assert llm.engine.model.dtype == torch.bfloat16
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, logprobs=0,
                                                    ignore_eos=True))
    finally:
        llm.close()
    logprobs = [[e.logprob for e in o.prompt_logprobs[1:]] for o in outs]
    return logprobs, [o.outputs[0].token_ids for o in outs], sum(taken)


def test_prompt_chunks_token_by_token_match_transformers_and_the_padded_path(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    folder = build(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS]
    expected = [[float(r[i, p[i + 1]]) for i in range(len(p) - 1)] for r, p in zip(ref, PROMPTS)]

    tokenwise, tokens, taken = scored(folder, monkeypatch, ops.TOKENWISE_MAX_KEYS)
    padded, padded_tokens, padded_taken = scored(folder, monkeypatch, -1)
    assert taken > 5 and padded_taken == 0  # every prompt step went token by token, then none did
    # bf16 keeps 8 bits of mantissa: two orders of the same sums differ by a few ulps (test_reference's bound)
    for ours, other, want in zip(tokenwise, padded, expected):
        assert ours == pytest.approx(want, abs=0.05)
        assert ours == pytest.approx(other, abs=0.05)
    assert tokens == padded_tokens
