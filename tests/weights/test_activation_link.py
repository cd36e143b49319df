"""The activations' link (engine/weights/transports/activations.py, issue #38): on a GPU the tensors a CPU-computed
group needs cross in pinned staging on a copy stream, ordered by events (replayed on CPU by the recording runtime,
proved by check_activations); elsewhere they cross with .to(), behind the simulated link at its rate."""

from __future__ import annotations

import time

import pytest
import torch

from engine.weights.transports.activations import HostLink
from tests.support.cuda_replay import check_activations, record_activation_links

HIDDEN, TOP_K = 64, 2


@pytest.fixture
def link(monkeypatch):
    import engine.weights.transports.activations as act

    made = record_activation_links(monkeypatch)
    link = act.CudaActivationLink(torch.device("cpu"), 4 * (HIDDEN * 4 + TOP_K * 12) + 3 * 256)
    assert made == [link]
    yield link
    link.close()


def crossing(link, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """One round trip as the CPU path makes it: hidden states and routing there, their sum back."""
    g = torch.Generator().manual_seed(seed)
    hn = torch.randn(tokens, HIDDEN, generator=g)  # (tokens, hidden)
    ids = torch.randint(0, 8, (tokens, TOP_K), generator=g)  # (tokens, top_k) int64
    gates = torch.rand(tokens, TOP_K, generator=g)  # (tokens, top_k) fp32
    x, i, w = link.to_host(hn, ids, gates).wait()
    assert torch.equal(x, hn) and torch.equal(i, ids) and torch.equal(w, gates)
    out = link.to_device(x * 2 + w.sum(-1, keepdim=True), hn)  # (tokens, hidden)
    assert torch.equal(out, hn * 2 + gates.sum(-1, keepdim=True))
    return hn, ids, gates


def test_crossings_keep_their_values_and_the_event_order(link):
    for step, tokens in enumerate([4, 1, 3, 4]):
        crossing(link, tokens, step)
    d2h, h2d = check_activations(link, link.rt.log)
    assert (d2h, h2d) == (3 * 4, 4)
    assert link.host_bytes == 2 * link.capacity  # the staging was pinned once: every crossing fit


def test_a_larger_crossing_grows_the_staging_after_a_drain(link):
    before = link.capacity
    crossing(link, 9, 0)  # more tokens than the staging was sized for
    assert link.capacity > before
    crossing(link, 2, 1)
    assert check_activations(link, link.rt.log) == (6, 2)


@pytest.mark.parametrize("broken, message", [
    ("up_landed", "'up' staging refilled before its last host -> device copy finished"),
    ("down_landed", "used the crossing's inputs before they landed"),
])
def test_the_check_catches_staging_used_before_its_copy(link, broken, message):
    """Without the host's wait, pinned staging would be reused (or read) while a copy still owns it."""
    event = getattr(link, f"_{broken}")
    link.rt.skip_host_wait = lambda e: e is event
    for step in range(3):
        crossing(link, 2, step)
    with pytest.raises(AssertionError, match=message):
        check_activations(link, link.rt.log)


def test_the_check_catches_copies_not_ordered_behind_compute(link):
    link.rt.skip_record = lambda e: e is link._computed
    crossing(link, 2, 0)
    with pytest.raises(AssertionError, match="stale `computed`"):
        check_activations(link, link.rt.log)


def test_the_simulated_link_charges_the_activations_bytes():
    x = torch.ones(1000, HIDDEN)  # 256 kB in fp32
    link = HostLink(seconds_per_byte=1 / 1e9)  # 1 GB/s: at least 0.256 ms each way
    t0 = time.perf_counter()
    (back,) = link.to_host(x).wait()
    out = link.to_device(back * 3, x)
    assert time.perf_counter() - t0 >= 2 * x.numel() * 4 / 1e9
    assert back is x and torch.equal(out, x * 3)  # the host's memory is compute's: nothing is copied there


@pytest.mark.cuda
def test_crossings_on_a_gpu_keep_their_values_while_the_compute_stream_is_busy():
    """Real streams and events: each crossing's inputs are made by kernels still queued when it starts, the compute
    stream is kept busy while the host waits, and the result is used by a kernel right after it comes back; the
    staging is reused every time. Values are exact."""
    from engine.weights.transports.activations import CudaActivationLink

    dev = torch.device("cuda")
    link = CudaActivationLink(dev, 64 * (HIDDEN * 4 + TOP_K * 12) + 3 * 256)
    a = torch.randn(2048, 2048, device=dev)  # (2048, 2048): a busy stream's work
    try:
        for step in range(20):
            tokens = 1 + step % 64
            base = torch.randn(tokens, HIDDEN, device=dev)
            hn = (a @ a)[:tokens, :HIDDEN] * 0 + base  # (tokens, hidden), behind a large product
            ids = torch.randint(0, 8, (tokens, TOP_K), device=dev)  # (tokens, top_k) int64
            gates = torch.rand(tokens, TOP_K, device=dev)  # (tokens, top_k) fp32
            crossing = link.to_host(hn, ids, gates)
            busy = a @ a  # the device works while the copy and the host's wait run
            x, i, w = crossing.wait()
            assert torch.equal(x, base.cpu()) and torch.equal(i, ids.cpu()) and torch.equal(w, gates.cpu())
            host = x * 2 + w.sum(-1, keepdim=True)  # (tokens, hidden), the host's result
            out = link.to_device(host, hn) + 1  # used by a kernel at once
            assert torch.equal(out.cpu(), host + 1)
            del busy
        assert link.host_bytes == 2 * link.capacity  # pinned once
    finally:
        link.close()
