"""Serving LoRA adapters (engine.lora_serving) through the real engine on a tiny fp32 Llama: a served
adapter's logits against PEFT's merged model, resident (q/k/v and gate/up stacked) and streamed (apart);
a step mixing the base and two adapters against each request alone; the fused C++ decode block kept for
base-only steps and left for steps with adapter rows; unloading refused while requests use the adapter."""

from __future__ import annotations

import pytest
import torch

from engine import EngineArgs, SamplingParams
from engine.llm import LLM
from engine.llm_engine import LoRAAdapterBusyError
from engine.lora_serving import UnknownAdapterError
from tests.support.batching import Result, assert_same, drive, greedy
from tests.support.lora import make_adapter, merged_logits

PROMPT = [(i * 37 + 11) % 500 + 6 for i in range(21)]
MAX_LEN = 96


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two adapters of different ranks and targets; b uses rsLoRA's scale alpha / sqrt(r)."""
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(root / "a", llama_dir, r=4, alpha=8.0, seed=1),
            "b": make_adapter(root / "b", llama_dir, r=8, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"),
                              seed=2, use_rslora=True)}


def _budget_streaming_all_but_one(llama_dir, **kw) -> int:
    llm = LLM(str(llama_dir), **kw)
    p = llm.plan
    llm.close()
    return (p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + p.block_bytes
            + (p.prefetch_depth + 1) * p.block_bytes)


@pytest.mark.parametrize("streamed,device", [(False, "cpu"), (True, "cpu"),
                                             pytest.param(True, "cuda", marks=pytest.mark.cuda)],
                         ids=["resident", "streamed", "streamed-cuda"])
def test_served_adapter_logits_equal_peft_merged_model(llama_dir, adapters, streamed, device):
    kw = dict(dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4, device=device)
    if streamed:
        kw["max_device_memory"] = _budget_streaming_all_but_one(llama_dir, **kw)
    llm = LLM(str(llama_dir), lora_modules={k: str(v) for k, v in adapters.items()}, **kw)
    try:
        assert bool(llm.plan.streamed_blocks) == streamed
        base = merged_logits(llama_dir, None, PROMPT)
        torch.testing.assert_close(llm.engine.prompt_logits(PROMPT), base, atol=1e-4, rtol=1e-4)
        for name, folder in adapters.items():
            want = merged_logits(llama_dir, folder, PROMPT)
            assert (want - base).abs().max() > 1e-2  # the adapter changes the model
            torch.testing.assert_close(llm.engine.prompt_logits(PROMPT, name), want, atol=1e-4, rtol=1e-4,
                                       msg=name)
    finally:
        llm.close()


def _run(engine, requests: list[tuple[str, list[int], object, str | None]]) -> dict[str, Result]:
    """Add every request at once, then step until they finish; each request's tokens and logprobs."""
    return drive(engine, {0: requests})


def test_a_step_mixing_base_and_two_adapters_gives_each_row_what_it_gets_alone(llama_dir, adapters):
    """The same prompt under the base and two adapters, batched (one base product per step for all three,
    prefix caching on); the reference serves each alone on an engine without a prefix cache."""
    modules = {k: str(v) for k, v in adapters.items()}
    kw = dict(dtype="float32", max_model_len=MAX_LEN, lora_modules=modules)
    requests = [("base", PROMPT, greedy(10), None), ("a", PROMPT, greedy(10), "a"), ("b", PROMPT, greedy(10), "b"),
                ("a2", PROMPT[:9], greedy(6), "a")]
    alone = LLM(str(llama_dir), max_num_seqs=1, max_num_batched_tokens=MAX_LEN, enable_prefix_caching=False, **kw)
    try:
        want = {rid: _run(alone.engine, [(rid, p, params, lora)])[rid] for rid, p, params, lora in requests}
    finally:
        alone.close()
    mixed = LLM(str(llama_dir), max_num_seqs=4, max_num_batched_tokens=16, **kw)
    try:
        got = _run(mixed.engine, requests)
    finally:
        mixed.close()
    for rid in want:
        assert_same(got[rid], want[rid])
    assert len({tuple(want[rid].tokens) for rid in ("base", "a", "b")}) == 3  # three different models
    shared = set(got["base"].steps) & set(got["a"].steps) & set(got["b"].steps)
    assert shared  # some step decoded all three together


def test_the_fused_decode_block_adds_the_adapters_as_the_op_by_op_block_does(llama_dir, adapters, monkeypatch):
    """bf16 on the CPU: decode steps with adapter rows (beside base rows) take the C++ block too, with the
    adapters' term on each projection (decode_block.cpp), and give the op-by-op block's tokens and
    log-probabilities bit for bit; the adapter is not skipped (its tokens differ from the base's)."""
    from engine import ops

    if ops.decode_block() is None:
        pytest.skip("the fused decode block does not run on this CPU")
    calls = []
    real = ops.fused_block

    def spy(x, w, k_cache, v_cache, step, cfg):
        out = real(x, w, k_cache, v_cache, step, cfg)
        calls.append((step.lora is not None, out is not None))
        return out

    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(ops, "fused_block", spy if fused else (lambda *args: None))
        llm = LLM(str(llama_dir), dtype="bfloat16", max_model_len=MAX_LEN, lora_modules={"b": str(adapters["b"])})
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
            runs[fused] = drive(llm.engine, {0: [("adapted", PROMPT, params, "b"), ("base", PROMPT, params)]})
        finally:
            llm.close()
    assert any(has_lora and ran for has_lora, ran in calls)  # mixed decode steps ran as one C++ call a block
    for rid in ("adapted", "base"):
        assert runs[True][rid].tokens == runs[False][rid].tokens
        assert runs[True][rid].logprobs == runs[False][rid].logprobs
    assert runs[True]["adapted"].tokens != runs[True]["base"].tokens  # the adapter's row is not the base's


def test_unloading_is_refused_while_a_request_uses_the_adapter(llama_dir, adapters):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=MAX_LEN)
    engine = llm.engine
    try:
        served = engine.load_lora("a", str(adapters["a"]))
        assert [x.name for x in engine.telemetry().lora_adapters] == ["a"] and served.r == 4
        engine.add_request(PROMPT, greedy(3), "r1", lora_name="a")
        with pytest.raises(LoRAAdapterBusyError, match="in use by 1 request"):
            engine.remove_lora("a")
        while engine.has_unfinished():
            engine.step()
        engine.remove_lora("a")
        assert engine.telemetry().lora_adapters == ()
        with pytest.raises(UnknownAdapterError):
            engine.add_request(PROMPT, greedy(3), "r2", lora_name="a")
        with pytest.raises(UnknownAdapterError):
            engine.remove_lora("a")
    finally:
        llm.close()


def test_adapters_with_speculative_decoding_are_refused_at_configuration(llama_dir, adapters):
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(model=str(llama_dir), lora_modules={"a": str(adapters["a"])}, speculative_method="ngram")
