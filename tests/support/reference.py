"""The engine against transformers on the same weights: reference greedy tokens and logits, the engine's
prompt logits through its own runner, and the budget that streams all but one block."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams


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


def budget_for(folder, resident: int = 0, depth: int = 1, dtype: str = "auto", **limits) -> int:
    """A device budget with room for exactly `resident` blocks besides depth + 1 stream buffers, under
    `limits` (EngineArgs fields; max_model_len=128, max_num_seqs=2 unless given)."""
    limits = {"max_model_len": 128, "max_num_seqs": 2, **limits}
    llm = LLM(str(folder), dtype=dtype, **limits)
    llm.close()
    return llm.plan.budget_keeping(resident, depth)
