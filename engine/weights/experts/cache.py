"""The device expert cache: a fixed number of expert slots, filled by a fetch thread, evicted LRU.

Keys are (block, expert). A slot is in one of three states:
  loading  its fill is queued or running on the fetch thread (never evicted: the thread writes it)
  pinned   compute holds it for the group being computed (never evicted: kernels read it)
  ready    filled and unpinned: an eviction candidate, in least-recently-used order
Eviction policy: LRU over the ready slots of every block together (one pool, not one per block: a
block whose tokens agree on few experts leaves room to the blocks that need more). A slot becomes
most recently used when compute releases it or a prefetch fill completes.

Two queues feed the fetch thread: demand fills (experts the current block needs now) are always
taken before prefetch fills (guesses for the next block), so a wrong guess never delays a step by
more than the one fill in progress. A prefetch that compute then asks for is re-queued as demand.

Thread roles: reserve/release/prefetch run on the compute thread, fills on the fetch thread; one
lock covers the bookkeeping, with two conditions on it (fills queued, for the fetch thread; slots
filled or freed, for compute), and the fill itself (the byte copy) runs unlocked.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..transports.exit_stop import close_at_exit, closed

Key = tuple[int, int]  # (block, expert)


@dataclass
class _Fill:
    key: Key
    slot: int
    prefetch: bool  # a guess; becomes False when compute asks for it before it is filled


@dataclass(frozen=True)
class ExpertCacheStats:
    """Counters since the cache was made (the telemetry snapshot carries them per step and in total)."""

    hits: int = 0  # experts compute asked for that were cached or already being fetched by a prefetch
    misses: int = 0  # experts fetched on demand
    fills: int = 0  # slot fills done (demand + prefetch)
    fill_bytes: int = 0  # bytes those fills moved into the cache
    fill_seconds: float = 0.0  # fetch thread busy filling
    prefetch_fills: int = 0  # fills started by a guess
    prefetch_used: int = 0  # of those, experts compute then asked for before they were evicted
    wait_seconds: float = 0.0  # compute thread waiting for fills


class ExpertCache:
    def __init__(self, slots: int, fill: Callable[[Key, int], int]):
        """fill(key, slot) writes expert `key` into slot `slot` and returns the bytes it moved."""
        if slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {slots}")
        self.slots = slots
        self._fill_fn = fill
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # slots filled or freed: what the compute thread waits for
        # Fills queued or stop: what the fetch thread waits for. Its own condition, so that compute
        # releasing a group (every MoE block) does not wake the fetch thread for nothing: on a busy
        # host every wake-up costs the compute thread a GIL hand-over.
        self._work = threading.Condition(self._lock)
        self._slot_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))
        self._lru: OrderedDict[Key, None] = OrderedDict()  # ready and unpinned, oldest first
        self._pins: dict[Key, int] = {}
        self._loading: dict[Key, _Fill] = {}
        self._unused_prefetch: set[Key] = set()  # prefetched, not asked for yet
        self._errors: dict[Key, BaseException] = {}  # failed demand fills, for the waiter to raise
        self._demand: list[_Fill] = []
        self._prefetch: list[_Fill] = []
        self._filling: _Fill | None = None  # the fill the fetch thread is on
        self._stats = ExpertCacheStats()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="layerstream-experts", daemon=True)
        self._thread.start()
        close_at_exit(self)

    @property
    def stats(self) -> ExpertCacheStats:
        return self._stats

    def cached(self, key: Key) -> bool:
        with self._lock:
            return key in self._slot_of

    # -- compute thread ----------------------------------------------------------------------------
    def acquire(self, keys: list[Key]) -> dict[Key, int]:
        """reserve() then wait(): the keys pinned and filled, key -> slot."""
        self.reserve(keys)
        return self.wait(keys)

    def reserve(self, keys: list[Key]) -> None:
        """Pin every key (at most `slots` of them) and queue fills of the missing ones as demand, without
        waiting for them (prefetches queued next start right after). May wait for a slot to free up
        when prefetch fills in flight hold every unpinned one."""
        if len(keys) > self.slots:
            raise ValueError(f"{len(keys)} experts asked for at once, the cache holds {self.slots}")
        hits = misses = used = 0
        with self._lock:
            for key in keys:  # hits first: a miss must never evict an expert this same group needs
                if key in self._slot_of:
                    hits += 1
                    pending = self._loading.get(key)
                    used += key in self._unused_prefetch or (pending is not None and pending.prefetch)
                    self._unused_prefetch.discard(key)
                    self._pin(key)
                    if pending is not None and pending.prefetch:
                        # asked for now: ahead of every remaining guess
                        pending.prefetch = False
                        if pending in self._prefetch:
                            self._prefetch.remove(pending)
                            self._demand.append(pending)
            for key in keys:
                if key not in self._slot_of:
                    misses += 1
                    self._start_fill(key, self._take_slot_locked(), prefetch=False)
                    self._pin(key)
            self._stats = _bump(self._stats, hits=hits, misses=misses, prefetch_used=used)
            if self._demand:
                self._work.notify()

    def wait(self, keys: list[Key]) -> dict[Key, int]:
        """Wait until every (reserved) key is filled: key -> slot. A failed fill raises, unpinning the keys."""
        t0 = time.perf_counter()
        with self._lock:
            while any(k in self._loading for k in keys):
                self._changed.wait()
            self._stats = _bump(self._stats, wait_seconds=time.perf_counter() - t0)
            failed = [k for k in keys if k not in self._slot_of]
            error = self._errors.pop(failed[0], None) if failed else None
            for k in failed[1:]:
                self._errors.pop(k, None)
            if failed and error is None:
                error = RuntimeError(f"expert {failed[0]} was dropped before it was filled")
            slots = None if error is not None else {k: self._slot_of[k] for k in keys}
        if error is not None:
            self.release(keys)
            raise RuntimeError(f"fetching an expert failed: {error}") from error
        return slots

    def release(self, keys: list[Key]) -> None:
        """Compute is done with these: they become the most recently used eviction candidates."""
        with self._lock:
            for key in keys:
                n = self._pins.get(key, 0) - 1
                if n > 0:
                    self._pins[key] = n
                    continue
                self._pins.pop(key, None)
                if key in self._slot_of and key not in self._loading:
                    self._lru[key] = None
                    self._lru.move_to_end(key)
            self._changed.notify_all()

    def prefetch(self, keys: list[Key]) -> int:
        """Start fetching guessed experts into slots nothing needs now (only ready, unpinned ones are
        evicted; none is waited for). Returns how many fills were queued."""
        queued = 0
        with self._lock:
            for key in keys:
                if key in self._slot_of:
                    continue
                slot = self._take_slot_locked(wait=False)
                if slot is None:
                    break
                self._start_fill(key, slot, prefetch=True)
                queued += 1
            if queued:
                self._stats = _bump(self._stats, prefetch_fills=queued)
                self._work.notify()
        return queued

    def drop_prefetches(self) -> None:
        """Forget queued guesses (a step failed half-way; the cache itself stays valid), and wait for a guess
        already being filled: nothing moves on the old step's behalf after this returns, so what the next step
        counts (fill bytes) is its own."""
        with self._lock:
            for f in self._prefetch:
                self._forget(f.key)
            self._prefetch.clear()
            self._changed.notify_all()
            while self._filling is not None and self._filling.prefetch and not self._stop:
                self._changed.wait()

    def close(self) -> None:
        closed(self)
        with self._lock:
            self._stop = True
            self._work.notify_all()
            self._changed.notify_all()
        self._thread.join()

    # -- bookkeeping (lock held) ---------------------------------------------------------------------
    def _pin(self, key: Key) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        self._lru.pop(key, None)

    def _take_slot_locked(self, wait: bool = True) -> int | None:
        """A free slot, else the least recently used ready one; waits for one (wait) or gives None."""
        while True:
            if self._free:
                return self._free.pop()
            if self._lru:
                victim, _ = self._lru.popitem(last=False)
                self._unused_prefetch.discard(victim)
                slot = self._slot_of.pop(victim)
                self._key_of[slot] = None
                return slot
            if not wait:
                return None
            if not self._loading:
                raise RuntimeError("expert cache: every slot is pinned")  # a caller pinned more than it released
            self._changed.wait()

    def _start_fill(self, key: Key, slot: int, prefetch: bool) -> _Fill:
        fill = _Fill(key, slot, prefetch)
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._loading[key] = fill
        (self._prefetch if prefetch else self._demand).append(fill)
        return fill

    def _forget(self, key: Key) -> None:
        slot = self._slot_of.pop(key)
        self._key_of[slot] = None
        self._loading.pop(key, None)
        self._unused_prefetch.discard(key)
        self._free.append(slot)

    # -- fetch thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._demand and not self._prefetch:
                    self._work.wait()
                if self._stop:
                    return
                fill = self._demand.pop(0) if self._demand else self._prefetch.pop(0)
                self._filling = fill
            t0 = time.perf_counter()
            nbytes, error = 0, None
            try:
                nbytes = self._fill_fn(fill.key, fill.slot)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread that waits for it
                error = e
            with self._lock:
                self._filling = None
                self._loading.pop(fill.key, None)
                if error is not None:  # the slot holds nothing usable: forget the key (a waiter gets the error)
                    if not fill.prefetch:
                        self._errors[fill.key] = error
                    self._slot_of.pop(fill.key, None)
                    self._key_of[fill.slot] = None
                    self._free.append(fill.slot)
                elif fill.key not in self._pins:
                    self._lru[fill.key] = None  # a completed guess: most recently used
                    if fill.prefetch:
                        self._unused_prefetch.add(fill.key)
                self._stats = _bump(self._stats, fills=1, fill_bytes=nbytes,
                                    fill_seconds=time.perf_counter() - t0)
                self._changed.notify_all()


def _bump(s: ExpertCacheStats, **add) -> ExpertCacheStats:
    """A new immutable record: a reader on another thread sees one state or the next, never a mix."""
    return ExpertCacheStats(**{k: getattr(s, k) + add.get(k, 0) for k in ExpertCacheStats.__dataclass_fields__})
