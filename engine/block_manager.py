"""Paged KV bookkeeping: which KV block holds which tokens of which sequence. Pure Python, no torch.

The device KV pool is `num_blocks` blocks of `block_size` token positions. A sequence owns a block
table (block ids in position order) that grows as it does; a finished sequence hands its blocks back.

Automatic prefix caching: once every token of a block has its K/V computed, the block gets a
content address, a hash chained over (parent block's hash, the block's token ids), so equal
prefixes, and only equal prefixes, share addresses. The first block's parent is the sequence's cache
salt (a served LoRA adapter's digest, or none for the base model): the same tokens under different
adapters have different K/V, and different addresses. A new sequence whose leading blocks match
cached addresses takes a reference to those blocks instead of computing them. A freed cached block
keeps its content and its address while it sits in the free pool; allocation takes never-cached
blocks first and then evicts cached ones least-recently-used first.

Host tier: with `num_host_blocks` > 0, a cached block evicted from the device pool is copied to a
bounded host pool (also LRU) instead of being dropped, and a later prefix hit on it copies it back
instead of recomputing it.

Disk tier (engine.kv_disk): with a `disk` given, every block is written through to disk when first
published ("spill"), and a prefix that misses the device pool and the host tier is looked up there by
its hashes; blocks found (read and verified before they count) are copied into fresh device blocks
("fetch"). The manager only decides; it queues the copies (`take_copies`) for the
KV cache to perform before the next forward pass, in order, which is what makes them safe: nothing
writes a device block except the forward pass, so a queued copy always reads what the bookkeeping
says is there.

Sliding-window layers (engine.kv_groups) keep a block table of their own: a block wholly before the
window of every query to come is released (release_before) and its entry becomes NULL_BLOCK, and a
prefix match needs only the blocks within the window before the matched point (PrefixMatch.skipped).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

NULL_BLOCK = -1  # a table entry whose block went back to the pool: before a sliding window, never read again


class PagedSequence(Protocol):
    """What the block manager reads and writes on a sequence (engine.scheduler.Sequence)."""

    block_table: list[int]
    block_hashes: list[bytes]  # chained hashes of the sequence's full blocks, computed once each
    num_computed: int
    cache_salt: bytes | None  # the first block's parent: sequences under different salts share no block

    @property
    def num_tokens(self) -> int: ...

    def token_range(self, start: int, count: int) -> list[int]: ...


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Content address of a full block: 128-bit BLAKE2b over the parent's address and the token ids,
    so a collision (two prefixes sharing KV that is not theirs) is out of reach in practice."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(frozen=True)
class BlockCopy:
    """One queued copy between the pools: "out" device block -> host block, "in" host -> device; with the
    disk tier, "spill" device block -> disk and "fetch" disk -> device block, both by content address `key`."""

    direction: str  # "out" | "in" | "spill" | "fetch"
    device_block: int
    host_block: int = -1
    group: int = 0  # the KV group (engine.kv_groups) whose pools these blocks are in
    key: bytes | None = None
    data: bytes | None = field(default=None, repr=False)  # "fetch": the block's verified bytes, read from disk


class DiskIndex(Protocol):
    """What the block manager asks of the disk tier (engine.kv_disk.KVDiskTier)."""

    def contains(self, key: bytes) -> bool: ...

    def prefetch(self, keys: list[bytes]) -> None: ...

    def load(self, keys: list[bytes]) -> int: ...

    def take(self, key: bytes) -> bytes | None: ...


@dataclass(frozen=True)
class PrefixMatch:
    """Leading cached blocks of a sequence, in order: (on_host, block id) each. Device blocks are
    shared; host blocks are copied into fresh device blocks."""

    blocks: tuple[tuple[bool, int], ...]
    block_size: int
    skipped: int = 0  # leading blocks not held at all: before a sliding window, their K/V never read again
    disk_keys: tuple[bytes, ...] = ()  # then these blocks, read from the disk tier into fresh device blocks

    @property
    def num_tokens(self) -> int:
        return (self.skipped + len(self.blocks) + len(self.disk_keys)) * self.block_size

    def empty(self) -> PrefixMatch:
        """No cached block: everything computed afresh (prompt logprobs need every position's logits)."""
        return PrefixMatch((), self.block_size)

    @property
    def num_host_blocks(self) -> int:
        return sum(on_host for on_host, _ in self.blocks)


@dataclass
class BlockStats:
    """Counters since start (telemetry)."""

    queried_tokens: int = 0  # tokens of sequences looked up in the prefix cache on admission
    hit_tokens: int = 0  # of those, tokens whose K/V came from the cache (device or host)
    host_hit_tokens: int = 0  # of the hits, tokens copied back from the host tier
    blocks_swapped_out: int = 0  # device -> host copies
    blocks_swapped_in: int = 0  # host -> device copies
    evictions: int = 0  # cached device blocks reused for other content
    disk_hit_tokens: int = 0  # of the hits, tokens read from the disk tier
    blocks_spilled: int = 0  # blocks written through to the disk tier


@dataclass(frozen=True)
class KVTelemetry:
    """A snapshot of the paged KV cache for observers (/metrics, the engine's telemetry): pool use,
    prefix-cache hits in tokens, host-tier traffic, preemptions. Counters are totals since start."""

    block_size: int
    blocks_total: int
    blocks_used: int  # held by running sequences
    blocks_cached: int  # holding a cached prefix (in use or not)
    host_blocks_total: int
    host_blocks_used: int
    prefix_caching: bool
    queried_tokens: int
    hit_tokens: int
    host_hit_tokens: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    bytes_swapped_out: int
    bytes_swapped_in: int
    preemptions: int
    disk_hit_tokens: int = 0
    blocks_spilled: int = 0

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running sequences (cached free blocks count as free)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits over tokens looked up, both in tokens."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class _HostTier:
    """A bounded LRU pool of cached blocks in host memory, addressed like the device cache."""

    num_blocks: int
    by_hash: dict[bytes, int] = field(default_factory=dict)
    hash_of: dict[int, bytes] = field(default_factory=dict)
    lru: OrderedDict = field(default_factory=OrderedDict)  # host block -> None, least recent first
    free: list[int] = field(default_factory=list)
    # Host blocks an allocation in progress is about to copy in: not to be overwritten before.
    pinned: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def touch(self, host_block: int) -> None:
        self.lru.move_to_end(host_block)

    def take(self) -> int | None:
        """A host block to overwrite: a never-used one, else the least recently used unpinned one;
        None when every host block is pinned."""
        if self.free:
            hb = self.free.pop()
        else:
            hb = next((b for b in self.lru if b not in self.pinned), None)
            if hb is None:
                return None
            del self.lru[hb]
            del self.by_hash[self.hash_of.pop(hb)]
        self.lru[hb] = None
        return hb


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, disk: DiskIndex | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        # Free blocks without cached content, used as a stack: the most recently freed block is
        # reused first, so on the CPU (lazily faulted zeros) the pages touched follow peak use.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still hold a cached prefix, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.host = _HostTier(num_host_blocks) if enable_prefix_caching and num_host_blocks > 0 else None
        self._copies: list[BlockCopy] = []
        self.stats = BlockStats()
        self.disk = disk if enable_prefix_caching else None

    # -- what is free ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now (never-cached ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks holding a cached prefix (in use or not)."""
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission: prefix lookup and the first allocation --------------------------------------
    def _hashes(self, seq: PagedSequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of the first num_blocks full blocks, extending the sequence's memo."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else seq.cache_salt, seq.token_range(i * bs, bs)))
        return hashes[:num_blocks]

    def match(self, seq: PagedSequence) -> PrefixMatch:
        """The cached leading blocks of a sequence that holds no blocks. At least its last token is
        left to compute: its logits give the next token."""
        found: list[tuple[bool, int]] = []
        places = self.lookup(seq, (seq.num_tokens - 1) // self.block_size)
        for place in places:
            if place is None:
                break
            found.append(place)
        on_disk: tuple[bytes, ...] = ()
        if self.disk is not None and self.enable_prefix_caching and len(found) < len(places):
            rest = self._hashes(seq, len(places))[len(found):]
            on_disk = tuple(rest[:self.disk.load(rest)])  # read and verified: a hit that cannot turn out wrong
        return PrefixMatch(tuple(found), self.block_size, disk_keys=on_disk)

    def prefetch(self, seq: PagedSequence) -> None:
        """A sequence was queued: start reading the blocks of its prefix the disk tier holds (and the
        device pool and host tier do not), so that its admission finds them read."""
        if self.disk is None or seq.block_table:
            return
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        first = next((i for i, h in enumerate(hashes) if h not in self._by_hash
                      and not (self.host is not None and h in self.host.by_hash)), len(hashes))
        self.disk.prefetch(hashes[first:])

    def lookup(self, seq: PagedSequence, num_blocks: int) -> list[tuple[bool, int] | None]:
        """Where each of the sequence's first num_blocks full blocks is cached: (on_host, block id), or
        None. The chained address says the whole prefix matches, wherever the parent lives."""
        assert not seq.block_table, "lookup() is for a sequence without blocks"
        if not self.enable_prefix_caching:
            return [None] * num_blocks
        out: list[tuple[bool, int] | None] = []
        for h in self._hashes(seq, num_blocks):
            if h in self._by_hash:
                out.append((False, self._by_hash[h]))
            elif self.host is not None and h in self.host.by_hash:
                out.append((True, self.host.by_hash[h]))
            else:
                out.append(None)
        return out

    def can_allocate(self, match: PrefixMatch, num_tokens: int, reserve: int = 0) -> bool:
        """Whether a sequence with this match can get blocks covering num_tokens positions and
        leave `reserve` blocks free."""
        shared = [b for on_host, b in match.blocks if not on_host]
        # Sharing a free cached block takes it out of the free pool too.
        shared_free = sum(1 for b in shared if self.ref_count[b] == 0)
        need = self.blocks_for(num_tokens) - match.skipped - len(shared)
        return need + shared_free + reserve <= self.num_free_blocks

    def allocate(self, seq: PagedSequence, match: PrefixMatch, num_tokens: int) -> None:
        """Give a sequence without blocks its cached prefix plus fresh blocks up to num_tokens
        positions; its computed tokens become the matched ones. Check can_allocate first."""
        assert self.can_allocate(match, num_tokens)
        # Take the shared blocks before any fresh one: taking could otherwise evict them.
        for on_host, b in match.blocks:
            if not on_host:
                self._share(b)
            else:
                self.host.pinned.add(b)
        seq.block_table.extend([NULL_BLOCK] * match.skipped)
        for on_host, b in match.blocks:
            if on_host:
                hb, b = b, self._take()
                self._copies.append(BlockCopy("in", b, hb))
                self.host.touch(hb)
                self._register(b, self.host.hash_of[hb])
                self.stats.blocks_swapped_in += 1
            seq.block_table.append(b)
        if self.host is not None:
            self.host.pinned.clear()
        fetched = 0
        for h in match.disk_keys:
            # The bytes are taken now, with the blocks: a read staged at match() but dropped since (the
            # stage is bounded) only shortens the hit, and those tokens are computed instead.
            data = self.disk.take(h)
            if data is None:
                break
            b = self._take()
            self._copies.append(BlockCopy("fetch", b, key=h, data=data))
            self._register(b, h)
            seq.block_table.append(b)
            fetched += 1
        self.stats.disk_hit_tokens += fetched * self.block_size
        seq.num_computed = (match.skipped + len(match.blocks) + fetched) * self.block_size
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += seq.num_computed
        self.stats.host_hit_tokens += match.num_host_blocks * self.block_size
        self.grow(seq, num_tokens)

    # -- growth and release ----------------------------------------------------------------------
    def can_grow(self, seq: PagedSequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: PagedSequence, num_tokens: int) -> None:
        """Append fresh blocks until the table covers num_tokens positions."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        assert need <= self.num_free_blocks, "grow() without can_grow()"
        for _ in range(need):
            seq.block_table.append(self._take())

    def commit(self, seq: PagedSequence, since: int = 0) -> None:
        """Publish the sequence's blocks that are full of computed K/V to the prefix cache; `since`
        (tokens computed before the last step) skips the blocks published before."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        hashes = self._hashes(seq, full)
        for i in range(since // self.block_size, full):
            b = seq.block_table[i]
            if b != NULL_BLOCK and self.hash_of[b] is None and hashes[i] not in self._by_hash:
                # A block computed twice (two sequences admitted together) keeps the first copy's
                # address; the second stays private and is freed without cached content.
                self._register(b, hashes[i])
                if self.disk is not None and not self.disk.contains(hashes[i]):
                    # Written through: the copy runs before the next pass, which is the first that could
                    # overwrite the block (it is ours until then).
                    self._copies.append(BlockCopy("spill", b, key=hashes[i]))
                    self.stats.blocks_spilled += 1

    def free(self, seq: PagedSequence) -> None:
        """Release every block of a sequence. Blocks are released tail first, so among equally old
        cached blocks the tail of a sequence is evicted before the prefix other requests share."""
        for b in reversed(seq.block_table):
            if b != NULL_BLOCK:
                self._release(b)
        seq.block_table.clear()

    def release_before(self, seq: PagedSequence, position: int) -> None:
        """A sliding-window layer's blocks wholly before `position` (the first key any later query of
        the sequence can see) go back to the pool, cached content and all; their entries become
        NULL_BLOCK. Released blocks are always a leading run, so the walk stops at the first null."""
        table = seq.block_table
        for i in range(min(position // self.block_size, len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            self._release(table[i])
            table[i] = NULL_BLOCK

    def _release(self, b: int) -> None:
        self.ref_count[b] -= 1
        assert self.ref_count[b] >= 0
        if self.ref_count[b] == 0:
            if self.hash_of[b] is None:
                self._free.append(b)
            else:
                self._evictable[b] = None

    def take_copies(self) -> list[BlockCopy]:
        """The queued pool-to-pool copies, in the order they must run (before the next forward)."""
        copies, self._copies = self._copies, []
        return copies

    def telemetry(self, bytes_swapped_out: int, bytes_swapped_in: int, preemptions: int) -> KVTelemetry:
        """The snapshot, with the bytes the KV cache actually copied between the tiers."""
        s, host = self.stats, self.host
        return KVTelemetry(
            block_size=self.block_size, blocks_total=self.num_blocks, blocks_used=self.num_used_blocks,
            blocks_cached=self.num_cached_blocks, host_blocks_total=host.num_blocks if host else 0,
            host_blocks_used=len(host.by_hash) if host else 0, prefix_caching=self.enable_prefix_caching,
            queried_tokens=s.queried_tokens, hit_tokens=s.hit_tokens, host_hit_tokens=s.host_hit_tokens,
            blocks_swapped_out=s.blocks_swapped_out, blocks_swapped_in=s.blocks_swapped_in,
            bytes_swapped_out=bytes_swapped_out, bytes_swapped_in=bytes_swapped_in, preemptions=preemptions,
            disk_hit_tokens=s.disk_hit_tokens, blocks_spilled=s.blocks_spilled)

    def check(self) -> None:
        """Internal consistency (tests call it after every step): every block is exactly one of
        in use, free, or free-with-cached-content; addresses and blocks agree."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for b in range(self.num_blocks):
            in_use = self.ref_count[b] > 0
            assert in_use + (b in free) + (b in evictable) == 1, f"block {b} is lost or double-counted"
            if b in free:
                assert self.hash_of[b] is None
            if b in evictable:
                assert self.hash_of[b] is not None
        assert all(self.hash_of[b] == h for h, b in self._by_hash.items())
        assert sum(h is not None for h in self.hash_of) == len(self._by_hash)

    # -- internals -------------------------------------------------------------------------------
    def _share(self, b: int) -> None:
        if self.ref_count[b] == 0:
            del self._evictable[b]
        self.ref_count[b] += 1

    def _register(self, b: int, h: bytes) -> None:
        self.hash_of[b] = h
        self._by_hash[h] = b

    def _take(self) -> int:
        """A block for new content, owned once: never-cached first, else evict the LRU cached one."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._evict(b)
        self.ref_count[b] = 1
        return b

    def _evict(self, b: int) -> None:
        h = self.hash_of[b]
        self.hash_of[b] = None
        del self._by_hash[h]
        self.stats.evictions += 1
        if self.host is None:
            return
        hb = self.host.by_hash.get(h)
        if hb is not None:  # the host still holds this content (it was swapped in from there)
            self.host.touch(hb)
            return
        hb = self.host.take()
        if hb is None:
            return
        self.host.by_hash[h] = hb
        self.host.hash_of[hb] = h
        self._copies.append(BlockCopy("out", b, hb))
        self.stats.blocks_swapped_out += 1
