"""Planning a mixture of experts that does not fit: KV first, blocks without experts next, the expert cache last."""

import pytest

from engine.planner import PlanError, PlanInputs, plan_memory

MiB = 1 << 20


def inputs(budget, **kw):
    base = dict(num_layers=8, block_bytes=66 * MiB, global_bytes=10 * MiB, kv_bytes_per_token=1024,
                workspace_bytes=4 * MiB, budget=budget, max_model_len=1024, max_num_seqs=4,
                expert_bytes=2 * MiB, num_experts_total=8 * 32, dense_block_bytes=2 * MiB, min_expert_slots=4,
                experts_per_token=8 * 2, predictor_bytes=MiB)
    base.update(kw)
    return PlanInputs(**base)


FIXED = 10 * MiB + 4 * MiB + 4 * 1024 * 1024 + MiB  # globals, workspace, KV, predictor


def test_dense_parts_first_then_the_expert_cache():
    plan = plan_memory(inputs(FIXED + 8 * 2 * MiB + 40 * 2 * MiB + MiB))
    assert plan.resident_blocks == list(range(8)) and plan.stream_buffer_bytes == 0
    assert plan.expert_slots == 40 and plan.expert_streaming
    assert plan.device_bytes <= plan.budget
    # random routing: 16 experts per token, each cached with probability 40/256
    assert plan.expert_bytes_per_token_random() == pytest.approx(16 * 2 * MiB * (1 - 40 / 256))
    assert "expert cache: 40/256 experts (16%" in plan.describe()


def test_small_budget_streams_dense_blocks_and_keeps_the_minimum_cache():
    plan = plan_memory(inputs(FIXED + 2 * 2 * MiB + 4 * 2 * MiB + MiB))
    assert plan.resident_blocks == [] and len(plan.streamed_blocks) == 8
    assert plan.block_bytes == 2 * MiB  # what a streamed block moves: no experts inside
    assert plan.expert_slots == 4
    # one more block's worth of room goes to a resident block, not to a fifth expert slot
    plan = plan_memory(inputs(FIXED + 2 * 2 * MiB + 5 * 2 * MiB + MiB))
    assert len(plan.resident_blocks) == 1 and plan.expert_slots == 4


def test_too_small_for_the_minimum_expert_cache():
    # (the KV pool shrinks to one sequence first: 3 MiB of the 4 come back)
    with pytest.raises(PlanError, match=r"an expert cache of 4 experts \(8\.00 MiB\)"):
        plan_memory(inputs(FIXED - 3 * MiB + 2 * 2 * MiB + 3 * 2 * MiB))


def test_a_model_that_fits_stays_whole():
    plan = plan_memory(inputs(FIXED + 8 * 66 * MiB))
    assert plan.resident_blocks == list(range(8)) and not plan.expert_streaming and plan.block_bytes == 66 * MiB
