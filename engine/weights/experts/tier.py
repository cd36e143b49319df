"""The expert-granular tier: each routed expert of a mixture is its own streaming unit.

Blocks stream (or stay resident) without their experts, following the block plan; an expert reaches
compute only when a token of the step chose it, read by byte range from the original checkpoint
into a slot of the device expert cache (cache.ExpertCache: LRU, one pool for every block).
Per block and step the union of the experts chosen by all the batch's tokens is fetched once.

Keeping routing -> fetch off the critical path: a block's routing is known only after its attention,
so a miss would stall compute for a whole fetch. While block l computes, the tier guesses block
l+1's experts by running l+1's router (and its post-attention norm, both kept on the device for
this, `predictor_bytes` in the plan) on block l's post-attention hidden state, and queues those
fetches behind l's own misses; consecutive blocks' residual streams are close, so most guesses
hold. Accuracy is measured (StreamStats.prefetch_accuracy), never assumed. The router itself is the
model's math, which the runner passes in (`Router`): the tier holds only its weights.

Where an expert's bytes come from (`ExpertReader`): the page cache (zero-copy views when the dtype
matches, as the CPU transport serves blocks; else copied, converting the dtype), the disk (O_DIRECT reads of the expert's byte ranges, the disk tier), or either behind a
simulated slow link (the CUDA stand-in on CPU). Where the cache's slots live (`slots`): host memory
when the device is the CPU (`HostExpertSlots`), or device memory filled from pinned staging on a copy
stream and ordered by events (`cuda_slots.CudaExpertSlots`); the tier tells the slots when compute
starts reading a group (activate) and when its kernels were issued (retire), before the cache may
evict them. A packed checkpoint's (GGUF) experts move as stored: into a GPU's slots as GGML bytes (packed.py,
computed as GGUFWeight), or on a CPU device as the packed forms its CPU path already holds (ExpertReader.forms).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ...arch import ModelConfig
from ..transports.disk_reader import DiskReader, StagingBuffer, plan_reads
from .cache import ExpertCache, ExpertCacheStats, Key
from ..formats.safetensors_index import MADV_POPULATE_READ
from ..formats.block_source import BlockSource
from ..transports.streamer import StreamStats
from ..transports.base import DISK, HOST

if TYPE_CHECKING:
    from .cuda_slots import CudaExpertSlots

PREDICTOR = ("mlp_norm", "router", "router_bias")  # what the guess of a block's experts reads
# The model's router for a guess: (hidden (tokens, hidden), {"mlp_norm", "router"[, "router_bias"]} of a MoE block)
# -> the experts it would choose, (tokens, top_k) int64.
Router = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


class ExpertReader:
    """One expert's bytes from the page cache: copied (converting the dtype) into cache tensors (read),
    or handed over as zero-copy views (map); either returns the bytes moved in the compute dtype."""

    tier = HOST

    def __init__(self, source: BlockSource, seconds_per_byte: float = 0.0,
                 forms: Callable[[Key], dict[str, object]] | None = None, forms_moved: bool = False):
        """forms(key): the expert in the CPU kernels' form where host memory already holds it (a packed
        checkpoint's experts off the device: views of the prepacked entry, or made once at load for the CPU
        path): on a CPU device a fill hands those over (map), and only their bytes cross the (simulated) link:
        the forms' own bytes where they are what is stored (forms_moved: the prepacked entry's parts, which the
        planner priced the group at), else the file's stored bytes."""
        self.source = source
        self.seconds_per_byte = seconds_per_byte  # > 0: behind a simulated link
        self.forms = forms
        self.forms_moved = forms_moved
        self.disk_bytes = 0
        self.disk_seconds = 0.0

    def views(self, key: Key) -> dict[str, torch.Tensor]:
        """The expert's tensors as stored (a packed one as its rows of bytes), its pages faulted in with one
        call: copying them out one 4 KiB fault at a time would make the fill, not the link, the slow part (as
        for a streamed block)."""
        self.source.advise_expert(*key, MADV_POPULATE_READ)
        return self.source.expert_stored(*key)

    def read(self, key: Key, out: dict[str, torch.Tensor]) -> int:
        t0 = time.perf_counter()
        views = self.views(key)
        for k, v in views.items():
            out[k].copy_(v)
        n = sum(o.numel() * o.element_size() for o in out.values())
        self._link(t0, n)
        return n

    def zero_copy(self, dtype: torch.dtype) -> bool:
        """Compute can read the experts where they lie: the page cache, already in the compute dtype, or the
        host's packed forms (forms)."""
        if self.forms is not None:
            return True
        blocks = self.source.expert_blocks()
        return bool(blocks) and all(t.dtype == dtype for t in self.source.expert_tensors(blocks[0], 0).values())

    def map(self, key: Key) -> tuple[dict[str, torch.Tensor], int]:
        """The expert as zero-copy views of the page cache, its pages faulted in ahead of compute (as the
        CPU transport does for a streamed block), and the bytes that crossed the (simulated) link."""
        t0 = time.perf_counter()
        if self.forms is not None:
            views = self.forms(key)
            if self.forms_moved:  # the entry's parts (codes and scales), what the planner priced the group at
                n = sum(v.nbytes for v in views.values())
            else:  # the packed tensors' stored bytes (what the planner priced the group at), plain ones as held
                n = sum(t.nbytes if t.quant is not None else views[k].numel() * views[k].element_size()
                        for k, t in self.source.expert_tensors(*key).items())
        else:
            views = self.views(key)
            n = sum(v.numel() * v.element_size() for v in views.values())
        self._link(t0, n)
        return views, n

    def _link(self, t0: float, n: int) -> None:
        """Behind a simulated link: the fill takes at least n bytes' link time from t0 (a sleep)."""
        if self.seconds_per_byte:
            deadline = t0 + n * self.seconds_per_byte
            while (left := deadline - time.perf_counter()) > 0:
                time.sleep(left)

    def close(self) -> None:
        pass


class DiskExpertReader(ExpertReader):
    """The disk tier for experts: each expert's byte ranges read with O_DIRECT (no page cache)."""

    tier = DISK

    def __init__(self, source: BlockSource, seconds_per_byte: float = 0.0):
        super().__init__(source, seconds_per_byte)
        self._reader = DiskReader(source.files)
        blocks = source.expert_blocks()
        self._plans = {(b, e): plan_reads(source.expert_tensors(b, e))
                       for b in blocks for e in range(source.num_experts(b))}
        self._buf = StagingBuffer(max(p.buffer_bytes for p in self._plans.values()))

    def zero_copy(self, dtype: torch.dtype) -> bool:
        return False  # the bytes land in one reused read buffer

    def views(self, key: Key) -> dict[str, torch.Tensor]:
        plan = self._plans[key]
        t0 = time.perf_counter()
        self.disk_bytes += self._reader.read(plan, self._buf)
        self.disk_seconds += time.perf_counter() - t0
        return plan.views(self._buf)

    def close(self) -> None:
        self._reader.close()


class HostExpertSlots:
    """The cache's slots in host memory (the device is the CPU). Experts already in the page cache in the
    compute dtype are not copied at all: a slot holds zero-copy views of the mapped file, as a streamed
    block on the CPU does, and its fill only faults the pages in (and crosses the simulated link); so are a
    packed checkpoint's, whose slots hold the forms the host made once for the CPU path (ExpertReader.forms).
    Otherwise (a dtype to convert, or the disk tier's O_DIRECT reads) a slot is a buffer the fill
    copies into."""

    host_bytes = 0  # no pinned memory

    def __init__(self, slots: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                 reader: ExpertReader):
        self.reader, self.count = reader, slots
        self.zero_copy = reader.zero_copy(dtype)
        self._held: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]  # zero-copy: slot -> views
        # (slots, *shape) per expert tensor: slot s of every tensor together is one expert
        self.buffers = {} if self.zero_copy else {
            k: torch.empty((slots, *shape), dtype=dtype, device=device) for k, shape in shapes.items()}

    def fill(self, key: Key, slot: int) -> int:
        if not self.zero_copy:
            return self.reader.read(key, self.weights(slot))
        views, n = self.reader.map(key)
        self._held[slot] = views  # replaced whole: compute never holds this slot while it is filled
        return n

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        if self.zero_copy:
            return self._held[slot]
        return {k: b[slot] for k, b in self.buffers.items()}

    def activate(self, slots: list[int]) -> None:
        pass  # the copy finished before the fill returned

    def retire(self, slots: list[int]) -> None:
        pass  # CPU kernels are done when they return

    def close(self) -> None:
        self._held = []


class ExpertTier:
    def __init__(self, cfg: ModelConfig, source: BlockSource, dtype: torch.dtype, device: torch.device,
                 slots: "HostExpertSlots | CudaExpertSlots", guess: bool = True):
        """`slots` (built for the cache's slot count, owning the reader) is owned by the tier from here on.
        guess=False: no guess of the next block's experts (no predictor weights either): the offload tier's
        experts, whose next block may compute on the CPU, where a guessed fill would move bytes for nothing."""
        m = cfg.moe
        self.cfg, self.dtype, self.slots, self.reader = cfg, dtype, slots, slots.reader
        self.sparse = list(m.sparse_layers) if guess else []
        self.next_sparse = {b: n for b, n in zip(self.sparse, self.sparse[1:])}
        self.cache = None
        try:
            # The guesser's weights: each sparse block's router (and its bias, GPT-OSS) and post-attention
            # norm (predictor_bytes).
            self.predictor: dict[int, dict[str, torch.Tensor]] = {}
            # only these tensors' views: a packed checkpoint's (GGUF) other tensors have none
            predictor = source.select(lambda _b, short: short in PREDICTOR)
            for b in self.sparse:
                views = predictor.views(b)
                self.predictor[b] = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in views.items()}
            self.cache = ExpertCache(slots.count, slots.fill)
        except BaseException:
            self.close()
            raise
        self._guess: dict[int, set[int]] = {}  # block -> experts guessed for it this step
        self.predicted = self.predicted_right = self.needed_with_guess = 0

    def groups(self, block: int, chosen: list[int], hidden: torch.Tensor, router: Router
               ) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """Block `block`'s chosen experts, as many per group as the cache holds (one group unless the
        batch chose more experts than there are slots). Each group stays pinned until the next is asked for.
        router(hidden, the next MoE block's predictor weights) guesses that block's experts."""
        guess = self._guess.pop(block, None)
        if guess is not None:
            self.needed_with_guess += len(chosen)
            self.predicted_right += len(guess.intersection(chosen))
        keys = [(block, e) for e in chosen]
        # cached experts first: the first group then waits for the fewest fills
        keys.sort(key=lambda k: not self.cache.cached(k))
        slots = self.cache.slots
        groups = [keys[i:i + slots] for i in range(0, len(keys), slots)] or [[]]
        for group in groups:
            self.cache.reserve(group)
            if len(groups) == 1:
                # queued behind this group's misses, fetched while it computes
                self._prefetch_next(block, hidden, router)
            where = self.cache.wait(group)
            held = [where[k] for k in sorted(group)]
            self.slots.activate(held)
            try:
                # ascending expert order, as whole-block streaming adds them: in bf16 the sum's order
                # shows in the last bits, and both modes then give the same tokens
                yield {e: self.slots.weights(where[(b, e)]) for b, e in sorted(group)}
            finally:
                # retire before release: once released the cache may refill a slot, and that copy must
                # wait (on the device) for the kernels just issued on it
                self.slots.retire(held)
                self.cache.release(group)

    def _prefetch_next(self, block: int, hidden: torch.Tensor, router: Router) -> None:
        nxt = self.next_sparse.get(block)
        if nxt is None:
            return
        guess = sorted(set(router(hidden, self.predictor[nxt]).flatten().tolist()))
        self._guess[nxt] = set(guess)
        self.predicted += len(guess)
        self.cache.prefetch([(nxt, e) for e in guess])

    def reset(self) -> None:
        self._guess.clear()
        self.cache.drop_prefetches()

    @property
    def stats(self) -> StreamStats:
        """What the tier did, as StreamStats counters (expert bytes counted by tier too)."""
        c: ExpertCacheStats = self.cache.stats
        disk = self.reader.tier == DISK
        return StreamStats(
            host_tier_bytes=0 if disk else c.fill_bytes, disk_tier_bytes=c.fill_bytes if disk else 0,
            disk_bytes_read=self.reader.disk_bytes, stall_seconds=c.wait_seconds, prepare_seconds=c.fill_seconds,
            disk_read_seconds=self.reader.disk_seconds, expert_bytes=c.fill_bytes, expert_hits=c.hits,
            expert_misses=c.misses, experts_guessed=self.predicted, experts_guessed_right=self.predicted_right,
            experts_needed_guessed=self.needed_with_guess)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory the tier holds (CUDA staging)."""
        return self.slots.host_bytes

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()  # the fetch thread first: nothing fills a slot after this
            self.cache = None
        self.slots.close()
        self.reader.close()
