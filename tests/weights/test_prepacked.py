"""GGUF blocks prepacked once into a cache entry (engine/weights/packed/prepacked.py, transports/prepacked.py):
the same logits and tokens as the repack at load and per step, whatever tier a block comes from;
streamed blocks are views of the mapped entry; a stale or damaged entry is rebuilt; a second load
converts nothing; the model's folder is never written; `layerstream convert`; the fallbacks.
Tiny GGUFs (tests/support/gguf_models.py), a few seconds once the kernels are built."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import LLM
from engine import kernels
from engine.kernels import ggml_repack as repack_module
from engine.weights import CheckpointError
from engine.weights.transports.disk_reader import StagingBuffer
from engine.weights.packed.fuse import fuse_projections
from engine.weights.formats.gguf_file import GGUFIndex
from engine.weights.packed.weights import Int4Weight, Int8Weight, KQuantWeight
from engine.weights.packed.compute_form import PackedFormat
from engine.weights.transports.gguf import PackedCpuTransport
from engine.weights.packed.prepacked import DATA, PrepackedBlocks, prepack_layout, prepack_mode
from engine.weights.transports.prepacked import PrepackedTransport
from engine.weights.formats.block_source import BlockSource
from engine.weights.packed.stream_repack import make_repacker
from tests.support.gguf_models import SHORT, greedy_tokens, tiny_gguf, tiny_moe_gguf
from tests.support.reference import PROMPT, prompt_logits
from tests.support.packed import same_weight, streamed_kinds
from tests.support.memory_maps import mapped_ranges
from engine.weights.formats.views import file_mappings

BF16 = PackedFormat(torch.bfloat16)


@pytest.fixture(scope="module")
def repack():
    if kernels.int4_backend() != "vnni" or repack_module.ggml_repack() is None:
        pytest.skip("the VNNI kernels or the repack do not run here: GGUF blocks are not prepacked")


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-prepacked")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A layerstream cache of this test's own (the kernels are built before: conftest)."""
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class Opened:
    """A tiny GGUF's reader and block source, and its prepacked layout in bf16."""

    def __init__(self, path):
        self.index = GGUFIndex(path)
        self.source = BlockSource(self.index, self.index.model_config())
        self.layout, why = prepack_layout(self.source, BF16)
        assert self.layout is not None, why

    def close(self):
        self.index.close()


def _tensors(w) -> list[torch.Tensor]:
    return [w.codes, w.scales] if isinstance(w, (Int4Weight, Int8Weight, KQuantWeight)) else [w]


# -- the same computation from every tier ---------------------------------------------------------------

RUN_CASES = [("llama", Q.Q4_0), ("qwen2", Q.Q4_K), ("llama", Q.Q8_0)]


@pytest.mark.parametrize("arch,qtype", RUN_CASES, ids=[f"{a}-{q.name}" for a, q in RUN_CASES])
def test_every_tier_computes_the_repack_paths_logits(repack, gguf_root, cache, monkeypatch, arch, qtype):
    """The reference is today's path (LAYERSTREAM_PREPACK=off: repacked at load, all resident). From the
    prepacked entry, all resident, streamed from the page cache, and read from disk each step: the
    same prompt logits bit for bit and the same greedy tokens, with no block repacked on the host and
    every streamed block counted at the entry's bytes the plan counts."""
    path = tiny_gguf(gguf_root, arch, qtype)
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "off")
    llm = LLM(str(path), **SHORT)
    try:
        ref_logits, ref_tokens, budget = prompt_logits(llm, PROMPT), greedy_tokens(llm), llm.plan.budget_keeping(1)
        assert llm.telemetry().transport_name == "PackedCpuTransport"
    finally:
        llm.close()
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "auto")
    for transport, cap in (("auto", None), ("cpu", budget), ("disk", budget)):
        # blocks streamed whole (experts one by one: the next test)
        llm = LLM(str(path), transport=transport, max_device_memory=cap, expert_streaming=False, **SHORT)
        try:
            plan, telemetry = llm.plan, llm.telemetry()
            assert telemetry.transport_name == "PrepackedTransport"
            assert torch.equal(prompt_logits(llm, PROMPT), ref_logits), transport
            assert greedy_tokens(llm) == ref_tokens, transport
            if cap is None:
                assert not plan.streamed_blocks
                continue
            assert len(plan.resident_blocks) == 1 and plan.streamed_blocks
            assert streamed_kinds(llm) <= {Int4Weight, Int8Weight, KQuantWeight}
            total = llm.telemetry().total
            assert total.blocks_streamed > 0 and llm.telemetry().blocks_converted == 0
            assert total.bytes_streamed == total.blocks_streamed * plan.stream_block_bytes
            assert plan.stream_block_bytes % 4096 == 0  # whole pages of the entry, not the GGUF's bytes
            if transport == "disk":
                assert plan.disk_block_bytes == plan.stream_block_bytes
                assert total.disk_bytes_read == total.disk_tier_bytes == total.bytes_streamed
        finally:
            llm.close()


# -- views, copies, and the repack's bytes --------------------------------------------------------------

def test_streamed_block_is_a_view_of_the_mapping(repack, gguf_root, cache):
    """Page-cache tier: every tensor of a prepared block shares the mapped entry's storage and lies
    inside the mapping, and its bytes are the per-step repack's (and the resident repack's, stacked).
    With a disk tier, resident blocks and disk-tier blocks are not views of the mapping (read into a
    buffer of their own; a staging buffer); without one, resident blocks are views too."""
    opened = Opened(tiny_gguf(gguf_root, "qwen2", Q.Q4_1))
    store = PrepackedBlocks(opened.source, opened.layout)
    transport = PrepackedTransport(store, disk_blocks=[2], depth=1, direct=False)
    try:
        repacker = make_repacker(opened.source, BF16)
        old = PackedCpuTransport(opened.source, BF16, repacker=repacker)
        base = store.raw(0).untyped_storage()
        lo, hi = base.data_ptr(), base.data_ptr() + base.nbytes()
        for block in (1, 3):
            ticket = transport.prepare(block)
            repacked = old.prepare(block)
            assert ticket.weights.keys() == repacked.weights.keys()
            for name, w in ticket.weights.items():
                assert same_weight(w, repacked.weights[name]), name
                for t in _tensors(w):
                    assert t.untyped_storage().data_ptr() == lo, name
                    assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi, name
            assert ticket.nbytes == store.nbytes(block)
            old.retire(repacked)
            transport.retire(ticket)
        resident = transport.resident(0)
        assert all(same_weight(resident[k], w) for k, w in fuse_projections(old.resident(0)).items())
        assert not any(lo <= t.data_ptr() < hi for w in resident.values() for t in _tensors(w))
        ticket = transport.prepare(2)
        assert isinstance(ticket.staging, StagingBuffer) and ticket.tier == "disk"
        start = ticket.staging.tensor.data_ptr()
        assert all(start <= t.data_ptr() < start + ticket.staging.nbytes
                   for w in ticket.weights.values() for t in _tensors(w))
        transport.retire(ticket)
    finally:
        transport.close()
    store = PrepackedBlocks(opened.source, opened.layout)
    transport = PrepackedTransport(store, depth=1)
    try:
        base = store.raw(0).untyped_storage()
        lo, hi = base.data_ptr(), base.data_ptr() + base.nbytes()
        resident = transport.resident(0)
        assert all(same_weight(resident[k], w) for k, w in fuse_projections(old.resident(0)).items())
        assert all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for w in resident.values() for t in _tensors(w))
    finally:
        transport.close()
        opened.close()


def test_q4_0_is_stored_without_its_implied_mins(repack, gguf_root, cache):
    """Q4_0's int4 weights (blocks and head) are stored as scales only, their mins being -8 * their scales:
    every mapped one is in the symmetric form, and a block is 10% smaller than with the mins; a Q4_K
    file's weights keep their mins (every tier's logits against the repack path: the test above)."""
    opened = Opened(tiny_gguf(gguf_root, "llama", Q.Q4_0))
    store = PrepackedBlocks(opened.source, opened.layout)
    try:
        kinds = {w.kind for b in opened.layout.blocks for w in b.weights}
        assert "int4s" in kinds and "int4" not in kinds
        weights = [w for w in store.mapped(0).values() if isinstance(w, Int4Weight)] + [store.head()]
        assert weights and all(w.scales.dim() == 3 for w in weights)
        full = sum(w.codes.nbytes + 2 * w.scales.nbytes for w in weights)
        assert sum(w.nbytes for w in weights) < 0.92 * full
    finally:
        store.close()
        opened.close()
    q4k = Opened(tiny_gguf(gguf_root, "qwen2", Q.Q4_K))
    try:
        assert "int4s" not in {w.kind for b in q4k.layout.blocks for w in b.weights}
    finally:
        q4k.close()


def test_resident_blocks_and_head_are_copies_of_their_own_unless_mapped(repack, gguf_root, cache):
    """--resident-weights auto (the default): every resident block's tensors and the head lie outside the entry's
    mapping, in memory of their own (collapsed into huge pages afterwards), and their pages are dropped from the
    mapping (it holds less than the blocks' bytes; map: all of them); map: views of the mapping. The same prompt
    logits bit for bit either way."""
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    logits = {}
    for mode in ("auto", "map"):
        llm = LLM(str(path), resident_weights=mode, **SHORT)
        try:
            weights = llm.engine.model.weights
            (entry,) = cache.glob(f"prepacked-v*/*/{DATA}")
            (lo, hi), = mapped_ranges(entry)
            assert not llm.plan.streamed_blocks
            tensors = [t for i in range(llm.plan.num_layers) for w in weights.acquire(i).values() for t in _tensors(w)]
            for i in range(llm.plan.num_layers):
                weights.release(i)
            tensors += _tensors(weights.globals.head)
            inside = [lo <= t.data_ptr() < hi for t in tensors]
            entry_rss = file_mappings()[str(entry.resolve())][0]
            assert weights.wait_resident_copies(60)
            telemetry = llm.telemetry()
            blocks_bytes = llm.plan.num_layers * llm.plan.block_bytes
            if mode == "auto":
                assert not any(inside) and telemetry.resident_copies == llm.plan.num_layers + 1  # and the head
                # The header's pages stay, and a page fault maps the pages around it that the page cache holds
                # (fault-around, a whole large folio): with this model's 23 KB blocks that can be a block's bytes
                # or more (36,864 once in a full run), never all of them.
                assert entry_rss < blocks_bytes, entry_rss
            else:
                assert all(inside) and telemetry.resident_copies == 0 and entry_rss >= blocks_bytes, entry_rss
            logits[mode] = prompt_logits(llm, PROMPT)
        finally:
            llm.close()
    assert torch.equal(logits["auto"], logits["map"])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["int4-head", "int8-head"])
def test_head_is_a_view_of_the_entry_with_the_load_time_repacks_bytes(repack, gguf_root, cache, qtype):
    """The head (the tied token table here) is stored in the entry after the blocks, in the form the
    load made of it before (PackedFormat.resident; Q4_0's without its implied mins), and handed out as
    views of the mapping."""
    opened = Opened(tiny_gguf(gguf_root, "llama", qtype))
    store = PrepackedBlocks(opened.source, opened.layout)
    try:
        assert opened.layout.head is not None
        head = store.head()
        infos = opened.source.global_infos()
        name = "lm_head" if "lm_head" in infos else "embed"
        made = BF16.resident(infos[name], opened.source.global_rows(name))
        if qtype == Q.Q4_0:  # stored in the symmetric form: its mins are -8 * its scales
            made = made.without_min()
            assert made.scales.dim() == 3
        assert type(head) is type(made) and same_weight(head, made)
        base = store.raw(0).untyped_storage()
        lo, hi = base.data_ptr(), base.data_ptr() + base.nbytes()
        assert all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for t in _tensors(head))
    finally:
        store.close()
        opened.close()


# -- once, checked, rebuilt -----------------------------------------------------------------------------

def test_second_load_converts_nothing_and_the_model_folder_is_untouched(repack, gguf_root, cache, caplog):
    """Two loads of the same GGUF: the first prepacks (once, logged), the second maps the same file
    (same inode and mtime, nothing logged) and computes the same tokens; the model's folder is unchanged."""
    path = tiny_gguf(gguf_root, "llama", Q.Q4_K)
    before = {p.name: p.stat().st_mtime_ns for p in path.parent.iterdir()}
    tokens, stats = [], []
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="layerstream"):
            llm = LLM(str(path), **SHORT)
        try:
            tokens.append(greedy_tokens(llm))
        finally:
            llm.close()
        entry = next(cache.glob(f"prepacked-v*/*/{DATA}"))
        stats.append((entry.stat().st_ino, entry.stat().st_mtime_ns))
    assert sum("prepacking" in r.message for r in caplog.records) == 1
    assert len(list(cache.glob(f"prepacked-v*/*/{DATA}"))) == 1
    assert stats[0] == stats[1] and tokens[0] == tokens[1]
    assert {p.name: p.stat().st_mtime_ns for p in path.parent.iterdir()} == before


def _truncate(path, layout):
    os.truncate(path, layout.file_bytes - 4096)


def _overwrite_header(path, layout):
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\x00" * 8)


def _overwrite_block(path, layout):
    with open(path, "r+b") as f:  # the first bytes of block 0: the first sampled piece
        f.seek(layout.data_start)
        f.write(bytes(b ^ 0xFF for b in f.read(64)[::-1]))


@pytest.mark.parametrize("damage", [_truncate, _overwrite_header, _overwrite_block], ids=lambda f: f.__name__[1:])
def test_damaged_entry_is_detected_and_rebuilt(repack, gguf_root, cache, caplog, damage):
    opened = Opened(tiny_gguf(gguf_root, "llama", Q.Q4_0))
    try:
        first = PrepackedBlocks(opened.source, opened.layout)
        assert first.built
        good = [{k: [t.clone() for t in _tensors(w)] for k, w in first.mapped(b).items()}
                for b in range(opened.source.num_blocks)]
        first.close()
        damage(first.path, opened.layout)
        with caplog.at_level(logging.WARNING, logger="layerstream"):
            second = PrepackedBlocks(opened.source, opened.layout)
        try:
            assert second.built
            assert any("stale or damaged" in r.message for r in caplog.records)
            for b, weights in enumerate(good):
                for k, w in second.mapped(b).items():
                    assert all(torch.equal(t.view(torch.uint8), r.view(torch.uint8))
                               for t, r in zip(_tensors(w), weights[k]))
        finally:
            second.close()
    finally:
        opened.close()


def test_changed_source_gets_a_new_entry(repack, gguf_root, cache, tmp_path):
    """The key covers the source's identity: a GGUF file rewritten in place (other bytes, same name)
    is prepacked again into another entry; the stale one is never mapped for it."""
    src = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    path = tmp_path / "model" / src.name
    path.parent.mkdir()
    path.write_bytes(src.read_bytes())
    opened = Opened(path)
    store = PrepackedBlocks(opened.source, opened.layout)
    assert store.built
    store.close()
    opened.close()
    data = bytearray(path.read_bytes())
    data[-100:] = bytes(b ^ 0x11 for b in data[-100:])  # the last tensor's last bytes
    path.write_bytes(bytes(data))
    opened = Opened(path)
    try:
        again = PrepackedBlocks(opened.source, opened.layout)
        assert again.built and again.folder != store.folder
        again.close()
    finally:
        opened.close()


# -- mixtures of experts ----------------------------------------------------------------------------------

def _entry_views(weights: dict, entry_bytes: int) -> bool:
    """Every tensor of a block's weights is a view of the mapped entry (its storage the whole file's mapping)."""
    return all(t.untyped_storage().nbytes() == entry_bytes for w in weights.values() for t in _tensors(w))


def test_a_mixture_of_experts_comes_from_the_entry(repack, gguf_root, cache, monkeypatch):
    """A MoE GGUF (DeepSeek-V3's tiny one: routed and shared experts, router, latent attention) prepacked like a
    dense one. Against today's path (LAYERSTREAM_PREPACK=off: repacked at load, streamed blocks per step): the same
    greedy tokens all resident, streamed whole from the page cache and read from disk each step. The second load
    maps the entry and repacks nothing (the C++ repack, the per-step repacker and the entry's build all raise);
    resident and page-cache blocks, routed experts included, are views of the mapping holding the load-time
    repack's bytes, each expert's tensors one contiguous range of the block."""
    path = tiny_moe_gguf(gguf_root)
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "off")
    llm = LLM(str(path), **SHORT)
    try:
        ref_tokens, budget = greedy_tokens(llm), llm.plan.budget_keeping(1)
        weights = llm.engine.model.weights
        ref_block = copy.deepcopy(weights.acquire(1))  # repacked at load (a copy: close() frees the load's)
        weights.release(1)
    finally:
        llm.close()
    assert any(k.startswith("experts.") for k in ref_block) and any(k.startswith("shared.") for k in ref_block)
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "auto")
    llm = LLM(str(path), **SHORT)  # builds the entry
    try:
        assert llm.telemetry().transport_name == "PrepackedTransport" and greedy_tokens(llm) == ref_tokens
    finally:
        llm.close()

    def no_repack(*args, **kwargs):
        raise AssertionError("repacked after the entry was built")

    import engine.weights.packed.prepacked as prepacked
    from engine.weights.packed.stream_repack import StreamRepacker

    for name in ("repack_int4", "repack_int8", "repack_kquant"):
        monkeypatch.setattr(repack_module.ggml_repack(), name, no_repack)
    monkeypatch.setattr(StreamRepacker, "fill", no_repack)
    monkeypatch.setattr(prepacked.PrepackedBlocks, "_build", no_repack)
    (entry,) = cache.glob(f"prepacked-v*/*/{DATA}")
    for transport, cap in (("auto", None), ("cpu", budget), ("disk", budget)):
        # blocks streamed whole (experts one by one: the next test); resident ones left views of the entry, to see
        # where they lie (copied by default: test_resident_blocks_and_head_are_copies_of_their_own_unless_mapped)
        llm = LLM(str(path), transport=transport, max_device_memory=cap, expert_streaming=False,
                  resident_weights="map", **SHORT)
        try:
            plan, telemetry = llm.plan, llm.telemetry()
            assert telemetry.transport_name == "PrepackedTransport", transport
            assert greedy_tokens(llm) == ref_tokens, transport
            weights = llm.engine.model.weights
            for b in range(plan.num_layers):  # in order, as the runner acquires them; each checked while held
                w = weights.acquire(b)
                if transport != "disk":  # (a disk tier reads resident blocks into buffers of their own)
                    assert _entry_views(w, entry.stat().st_size), (transport, b)
                if b == 1:
                    assert w.keys() == ref_block.keys()
                    assert all(same_weight(w[k], r) for k, r in ref_block.items() if k.startswith("experts."))
                    parts = sorted((t.data_ptr(), t.nbytes) for k, x in w.items() if k.startswith("experts.3.")
                                   for t in _tensors(x))
                    # one range: its parts back to back, each on a cache line (prepacked.ALIGN)
                    assert parts[-1][0] + parts[-1][1] - parts[0][0] < sum(n for _, n in parts) + len(parts) * 64
                weights.release(b)
            weights.reset()
            total = llm.telemetry().total
            assert llm.telemetry().blocks_converted == 0
            if cap is None:
                assert not plan.streamed_blocks
                continue
            assert plan.streamed_blocks and not plan.expert_streaming  # MoE blocks stream whole
            assert total.blocks_streamed > 0 and total.bytes_streamed == total.blocks_streamed * plan.stream_block_bytes
        finally:
            llm.close()


def test_a_mixture_streams_single_experts_from_the_entry(repack, gguf_root, cache, monkeypatch):
    """Under a budget that streams, a MoE GGUF's routed experts stream one by one as a safetensors mixture's do
    (docs/usage/moe.md): blocks without their experts, each chosen expert zero-copy views of the entry (page cache),
    planned and counted at its parts' bytes there. The same greedy tokens as all resident and as
    LAYERSTREAM_PREPACK=off (whole blocks repacked per step). The disk tier reads no single expert from the entry:
    there MoE blocks stream whole, and the plan says so."""
    path = tiny_moe_gguf(gguf_root)
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "off")
    llm = LLM(str(path), **SHORT)
    try:
        ref_tokens, budget = greedy_tokens(llm), llm.plan.budget_keeping(1)
        ref_block = copy.deepcopy(llm.engine.model.weights.acquire(1))  # repacked at load, experts included
        llm.engine.model.weights.release(1)
    finally:
        llm.close()
    llm = LLM(str(path), max_device_memory=budget, **SHORT)
    try:  # no entry: nothing prices a GGUF expert, so its blocks stream whole
        assert llm.plan.streamed_blocks and not llm.plan.expert_streaming
        assert greedy_tokens(llm) == ref_tokens
    finally:
        llm.close()
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "auto")
    llm = LLM(str(path), **SHORT)  # builds the entry
    try:
        assert not llm.plan.streamed_blocks and greedy_tokens(llm) == ref_tokens
    finally:
        llm.close()
    (entry,) = cache.glob(f"prepacked-v*/*/{DATA}")
    opened = Opened(path)
    try:  # one expert's parts in the entry, from its layout (every expert of this file is Q8_0: the same bytes)
        one = sum(p.nbytes for w in opened.layout.blocks[1].weights if w.name.startswith("experts.0.") for p in w.parts)
    finally:
        opened.close()
    assert one > 0
    for transport in ("cpu", "auto"):
        llm = LLM(str(path), transport=transport, max_device_memory=budget, **SHORT)
        try:
            plan = llm.plan
            assert plan.expert_streaming and plan.streamed_blocks and not plan.disk_blocks, transport
            assert plan.expert_bytes == one
            assert greedy_tokens(llm) == ref_tokens, transport
            total = llm.telemetry().total
            # every fill maps one expert's parts: the misses', and the guesses' for the next block (prefetch)
            assert total.expert_misses > 0 and total.expert_bytes % one == 0
            fills = total.expert_bytes // one
            assert total.expert_misses <= fills <= total.expert_misses + total.experts_guessed
            weights = llm.engine.model.weights
            for b in plan.streamed_blocks:
                w = weights.acquire(b)
                assert not any(k.startswith("experts.") for k in w) and _entry_views(w, entry.stat().st_size)
                weights.release(b)
            hidden = torch.zeros(1, llm.engine.model.cfg.hidden_size, dtype=torch.bfloat16)
            for group in weights.experts(1, [0, 3], hidden, lambda h, predictor: torch.zeros(1, 2, dtype=torch.long)):
                assert sorted(group) == [0, 3]
                for e, expert in group.items():
                    assert _entry_views(expert, entry.stat().st_size)
                    assert all(same_weight(w, ref_block[f"experts.{e}.{k}"]) for k, w in expert.items())
            weights.reset()
            # every expert of the last MoE block: no next block to guess for, so every fill is a miss, and more
            # experts than the cache has slots, so some are
            moe = llm.engine.model.cfg.moe
            assert plan.expert_slots < moe.num_experts
            before = weights.stream_stats
            seen = [e for group in weights.experts(moe.sparse_layers[-1], list(range(moe.num_experts)), hidden,
                                                   lambda h, predictor: None) for e in group]
            step = weights.stream_stats.since(before)
            assert sorted(seen) == list(range(moe.num_experts))
            assert step.expert_misses > 0 and step.expert_bytes == step.expert_misses * one
            weights.reset()
        finally:
            llm.close()
    llm = LLM(str(path), transport="disk", max_device_memory=budget, **SHORT)
    try:
        assert llm.plan.streamed_blocks and llm.plan.disk_blocks and not llm.plan.expert_streaming
        assert any("MoE blocks stream whole" in n for n in llm.plan.notes)
        assert greedy_tokens(llm) == ref_tokens
    finally:
        llm.close()
    # A cache that cannot take the entry: planning does not count on it, and MoE blocks stream whole from the file.
    import engine.weights.packed.prepacked as prepacked

    monkeypatch.setenv("LAYERSTREAM_CACHE", str(cache.parent / "full-cache"))
    monkeypatch.setattr(prepacked.shutil, "disk_usage", lambda _path: _Usage(free=0))
    llm = LLM(str(path), max_device_memory=budget, **SHORT)
    try:
        assert llm.plan.streamed_blocks and not llm.plan.expert_streaming
        assert llm.telemetry().transport_name == "PackedCpuTransport" and greedy_tokens(llm) == ref_tokens
    finally:
        llm.close()


# -- fallbacks and the command --------------------------------------------------------------------------

def test_fallbacks_keep_the_gguf_paths(gguf_root, cache, monkeypatch, caplog):
    """fp32 exact mode and LAYERSTREAM_PREPACK=off: no entry; a bad setting: a clear error; a cache
    without room: a warning, and the repack at load and per step (the same tokens)."""
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    opened = Opened(path) if repack_module.ggml_repack() is not None else None
    index = GGUFIndex(path)
    try:
        source = BlockSource(index, index.model_config())
        layout, why = prepack_layout(source, PackedFormat(torch.float32))
        assert layout is None and "exact" in why
        monkeypatch.setenv("LAYERSTREAM_PREPACK", "off")
        assert prepack_layout(source, BF16) == (None, "LAYERSTREAM_PREPACK=off")
        monkeypatch.setenv("LAYERSTREAM_PREPACK", "sometimes")
        with pytest.raises(ValueError, match="auto or off, got 'sometimes'"):
            prepack_mode()
    finally:
        index.close()
    monkeypatch.delenv("LAYERSTREAM_PREPACK")
    if opened is None:
        return
    opened.close()
    ref = LLM(str(path), **SHORT)
    tokens = greedy_tokens(ref)
    ref.close()
    import engine.weights.packed.prepacked as prepacked

    for entry in cache.glob("prepacked-v*/*"):  # the run above built it: gone, so this load has to build
        prepacked.shutil.rmtree(entry)
    monkeypatch.setattr(prepacked.shutil, "disk_usage", lambda _path: _Usage(free=0))
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        llm = LLM(str(path), max_device_memory=None, **SHORT)
    try:
        assert any("cannot build the prepacked cache entry" in r.message for r in caplog.records)
        assert llm.telemetry().transport_name == "PackedCpuTransport"
        assert greedy_tokens(llm) == tokens
    finally:
        llm.close()


class _Usage:
    def __init__(self, free):
        self.free = free


def test_damaged_entry_that_stays_damaged_is_an_error(repack, gguf_root, cache, monkeypatch):
    """A build whose result does not check (here: its digest forced wrong) fails loudly, naming the entry."""
    opened = Opened(tiny_gguf(gguf_root, "llama", Q.Q4_0))
    import engine.weights.packed.prepacked as prepacked

    monkeypatch.setattr(prepacked, "_sample_digest", lambda fd, s, e: os.urandom(8).hex())
    try:
        with pytest.raises(CheckpointError, match="just built is unusable"):
            PrepackedBlocks(opened.source, opened.layout)
    finally:
        opened.close()
