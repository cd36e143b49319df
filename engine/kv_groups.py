"""KV groups: the layers of a model whose KV cache lives in one paged pool, one pool per kind of layer.

A full-attention layer reads every position of its sequence; a sliding-window layer only the last
`window` (Gemma 2/3, GPT-OSS, Mistral, Phi-3). So the layers are grouped by window, each group has its
own pool and its own block table per sequence, and a windowed group's blocks wholly before the window
of every query to come go back to its pool as the sequence grows (BlockManager.release_before). Every
group's table covers the same positions (a released entry is NULL_BLOCK), so a sequence grows by the
same number of blocks in each: the scheduler reads one table's length and the fewest free blocks of any
group, and needs nothing else.

Prefix caching: every group addresses a block by the same chained hash. A prefix of n blocks is a hit
when the full-attention groups hold all n and each windowed group holds the blocks within its window
before position n * block_size (what the first computed query reads).

Pure Python (no torch), like the block manager and the scheduler that use it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .block_manager import BlockCopy, BlockManager, BlockStats, KVTelemetry, PagedSequence, PrefixMatch


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]
    window: int | None  # None: full attention, every position kept


@dataclass(frozen=True)
class KVLayout:
    """Which layer's KV lives in which group. Group 0 is the full-attention layers when the model has any:
    its table (Sequence.block_table) then covers every position, which a separate draft model's pool
    mirrors (engine.speculative)."""

    groups: tuple[KVGroup, ...]

    @staticmethod
    def of(windows: list[int | None] | tuple[int | None, ...]) -> KVLayout:
        """The layout of a model whose layer i has sliding window windows[i] (None: full attention)."""
        order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        return KVLayout(tuple(KVGroup(tuple(i for i, w in enumerate(windows) if w == window), window)
                              for window in order))

    @staticmethod
    def single(num_layers: int) -> KVLayout:
        """Every layer in one full-attention group (a draft model's pool, which mirrors group 0)."""
        return KVLayout((KVGroup(tuple(range(num_layers)), None),))

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_groups(self) -> tuple[int, ...]:
        """The group of each layer, in layer order."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return tuple(out)

    def blocks_per_seq(self, group: int, max_model_len: int, block_size: int, step_tokens: int) -> int:
        return blocks_per_seq(self.groups[group].window, max_model_len, block_size, step_tokens)


def blocks_per_seq(window: int | None, max_model_len: int, block_size: int, step_tokens: int) -> int:
    """Blocks one sequence of max_model_len holds at most in a group with this window: all of them under
    full attention; under a window, those of a step of `step_tokens` tokens and the window before it (the
    blocks before are released after each step), plus one a misaligned window straddles."""
    whole = -(-max_model_len // block_size)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + step_tokens) // block_size) + 1)


class _GroupTable:
    """A sequence seen by one group's block manager (engine.block_manager.PagedSequence): the group's own
    block table (Sequence.kv_tables), the sequence's tokens, hashes and computed count."""

    __slots__ = ("seq", "block_table")

    def __init__(self, seq, group: int):
        while len(seq.kv_tables) < group:
            seq.kv_tables.append([])
        self.seq = seq
        self.block_table = seq.kv_tables[group - 1]

    @property
    def block_hashes(self) -> list[bytes]:
        return self.seq.block_hashes

    @property
    def cache_salt(self) -> bytes | None:
        return self.seq.cache_salt

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        self.seq.num_computed = value

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    def token_range(self, start: int, count: int) -> list[int]:
        return self.seq.token_range(start, count)


@dataclass(frozen=True)
class GroupedMatch:
    """A prefix hit in every group: each group's PrefixMatch covers the same positions."""

    matches: tuple[PrefixMatch, ...]

    @property
    def num_tokens(self) -> int:
        return self.matches[0].num_tokens

    @property
    def num_host_blocks(self) -> int:
        return sum(m.num_host_blocks for m in self.matches)

    def empty(self) -> GroupedMatch:
        return GroupedMatch(tuple(m.empty() for m in self.matches))


class GroupedBlockManager:
    """The block managers of a model with more than one KV group, or with sliding windows, behind the one
    BlockManager's interface the scheduler uses. Group 0's manager is the primary: its table is
    Sequence.block_table, its counters are the prefix cache's and the pool's in telemetry."""

    def __init__(self, layout: KVLayout, group_blocks: tuple[int, ...], block_size: int = 16,
                 enable_prefix_caching: bool = True, group_host_blocks: tuple[int, ...] = ()):
        if len(group_blocks) != len(layout.groups):
            raise ValueError(f"{len(group_blocks)} pool sizes for {len(layout.groups)} KV groups")
        host = group_host_blocks or (0,) * len(group_blocks)
        self.layout = layout
        self.windows = tuple(g.window for g in layout.groups)
        self.managers = [BlockManager(n, block_size, enable_prefix_caching, h) for n, h in zip(group_blocks, host)]
        self.primary = self.managers[0]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    def _tables(self, seq) -> list[PagedSequence]:
        return [seq] + [_GroupTable(seq, g) for g in range(1, len(self.managers))]

    # -- what is free: the primary's pool, but a sequence grows only as far as every group can follow
    @property
    def num_blocks(self) -> int:
        return self.primary.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return min(m.num_free_blocks for m in self.managers)

    @property
    def num_used_blocks(self) -> int:
        return self.primary.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.primary.num_cached_blocks

    @property
    def stats(self) -> BlockStats:
        return self.primary.stats

    def blocks_for(self, num_tokens: int) -> int:
        return self.primary.blocks_for(num_tokens)

    # -- admission ----------------------------------------------------------------------------------
    def _first_needed(self, group: int, num_blocks: int) -> int:
        """The first block a query at position num_blocks * block_size reads in a group."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def match(self, seq) -> GroupedMatch:
        """The longest prefix every group can serve from its cache (module docstring)."""
        tables = self._tables(seq)
        most = (seq.num_tokens - 1) // self.block_size
        places = [m.lookup(t, most) for m, t in zip(self.managers, tables)]
        # runs[g][i]: how many blocks up to and including i group g holds without a gap, so each candidate
        # length is checked in O(1) per group: blocks [first, n) are all held when runs[g][n - 1] >= n - first.
        runs = []
        for p in places:
            run, count = [], 0
            for place in p:
                count = count + 1 if place is not None else 0
                run.append(count)
            runs.append(run)
        n = most
        while n > 0 and not all(r[n - 1] >= n - self._first_needed(g, n) for g, r in enumerate(runs)):
            n -= 1
        return GroupedMatch(tuple(
            PrefixMatch(tuple(p[self._first_needed(g, n):n]), self.block_size, self._first_needed(g, n))
            for g, p in enumerate(places)))

    def prefetch(self, seq) -> None:
        """Nothing to read ahead: models with sliding-window groups keep no KV disk tier."""

    def can_allocate(self, match: GroupedMatch, num_tokens: int, reserve: int = 0) -> bool:
        return all(m.can_allocate(pm, num_tokens, reserve) for m, pm in zip(self.managers, match.matches))

    def allocate(self, seq, match: GroupedMatch, num_tokens: int) -> None:
        for m, t, pm in zip(self.managers, self._tables(seq), match.matches):
            m.allocate(t, pm, num_tokens)

    # -- growth and release ------------------------------------------------------------------------
    def can_grow(self, seq, num_tokens: int) -> bool:
        return all(m.can_grow(t, num_tokens) for m, t in zip(self.managers, self._tables(seq)))

    def grow(self, seq, num_tokens: int) -> None:
        for m, t in zip(self.managers, self._tables(seq)):
            m.grow(t, num_tokens)

    def commit(self, seq, since: int = 0) -> None:
        """Publish the blocks the step filled in every group, then release the windowed groups' blocks
        no later query reads."""
        for m, t in zip(self.managers, self._tables(seq)):
            m.commit(t, since)
        self._release_outside_windows(seq)

    def _release_outside_windows(self, seq) -> None:
        for m, t, window in zip(self.managers, self._tables(seq), self.windows):
            if window is not None:
                # The next query is at num_computed: it reads keys from num_computed - window + 1 on.
                m.release_before(t, seq.num_computed - window + 1)

    def free(self, seq) -> None:
        for m, t in zip(self.managers, self._tables(seq)):
            m.free(t)

    def take_copies(self) -> list[BlockCopy]:
        return [replace(c, group=g) for g, m in enumerate(self.managers) for c in m.take_copies()]

    def telemetry(self, bytes_swapped_out: int, bytes_swapped_in: int, preemptions: int) -> KVTelemetry:
        return self.primary.telemetry(bytes_swapped_out, bytes_swapped_in, preemptions)

    def check(self) -> None:
        for m in self.managers:
            m.check()
