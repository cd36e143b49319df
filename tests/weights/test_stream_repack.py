"""Streamed GGUF blocks repacked in C++ (engine/kernels/ggml_repack.cpp, engine/weights/packed/stream_repack.py)
into exactly their resident twins' compute form: the repack's bytes equal the load-time repack's for
every type, a streamed block's weights equal the resident block's (stacked q/k/v and gate/up included),
and a capped or disk-tier run in fast mode computes the all-resident run's logits and tokens. Also the
fallbacks (forced off, a failed build, aten's kernels: streamed blocks dequantized per use) and bad input.
~20 s once the extension is built (~50 s to build it on a 2-core machine)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import LLM
from engine import kernels, ops
from engine.kernels import ggml_repack as repack_module
from engine.kernels.fused_ops import fused_ops
from engine.weights.packed.dequant import dequantize
from engine.weights.transports.disk_reader import StagingBuffer
from engine.weights.packed.fuse import fuse_projections
from engine.weights.formats.gguf_file import GGUFIndex
from engine.weights.packed.weights import (INT4_TYPES, GGUFWeight, Int4Weight, Int8Weight, KQuantWeight,
                                           int4_from_gguf, vnni_parts)
from engine.weights.packed.compute_form import PackedFormat
from engine.weights.transports.gguf import PackedCpuTransport
from engine.weights.formats.block_source import BlockSource
from engine.weights.packed.stream_repack import StreamRepacker, make_repacker
from tests.support.gguf_models import random_blocks, write_gguf
from tests.support.gguf_models import SHORT, greedy_tokens, tiny_gguf
from tests.support.reference import PROMPT, prompt_logits
from tests.support.packed import same_weight, streamed_kinds

REPACKED = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)


@pytest.fixture(scope="module")
def repack():
    """The compiled repack; the tests that need it skip where the VNNI kernels do not run."""
    if kernels.int4_backend() != "vnni" or repack_module.ggml_repack() is None:
        pytest.skip("the VNNI kernels or the repack do not run here (the fallbacks are tested below)")
    return repack_module.ggml_repack()


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-repack")


# -- the C++ repack against the load-time repack --------------------------------------------------

@pytest.mark.parametrize("rows", [48, 37], ids=["whole-blocks", "padded"])
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda q: q.name)
def test_repack_equals_the_load_time_repack(repack, qtype, rows):
    """Every byte of codes and scales (padding rows included, written over a dirty buffer) equals
    packed.int4_from_gguf / Int8Weight.quantize(dequantize(...)) of the same rows in engine order."""
    module = repack
    cols = 512
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=int(qtype)))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    if qtype in INT4_TYPES:
        ref = int4_from_gguf(raw[order], qtype, (rows, cols), torch.bfloat16)
        fn = module.repack_int4
    else:
        ref = Int8Weight.quantize(dequantize(raw[order], qtype, (rows, cols)), torch.bfloat16)
        fn = module.repack_int8
    assert ref.layout == "vnni"
    codes, scales = torch.full_like(ref.codes, 0x5A), torch.full_like(ref.scales, 3.0)
    fn(raw, int(qtype), cols, codes, scales, order)
    assert torch.equal(codes, ref.codes)
    assert torch.equal(scales.view(torch.uint8), ref.scales.view(torch.uint8))
    fn(raw[order].contiguous(), int(qtype), cols, codes, scales)  # no order: the rows as given
    assert torch.equal(codes, ref.codes)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_kquant_repack_takes_rows_in_engine_order_and_zeroes_padding(repack, qtype):
    """The k-quant layouts (their products: tests/kernels/test_kquant_kernel.py): `order` picks the same
    bytes as the rows given in that order, and the padding rows of the last block are zeros (code 0, every
    scale 0) over a dirty buffer, so they add nothing."""
    rows, cols = 37, 512
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=int(qtype)))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    layout = {Q.Q4_K: "q4k", Q.Q6_K: "q6k"}[qtype]
    (_, code_shape), (_, scale_shape) = vnni_parts(layout, (rows, cols))
    made = []
    for args in ((raw, order), (raw[order].contiguous(), None)):
        codes = torch.full(code_shape, 0x5A, dtype=torch.uint8)
        scales = torch.full(scale_shape, 0x5A, dtype=torch.uint8)
        repack.repack_kquant(args[0], int(qtype), cols, codes, scales, args[1])
        made.append((codes, scales))
    assert torch.equal(made[0][0], made[1][0]) and torch.equal(made[0][1], made[1][1])
    codes, scales = made[0]
    x = torch.randn(2, cols)
    y = KQuantWeight(codes, scales, (48, cols), layout)  # the padded block's rows computed too
    assert torch.equal(ops.linear(x, y)[:, rows:], torch.zeros(2, 48 - rows))
    with pytest.raises(ValueError, match="no k-quant layout"):
        repack.repack_kquant(raw, int(Q.Q4_0), cols, codes, scales)


def test_repack_rejects_bad_input(repack):
    module = repack
    raw = torch.from_numpy(random_blocks(Q.Q4_0, 16, 64, seed=1))  # (16, 36)
    codes, scales = torch.empty(1, 2 * 256, dtype=torch.uint8), torch.empty(1, 2, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="is 54 bytes .*got 36"):
        module.repack_int4(raw, int(Q.Q4_0), 96, codes, scales)
    with pytest.raises(ValueError, match="not a 4-bit type"):
        module.repack_int4(raw, int(Q.Q8_0), 64, codes, scales)
    with pytest.raises(ValueError, match="not requantized to int8"):
        module.repack_int8(raw, int(Q.Q4_0), 64, codes, scales)
    with pytest.raises(ValueError, match="codes must be"):
        module.repack_int4(raw, int(Q.Q4_0), 64, codes[:, :256], scales)
    with pytest.raises(ValueError, match="out of range"):
        module.repack_int4(raw, int(Q.Q4_0), 64, codes, scales, torch.full((16,), 16))
    big = raw.clone()
    big[:, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # d = inf
    with pytest.raises(ValueError, match="does not fit in float16"):
        module.repack_int4(big, int(Q.Q4_0), 64, codes, scales)


# -- a streamed block is its resident twin --------------------------------------------------------


# A Q4_K_M-like mix: attention in Q4_K, v and down in Q6_K (so q/k/v stay apart), gate/up in Q4_K.
MIX = {"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K, "attn_output.weight": Q.Q5_K}
BLOCK_CASES = [("llama", Q.Q4_0, None), ("llama", Q.Q8_0, None), ("qwen2", Q.Q4_1, None), ("qwen2", Q.Q5_0, None),
               ("mistral", Q.Q5_1, None), ("qwen3", Q.Q4_K, MIX), ("qwen3", Q.Q6_K, None)]


def _mixed_gguf(root: Path, arch: str, qtype: Q, mix: dict | None) -> Path:
    if mix is None:
        return tiny_gguf(root, arch, qtype)
    base = tiny_gguf(root, arch, qtype)  # builds the transformers folder next to it
    folder = root / f"{arch}-wide"
    types = {f"blk.{i}.{k}": v for i in range(4) for k, v in mix.items()}
    out = root / f"{arch}-mix.gguf"
    return out if out.exists() else write_gguf(folder if folder.exists() else base.parent, out, qtype, types=types)


@pytest.mark.parametrize("arch,qtype,mix", BLOCK_CASES, ids=[f"{a}-{q.name}{'-mix' if m else ''}"
                                                              for a, q, m in BLOCK_CASES])
def test_streamed_block_equals_the_resident_block(repack, gguf_root, arch, qtype, mix):
    """From the mapping (page-cache tier) and from a disk read's staging buffer: the same weights,
    byte for byte, as the load-time repack plus fuse.py's stacking, name by name."""
    path = _mixed_gguf(gguf_root, arch, qtype, mix)
    index = GGUFIndex(path)
    try:
        source = BlockSource(index, index.model_config())
        fmt = PackedFormat(torch.bfloat16)
        repacker = make_repacker(source, fmt)
        assert isinstance(repacker, StreamRepacker)
        transport = PackedCpuTransport(source, fmt, repacker=repacker)
        from engine.weights.transports.disk_reader import DiskReader, plan_reads

        reader = DiskReader(source.files, direct=False)
        for block in range(source.num_blocks):
            resident = fuse_projections(transport.resident(block))
            ticket = transport.prepare(block)
            plan = plan_reads(source.tensors(block))
            buf = StagingBuffer(plan.buffer_bytes)
            reader.read(plan, buf)
            from_disk, slot = repacker.fill(block, plan.views(buf))
            for streamed in (ticket.weights, from_disk):
                assert streamed.keys() == resident.keys()
                assert all(same_weight(streamed[k], resident[k]) for k in resident), \
                    [k for k in resident if not same_weight(streamed[k], resident[k])]
            kinds = {type(w) for w in ticket.weights.values()}
            assert kinds <= {torch.Tensor, Int4Weight, Int8Weight, KQuantWeight} and GGUFWeight not in kinds
            transport.retire(ticket)
            repacker.give(slot)
        reader.close()
        # Slots are reused: two in flight at most here, however many blocks were prepared.
        assert repacker.sets_made == 2 and repacker.takes == 2 * source.num_blocks
        if mix is None:
            assert "wqkv" in resident and "w_gate_up" in resident
        else:
            assert "wqkv" not in resident and "w_gate_up" in resident
    finally:
        index.close()


# -- capped and disk-tier runs give the all-resident run's logits and tokens -----------------------

RUN_CASES = [("llama", Q.Q4_0), ("qwen2", Q.Q4_K), ("llama", Q.Q8_0)]


@pytest.mark.parametrize("arch,qtype", RUN_CASES, ids=[f"{a}-{q.name}" for a, q in RUN_CASES])
def test_streamed_runs_compute_the_resident_run(repack, gguf_root, monkeypatch, arch, qtype):
    """Fast mode (bf16) without the prepacked cache entry (tests/weights/test_prepacked.py tests it): one block
    resident and the others streamed from the page cache, or read from disk each step, gives the
    all-resident run's prompt logits bit for bit and its greedy tokens; the disk tier still reads the
    packed bytes and the counters count them."""
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "off")
    path = tiny_gguf(gguf_root, arch, qtype)
    llm = LLM(str(path), **SHORT)
    try:
        ref_logits, ref_tokens, budget = prompt_logits(llm, PROMPT), greedy_tokens(llm), llm.plan.budget_keeping(1)
        assert not llm.plan.streamed_blocks
    finally:
        llm.close()
    for transport in ("cpu", "disk"):
        llm = LLM(str(path), transport=transport, max_device_memory=budget, **SHORT)
        try:
            assert len(llm.plan.resident_blocks) == 1 and llm.plan.streamed_blocks
            assert streamed_kinds(llm) <= {Int4Weight, Int8Weight, KQuantWeight}
            assert torch.equal(prompt_logits(llm, PROMPT), ref_logits)
            assert greedy_tokens(llm) == ref_tokens
            telemetry = llm.telemetry()
            total = telemetry.total
            # Every streamed block repacked on the host (and those prepared ahead), into depth + 1
            # reused slots at most.
            assert total.blocks_streamed <= telemetry.blocks_converted
            assert 0 < telemetry.buffer_sets <= llm.plan.prefetch_depth + 1
            packed = llm.plan.stream_block_bytes
            assert total.bytes_streamed == total.blocks_streamed * packed
            if transport == "disk":
                assert total.blocks_streamed * packed <= total.disk_bytes_read
                assert total.disk_bytes_read <= total.blocks_streamed * (packed + 2 * 4096)
        finally:
            llm.close()


# -- fallbacks ------------------------------------------------------------------------------------

@pytest.fixture
def fresh_choice(monkeypatch):
    """Decide the repack again under this test's environment; restore the process's choices after."""
    repack_module.ggml_repack.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    repack_module.ggml_repack.cache_clear()
    kernels.int4_backend.cache_clear()
    kernels.int4_backend()


@pytest.mark.parametrize("setup", ["off", "broken", "aten"])
def test_fallbacks_dequantize_streamed_blocks_per_use(gguf_root, fresh_choice, tmp_path, caplog, setup):
    """LAYERSTREAM_STREAM_REPACK=off, a repack source that does not compile, or aten's kernels
    (LAYERSTREAM_INT4_KERNEL=aten, whose layouts the repack does not write): one warning, and streamed
    blocks are GGUFWeight views dequantized per use again, within the fast-mode tolerance of the
    all-resident run under the same setup. Runs on any CPU."""
    monkeypatch = fresh_choice
    if setup == "off":
        monkeypatch.setenv("LAYERSTREAM_STREAM_REPACK", "off")
    elif setup == "broken":
        bad = tmp_path / "broken.cpp"
        bad.write_text("#error this repack does not compile\n")
        kernels.int4_backend(), fused_ops()  # decided (built) before the cache moves: only the repack builds there
        monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(repack_module, "SOURCE", bad)
    else:
        monkeypatch.setenv("LAYERSTREAM_INT4_KERNEL", "aten")
        kernels.int4_backend.cache_clear()
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    llm = LLM(str(path), **SHORT)
    try:
        ref, budget = prompt_logits(llm, PROMPT), llm.plan.budget_keeping(1)
    finally:
        llm.close()
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        llm = LLM(str(path), max_device_memory=budget, **SHORT)
    try:
        assert any("not repacked" in r.message for r in caplog.records)
        assert streamed_kinds(llm) == {GGUFWeight}
        torch.testing.assert_close(prompt_logits(llm, PROMPT), ref, atol=0.15, rtol=0.05)
    finally:
        llm.close()


def test_bad_repack_setting(fresh_choice):
    fresh_choice.setenv("LAYERSTREAM_STREAM_REPACK", "sometimes")
    with pytest.raises(ValueError, match="auto or off, got 'sometimes'"):
        repack_module.ggml_repack()


def test_exact_mode_streams_gguf_weights(repack, gguf_root):
    """fp32 stays the exact reference mode: streamed blocks are dequantized per use, no repacker."""
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    index = GGUFIndex(path)
    try:
        source = BlockSource(index, index.model_config())
        assert make_repacker(source, PackedFormat(torch.float32)) is None
        assert make_repacker(source, PackedFormat(torch.bfloat16)) is not None
    finally:
        index.close()


def test_disk_tier_reads_the_next_block_while_repacking(repack, gguf_root):
    """The disk tier keeps the next disk blocks' reads going while it repacks the current one, in the
    streamer's cyclic order; a block asked for out of that order (after a reset) is read then and
    still comes out as its resident twin; no staging buffer stays held once a block is repacked."""
    from engine.weights.transports.disk import DiskTransport

    path = tiny_gguf(gguf_root, "qwen2", Q.Q4_K)
    index = GGUFIndex(path)
    try:
        source = BlockSource(index, index.model_config())
        fmt = PackedFormat(torch.bfloat16)
        transport = DiskTransport(source, torch.bfloat16, [1, 2, 3], depth=2, direct=False, fmt=fmt,
                                  repacker=make_repacker(source, fmt))
        host = PackedCpuTransport(source, fmt)
        try:
            for block, ahead in [(1, 2), (2, 3), (3, 1), (2, 3), (1, 2)]:  # (2 after 3: a reset)
                ticket = transport.prepare(block)
                assert ahead in transport.reads.reading
                assert ticket.staging is None and transport.reads.held == 0
                resident = fuse_projections(host.resident(block))
                assert all(same_weight(ticket.weights[k], resident[k]) for k in resident)
                transport.retire(ticket)
        finally:
            transport.close()  # waits for the reads still ahead
        # the 5 blocks asked for, and the reads started ahead of them
        assert transport.reader.stats.bytes_read >= 7 * source.nbytes(1)
    finally:
        index.close()
