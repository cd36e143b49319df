"""Scheduler rules, pure Python (no model): chunked prefill, token and sequence budgets, KV blocks,
admission by free blocks, preemption, prefix-cache hits, cancellation and the bounded queue."""

from __future__ import annotations

import pytest

from engine.scheduler import QueueFullError, ScheduledChunk, Scheduler, SchedulerConfig, Sequence, SeqStatus


def seq(rid: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), max_tokens)


def run_step(sched: Scheduler, token: int = 7) -> list[ScheduledChunk]:
    """What the engine does with a schedule: count the computed tokens, sample where a chunk
    reaches a sequence's end, and finish sequences that reached max_tokens."""
    chunks = sched.schedule()
    for c in chunks:
        sched.commit(c)
        if c.samples:
            c.seq.output_ids.append(token)
            if len(c.seq.output_ids) >= c.seq.max_tokens:
                sched.finish(c.seq, "length")
    return chunks


def shape(chunks: list[ScheduledChunk]) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.count) for c in chunks]


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_queue=256))
    a = seq("a", 20)
    sched.add(a)
    steps, samples = [], []
    for _ in range(4):
        chunks = sched.schedule()
        samples += [c.samples for c in chunks]  # read before the engine advances the sequence
        for c in chunks:
            c.seq.num_computed += c.count
            if c.samples:
                c.seq.output_ids.append(7)
        steps.append(shape(chunks))
    assert steps == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)]]
    # Only the chunk that reaches the end of the prompt samples a token.
    assert samples == [False, False, True, True]
    assert a.output_ids == [7, 7]


def test_decodes_come_first_and_prefill_gets_what_is_left_of_the_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_queue=256))
    a, b = seq("a", 3), seq("b", 2)
    sched.add(a)
    sched.add(b)
    assert shape(run_step(sched)) == [("a", 0, 3), ("b", 0, 2)]
    c = seq("c", 10)
    sched.add(c)
    # a and b decode one token each; c's prefill takes the remaining 6 tokens of the budget.
    assert shape(run_step(sched)) == [("a", 3, 1), ("b", 2, 1), ("c", 0, 6)]
    # c's remaining prefill is continued before anything new is admitted.
    d = seq("d", 5)
    sched.add(d)
    assert shape(run_step(sched)) == [("a", 4, 1), ("b", 3, 1), ("c", 6, 4), ("d", 0, 2)]


@pytest.mark.parametrize("budget", [4, 5, 16])
def test_no_step_exceeds_the_token_budget(budget):
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_queue=256))
    for i, n in enumerate([9, 1, 13, 4, 6, 2]):
        sched.add(seq(f"s{i}", n, max_tokens=3))
    steps = 0
    while sched.has_work():
        chunks = run_step(sched)
        assert sum(c.count for c in chunks) <= budget
        assert len({c.seq.request_id for c in chunks}) == len(chunks)  # one chunk per sequence
        steps += 1
        assert steps < 200
    assert not sched.running and not sched.waiting


def test_max_num_seqs_bounds_running_and_a_finished_sequence_frees_its_blocks_at_once():
    sched = Scheduler(SchedulerConfig(max_queue=256, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64))
    a, b, c = seq("a", 4, max_tokens=2), seq("b", 4, max_tokens=5), seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    assert shape(run_step(sched)) == [("a", 0, 4), ("b", 0, 4)]
    assert c.status == SeqStatus.WAITING and len(sched.running) == 2
    assert shape(run_step(sched)) == [("a", 4, 1), ("b", 4, 1)]
    # a reached max_tokens in that step: it left at once and c comes in at the next step.
    assert a.status == SeqStatus.FINISHED and a.block_table == []
    assert shape(run_step(sched)) == [("b", 5, 1), ("c", 0, 4)]
    assert sched.blocks.num_used_blocks == 2


def assert_blocks_consistent(sched: Scheduler) -> None:
    """Every block's reference count is the number of running tables that hold it, and a block
    two sequences hold is a cached (content-addressed) one."""
    sched.blocks.check()
    held: dict[int, int] = {}
    for s in sched.running:
        assert len(s.block_table) * sched.config.block_size >= s.num_computed
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for b in range(sched.blocks.num_blocks):
        assert sched.blocks.ref_count[b] == held.get(b, 0)
        if held.get(b, 0) > 1:
            assert sched.blocks.hash_of[b] is not None


def test_blocks_are_owned_once_unless_shared_through_the_cache():
    sched = Scheduler(SchedulerConfig(max_queue=256, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64, block_size=4))
    for i in range(7):
        sched.add(seq(f"s{i}", 2 + i, max_tokens=1 + i % 3))
    while sched.has_work():
        run_step(sched)
        assert_blocks_consistent(sched)
    assert sched.blocks.num_used_blocks == 0


def test_cancelling_a_running_sequence_leaves_the_others_positions_alone():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_queue=256))
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    sched.finish(b, "abort")
    assert b.status == SeqStatus.FINISHED and b.finish_reason == "abort" and b not in sched.running
    assert shape(run_step(sched)) == [("a", 3, 1), ("c", 3, 1)]
    assert b.block_table == [] and sched.blocks.num_used_blocks == 2


def test_cancelling_a_waiting_sequence_removes_it_from_the_queue():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_queue=256))
    a, b = seq("a", 3), seq("b", 3)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b, "abort")
    assert list(sched.waiting) == [] and b.status == SeqStatus.FINISHED
    sched.finish(b, "abort")  # twice is harmless
    assert shape(run_step(sched)) == [("a", 3, 1)]


def test_a_full_queue_raises_and_admits_again_once_there_is_room():
    """Room is free slots + --max-queue: three requests fit one slot and a queue of two even when
    they all arrive before the next step (a burst at an idle server); a fourth does not."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_queue=2))
    assert sched.capacity == 3
    for rid in "abc":
        sched.add(seq(rid, 3))
    with pytest.raises(QueueFullError):
        sched.add(seq("d", 3))
    assert [s.request_id for s in sched.waiting] == ["a", "b", "c"]
    run_step(sched)  # a takes the slot: still three held, still full
    with pytest.raises(QueueFullError):
        sched.add(seq("d", 3))
    sched.finish(sched.running[0], "stop")  # a finishes: room for one more
    sched.add(seq("d", 3))
    assert [s.request_id for s in sched.waiting] == ["b", "c", "d"]


def test_new_requests_join_at_the_next_step_while_others_decode():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_queue=256))
    a = seq("a", 4, max_tokens=10)
    sched.add(a)
    run_step(sched)
    run_step(sched)
    b = seq("b", 6)
    sched.add(b)
    assert shape(run_step(sched)) == [("a", 5, 1), ("b", 0, 6)]
    assert shape(run_step(sched)) == [("a", 6, 1), ("b", 6, 1)]


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(max_num_seqs=8, max_num_batched_tokens=4),
                                    dict(max_queue=0), dict(max_queue=-3), dict(max_model_len=0)])
def test_invalid_config_is_rejected_with_the_value(kwargs):
    """The limits are validated once, by EngineArgs, for every entry point (SchedulerConfig is built
    from validated values)."""
    from engine import EngineArgs

    with pytest.raises(ValueError, match=str(list(kwargs.values())[-1])):
        EngineArgs(model="unused", **kwargs)


def test_max_model_len_is_a_limit_not_a_reservation():
    # A pool of 8 blocks of 16 tokens: a slot cache of max_model_len 64 would hold 2 sequences;
    # short ones take one block each, so 8 run at once.
    sched = Scheduler(SchedulerConfig(max_queue=256, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_kv_blocks=8))
    for i in range(8):
        sched.add(Sequence(f"s{i}", [100 + i] * 6, 4))
    run_step(sched)
    assert len(sched.running) == 8 and sched.blocks.num_free_blocks == 0
    assert_blocks_consistent(sched)


def test_a_pool_smaller_than_one_full_sequence_is_refused():
    with pytest.raises(ValueError, match="num_kv_blocks \\(3\\) cannot hold one sequence"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_queue=256, max_model_len=64, num_kv_blocks=3)


def test_a_full_pool_preempts_the_newest_sequence_which_resumes_with_its_tokens():
    sched = Scheduler(SchedulerConfig(max_queue=256, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
                                      block_size=4, num_kv_blocks=8))
    seqs = [Sequence(f"s{i}", [10 * i + j for j in range(5)], 10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    history: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    steps = 0
    while sched.has_work():
        chunks = sched.schedule()
        for c in chunks:
            sched.commit(c)
            if c.samples:
                # Each token is a function of the sequence so far, as a model's would be.
                token = (sum(c.seq.prompt_ids + c.seq.output_ids) * 31) % 97
                c.seq.output_ids.append(token)
                history[c.seq.request_id].append(token)
                if len(c.seq.output_ids) >= c.seq.max_tokens:
                    sched.finish(c.seq, "length")
        assert_blocks_consistent(sched)
        steps += 1
        assert steps < 200
    # 3 sequences of 15 tokens need 12 blocks of 4 at the end: the pool of 8 forced preemptions.
    assert sched.num_preemptions > 0 and seqs[-1].num_preemptions > 0 and seqs[0].num_preemptions == 0
    for s in seqs:
        assert len(s.output_ids) == 10 and s.output_ids == history[s.request_id]
    assert sched.blocks.num_used_blocks == 0


def test_a_cached_prefix_is_not_prefilled_again():
    sched = Scheduler(SchedulerConfig(max_queue=256, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64))
    prompt = list(range(40))
    a = Sequence("a", prompt, 1)
    sched.add(a)
    run_step(sched)  # a: 40 tokens prefilled, one sampled, finished; its two full blocks stay cached
    assert a.status == SeqStatus.FINISHED and sched.blocks.num_cached_blocks == 2
    b = Sequence("b", prompt + [7], 1)
    sched.add(b)
    assert shape(run_step(sched)) == [("b", 32, 9)]
    assert b.num_cached_tokens == 32
    stats = sched.blocks.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (40 + 41, 32)


def test_prefix_caching_off_prefills_everything():
    sched = Scheduler(SchedulerConfig(max_queue=256, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                                      enable_prefix_caching=False))
    prompt = list(range(40))
    sched.add(Sequence("a", prompt, 1))
    run_step(sched)
    sched.add(Sequence("b", prompt, 1))
    assert shape(run_step(sched)) == [("b", 0, 40)]
