import pytest

from engine.planner import PlanError, PlanInputs, parse_bytes, plan_memory

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


def test_kv_cache_shrinks_concurrency_before_refusing():
    kv_one = 1024 * 1024
    budget = 5 * MiB + 1 * MiB + 2 * kv_one + 2 * 10 * MiB
    p = plan_memory(inputs(budget=budget))
    assert p.max_num_seqs == 2 and p.resident_blocks == []
    assert any("max_num_seqs lowered from 4 to 2" in n for n in p.notes)


def test_too_small_budget_is_a_clear_error():
    with pytest.raises(PlanError, match="too small.*need at least"):
        plan_memory(inputs(budget=10 * MiB))
