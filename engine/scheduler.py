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
from typing import TYPE_CHECKING

from .kv_groups import KVLayout

if TYPE_CHECKING:
    from .block_manager import DiskIndex
    from .request import RequestState  # torch: annotations only


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class QueueFullError(RuntimeError):
    """max_num_seqs sequences run and --max-queue requests wait; the caller should retry later."""


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # KV blocks, in position order, while running
    # The block tables of the model's other KV groups (engine.kv_groups: sliding-window layers), if any
    kv_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # memo of the block manager's addresses
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt at the last admission, tokens found in the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    state: RequestState | None = None  # the engine's (engine.request); the scheduler never reads it
    prompt_logits: bool = False  # the runner also returns the logits of its prompt positions (prompt logprobs)
    lora_slot: int | None = None  # the served LoRA adapter it runs with (engine.lora_serving), None: the base
    # The first block's parent in the prefix cache's hash chain (the adapter's digest): KV computed under one
    # adapter is never another's, nor the base's. None: the base model's chain.
    cache_salt: bytes | None = None

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
    # Speculative decoding: the ids fed at positions start.. when they are not only the sequence's
    # own (a verify pass feeds the last token and k drafts; a draft model feeds its drafts), and how
    # many trailing positions need logits. None: the sequence's own tokens, logits of the last one
    # if the chunk reaches the end of the sequence.
    ids: list[int] | None = None
    spec_logits: int = 0

    @property
    def num_logits(self) -> int:
        """Rows of logits this chunk gets from the step."""
        if self.ids is not None:
            return self.spec_logits
        return 1 if self.start + self.count == self.seq.num_tokens else 0

    @property
    def samples(self) -> bool:
        """Whether this chunk gets logits (it reaches the end of the sequence, or it is speculative)."""
        return self.num_logits > 0

    def token_ids(self) -> list[int]:
        return self.ids if self.ids is not None else self.seq.token_range(self.start, self.count)

    @property
    def prompt_logit_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token, when the sequence asks
        for prompt logprobs: its prompt positions but the prompt's last (whose logits sample)."""
        if not self.seq.prompt_logits or self.seq.output_ids:  # scored once; a preempted re-prefill is not
            return range(0)
        end = min(self.start + self.count, len(self.seq.prompt_ids) - 1)
        return range(self.start, max(self.start, end))


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's share of the engine limits, which EngineArgs validated and the plan sized
    (the KV pool, the context when the user chose none)."""

    max_num_seqs: int
    max_num_batched_tokens: int  # >= max_num_seqs, so every running sequence can decode each step
    max_queue: int
    max_model_len: int = 2048  # per request (prompt + completion); not a reservation
    block_size: int = 16
    # KV pool size in blocks; None = as many as max_num_seqs sequences of max_model_len would need.
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    num_host_kv_blocks: int = 0  # host tier for evicted cached blocks (0 = none)
    # Layers grouped by sliding window (engine.kv_groups), with each group's pool and host tier in blocks;
    # None: one pool of kv_blocks for every layer.
    kv_layout: KVLayout | None = None
    kv_group_blocks: tuple[int, ...] = ()
    kv_group_host_blocks: tuple[int, ...] = ()

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def kv_blocks(self) -> int:
        return self.max_num_seqs * self.blocks_per_seq if self.num_kv_blocks is None else self.num_kv_blocks

    def __post_init__(self) -> None:
        layout = self.kv_layout
        if layout is not None and len(self.kv_group_blocks) == len(layout.groups):
            for g, blocks in enumerate(self.kv_group_blocks):
                need = layout.blocks_per_seq(g, self.max_model_len, self.block_size, self.max_num_batched_tokens)
                if blocks < need:
                    raise ValueError(f"KV group {g} (window {layout.groups[g].window}) has {blocks} blocks; one "
                                     f"sequence of max_model_len {self.max_model_len} needs {need}")
            return
        if self.kv_blocks < self.blocks_per_seq:
            # With fewer, a lone sequence at max_model_len could never finish (nothing to preempt).
            raise ValueError(f"num_kv_blocks ({self.num_kv_blocks}) cannot hold one sequence of max_model_len "
                             f"{self.max_model_len} ({self.blocks_per_seq} blocks of {self.block_size} tokens)")


class Scheduler:
    """Admission by free KV blocks, not slots: a sequence takes blocks as it grows.

    When a running sequence needs a block and none is free, the most recently admitted running
    sequence is preempted (vLLM's policy: the oldest requests keep making progress). Preemption
    frees its blocks and puts it back at the head of the queue; its generated tokens are kept and
    become part of what it re-prefills. Recompute, then, but cheap with prefix caching on: its full
    blocks were published to the prefix cache, stay there until evicted (and then move to the host
    tier, if there is one), so readmission finds them and recomputes only what was lost.
    """

    def __init__(self, config: SchedulerConfig, disk: DiskIndex | None = None):
        """disk: the KV disk tier the block manager writes through and looks prefixes up in (None: none)."""
        from .block_manager import BlockManager
        from .kv_groups import GroupedBlockManager

        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        layout = config.kv_layout
        if layout is None or (len(layout.groups) == 1 and layout.groups[0].window is None):
            self.blocks = BlockManager(config.kv_blocks, config.block_size, config.enable_prefix_caching,
                                       config.num_host_kv_blocks, disk)
        else:
            # Sliding-window groups keep no disk tier (the loader opens none for them): a block's K/V
            # is not one byte string over every layer there.
            assert disk is None, "the KV disk tier is for models with one KV group"
            self.blocks = GroupedBlockManager(layout, config.kv_group_blocks, config.block_size,
                                              config.enable_prefix_caching, config.kv_group_host_blocks)
        self.num_preemptions = 0

    @property
    def capacity(self) -> int:
        """Sequences held at most: max_num_seqs running plus --max-queue waiting. A request arriving
        at an idle server waits until the next step to be admitted, so room to run counts as room,
        not only the queue."""
        return self.config.max_num_seqs + self.config.max_queue

    def add(self, seq: Sequence) -> None:
        if len(self.running) + len(self.waiting) >= self.capacity:
            raise QueueFullError(f"{len(self.running)} sequences run (at most {self.config.max_num_seqs}) and "
                                 f"{len(self.waiting)} requests are already waiting (--max-queue "
                                 f"{self.config.max_queue})")
        self.waiting.append(seq)
        self.blocks.prefetch(seq)  # the disk tier's reads of its prefix start now, beside the running steps

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        cfg = self.config
        chunks: dict[Sequence, ScheduledChunk] = {}  # insertion-ordered: decodes, prefills, admissions

        def budget() -> int:
            return cfg.max_num_batched_tokens - sum(c.count for c in chunks.values())

        # Decodes first: each running sequence past its prompt advances one token every step.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_computed == seq.num_tokens - 1 and self._make_room(seq, seq.num_tokens, chunks):
                chunks[seq] = ScheduledChunk(seq, seq.num_computed, 1)
            i += 1
        # Then prefill still owed by running sequences, as far as the token budget and blocks allow.
        i = 0
        while i < len(self.running) and budget() > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1:
                fit = self._tokens_that_fit(seq)
                if fit < 1:
                    if not self._make_room(seq, seq.num_computed + 1, chunks):
                        continue  # seq itself was preempted (it was the newest, so the last)
                    fit = self._tokens_that_fit(seq)
                n = min(remaining, budget(), fit)
                self.blocks.grow(seq, seq.num_computed + n)
                chunks[seq] = ScheduledChunk(seq, seq.num_computed, n)
            i += 1
        # Then new (or preempted) sequences, first come first served, while blocks allow. Keep
        # free the blocks running sequences will need at the next step, so admitting does not
        # just preempt the newcomer again then.
        bs = cfg.block_size
        reserve = sum(1 for s in self.running if len(s.block_table) * bs < s.num_tokens + 1)
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget() > 0:
            seq = self.waiting[0]
            match = self.blocks.match(seq)
            if seq.prompt_logits and not seq.output_ids:
                # Prompt logprobs need the logits of every prompt position: nothing may be skipped.
                match = match.empty()
            n = min(seq.num_tokens - match.num_tokens, budget())
            if not self.blocks.can_allocate(match, match.num_tokens + n, reserve=reserve):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, match, match.num_tokens + n)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed  # the match, less any disk read lost since
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks[seq] = ScheduledChunk(seq, seq.num_computed, n)
        return list(chunks.values())

    def _tokens_that_fit(self, seq: Sequence) -> int:
        """Tokens seq could compute now with its blocks plus every free one."""
        return (len(seq.block_table) + self.blocks.num_free_blocks) * self.config.block_size - seq.num_computed

    def _make_room(self, seq: Sequence, num_tokens: int, chunks: dict[Sequence, ScheduledChunk]) -> bool:
        """Grow seq's blocks to num_tokens positions, preempting the newest running sequences while
        none is free; False if seq itself had to go (it was the newest)."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, chunks)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, chunks: dict[Sequence, ScheduledChunk]) -> None:
        chunks.pop(seq, None)
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # first to come back: it is older than anything waiting

    def commit(self, chunk: ScheduledChunk, count: int | None = None) -> None:
        """The step computed this chunk's K/V: count it and publish the blocks it filled. count: of
        a speculative chunk, the positions kept (the rest held rejected drafts)."""
        chunk.seq.num_computed += chunk.count if count is None else count
        self.blocks.commit(chunk.seq, since=chunk.start)

    def grow_for_lookahead(self, seq: Sequence, wanted: int) -> int:
        """Blocks for up to `wanted` positions past seq's tokens (speculative drafts), from free
        blocks only (never preempting for a guess); returns how many positions it got."""
        bs = self.config.block_size
        room = (len(seq.block_table) + self.blocks.num_free_blocks) * bs - seq.num_tokens
        got = max(0, min(wanted, room))
        self.blocks.grow(seq, seq.num_tokens + got)
        return got

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or cancelled) and free its blocks at once."""
        seq.finish_reason = seq.finish_reason or reason
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
