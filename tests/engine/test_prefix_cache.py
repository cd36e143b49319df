"""Paged KV and automatic prefix caching through the real engine (tiny fp32 Llama): a request's tokens
and logprobs must not depend on whether its prefix came from the cache, on preemption, on blocks
swapped to the host tier and back, or on other requests aborted around it.

The reference is the engine with prefix caching off serving each request alone, its whole prompt
in one prefill chunk; the engines under test chunk prefills and batch requests that share prefixes.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support.batching import MAX_LEN, assert_same, drive, greedy, one_at_a_time

PREFIX = [(i * 17 + 5) % 500 + 6 for i in range(40)]  # 2.5 blocks of 16 shared by every prompt


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True,
                          logprobs=0)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=1, max_num_batched_tokens=MAX_LEN,
              enable_prefix_caching=False)
    yield one_at_a_time(llm)
    llm.close()


def kv_block_bytes(llm) -> int:
    return llm.plan.kv_cache_bytes // llm.plan.num_kv_blocks


def checked(engine):
    """on_step hook: block accounting is consistent after every step."""
    def on_step(_step, e):
        e.scheduler.blocks.check()
    return on_step


def assert_no_leaks(engine) -> None:
    blocks = engine.scheduler.blocks
    blocks.check()
    assert not engine.has_unfinished()
    assert blocks.num_used_blocks == 0  # every block is free or held only by the prefix cache


def shared_prefix_workload(reference):
    x = PREFIX + [1, 2, 3]
    x_out = reference(x, greedy(10)).tokens
    return {
        0: [("x", x, greedy(10))],
        3: [("y", PREFIX + [4, 5], greedy(8)), ("y2", PREFIX + [4, 5], sampled(8, seed=1))],  # n > 1 alike
        6: [("z", x + [7] * 20, sampled(12, seed=3))],  # extends x's prompt past the next block
        # The next turn of x's chat: its history, generated tokens included, then a new message.
        20: [("x-turn2", x + x_out + [9, 9], greedy(6)), ("short", [3, 4], greedy(5))],
    }


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_shared_prefixes_give_the_same_tokens_and_logprobs_as_each_request_alone(llama_dir, reference,
                                                                                prefix_caching):
    arrivals = shared_prefix_workload(reference)
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
              enable_prefix_caching=prefix_caching)
    try:
        got = drive(llm.engine, arrivals, on_step=checked(llm.engine))
        for reqs in arrivals.values():
            for rid, prompt, params in reqs:
                assert_same(got[rid], reference(prompt, params))
        stats = llm.engine.scheduler.blocks.stats
        if prefix_caching:
            # y, y2, z and x-turn2 found whole blocks of what x (and y) computed before them.
            assert stats.hit_tokens >= 32 * 4
            t = llm.engine.telemetry().kv
            assert (t.hit_tokens, t.queried_tokens, t.blocks_used) == (stats.hit_tokens, stats.queried_tokens, 0)
            assert 0 < t.hit_rate < 1 and t.blocks_cached > 0
        else:
            assert stats.hit_tokens == 0 and llm.engine.scheduler.blocks.num_cached_blocks == 0
        assert_no_leaks(llm.engine)
    finally:
        llm.close()


@pytest.mark.parametrize("host_blocks", [0, 24], ids=["recompute", "host-tier"])
def test_preemption_and_host_swaps_leave_outputs_unchanged(llama_dir, reference, host_blocks):
    """A pool of exactly one max_model_len sequence (8 blocks) for four growing sequences: the
    newest are preempted and resume; with a host tier their evicted cached blocks come back from it."""
    probe = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=4)
    block = kv_block_bytes(probe)
    probe.close()
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory=8 * block, kv_host_memory=host_blocks * block)
    try:
        assert llm.plan.num_kv_blocks == 8 and llm.plan.num_host_kv_blocks == host_blocks
        arrivals = {0: [(f"s{i}", PREFIX[: 20 + 6 * i] + [i + 1] * 5, greedy(24 - 3 * i)) for i in range(3)]
                    + [("t", PREFIX + [8], sampled(20, seed=5))],
                    30: [("late", PREFIX[:33] + [2], greedy(10))]}
        got = drive(llm.engine, arrivals, on_step=checked(llm.engine))
        for reqs in arrivals.values():
            for rid, prompt, params in reqs:
                assert_same(got[rid], reference(prompt, params))
        assert llm.engine.scheduler.num_preemptions > 0
        stats = llm.engine.scheduler.blocks.stats
        if host_blocks:
            assert stats.blocks_swapped_out > 0 and stats.blocks_swapped_in > 0 and stats.host_hit_tokens > 0
            kv = llm.engine.telemetry().kv
            assert kv.bytes_swapped_in == stats.blocks_swapped_in * block
            assert kv.bytes_swapped_out == stats.blocks_swapped_out * block
        assert_no_leaks(llm.engine)
    finally:
        llm.close()


def test_aborts_of_sequences_sharing_blocks_leave_the_others_unchanged(llama_dir, reference):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        a = PREFIX + [11, 12]
        arrivals = {0: [("a", a, greedy(12))],
                    4: [("b", a + [13], greedy(12)), ("c", PREFIX + [14], greedy(12))],
                    5: [("d", a, sampled(10, seed=2))]}
        # b is cancelled while it shares a's blocks, c mid-prefill, d right after its admission.
        got = drive(llm.engine, arrivals, aborts={6: ["b", "d"], 5: ["c"]}, on_step=checked(llm.engine))
        assert_same(got["a"], reference(a, greedy(12)))
        assert_no_leaks(llm.engine)
        # The cache still serves later requests correctly.
        again = drive(llm.engine, {0: [("e", a + [13], greedy(5))]})
        assert_same(again["e"], reference(a + [13], greedy(5)))
        assert_no_leaks(llm.engine)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    """The tiny Llama with a 2048-token default context (its max_position_embeddings)."""
    import zlib

    from engine.demo import build_random_model
    from tests.support.models import make_config

    cfg = make_config("llama")
    cfg.max_position_embeddings = 2048
    return build_random_model(tmp_path_factory.mktemp("long") / "llama", cfg, seed=zlib.crc32(b"long") % 1000)


def test_a_budget_below_the_default_context_starts_with_the_largest_context_that_fits(long_context_dir):
    """A budget that holds the default context's KV with none of the step's workspace left: the step
    shrinks first (max_num_batched_tokens lowered, the context kept); one that cannot hold it even with
    the smallest step: the largest context that fits. A context the user asked for is never lowered."""
    from engine.arch import load_model_config
    from engine.planner import PlanError
    from engine.workspace import MIN_ATTN_CHUNK_BYTES, workspace_bytes

    full = LLM(str(long_context_dir), max_num_seqs=2, max_num_batched_tokens=32)
    p = full.plan
    assert p.max_model_len == 2048
    full.close()
    per_token = p.kv_cache_bytes // (p.num_kv_blocks * p.kv_block_size)
    # Room for about 1000 tokens of KV besides what streaming needs and the smallest step's workspace
    # (32 tokens, attention calls bounded by the budget) at that context.
    smallest = workspace_bytes(load_model_config(long_context_dir), 32, 2, 1000, torch.float32, 2,
                               MIN_ATTN_CHUNK_BYTES)
    budget = p.global_bytes + smallest + 2 * p.block_bytes + 1000 * per_token
    llm = LLM(str(long_context_dir), max_num_seqs=2, max_device_memory=budget)
    try:
        q = llm.plan
        assert 900 <= q.max_model_len < 2048 and q.max_model_len % 16 == 0
        assert q.num_kv_blocks * q.kv_block_size >= q.max_model_len and q.device_bytes <= budget
        assert any(f"max_model_len lowered from 2048 to {q.max_model_len}" in n for n in q.notes)
        assert q.max_num_batched_tokens == 32 and llm.engine.max_model_len == q.max_model_len
        out = llm.generate([5, 6, 7], greedy(4))[0].outputs[0]
        assert len(out.token_ids) == 4
    finally:
        llm.close()
    # The user's own --max-model-len is honoured or refused, never lowered: here refused.
    with pytest.raises(PlanError, match="too small"):
        LLM(str(long_context_dir), max_num_seqs=2, max_device_memory=budget, max_model_len=2048)
    # Room for the whole context's KV and the smallest step: the step shrinks, the context stays.
    roomy = p.global_bytes + p.workspace_bytes + 2 * p.block_bytes + 2048 * per_token
    llm = LLM(str(long_context_dir), max_num_seqs=2, max_device_memory=roomy)
    try:
        r = llm.plan
        assert r.max_model_len == 2048 and r.max_num_batched_tokens < 512 and r.device_bytes <= roomy
        assert any("max_num_batched_tokens lowered" in n for n in r.notes)
        assert llm.generate([5, 6, 7], greedy(4))[0].outputs[0].token_ids == out.token_ids
    finally:
        llm.close()
    with pytest.raises(PlanError, match="too small"):
        LLM(str(long_context_dir), max_num_seqs=2, max_device_memory=p.global_bytes + 2 * p.block_bytes,
            max_model_len=2048)
    # A budget that cannot hold even 256 tokens says what would do.
    with pytest.raises(PlanError, match=r"too small even for a context of 256 tokens: that needs at least .*"
                                        r"the full context of 2048 needs"):
        LLM(str(long_context_dir), max_num_seqs=2, max_device_memory=p.global_bytes + 2 * p.block_bytes)


def test_the_cpu_path_has_no_kv_host_tier_unless_asked(llama_dir):
    """On the CPU the device pool already is host memory: no host tier by default (a second pool
    would copy blocks within the same RAM); --kv-host-memory turns one on; it holds only prefix-cache
    blocks, so with prefix caching off there is none whatever was asked."""
    def host_blocks(**kw) -> int:
        llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=2, **kw)
        llm.close()
        return llm.plan.num_host_kv_blocks

    probe = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=2)
    try:
        block = kv_block_bytes(probe)
        assert probe.plan.num_host_kv_blocks == 0 and probe.telemetry().kv.host_blocks_total == 0
    finally:
        probe.close()
    assert host_blocks(kv_host_memory=10 * block) == 10
    assert host_blocks(kv_host_memory=10 * block, enable_prefix_caching=False) == 0


def test_n_choices_share_the_prompt_and_each_equals_its_choice_alone(llama_dir, reference):
    """n > 1 through the offline API (each choice a request with its own seed, admitted together):
    with prefix caching on, each choice equals that choice's parameters served alone with caching
    off; a second call with the same prompt finds its blocks cached."""
    import dataclasses

    prompt = PREFIX + [21, 22, 23]
    params = dataclasses.replace(sampled(10, seed=7), n=3)
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        for call in range(2):
            hits_before = llm.telemetry().kv.hit_tokens
            outs = llm.generate([prompt], params)[0].outputs
            for out, choice in zip(outs, params.per_choice()):
                want = reference(prompt, choice)
                assert out.token_ids == want.tokens and out.finish_reason == want.finish_reason
                torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]),
                                           torch.tensor(want.logprobs), atol=1e-4, rtol=1e-4)
            if call == 1:  # every choice found the prompt's 2 full blocks computed by the first call
                assert llm.telemetry().kv.hit_tokens - hits_before >= 3 * 32
        assert len({tuple(o.token_ids) for o in outs}) > 1  # the seeds differ: so do the choices
        assert_no_leaks(llm.engine)
    finally:
        llm.close()
