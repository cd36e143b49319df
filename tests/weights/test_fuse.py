"""Stacked projections (engine/weights/packed/fuse.py): a fused weight computes exactly what its parts compute,
parts that cannot be stacked stay apart, and resident blocks are fused while streamed ones are not."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from engine import LLM, kernels
from engine import ops
from engine.weights.packed.fuse import fuse_projections, stack_rows
from engine.weights.packed.weights import GGUFWeight, Int4Weight, Int8Weight
from engine.weights.packed.quantize import quantize_int4
from tests.support.models import build
from tests.support.reference import stream_all_but_one_budget

SHAPES = [(128, 64), (64, 64), (64, 64)]  # q, k, v rows x hidden


def _dense(seed: int, shapes=SHAPES, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _gguf(w: torch.Tensor, qtype: Q) -> GGUFWeight:
    data = torch.from_numpy(quants.quantize(w.numpy(), qtype))  # (rows, bytes per row)
    return GGUFWeight(data, qtype, tuple(w.shape), torch.float32)


def _assert_stacks_exactly(parts, x):
    fused = stack_rows(parts)
    assert fused is not None and tuple(fused.shape) == (sum(p.shape[0] for p in parts), parts[0].shape[1])
    torch.testing.assert_close(ops.linear(x, fused), torch.cat([ops.linear(x, p) for p in parts], dim=-1),
                               atol=0, rtol=0)


@pytest.fixture(params=["vnni", "aten"])
def int4_layout(request, monkeypatch):
    """Each int4 layout in turn (engine.kernels picks one per process; LAYERSTREAM_INT4_KERNEL forces aten)."""
    kernels.int4_backend.cache_clear()
    monkeypatch.setenv("LAYERSTREAM_INT4_KERNEL", "auto" if request.param == "vnni" else "aten")
    if kernels.int4_backend() != request.param:
        kernels.int4_backend.cache_clear()
        pytest.skip("the int4 VNNI kernel is not available here")
    yield request.param
    monkeypatch.undo()
    kernels.int4_backend.cache_clear()
    kernels.int4_backend()


def test_int4_stacking_is_the_packing_of_the_stacked_codes(int4_layout):
    """Stacked packed bytes equal packing the stacked codes at once (the layout's row tiles line up)."""
    g = torch.Generator().manual_seed(0)
    # whole tiles (vnni 16 rows, aten 64), then a last part that is not (aten takes no part of < 16 rows at all)
    rows = (128, 64, 72 if int4_layout == "vnni" else 80)
    codes = [torch.randint(0, 16, (n, 64), generator=g) for n in rows]
    scales = [torch.rand(n, 2, generator=g) + 0.1 for n in rows]
    mins = [torch.randn(n, 2, generator=g) for n in rows]
    parts = [Int4Weight.from_codes(c, s, m, torch.bfloat16) for c, s, m in zip(codes, scales, mins)]
    whole = Int4Weight.from_codes(torch.cat(codes), torch.cat(scales), torch.cat(mins), torch.bfloat16)
    fused = Int4Weight.stack_rows(parts)
    assert fused.layout == whole.layout == int4_layout
    assert torch.equal(fused.codes, whole.codes) and torch.equal(fused.scales, whole.scales)
    _assert_stacks_exactly(parts, torch.randn(3, 64, generator=g).to(torch.bfloat16))


def test_int4_parts_off_the_layout_tiles_stay_apart(int4_layout):
    first = 8 if int4_layout == "vnni" else 16  # not whole tiles
    parts = [quantize_int4(w, torch.bfloat16) for w in _dense(1, [(first, 64), (64, 64)])]
    assert Int4Weight.stack_rows(parts) is None


def test_int8_stacking_is_the_quantization_of_the_stacked_rows(int4_layout):
    """Int8Weight shares the layout choice: per-row codes and scales, in the vnni layout in blocks of
    16 rows, so whole blocks then any last part stack into what quantizing the stacked rows gives."""
    dense = _dense(6, [(32, 64), (16, 64), (40, 64)])
    parts = [Int8Weight.quantize(w, torch.bfloat16) for w in dense]
    whole = Int8Weight.quantize(torch.cat(dense), torch.bfloat16)
    fused = Int8Weight.stack_rows(parts)
    assert fused.layout == whole.layout == int4_layout and fused.shape == (88, 64)
    assert torch.equal(fused.codes, whole.codes) and torch.equal(fused.scales, whole.scales)
    _assert_stacks_exactly(parts, torch.randn(3, 64).to(torch.bfloat16))
    off_blocks = [Int8Weight.quantize(w, torch.bfloat16) for w in _dense(7, [(8, 64), (16, 64)])]
    assert (Int8Weight.stack_rows(off_blocks) is None) == (int4_layout == "vnni")


@pytest.mark.parametrize("kind", ["dense", "int8", "q4_0", "q8_0"])
def test_stacked_weight_computes_what_its_parts_compute(kind):
    dense = _dense(2)
    parts = {"dense": dense, "int8": [Int8Weight.quantize(w, torch.float32) for w in dense],
             "q4_0": [_gguf(w, Q.Q4_0) for w in dense], "q8_0": [_gguf(w, Q.Q8_0) for w in dense]}[kind]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    if kind == "dense":  # the fp32 GEMM may block the reduction differently for a taller matrix
        torch.testing.assert_close(ops.linear(x, stack_rows(parts)), torch.cat([x @ p.T for p in parts], -1))
    else:
        _assert_stacks_exactly(parts, x)


def test_fuse_projections_keeps_what_cannot_be_stacked():
    q, k, v = _dense(4)
    gate, up = _dense(5, [(96, 64), (96, 64)])
    mixed = {"wq": q, "wk": k, "wv": Int8Weight.quantize(v, torch.float32), "w_gate": gate, "w_up": up,
             "attn_norm": torch.ones(64)}
    out = fuse_projections(mixed)
    assert {"wq", "wk", "wv", "w_gate_up", "attn_norm"} == set(out) and "w_gate" not in out
    # Some projections biased, others not: stacking the biases would misplace them.
    assert "wqkv" not in fuse_projections({"wq": q, "wk": k, "wv": v, "bq": torch.zeros(128)})
    both = fuse_projections({"wq": q, "wk": k, "wv": v, "bq": torch.zeros(128), "bk": torch.ones(64),
                             "bv": torch.full((64,), 2.0)})
    assert set(both) == {"wqkv", "bqkv"} and torch.equal(both["bqkv"][128:192], torch.ones(64))


def _mapped_from(path, t: torch.Tensor) -> bool:
    """Whether t's bytes lie in this process's mapping of the file at `path` (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
                if lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi:
                    return True
    return False


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_resident_blocks_are_fused_unless_views_and_streamed_blocks_are_not(tmp_path, arch):
    """A resident block converted to the compute dtype (a float32 checkpoint run in bf16) gets stacked q/k/v
    (with Qwen2's biases) and gate/up; one whose checkpoint holds the compute dtype stays the file's views,
    apart (stacking would copy it); a streamed block stays the file's views. The math on every form matches
    transformers (tests/engine/test_reference.py)."""
    folder = build(tmp_path / arch, arch)
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=1, dtype="bfloat16")
    try:
        w = llm.engine.model.weights.acquire(0)
        assert {"wqkv", "w_gate_up"} <= set(w) and not {"wq", "wk", "wv", "w_gate", "w_up"} & set(w)
        assert ("bqkv" in w) == (arch == "qwen2")
    finally:
        llm.close()
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=1, dtype="float32")
    try:
        w = llm.engine.model.weights.acquire(0)
        assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(w) and not {"wqkv", "w_gate_up"} & set(w)
        files = list(folder.glob("*.safetensors"))
        assert all(any(_mapped_from(f, w[n]) for f in files) for n in ("wq", "w_up", "w_down"))
        budget = stream_all_but_one_budget(llm)
    finally:
        llm.close()
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=1, dtype="float32", max_device_memory=budget)
    try:
        weights = llm.engine.model.weights
        streamed = llm.plan.streamed_blocks[0]
        for b in range(streamed + 1):
            w = weights.acquire(b)
            weights.release(b)
        assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(w)
    finally:
        llm.close()
