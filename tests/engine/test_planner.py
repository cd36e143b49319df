import pytest

from engine.planner import PlanError, PlanInputs, parse_bytes, plan_largest_context, plan_memory

MiB = 1 << 20


def inputs(**kw):
    base = dict(num_layers=10, block_bytes=10 * MiB, global_bytes=5 * MiB, kv_bytes_per_token=1024,
                workspace_bytes=1 * MiB, budget=None, max_model_len=1024, max_num_seqs=4, prefetch_depth=1)
    base.update(kw)
    return PlanInputs(**base)


@pytest.mark.parametrize("text,value", [("4GiB", 4 << 30), ("512MB", 512_000_000), ("1.5GiB", int(1.5 * (1 << 30))),
                                        ("123", 123), (None, None), ("2 MiB", 2 * MiB)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["4 parsecs", "lots", "-1GB"])
def test_parse_bytes_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes(bad)


def test_unlimited_budget_keeps_everything_resident():
    p = plan_memory(inputs())
    assert p.resident_blocks == list(range(10)) and p.streamed_blocks == [] and p.streamed_bytes_per_step == 0


def test_budget_splits_blocks_and_accounts_everything():
    kv = 4 * 1024 * 1024  # 4 seqs x 1024 tokens x 1 KiB
    budget = 5 * MiB + 1 * MiB + kv + 2 * 10 * MiB + 3 * 10 * MiB  # fixed + buffers + 3 blocks
    p = plan_memory(inputs(budget=budget))
    assert len(p.resident_blocks) == 3 and len(p.streamed_blocks) == 7
    assert p.device_bytes <= budget
    assert p.streamed_bytes_per_step == 70 * MiB
    # resident blocks are spread out, not bunched at the start
    assert p.resident_blocks == [0, 3, 6]
    assert "blocks resident: 3/10" in p.describe()


def test_budget_that_fits_everything_streams_nothing():
    p = plan_memory(inputs(budget=1 << 30))
    assert p.streamed_blocks == [] and p.stream_buffer_bytes == 0


def test_kv_pool_shrinks_before_resident_blocks_and_refuses_below_one_sequence():
    kv_one = 1024 * 1024  # one sequence of 1024 tokens x 1 KiB = 64 blocks of 16 tokens
    budget = 5 * MiB + 1 * MiB + 2 * kv_one + 2 * 10 * MiB
    p = plan_memory(inputs(budget=budget))
    # Room for two full-length sequences' blocks, not four: the pool is smaller, concurrency is not
    # capped (it follows what sequences use); no block resident.
    assert p.num_kv_blocks == 128 and p.kv_cache_bytes == 2 * kv_one and p.max_num_seqs == 4
    assert p.resident_blocks == [] and p.device_bytes <= budget
    assert any("KV pool of 128 blocks" in n for n in p.notes)
    with pytest.raises(PlanError, match="KV cache for one sequence of 1024 tokens"):
        plan_memory(inputs(budget=budget - kv_one - 1))


def test_kv_cache_memory_sets_the_pool_and_must_hold_one_sequence():
    p = plan_memory(inputs(kv_cache_bytes=10 * MiB))
    assert p.num_kv_blocks == 10 * MiB // (16 * 1024)
    with pytest.raises(PlanError, match="holds 32 KV blocks; one sequence of max_model_len 1024 needs 64"):
        plan_memory(inputs(kv_cache_bytes=32 * 16 * 1024))


def test_largest_context_that_fits_is_chosen_and_a_hopeless_budget_says_what_would_do():
    budget = 5 * MiB + 1 * MiB + 300 * 1024 + 2 * 10 * MiB  # room for 300 tokens of KV besides the rest
    p = plan_largest_context(lambda n: inputs(budget=budget, max_model_len=n), 1024, 64, 16)
    assert p.max_model_len == 288 and p.num_kv_blocks == 18
    assert any("max_model_len lowered from 1024 to 288" in n for n in p.notes)
    with pytest.raises(PlanError, match=r"too small even for a context of 64 tokens: that needs at least 26\.06 MiB"):
        plan_largest_context(lambda n: inputs(budget=20 * MiB, max_model_len=n), 1024, 64, 16)


def test_too_small_budget_is_a_clear_error():
    with pytest.raises(PlanError, match="too small.*need at least"):
        plan_memory(inputs(budget=10 * MiB))


def test_a_draft_with_a_copy_per_streamed_block_gets_each_resident_block_s_copy_back():
    """PlanInputs.draft_block_bytes (a self-draft that copies only the streamed blocks, as it would on
    an accelerator): the largest draft (a copy of every block) is set aside, and each block kept
    resident costs its weights less its copy; the plan's draft is a copy per streamed block."""
    kv = 4 * 1024 * 1024
    fixed, copy = 1 * MiB, 2 * MiB
    budget = 5 * MiB + 1 * MiB + kv + 2 * 10 * MiB + fixed + 10 * copy + 3 * (10 * MiB - copy)
    p = plan_memory(inputs(budget=budget, draft_fixed_bytes=fixed, draft_block_bytes=copy, draft_name="d"))
    assert len(p.resident_blocks) == 3 and p.draft_bytes == fixed + 7 * copy
    assert p.device_bytes <= budget and "speculative draft" in p.describe()
    # Without the copies given back, the same budget keeps two blocks resident.
    q = plan_memory(inputs(budget=budget, draft_fixed_bytes=fixed + 10 * copy, draft_name="d"))
    assert len(q.resident_blocks) == 2
