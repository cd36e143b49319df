"""Paged KV bookkeeping, pure Python (no torch): allocation as sequences grow, ref-counted sharing of
cached prefixes, LRU eviction, the host tier's copies, and accounting that never leaks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine.block_manager import BlockManager, block_hash


@dataclass(eq=False)
class Seq:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    cache_salt: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_range(self, start: int, count: int) -> list[int]:
        return self.tokens[start:start + count]


def admit(bm: BlockManager, seq: Seq, upto: int | None = None) -> int:
    """Admit and compute a sequence up to `upto` tokens (all by default); returns the cached tokens."""
    m = bm.match(seq)
    upto = seq.num_tokens if upto is None else upto
    assert bm.can_allocate(m, upto)
    bm.allocate(seq, m, upto)
    hit = seq.num_computed
    seq.num_computed = upto
    bm.commit(seq)
    return hit


def test_blocks_follow_the_sequence_and_come_back_when_it_finishes():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s = Seq(list(range(10)))
    admit(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.tokens.append(99)
    s.tokens.append(98)  # 12 tokens: still three blocks
    assert bm.can_grow(s, 12)
    bm.grow(s, 12)
    assert len(s.block_table) == 3
    bm.grow(s, 13)  # the 13th token opens a fourth block
    assert len(s.block_table) == 4 and len(set(s.block_table)) == 4
    assert not bm.can_grow(s, 4 * 9)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    bm.check()


def test_a_full_pool_refuses_admission_until_blocks_are_freed():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = Seq(list(range(12)))
    admit(bm, a)
    b = Seq(list(range(100, 108)))
    assert not bm.can_allocate(bm.match(b), 8)
    assert bm.can_allocate(bm.match(b), 4)
    bm.free(a)
    assert bm.can_allocate(bm.match(b), 8)


def test_shared_prefix_is_found_by_content_and_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert admit(bm, a) == 0
    b = Seq(list(range(8)) + [50, 51, 52])
    assert admit(bm, b) == 8  # the two full blocks
    assert b.block_table[:2] == a.block_table[:2]
    assert all(bm.ref_count[x] == 2 for x in a.block_table[:2])
    # Same first block, different second: only the first matches (addresses chain over parents).
    c = Seq([0, 1, 2, 3, 4, 5, 6, 99, 8, 9])
    assert admit(bm, c) == 4
    # An identical 8-token prompt reuses one block, not two: its last token must be computed.
    d = Seq(list(range(8)))
    assert admit(bm, d) == 4
    # A different first block means no match at all, even with an equal second block.
    e = Seq([7, 1, 2, 3, 4, 5, 6, 7, 1])
    assert admit(bm, e) == 0
    assert bm.stats.hit_tokens == 16 and bm.stats.queried_tokens == 10 + 11 + 10 + 8 + 9
    bm.check()


def test_sequences_under_different_salts_share_no_block():
    """A served LoRA adapter's sequences salt their hash chain with its digest: the same tokens under another
    adapter (or the base) compute K/V of their own; under the same adapter they share as usual."""
    bm = BlockManager(num_blocks=16, block_size=4)
    assert admit(bm, Seq(list(range(10)))) == 0  # the base model's
    assert admit(bm, Seq(list(range(10)), cache_salt=b"adapter-1")) == 0
    assert admit(bm, Seq(list(range(10)), cache_salt=b"adapter-2")) == 0
    assert admit(bm, Seq(list(range(10)), cache_salt=b"adapter-1")) == 8
    assert admit(bm, Seq(list(range(10)))) == 8
    bm.check()


def test_blocks_are_cached_only_once_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(list(range(12)))
    m = bm.match(a)
    bm.allocate(a, m, 12)
    a.num_computed = 6  # chunked prefill: only the first block is full of computed K/V
    bm.commit(a)
    assert admit(bm, Seq(list(range(12)))) == 4


def test_cached_blocks_outlive_their_sequence_and_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    old, new = Seq([1] * 9), Seq([2] * 9)  # two full blocks + one partial each
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 4
    # 2 never-cached blocks are taken before any cached one; then the oldest cached ones go.
    filler = Seq(list(range(100, 116)))
    admit(bm, filler)
    assert bm.stats.evictions == 2
    bm.free(filler)
    assert admit(bm, Seq([2] * 9)) == 8  # the recent prefix survived
    bm.check()


def test_two_sequences_computing_the_same_block_keep_one_cached_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Seq(list(range(6))), Seq(list(range(6)))
    for s in (a, b):  # admitted in one step: neither finds the other's blocks yet
        bm.allocate(s, bm.match(s), 6)
    for s in (a, b):
        s.num_computed = 6
        bm.commit(s)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 8


def test_disabled_prefix_caching_never_matches():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, Seq(list(range(9))))
    assert admit(bm, Seq(list(range(9)))) == 0 and bm.num_cached_blocks == 0


def test_evicted_blocks_go_to_the_host_tier_and_come_back_on_a_hit():
    bm = BlockManager(num_blocks=3, block_size=4, num_host_blocks=4)
    a = Seq(list(range(9)))
    admit(bm, a)
    bm.free(a)
    other = Seq(list(range(100, 112)))  # takes all three device blocks: a's two cached blocks leave
    admit(bm, other)
    outs = bm.take_copies()
    assert [c.direction for c in outs] == ["out", "out"] and bm.stats.blocks_swapped_out == 2
    bm.free(other)
    back = Seq(list(range(9)))
    assert admit(bm, back) == 8
    ins = bm.take_copies()
    assert sorted(c.direction for c in ins).count("in") == 2
    assert {c.host_block for c in ins if c.direction == "in"} == {c.host_block for c in outs}
    assert bm.stats.host_hit_tokens == 8
    bm.check()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        BlockManager(4, num_host_blocks=-1)


@pytest.mark.parametrize("host_blocks", [0, 3, 12])
def test_random_workload_keeps_content_and_accounting_exact(host_blocks):
    """Simulate the pools' contents: each computed block holds its own address, copies move them.
    Every block a match hands out must hold exactly the address of the prefix it stands for, and
    when everything has finished, every block is free (or only cached)."""
    rng = random.Random(0)
    bs = 4
    bm = BlockManager(num_blocks=20, block_size=bs, num_host_blocks=host_blocks)
    device: list[object] = [None] * 20
    host: list[object] = [None] * host_blocks
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    live: list[Seq] = []

    def addresses(tokens: list[int]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(len(tokens) // bs):
            out.append(block_hash(out[-1] if out else None, tokens[i * bs:(i + 1) * bs]))
        return out

    for _ in range(400):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            s = Seq(list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))])
            m = bm.match(s)
            if not bm.can_allocate(m, s.num_tokens):
                continue
            bm.allocate(s, m, s.num_tokens)
            for c in bm.take_copies():
                if c.direction == "out":
                    host[c.host_block] = device[c.device_block]
                else:
                    device[c.device_block] = host[c.host_block]
            want = addresses(s.tokens)
            hit = s.num_computed // bs
            assert [device[b] for b in s.block_table[:hit]] == want[:hit]
            for i in range(hit, len(s.block_table)):  # "compute" the rest
                device[s.block_table[i]] = want[i] if i < len(want) else ("partial", id(s))
            s.num_computed = s.num_tokens
            bm.commit(s)
            live.append(s)
        bm.check()
    for s in live:
        bm.free(s)
    bm.check()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 20
    assert bm.stats.hit_tokens > 0
    if host_blocks:
        assert bm.stats.blocks_swapped_in > 0
