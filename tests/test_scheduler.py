"""Scheduler rules, pure Python (no model): chunked prefill, token and sequence budgets, slots,
admission, cancellation and the bounded queue."""

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
        c.seq.num_computed += c.count
        if c.samples:
            c.seq.output_ids.append(token)
            if len(c.seq.output_ids) >= c.seq.max_tokens:
                sched.finish(c.seq, "length")
    return chunks


def shape(chunks: list[ScheduledChunk]) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.count) for c in chunks]


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64))
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
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64))
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
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64))
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


def test_max_num_seqs_bounds_running_and_a_finished_sequence_frees_its_slot_at_once():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64))
    a, b, c = seq("a", 4, max_tokens=2), seq("b", 4, max_tokens=5), seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    assert shape(run_step(sched)) == [("a", 0, 4), ("b", 0, 4)]
    assert c.status == SeqStatus.WAITING and len(sched.running) == 2
    slot_a = a.slot
    assert shape(run_step(sched)) == [("a", 4, 1), ("b", 4, 1)]
    # a reached max_tokens in that step: it left at once and c takes its slot in the next step.
    assert a.status == SeqStatus.FINISHED and a.slot is None
    assert shape(run_step(sched)) == [("b", 5, 1), ("c", 0, 4)]
    assert c.slot == slot_a


def test_slots_are_unique_among_running_sequences():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64))
    for i in range(7):
        sched.add(seq(f"s{i}", 2 + i, max_tokens=1 + i % 3))
    while sched.has_work():
        run_step(sched)
        slots = [s.slot for s in sched.running]
        assert len(set(slots)) == len(slots) and all(0 <= s < 3 for s in slots)


def test_cancelling_a_running_sequence_leaves_the_others_positions_alone():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64))
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    sched.finish(b, "abort")
    assert b.status == SeqStatus.FINISHED and b.finish_reason == "abort" and b not in sched.running
    assert shape(run_step(sched)) == [("a", 3, 1), ("c", 3, 1)]
    assert len(sched.free_slots) == 1


def test_cancelling_a_waiting_sequence_removes_it_from_the_queue():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64))
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
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64, max_queue=2))
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
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64))
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
    with pytest.raises(ValueError, match=str(list(kwargs.values())[-1])):
        SchedulerConfig(**kwargs)
