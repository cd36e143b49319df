"""The disk tier: blocks read from disk each step (O_DIRECT, or buffered where refused) give the
same tokens as the resident run; the reader's bytes are the file's bytes; the host tier plan."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from engine.weights.transports import disk_bandwidth as dbw
from engine.weights.transports.disk_reader import ALIGN, DiskReader, StagingBuffer, plan_reads
from engine.llm import LLM
from engine.planner import HostTiering, PlanInputs, plan_memory
from engine.weights.formats.safetensors_index import WeightIndex
from engine.weights.formats.block_source import BlockSource
from engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Hello world! How are", "def main():"]
SMALL = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32)  # a tiny plan, so a few blocks stream


def _budget(folder, resident: int = 1, depth: int = 1, dtype: str = "auto", limits: dict = SMALL) -> int:
    """A device budget that keeps `resident` blocks besides the stream buffers under `limits`, from
    the plan's own figures (hand-written byte counts broke whenever an estimate changed)."""
    from tests.support.reference import budget_for

    return budget_for(folder, resident, depth, dtype, **limits)


GRAMMAR_CACHE = 64 << 10


def _host(folder, room: int) -> dict:
    """LLM arguments for `room` bytes of host memory besides what the plan counts for structured output:
    a small grammar cache (by default a share of the host memory) and the grammar probe's process."""
    from engine.grammar_probe import probe_memory_bytes
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(folder)
    probe = probe_memory_bytes(GRAMMAR_CACHE, checkpoint.cfg.vocab_size)
    checkpoint.close()
    return dict(max_host_memory=room + GRAMMAR_CACHE + probe, grammar_cache_memory=GRAMMAR_CACHE)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # The disk bandwidth is cached per file system in the layerstream cache folder.
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))


def _generate(model_dir, **kw):
    llm = LLM(str(model_dir), **kw)
    try:
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in out], llm.plan, llm.telemetry()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def resident_tokens(llama_dir):
    tokens, plan, _ = _generate(llama_dir)
    assert not plan.streamed_blocks
    return tokens


def _refuse_o_direct(monkeypatch, at: str) -> list[int]:
    """Make O_DIRECT fail the way file systems that refuse it do: EINVAL at open() or at read."""
    refused = []
    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()

    def fake_open(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            if at == "open":
                refused.append(1)
                raise OSError(errno.EINVAL, "Invalid argument")
            fd = real_open(path, flags, *a, **k)
            direct_fds.add(fd)
            return fd
        return real_open(path, flags, *a, **k)

    def fake_preadv(fd, buffers, offset, *a):
        if fd in direct_fds:
            refused.append(1)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    return refused


@pytest.mark.parametrize("refuse", [None, "open", "read"])
def test_disk_tier_tokens_identical_to_resident(llama_dir, resident_tokens, monkeypatch, refuse):
    refused = _refuse_o_direct(monkeypatch, refuse) if refuse else []
    tokens, plan, _ = _generate(llama_dir, max_device_memory=_budget(llama_dir), transport="disk", **SMALL)
    assert plan.disk_blocks and plan.disk_blocks == plan.streamed_blocks
    assert tokens == resident_tokens
    assert bool(refused) == bool(refuse)


def test_disk_tier_chosen_when_host_memory_is_short(llama_dir, resident_tokens):
    """Auto transport on CPU: a host budget below the weights puts the blocks that do not fit on disk.
    Steps of 8 tokens: a workspace small enough that one resident block fits below the weights."""
    limits = dict(SMALL, max_num_batched_tokens=8)
    tokens, plan, telemetry = _generate(llama_dir, **_host(llama_dir, _budget(llama_dir, limits=limits)), **limits)
    assert plan.disk_blocks and plan.resident_blocks
    assert telemetry.links.disk_gbps and telemetry.links.disk_gbps > 0
    assert "read from disk each step" in plan.describe()
    assert tokens == resident_tokens


def test_disk_tier_converts_dtype(llama_dir):
    """fp32 checkpoint, bf16 compute: converted on the prefetch thread, same tokens as resident bf16."""
    ref, _, _ = _generate(llama_dir, dtype="bfloat16")
    tokens, plan, _ = _generate(llama_dir, dtype="bfloat16", max_device_memory=_budget(llama_dir, 1, 2, "bfloat16"),
                             transport="disk",
                             prefetch_depth=2, **SMALL)
    assert plan.disk_blocks
    assert tokens == ref


@pytest.mark.parametrize("direct", [True, False])
def test_reader_returns_the_file_bytes(llama_dir, direct):
    index = WeightIndex(llama_dir)
    reader = DiskReader(index.files, direct=direct, chunk_bytes=ALIGN * 2, in_flight=3)
    try:
        names = {n: index.tensor(n) for n in index.names()[:7]}
        plan = plan_reads(names)
        buf = StagingBuffer(plan.buffer_bytes)
        assert buf.tensor.data_ptr() % ALIGN == 0
        reader.read(plan, buf)
        views = plan.views(buf)
        for name in names:
            torch.testing.assert_close(views[name], index.view(name), rtol=0, atol=0)
        assert reader.stats.bytes_read >= plan.payload_bytes
    finally:
        reader.close()
        index.close()


def test_reader_falls_back_mid_read(llama_dir, monkeypatch):
    refused = _refuse_o_direct(monkeypatch, "read")
    index = WeightIndex(llama_dir)
    reader = DiskReader(index.files, chunk_bytes=ALIGN, in_flight=4)
    try:
        entries = {n: index.tensor(n) for n in index.names()}
        plan = plan_reads(entries)
        buf = StagingBuffer(plan.buffer_bytes)
        reader.read(plan, buf)
        assert refused and not reader.direct and reader.stats.buffered_fallbacks == 1
        views = plan.views(buf)
        for name in entries:
            torch.testing.assert_close(views[name], index.view(name), rtol=0, atol=0)
    finally:
        reader.close()
        index.close()


def test_plan_reads_coalesces_a_block_into_one_span(llama_dir):
    from engine.arch import load_model_config

    cfg = load_model_config(llama_dir)
    index = WeightIndex(llama_dir)
    try:
        plan = plan_reads(BlockSource(index, cfg).tensors(2))
        assert len(plan.spans) == 1
        span = plan.spans[0]
        assert span.start % ALIGN == 0 and span.end % ALIGN == 0
        assert plan.payload_bytes <= plan.buffer_bytes < plan.payload_bytes + 2 * ALIGN
    finally:
        index.close()


def test_host_tier_arithmetic():
    device = dict(num_layers=10, block_bytes=100, global_bytes=50, kv_bytes_per_token=1, workspace_bytes=10,
                  budget=50 + 10 + 16 + 200 + 300, max_model_len=16, max_num_seqs=1)
    device_bytes = plan_memory(PlanInputs(**device)).device_bytes
    plan = plan_memory(PlanInputs(**device, host_budget=device_bytes + 250,
                                  host_tiering=HostTiering(0, holds_device_plan=True, disk_block_bytes=100)))
    assert len(plan.resident_blocks) == 3 and len(plan.streamed_blocks) == 7
    assert len(plan.host_blocks) == 2 and len(plan.disk_blocks) == 5
    assert sorted(plan.host_blocks + plan.disk_blocks) == plan.streamed_blocks
    disk_gbps = 1e-6  # 1000 bytes/s
    assert plan.disk_bytes_per_step == 500
    assert plan.disk_seconds_per_step(disk_gbps) == pytest.approx(0.5)
    plan = plan_memory(PlanInputs(**device, host_budget=10**9,
                                  host_tiering=HostTiering(0, False, disk_block_bytes=100, force_disk=True)))
    assert plan.disk_blocks == plan.streamed_blocks
    # The grammar cache's cap is host memory too: one block fewer kept in RAM.
    plan = plan_memory(PlanInputs(**device, host_budget=device_bytes + 250, grammar_cache_bytes=100,
                                  host_tiering=HostTiering(0, holds_device_plan=True, disk_block_bytes=100)))
    assert len(plan.host_blocks) == 1 and len(plan.disk_blocks) == 6
    assert "grammar cache" in plan.describe()
    # So is the grammar probe's (a process of its own in the same memory cgroup): one block fewer again.
    plan = plan_memory(PlanInputs(**device, host_budget=device_bytes + 250, grammar_cache_bytes=100,
                                  grammar_probe_bytes=100,
                                  host_tiering=HostTiering(0, holds_device_plan=True, disk_block_bytes=100)))
    assert len(plan.host_blocks) == 0 and len(plan.disk_blocks) == 7
    assert "grammar probe" in plan.describe()


def test_disk_bandwidth_is_measured_once_per_file_system(tmp_path, monkeypatch):
    monkeypatch.setattr(dbw, "MIN_CACHED_BYTES", ALIGN)
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(3 * ALIGN + 100))
    first = dbw.disk_bandwidth([f])
    assert not first.cached and first.gbps > 0 and first.bytes_read == 3 * ALIGN
    again = dbw.disk_bandwidth([f])
    assert again.cached and again.gbps == first.gbps
    assert dbw.filesystem_key(f) in (dbw._cache_path().read_text())


def test_disk_block_is_viewed_in_place_and_buffers_recycle(llama_dir):
    """Same dtype: a disk block's tensors are views into a staging buffer (no copy), and depth + 1
    buffers serve any number of blocks because retire() hands each back."""
    from engine.arch import load_model_config
    from engine.weights.transports.disk import DiskTransport

    cfg = load_model_config(llama_dir)
    index = WeightIndex(llama_dir)
    source = BlockSource(index, cfg)
    transport = DiskTransport(source, torch.float32, disk_blocks=range(cfg.num_layers), depth=1)
    try:
        buffers = set()
        for block in list(range(cfg.num_layers)) * 2:
            ticket = transport.prepare(block)
            buf = ticket.staging
            buffers.add(id(buf))
            lo = buf.tensor.data_ptr()
            for short, w in ticket.weights.items():
                assert lo <= w.data_ptr() < lo + buf.nbytes, short
                torch.testing.assert_close(w, source.views(block)[short], rtol=0, atol=0)
            transport.retire(ticket)
        assert len(buffers) <= 2
        assert transport.reads.held == 0  # every retired ticket gave its staging buffer back
    finally:
        transport.close()
        index.close()


@pytest.mark.cuda
def test_pinned_staging_feeds_a_device_copy(llama_dir):
    """The GPU path: disk -> pinned staging (O_DIRECT into page-locked memory) -> device."""
    index = WeightIndex(llama_dir)
    reader = DiskReader(index.files)
    try:
        names = {n: index.tensor(n) for n in index.names()}
        plan = plan_reads(names)
        buf = StagingBuffer(plan.buffer_bytes, pin_memory=True)
        assert buf.tensor.is_pinned() and buf.tensor.data_ptr() % ALIGN == 0
        reader.read(plan, buf)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            on_device = {n: v.to("cuda", non_blocking=True) for n, v in plan.views(buf).items()}
        stream.synchronize()
        for name, v in on_device.items():
            torch.testing.assert_close(v.cpu(), index.view(name), rtol=0, atol=0)
    finally:
        reader.close()
        index.close()


def test_bench_disk_skips_without_writable_cgroups(tmp_path, monkeypatch, capsys):
    from layerstream.bench import disk

    monkeypatch.setattr(disk, "CGROUP_ROOT", tmp_path / "no-cgroup-here")
    assert "no cgroup v1 memory controller" in disk.cgroups_unavailable()
    from layerstream.cli import main

    assert main(["bench-disk", "--model", str(tmp_path)]) == 0
    assert "bench-disk: skipped: no cgroup v1 memory controller" in capsys.readouterr().out


def test_disk_tier_on_a_sharded_checkpoint(tmp_path, resident_tokens):
    """Shards of ~100 KB: blocks span files, so a read plan has several spans in several files."""
    from tests.support.models import build

    folder = build(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 3
    tokens, plan, _ = _generate(folder, max_device_memory=_budget(folder), transport="disk", **SMALL)
    assert plan.disk_blocks
    assert tokens == resident_tokens


def test_host_memory_too_small_names_the_host_budget(llama_dir):
    from engine.planner import PlanError

    with pytest.raises(PlanError, match=r"does not fit in host memory .*raise --max-host-memory"):
        LLM(str(llama_dir), max_host_memory=300_000, **SMALL)


def test_cuda_transport_reads_disk_blocks_through_the_disk_reader(llama_dir, resident_tokens, monkeypatch):
    """The GPU path on CPU: CudaTransport replayed with the recording runtime of test_overlap; the
    blocks the host tier leaves on disk go disk -> aligned buffer -> staging -> device buffer, with
    the event protocol intact and the tokens of the resident run."""
    import engine.weights.transports.cuda as ct
    from tests.support.cuda_replay import RecordingRuntime, capture_cuda_transports, check_protocol

    monkeypatch.setattr(ct, "CudaRuntime", RecordingRuntime)
    built = capture_cuda_transports(monkeypatch)
    llm = LLM(str(llama_dir), transport="cuda", max_device_memory=_budget(llama_dir), **_host(llama_dir, 650_000),
              **SMALL)
    try:
        plan = llm.plan
        assert plan.disk_blocks and plan.host_blocks, plan.describe()
        t = built[0]
        assert t.disk is not None and t.disk.disk_blocks == set(plan.disk_blocks)
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in out] == resident_tokens
        assert llm.telemetry().total.disk_bytes_read >= len(plan.disk_blocks) * plan.disk_block_bytes
        assert check_protocol(t, t.rt.log) > 0
    finally:
        llm.close()


def test_cpu_plan_with_blocks_kept_in_ram_and_blocks_on_disk(llama_dir, resident_tokens):
    budget = _budget(llama_dir)  # host memory: the device plan (CPU compute) and room for two of the blocks
    tokens, plan, _ = _generate(llama_dir, max_device_memory=budget, **_host(llama_dir, budget + 300_000), **SMALL)
    assert plan.resident_blocks and plan.host_blocks and plan.disk_blocks, plan.describe()
    assert sorted(plan.host_blocks + plan.disk_blocks) == plan.streamed_blocks
    assert tokens == resident_tokens
