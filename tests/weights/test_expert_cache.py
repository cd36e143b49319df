"""The expert cache's bookkeeping: LRU eviction, pinned and loading slots never evicted, demand before
prefetch, fill errors reach the waiter. Fills write a slot's key into a list: no model needed."""

import threading

import pytest

from engine.weights.experts.cache import ExpertCache


class Slots:
    """A fill function that records which key each slot holds (and can be held back or made to fail)."""

    def __init__(self, n):
        self.held = [None] * n
        self.order = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a fill has started
        self.fail = set()

    def __call__(self, key, slot):
        self.entered.set()
        self.gate.wait()
        if key in self.fail:
            raise OSError(f"cannot read {key}")
        self.held[slot] = key
        self.order.append(key)
        return 100


@pytest.fixture
def cache():
    made = []

    def make(n):
        slots = Slots(n)
        c = ExpertCache(n, slots)
        made.append(c)
        return c, slots

    yield make
    for c in made:
        c.close()


def use(c, keys):
    where = c.acquire(keys)
    c.release(keys)
    return where


def test_hits_misses_and_lru_eviction(cache):
    c, slots = cache(3)
    use(c, [(0, 1), (0, 2), (0, 3)])
    use(c, [(0, 1)])  # (0, 2) is now the least recently used
    where = use(c, [(1, 5)])
    assert not c.cached((0, 2)) and c.cached((0, 1)) and c.cached((0, 3))
    assert slots.held[where[(1, 5)]] == (1, 5)
    s = c.stats
    assert (s.hits, s.misses, s.fills, s.fill_bytes) == (1, 4, 4, 400)


def test_pinned_experts_are_never_evicted(cache):
    c, slots = cache(2)
    c.acquire([(0, 0)])  # held by compute
    use(c, [(0, 1)])
    use(c, [(0, 2)])  # must evict (0, 1), not the pinned (0, 0)
    assert c.cached((0, 0)) and not c.cached((0, 1))
    with pytest.raises(ValueError, match="3 experts asked for at once, the cache holds 2"):
        c.acquire([(1, 0), (1, 1), (1, 2)])
    c.release([(0, 0)])


def test_prefetch_fills_free_slots_only_and_counts_use(cache):
    c, slots = cache(3)
    c.acquire([(0, 0), (0, 1)])  # pinned
    assert c.prefetch([(1, 3), (1, 4)]) == 1  # one unpinned slot left
    where = c.acquire([(1, 3)])  # the guess was right
    assert slots.held[where[(1, 3)]] == (1, 3)
    c.release([(0, 0), (0, 1), (1, 3)])
    s = c.stats
    assert (s.prefetch_fills, s.prefetch_used, s.hits, s.misses) == (1, 1, 1, 2)


def test_demand_fills_go_before_queued_guesses(cache):
    c, slots = cache(4)
    slots.gate.clear()  # hold the fetch thread so the queue builds up
    c.prefetch([(2, 0), (2, 1)])
    c.reserve([(3, 7)])
    slots.gate.set()
    c.wait([(3, 7)])
    c.release([(3, 7)])
    use(c, [(2, 0), (2, 1)])
    # the first guess may already have been taken when the gate closed; the demand beats the second
    assert slots.order.index((3, 7)) < slots.order.index((2, 1))


def test_a_failed_fill_raises_and_leaves_no_bad_slot(cache):
    c, slots = cache(2)
    slots.fail.add((0, 1))
    with pytest.raises(RuntimeError, match=r"fetching an expert failed: cannot read \(0, 1\)"):
        c.acquire([(0, 0), (0, 1)])
    assert not c.cached((0, 1))
    slots.fail.clear()
    where = use(c, [(0, 0), (0, 1)])  # both slots usable again
    assert sorted(where.values()) == [0, 1]


def test_dropping_guesses_waits_for_the_one_being_filled(cache):
    """A reset (drop_prefetches) forgets queued guesses and returns only once a guess already being filled is done,
    so no fill of the old step lands in the next step's counters."""
    c, slots = cache(4)
    slots.gate.clear()
    assert c.prefetch([(1, 0), (1, 1)]) == 2  # the fetch thread takes (1, 0) and blocks in the fill
    assert slots.entered.wait(5)
    dropped = threading.Thread(target=c.drop_prefetches, daemon=True)
    dropped.start()
    dropped.join(0.2)
    waited = dropped.is_alive()  # waiting for the guess in flight
    slots.gate.set()  # before any assertion: the fixture's close() joins the fetch thread
    assert waited
    dropped.join(5)
    assert not dropped.is_alive()
    s = c.stats
    assert (s.fills, s.fill_bytes) == (1, 100)  # the one in flight, done; the queued one forgotten
    assert c.cached((1, 0)) and not c.cached((1, 1))
