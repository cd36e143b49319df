"""Continuous batching through the real engine (tiny fp32 Llama): what a sequence generates must not
depend on which other sequences share its steps, when they arrive, or when they leave.

The reference for each request is the same engine serving it alone, with the whole prompt in one
prefill chunk; the batched engine chunks prefills (small --max-num-batched-tokens) and mixes them
with other sequences' decodes, so both ragged batching and chunked prefill are checked against it.
"""

from __future__ import annotations


import pytest
import torch

from engine.llm import LLM
from engine.llm_engine import PromptTooLongError
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError
from tests.support.batching import MAX_LEN, PROMPTS, assert_same, drive, greedy, one_at_a_time


@pytest.fixture(scope="module")
def alone(llama_dir):
    """Serves one request at a time, each prompt prefilled in one chunk."""
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=1, max_num_batched_tokens=MAX_LEN)
    yield one_at_a_time(llm)
    llm.close()


def batched_llm(llama_dir, streaming: bool = False, **kw) -> LLM:
    args = dict(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16) | kw
    llm = LLM(str(llama_dir), **args)
    if streaming:
        p = llm.plan
        # Room for exactly one resident block: the other blocks stream every step.
        budget = (p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + p.block_bytes
                  + (p.prefetch_depth + 1) * p.block_bytes)
        llm.close()
        llm = LLM(str(llama_dir), max_device_memory=budget, **args)
        assert len(llm.plan.streamed_blocks) == llm.engine.model.cfg.num_layers - 1
        assert llm.plan.max_num_seqs == 4
    return llm


@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streaming"])
def test_batched_greedy_equals_each_sequence_alone(llama_dir, alone, streaming):
    # Different lengths and different max_tokens: sequences leave the batch at different steps.
    params = {"a": greedy(20), "b": greedy(12), "c": greedy(24), "d": greedy(7)}
    llm = batched_llm(llama_dir, streaming)
    blocks_per_step = []
    try:
        on_step = lambda _s, eng: blocks_per_step.append(eng.telemetry().last_step.stream.blocks_streamed)  # noqa: E731
        got = drive(llm.engine, {0: [(rid, PROMPTS[rid], params[rid]) for rid in PROMPTS]}, on_step=on_step)
        assert llm.telemetry().total.blocks_streamed == sum(blocks_per_step)
    finally:
        llm.close()
    for rid in PROMPTS:
        assert_same(got[rid], alone(PROMPTS[rid], params[rid]))
    # All four decoded together: some step produced a token for each of them.
    steps = [set(got[rid].steps) for rid in PROMPTS]
    assert set.intersection(*steps)
    if streaming:
        # One pass over the blocks per step, whatever the number of sequences in it.
        streamed = len(llm.plan.streamed_blocks)
        assert all(b == streamed for b in blocks_per_step), blocks_per_step


def test_requests_arriving_while_others_decode(llama_dir, alone):
    params = greedy(16)
    llm = batched_llm(llama_dir)
    try:
        got = drive(llm.engine, {0: [("a", PROMPTS["a"], params)], 4: [("d", PROMPTS["d"], params)],
                                 9: [("b", PROMPTS["b"], params), ("c", PROMPTS["c"], params)]})
    finally:
        llm.close()
    for rid in PROMPTS:
        assert_same(got[rid], alone(PROMPTS[rid], params))
    # d's chunked prefill ran in steps where a was decoding, and the late arrivals joined a running batch.
    assert got["d"].steps[0] > 4 + len(PROMPTS["d"]) // 16 - 1
    assert set(got["a"].steps) & set(got["d"].steps) & set(got["b"].steps)


def test_abort_inside_a_batch_frees_the_slot_and_leaves_the_others_unchanged(llama_dir, alone):
    params = greedy(14)
    llm = batched_llm(llama_dir, max_num_seqs=3)
    engine = llm.engine
    seen = {}
    try:
        got = drive(engine,
                    {0: [(rid, PROMPTS[rid], params) for rid in ("a", "b", "c")],
                     8: [("d", PROMPTS["d"], params)]},  # waits: all three slots are taken
                    aborts={6: ["b"]},
                    on_step=lambda s, eng: seen.setdefault(s, (len(eng.scheduler.running), len(eng.scheduler.waiting))))
        assert not engine.abort("b")  # already gone
    finally:
        llm.close()
    assert got["b"].finish_reason is None  # aborted: the engine emits nothing more for it
    assert got["b"].tokens == alone(PROMPTS["b"], params).tokens[:len(got["b"].tokens)]
    assert max(got["b"].steps) < 6
    assert seen[6][0] == 2  # b left at once
    # d took b's slot (whose cache still holds b's keys) and is unaffected by them.
    for rid in ("a", "c", "d"):
        assert_same(got[rid], alone(PROMPTS[rid], params))


def test_per_sequence_sampling_seeds_and_stop_conditions_in_one_batch(llama_dir, alone):
    stop_at = alone(PROMPTS["c"], greedy(12)).tokens[3]
    params = {
        "a": SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True, logprobs=0),
        "b": SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=7, ignore_eos=True, logprobs=0),
        "c": greedy(12, stop_token_ids=[stop_at]),
        "d": greedy(12),
    }
    llm = batched_llm(llama_dir)
    try:
        got = drive(llm.engine, {0: [(rid, PROMPTS[rid], params[rid]) for rid in PROMPTS]})
    finally:
        llm.close()
    for rid in PROMPTS:
        assert_same(got[rid], alone(PROMPTS[rid], params[rid]))
    first_stop = alone(PROMPTS["c"], greedy(12)).tokens.index(stop_at)
    assert got["c"].finish_reason == "stop" and len(got["c"].tokens) == first_stop + 1


def test_a_full_queue_raises_queue_full_and_the_server_answers_503(llama_dir):
    params = greedy(6)
    llm = batched_llm(llama_dir, max_num_seqs=1, max_queue=2)
    engine = llm.engine
    try:
        for rid in "abc":  # one slot + a queue of two
            engine.add_request(PROMPTS[rid], params, rid)
        with pytest.raises(QueueFullError) as info:
            engine.add_request(PROMPTS["d"], params, "d")
        assert not engine.abort("d")  # the refused request left nothing behind
        finished = set()
        while engine.has_unfinished():
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"a", "b", "c"}
    finally:
        llm.close()
    errors = pytest.importorskip("server.errors")
    mapped = errors.error_for(info.value)
    assert mapped.status == 503 and "Retry-After" in mapped.headers


@pytest.mark.parametrize("kwargs", [dict(max_queue=0), dict(max_num_seqs=0), dict(max_num_batched_tokens=-1),
                                    dict(max_model_len=0)])
def test_limits_below_one_are_refused_before_the_model_loads(tmp_path, kwargs):
    """A ValueError naming the limit, from EngineArgs, before any file is read: the folder does not
    exist, and loading it would raise FileNotFoundError."""
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got {value}"):
        LLM(model=str(tmp_path / "missing"), **kwargs)


def test_queued_requests_finish_unchanged_once_a_slot_frees(llama_dir, alone):
    params = greedy(6)
    llm = batched_llm(llama_dir, max_num_seqs=1, max_queue=2)
    try:
        got = drive(llm.engine, {0: [("a", PROMPTS["a"], params), ("b", PROMPTS["b"], params)]})
    finally:
        llm.close()
    assert got["b"].steps[0] > got["a"].steps[-1]  # b waited for a's slot
    for rid in ("a", "b"):
        assert_same(got[rid], alone(PROMPTS[rid], params))


def test_a_request_that_can_never_fit_is_refused_up_front(llama_dir):
    llm = batched_llm(llama_dir)
    try:
        with pytest.raises(PromptTooLongError, match=str(MAX_LEN)):
            llm.engine.add_request(PROMPTS["d"], greedy(MAX_LEN), "x")
        assert not llm.engine.has_unfinished()
    finally:
        llm.close()


def test_streaming_with_dtype_conversion_reuses_its_buffers(tmp_path):
    """bf16 checkpoint computed in fp32: streamed blocks are converted into at most depth + 1
    reused buffer sets, and a batch gives the same tokens as the all-resident engine."""
    from tests.support.models import build

    folder = build(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    params = greedy(12)
    arrivals = {0: [(rid, PROMPTS[rid], params) for rid in PROMPTS]}
    resident = LLM(str(folder), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        want = drive(resident.engine, arrivals)
        p = resident.plan
        budget = p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + (p.prefetch_depth + 1) * p.block_bytes
    finally:
        resident.close()
    llm = LLM(str(folder), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
              max_device_memory=budget)
    try:
        assert len(llm.plan.resident_blocks) == 0
        got = drive(llm.engine, arrivals)
        telemetry = llm.telemetry()
    finally:
        llm.close()
    for rid in PROMPTS:
        assert_same(got[rid], want[rid])
    assert telemetry.blocks_converted > 10 * len(llm.plan.resident_blocks + llm.plan.streamed_blocks)  # every step
    assert telemetry.buffer_sets <= llm.plan.prefetch_depth + 1  # distinct buffer sets ever made
