"""Continuous batching: which sequences run in the next step, and how many tokens each.

Pure Python (no torch), so its rules are tested in milliseconds. Every step takes the next decode
token of every running sequence plus as much prefill as the token budget allows (chunked prefill);
the runner then passes ALL of them through each block once, so a streamed block's transfer is paid
once per step whatever the number of sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class QueueFullError(RuntimeError):
    """Every slot is taken and --max-queue requests wait for one; the caller should retry later."""


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None  # KV-cache slot while running
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    state: object = None  # engine-side state (sampling, detokenizer); the scheduler never reads it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_range(self, start: int, count: int) -> list[int]:
        ids = self.prompt_ids + self.output_ids if start + count > len(self.prompt_ids) else self.prompt_ids
        return ids[start:start + count]


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token fed this step
    count: int  # tokens fed this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last logits give a token."""
        return self.start + self.count == self.seq.num_tokens


def check_at_least_one(**limits: int) -> None:
    """ValueError naming the first of these limits that is below 1 (a count of sequences, tokens,
    queued requests... where 0 would serve nothing)."""
    for name, value in limits.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    max_queue: int = 256

    def __post_init__(self) -> None:
        check_at_least_one(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                           max_queue=self.max_queue)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))

    @property
    def capacity(self) -> int:
        """Sequences held at most: one per KV slot plus --max-queue waiting for a slot. A request
        arriving at an idle server waits until the next step for its free slot, so free slots
        count as room, not only the queue."""
        return self.config.max_num_seqs + self.config.max_queue

    def add(self, seq: Sequence) -> None:
        if len(self.running) + len(self.waiting) >= self.capacity:
            raise QueueFullError(f"all {self.config.max_num_seqs} slots are taken and {self.config.max_queue} "
                                 "requests are already waiting (--max-queue)")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Decodes first: each running sequence past its prompt advances one token every step.
        for seq in self.running:
            if seq.num_computed == seq.num_tokens - 1:
                chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
                budget -= 1
        # Then prefill still owed by running sequences, then new sequences while slots remain.
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1:
                if budget <= 0:
                    break
                n = min(remaining, budget)
                chunks.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or cancelled) and free its slot at once."""
        seq.finish_reason = seq.finish_reason or reason
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
