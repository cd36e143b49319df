"""The streamer's contract, with a fake transport: order, bounded tickets, failures, reset."""

import threading
import time

import pytest
import torch

from engine.weights.transports.streamer import BlockStreamer
from engine.weights.transports.base import Ticket, Transport


class CountingTransport(Transport):
    def __init__(self, fail_on=None, delay=0.0):
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.outstanding = 0
        self.max_outstanding = 0
        self.prepared: list[int] = []
        self.fail_on = fail_on
        self.delay = delay
        self.lock = threading.Lock()

    def resident(self, block):
        return {"w": torch.full((2,), float(block))}

    def prepare(self, block):
        if block == self.fail_on:
            raise OSError("disk on fire")
        time.sleep(self.delay)
        with self.lock:
            self.outstanding += 1
            self.max_outstanding = max(self.max_outstanding, self.outstanding)
            self.prepared.append(block)
        return Ticket(block, {"w": torch.full((2,), float(block))}, nbytes=8)

    def retire(self, ticket):
        with self.lock:
            self.outstanding -= 1


def run_steps(streamer, num_layers, steps):
    seen = []
    for _ in range(steps):
        for i in range(num_layers):
            w = streamer.acquire(i)
            seen.append(int(w["w"][0]))
            streamer.release(i)
    return seen


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_blocks_arrive_in_order_and_at_most_depth_plus_one_exist(depth):
    t = CountingTransport(delay=0.001)
    s = BlockStreamer(t, resident=[0, 3], streamed=[1, 2, 4, 5], depth=depth)
    try:
        assert run_steps(s, 6, 5) == list(range(6)) * 5
        assert t.max_outstanding <= depth + 1
        assert s.stats.blocks_streamed == 4 * 5 and s.stats.bytes_streamed == 8 * 20
    finally:
        s.close()
    assert t.outstanding == 0  # everything prepared was retired


def test_prefetcher_runs_ahead_while_compute_holds_a_block():
    t = CountingTransport()
    s = BlockStreamer(t, resident=[], streamed=[0, 1, 2], depth=2)
    try:
        s.acquire(0)
        deadline = time.time() + 5
        while len(t.prepared) < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert t.prepared == [0, 1, 2]  # blocks 1 and 2 were prepared while 0 was in use
        time.sleep(0.05)
        assert len(t.prepared) == 3  # and no further: depth bounds it
        s.release(0)
    finally:
        s.close()


def test_prepare_failure_surfaces_on_acquire_and_reset_recovers():
    t = CountingTransport(fail_on=2)
    s = BlockStreamer(t, resident=[0], streamed=[1, 2], depth=1)
    try:
        s.acquire(1)
        s.release(1)
        with pytest.raises(RuntimeError, match="streaming block 2 failed: disk on fire"):
            s.acquire(2)
        t.fail_on = None
        s.reset()
        assert run_steps(s, 3, 2) == [0, 1, 2, 0, 1, 2]
    finally:
        s.close()


def test_out_of_order_acquire_is_an_error():
    t = CountingTransport()
    s = BlockStreamer(t, resident=[], streamed=[0, 1], depth=1)
    try:
        with pytest.raises(RuntimeError, match="out of order"):
            s.acquire(1)
    finally:
        s.close()


def test_failed_load_stops_the_prefetch_thread(llama_dir, monkeypatch):
    """A load that fails after the streamer started must not leave its thread running."""
    import engine.loader as loader
    from engine import LLM

    class NoRoomKVCache(loader.KVCache):
        def __init__(self, *a, **kw):
            raise RuntimeError("no room for the KV cache")

    from tests.support.reference import stream_all_but_one_budget

    probe = LLM(str(llama_dir), max_model_len=64, max_num_seqs=1)
    budget = stream_all_but_one_budget(probe)
    probe.close()
    monkeypatch.setattr(loader, "KVCache", NoRoomKVCache)
    before = {t for t in threading.enumerate() if t.name == "layerstream-prefetch"}
    with pytest.raises(RuntimeError, match="no room"):
        LLM(str(llama_dir), max_model_len=64, max_num_seqs=1, max_device_memory=budget)
    assert {t for t in threading.enumerate() if t.name == "layerstream-prefetch"} == before


def test_cpu_transport_makes_a_blocks_views_once_and_lets_go_at_close(llama_dir):
    """Zero-copy streamed blocks: the views of the mapping are made on the first prepare and reused every
    step after (making and freeing them each step cost ~1-2 ms); close() drops them, so the mapping can
    be unmapped when the checkpoint closes."""
    import gc
    import weakref

    from engine.weights.model_weights import ModelCheckpoint
    from engine.weights.transports.cpu import CpuTransport

    ckpt = ModelCheckpoint(llama_dir)
    try:
        views = ckpt.source.views(0)
        dtype = next(iter(views.values())).dtype
        transport = CpuTransport(ckpt.source, dtype)
        first = transport.prepare(0)
        w1 = first.weights
        transport.retire(first)
        second = transport.prepare(0)
        assert all(second.weights[k] is w1[k] for k in w1)  # the same tensors, not remade
        assert all(torch.equal(second.weights[k], views[k]) for k in views)
        transport.retire(second)
        watched = weakref.ref(w1["wq"])
        del first, second, w1, views
        transport.close()
        gc.collect()
        assert watched() is None  # nothing of the transport's still views the mapping
    finally:
        ckpt.close()


EXIT_WITHOUT_CLOSE = """
import sys, time, torch
from engine.weights.experts.cache import ExpertCache
from engine.weights.transports.streamer import BlockStreamer
from engine.weights.transports.base import Ticket, Transport

a = torch.randn(1024, 1024)


def busy():  # native code with the GIL released, as a GGUF repack or a copy is
    for _ in range(20):
        a @ a


class BusyTransport(Transport):
    dtype, device = torch.float32, torch.device("cpu")

    def resident(self, block):
        return {}

    def prepare(self, block):
        busy()
        return Ticket(block, {"w": a}, nbytes=0)

    def retire(self, ticket):
        pass


if sys.argv[1] == "streamer":
    BlockStreamer(BusyTransport(), resident=[], streamed=[0, 1, 2], depth=2)
else:
    cache = ExpertCache(2, lambda key, slot: busy() or 0)
    cache.reserve([(0, 0), (0, 1)])
time.sleep(0.3)  # the background thread is inside a matmul now; exit without close()
"""


@pytest.mark.parametrize("owner", ["streamer", "expert_cache"])
def test_exit_without_close_stops_the_background_thread(tmp_path, owner):
    """A daemon thread inside native code while the interpreter tears down aborts the process
    ("terminate called without an active exception", 134); the exit hook closes the owner first."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit.py"
    script.write_text(EXIT_WITHOUT_CLOSE)
    out = subprocess.run([sys.executable, str(script), owner], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
