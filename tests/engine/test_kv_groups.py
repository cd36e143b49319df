"""The KV cache knows layer types (engine.kv_groups): a sliding-window layer's pool holds each sequence's
window only, its blocks before the window go back to the pool, and the planner sizes it so; the prefix
cache, the host KV tier, preemption, continuous batching and speculative decoding keep every family's
greedy tokens identical to transformers' on prompts that run past every window.

The block-manager rules are pure Python; the engine tests use the tiny family checkpoints of
tests/support/families.py with blocks of 4 tokens, so a window of 8 releases blocks within a few steps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.block_manager import NULL_BLOCK
from engine.kv_groups import GroupedBlockManager, KVLayout
from engine.planner import PlanInputs, plan_memory
from engine.scheduler import Scheduler, SchedulerConfig, Sequence
from tests.support.batching import drive
from tests.support.families import FAMILY_ARCHS, WINDOW, build

BS = 4  # tokens per KV block in these tests


# -- the bookkeeping, pure Python ----------------------------------------------------------------------

def gemma_like(window: int = 8, step_tokens: int = 8, seqs: int = 2, max_len: int = 64) -> Scheduler:
    layout = KVLayout.of([window, window, None] * 2)
    blocks = tuple(seqs * layout.blocks_per_seq(g, max_len, BS, step_tokens) for g in range(2))
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=step_tokens, max_queue=8,
                                     max_model_len=max_len, block_size=BS, kv_layout=layout, kv_group_blocks=blocks))


def run(sched: Scheduler, steps: int = 100) -> None:
    for _ in range(steps):
        if not sched.has_work():
            return
        for c in sched.schedule():
            sched.commit(c)
            if c.samples:
                c.seq.output_ids.append(7)
                if len(c.seq.output_ids) >= c.seq.max_tokens:
                    sched.finish(c.seq, "length")
        sched.blocks.check()
        for s in sched.running:  # the window's blocks and the step's, no more
            live = [b for b in s.kv_tables[0] if b != NULL_BLOCK]
            assert len(live) <= sched.config.kv_layout.blocks_per_seq(1, 64, BS, 8)
            assert len(s.kv_tables[0]) == len(s.block_table)


def test_layout_groups_layers_by_window_full_attention_first():
    layout = KVLayout.of([8, 8, None, 8, 8, None])
    assert [(g.layers, g.window) for g in layout.groups] == [((2, 5), None), ((0, 1, 3, 4), 8)]
    assert layout.layer_groups() == (1, 1, 0, 1, 1, 0)
    # a window of 8 and steps of 8 tokens: 15 keys at most, 4 blocks, one more where they straddle
    assert layout.blocks_per_seq(1, 64, BS, 8) == 5 and layout.blocks_per_seq(0, 64, BS, 8) == 16


def test_sliding_window_blocks_go_back_to_the_pool_as_a_sequence_grows():
    sched = gemma_like()
    a = Sequence("a", list(range(1, 41)), max_tokens=20)
    sched.add(a)
    run(sched, 15)  # 5 prefill steps of 8 tokens (the last samples), then 10 decodes
    assert a.num_computed == 50
    full, window = sched.blocks.managers
    # the full-attention group holds every position, the windowed one only the window's blocks
    assert NULL_BLOCK not in a.block_table and len(a.block_table) == -(-a.num_computed // BS)
    released = a.kv_tables[0].index(next(b for b in a.kv_tables[0] if b != NULL_BLOCK))
    assert released == (a.num_computed - WINDOW + 1) // BS and released >= 10
    assert window.num_used_blocks <= 5 < full.num_used_blocks
    run(sched)
    assert full.num_used_blocks == 0 and window.num_used_blocks == 0  # cached or free: nothing leaked


def test_prefix_hit_needs_only_the_window_before_it_in_a_windowed_group():
    sched = gemma_like()
    prompt = list(range(1, 41))
    a = Sequence("a", prompt, max_tokens=2)
    sched.add(a)
    run(sched)
    b = Sequence("b", prompt[:36] + [99, 98], max_tokens=2)
    match = sched.blocks.match(b)
    full, window = match.matches
    # 9 whole blocks shared (36 tokens); the windowed group needs keys 29..35 only: blocks 7 and 8
    assert match.num_tokens == 36 and len(full.blocks) == 9 and not full.skipped
    assert window.skipped == 7 and len(window.blocks) == 2
    sched.add(b)
    run(sched)
    assert sched.blocks.stats.hit_tokens == 36


def test_prefix_hit_shrinks_to_what_every_group_still_holds():
    sched = gemma_like()
    prompt = list(range(1, 41))
    sched.add(Sequence("a", prompt, max_tokens=2))
    run(sched)
    window = sched.blocks.managers[1]
    # Evict the windowed group's copy of block 8 (keys 32..35): a hit at 36 is lost, one at 32 is not.
    h = Sequence("probe", prompt, 1)
    hashes = window._hashes(h, 9)
    window._evict(window._by_hash[hashes[8]])
    match = sched.blocks.match(Sequence("b", prompt[:36] + [99, 98], max_tokens=2))
    assert match.num_tokens == 32


# -- the plan ---------------------------------------------------------------------------------------

def test_plan_of_a_128k_gemma3_pays_full_context_only_on_its_global_layers():
    """Gemma 3 4B's shape: 34 layers, 5 local (window 1024) : 1 global, 4 KV heads of 256, bf16."""
    layer = 2 * 4 * 256 * 2  # one layer's K and V per token
    windows = [1024 if (i + 1) % 6 else None for i in range(34)]
    layout = KVLayout.of(windows)
    n_global, n_local = len(layout.groups[0].layers), len(layout.groups[1].layers)
    assert (n_global, n_local) == (5, 29)
    base = dict(num_layers=34, block_bytes=100 << 20, global_bytes=1 << 30, kv_bytes_per_token=34 * layer,
                workspace_bytes=1 << 28, budget=None, max_model_len=131072, max_num_seqs=1,
                max_num_batched_tokens=512)
    plan = plan_memory(PlanInputs(**base, kv_groups=((n_global * layer, None), (n_local * layer, 1024))))
    local_blocks = -(-(1024 - 1 + 512) // 16) + 1
    assert plan.kv_group_blocks == (8192, local_blocks)
    assert plan.kv_cache_bytes == 8192 * 16 * n_global * layer + local_blocks * 16 * n_local * layer
    every_layer = plan_memory(PlanInputs(**base)).kv_cache_bytes  # as if every layer kept the whole context
    assert plan.kv_cache_bytes < every_layer * 0.16  # 5/34 of it, and the windows' few blocks
    text = plan.describe()
    assert "8192 blocks for the full-attention layers" in text and f"{local_blocks} blocks for the window-1024" in text
    assert "KV per token: 136.00 KiB up to the sliding windows, 20.00 KiB beyond them" in text


def test_a_budget_sized_pool_keeps_the_groups_in_proportion():
    layer = 1024
    base = dict(num_layers=6, block_bytes=1 << 20, global_bytes=1 << 20, kv_bytes_per_token=6 * layer,
                workspace_bytes=1 << 20, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                kv_groups=((2 * layer, None), (4 * layer, 128)))
    unlimited = plan_memory(PlanInputs(**base, budget=None))
    budget = 4 * (1 << 20) + unlimited.kv_cache_bytes // 2  # globals, workspace, two stream buffers, half the pool
    plan = plan_memory(PlanInputs(**base, budget=budget))
    assert plan.device_bytes <= budget
    assert plan.kv_group_blocks == (256, 52)  # four sequences of 64 blocks, and their windows' 13 blocks each
    assert plan.kv_cache_bytes == 256 * 16 * 2 * layer + 52 * 16 * 4 * layer


# -- every family through the engine ---------------------------------------------------------------

LIMITS = dict(max_model_len=128, max_num_seqs=3, block_size=BS, max_num_batched_tokens=8)
LONG = [(i * 37 + 11) % 500 + 6 for i in range(30)]  # prefilled in 4 chunks, well past the window of 8


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-groups")
    return {arch: build(root / arch, arch) for arch in FAMILY_ARCHS}


@pytest.fixture(scope="module")
def transformers_greedy(family_dirs):
    """(arch, prompt, n) -> n greedy tokens from transformers in fp32 (memoised; a plain loop, no cache)."""
    models, memo = {}, {}

    def run_ref(arch: str, prompt: list[int], n: int) -> list[int]:
        key = (arch, tuple(prompt), n)
        if key not in memo:
            if arch not in models:
                models[arch] = AutoModelForCausalLM.from_pretrained(family_dirs[arch], dtype=torch.float32).eval()
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(n):
                    ids.append(int(models[arch](torch.tensor([ids])).logits[0, -1].argmax()))
            memo[key] = ids[len(prompt):]
        return memo[key]

    return run_ref


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def windowed_use_is_bounded(engine) -> None:
    """on_step: the bookkeeping is consistent, and no running sequence holds more windowed blocks than
    its window and step need."""
    blocks = engine.scheduler.blocks
    blocks.check()
    if not isinstance(blocks, GroupedBlockManager):
        return
    cfg = engine.scheduler.config
    for g, group in enumerate(blocks.layout.groups):
        if g and group.window is not None:
            bound = blocks.layout.blocks_per_seq(g, cfg.max_model_len, BS, cfg.max_num_batched_tokens)
            for s in engine.scheduler.running:
                assert sum(b != NULL_BLOCK for b in s.kv_tables[g - 1]) <= bound + 1  # + a lookahead block


def check_workload(llm: LLM, arch: str, reference, arrivals: dict | None = None) -> dict:
    """Requests sharing prefixes, arriving while the others run (by default three): each one's tokens are
    transformers' for its prompt alone."""
    if arrivals is None:
        a_out = reference(arch, LONG, 12)
        arrivals = {0: [("a", LONG, greedy(12))],
                    3: [("b", LONG[:24] + [11, 12], greedy(10))],
                    14: [("c", LONG + a_out[:8] + [9, 9], greedy(10))]}
    got = drive(llm.engine, arrivals, on_step=lambda _s, e: windowed_use_is_bounded(e))
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert got[rid].tokens == reference(arch, prompt, params.max_tokens), (arch, rid)
    return got


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_prefix_cache_and_batching_past_every_window(family_dirs, transformers_greedy, arch):
    llm = LLM(str(family_dirs[arch]), **LIMITS)
    try:
        plan = llm.plan
        windowed = any(w is not None for _, w in plan.kv_groups)
        if windowed:  # the windowed groups' pools hold a few blocks per sequence, not the whole context
            assert all(n < plan.num_kv_blocks or w is None for n, (_, w) in zip(plan.kv_group_blocks, plan.kv_groups)) \
                or plan.kv_groups[0][1] is not None
            assert "sliding windows" in plan.describe()
        check_workload(llm, arch, transformers_greedy)
        hits = llm.engine.scheduler.blocks.stats.hit_tokens
        if llm.engine.model.cfg.rope_switches_within(LIMITS["max_model_len"]):
            assert hits == 0  # LongRoPE past its original context: the prefix cache is off
        else:
            assert hits >= 24 + 28  # b: 6 blocks of a; c: at least a's prompt
        assert llm.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "gpt_oss"])
def test_preemption_and_the_host_tier_past_every_window(family_dirs, transformers_greedy, arch):
    """A pool of one max_model_len sequence in every group for three growing sequences: the newest are
    preempted and resume, their evicted cached blocks (windowed ones too) coming back from the host tier."""
    limits = {**LIMITS, "max_model_len": 64}
    probe = LLM(str(family_dirs[arch]), **limits)
    pool = probe.plan.kv_cache_bytes // 3  # max_num_seqs 3: a third is one sequence's worth in every group
    probe.close()
    llm = LLM(str(family_dirs[arch]), **limits, kv_cache_memory=pool, kv_host_memory=4 * pool)
    other = [(i * 53 + 7) % 500 + 6 for i in range(40)]
    arrivals = {0: [("a", LONG, greedy(12)), ("b", LONG[:24] + [11, 12], greedy(6))],
                2: [("other", other, greedy(8))],  # its blocks push a's cached ones out to the host tier
                40: [("again", LONG[:28] + [3, 4], greedy(6))]}  # a's prefix, back from the host tier
    try:
        assert llm.plan.num_host_kv_blocks > 0
        check_workload(llm, arch, transformers_greedy, arrivals)
        stats = llm.engine.scheduler.blocks.stats
        assert llm.engine.scheduler.num_preemptions > 0
        assert stats.blocks_swapped_in > 0 and stats.host_hit_tokens > 0
    finally:
        llm.close()


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_speculative_decoding_past_every_window(family_dirs, transformers_greedy, arch, method):
    """Greedy speculative decoding gives the target's greedy tokens: n-gram drafts on a repetitive prompt,
    and the model drafting for itself as a separate draft model (its own pool mirroring group 0)."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["model"] = str(family_dirs[arch])
    llm = LLM(str(family_dirs[arch]), **LIMITS, speculative_config=spec)
    try:
        prompt = ([21, 22, 23, 24, 25] * 5)[:23]
        out = llm.generate([prompt, LONG], greedy(16))
        assert out[0].outputs[0].token_ids == transformers_greedy(arch, prompt, 16)
        assert out[1].outputs[0].token_ids == transformers_greedy(arch, LONG, 16)
        assert llm.telemetry().speculative.draft_tokens > 0
    finally:
        llm.close()



@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_a_quantized_cache_with_sliding_window_layers_is_a_clear_error(family_dirs, kv_dtype, arch):
    """The quantized attention path does not read the windowed groups' pools yet: refused before loading,
    naming the option and the way out, never a wrong or crashing step."""
    from engine.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=rf"--kv-cache-dtype {kv_dtype} is not supported yet for a model "
                                                    r"with sliding-window layers .*--kv-cache-dtype auto"):
        LLM(str(family_dirs[arch]), kv_cache_dtype=kv_dtype, **LIMITS)
