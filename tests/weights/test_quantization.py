"""quantization="int8" | "int4" at load for a safetensors checkpoint: close to bf16 of the same
weights, packed kernels in the blocks, and a plan that counts the quantized bytes."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, ops
from engine.weights.packed.weights import Int4Weight, Int8Weight
from engine.weights.packed.quantize import quantize_int4
from tests.support.models import build
from tests.support.reference import PROMPT, prompt_logits

# Max |log-prob difference| to the bf16 model over every prompt position, top-5 tokens of bf16
# (random tiny Llama, weights ~N(0, 0.02)). Measured ~0.01 (int8) and ~0.1 (int4); stated with margin.
TOL = {"int8": 0.05, "int4": 0.3}


def test_int4_round_trip_error_is_bounded():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q = quantize_int4(w, torch.float32)
    eye = torch.eye(256)
    back = ops.linear(eye, q).T  # (out, in): the dequantized weights
    lo = w.reshape(64, 8, 32).amin(-1)
    step = (w.reshape(64, 8, 32).amax(-1) - lo) / 15  # (out, groups)
    # Half a step of rounding, plus the rounding of scale and min to float16 in the VNNI kernel's
    # layout (the aten layout keeps them in the compute dtype, float32 here).
    slack = (15 * step + lo.abs()) * 2.0 ** -11 if q.layout == "vnni" else torch.full_like(step, 1e-5)
    err = (back - w).abs().reshape(64, 8, 32)
    assert (err <= (step / 2 + slack)[..., None]).all()


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("q") / "llama", "llama", dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_close_to_bf16(bf16_llama, mode):
    base = LLM(str(bf16_llama), max_model_len=64, max_num_seqs=1)
    try:
        ref = torch.log_softmax(prompt_logits(base, PROMPT), -1)
        base_block = base.plan.block_bytes
    finally:
        base.close()
    llm = LLM(str(bf16_llama), max_model_len=64, max_num_seqs=1, quantization=mode)
    try:
        got = torch.log_softmax(prompt_logits(llm, PROMPT), -1)
        w = llm.engine.model.weights.acquire(0)
        # Resident: gate and up stacked at load (engine/weights/packed/fuse.py), still packed.
        assert isinstance(w["w_gate_up"], Int4Weight if mode == "int4" else Int8Weight)
        assert isinstance(w["w_down"], Int4Weight if mode == "int4" else Int8Weight)
        assert isinstance(w["attn_norm"], torch.Tensor)
        assert isinstance(llm.engine.model.weights.globals.head, Int8Weight)
        # The plan holds the packed bytes: about 1/2 (int8) or 1/4 (int4) of bf16's.
        ratio = llm.plan.block_bytes / base_block
        assert (0.45 < ratio < 0.55) if mode == "int8" else (0.25 < ratio < 0.35)
    finally:
        llm.close()
    top = ref.topk(5, -1).indices
    diff = (ref.gather(-1, top) - got.gather(-1, top)).abs().max().item()
    assert 0 < diff < TOL[mode]


def test_quantized_streaming_counts_packed_bytes(bf16_llama):
    llm = LLM(str(bf16_llama), max_model_len=64, max_num_seqs=1, quantization="int4")
    budget = llm.plan.budget_keeping(1)
    resident = prompt_logits(llm, PROMPT)
    llm.close()
    llm = LLM(str(bf16_llama), max_model_len=64, max_num_seqs=1, quantization="int4", max_device_memory=budget)
    try:
        assert len(llm.plan.resident_blocks) == 1
        torch.testing.assert_close(prompt_logits(llm, PROMPT), resident, atol=0, rtol=0)
        stats = llm.engine.model.weights.stream_stats
        assert stats.bytes_streamed == stats.blocks_streamed * llm.plan.block_bytes
    finally:
        llm.close()


def test_bad_quantization_value():
    with pytest.raises(ValueError, match="quantization must be 'int8' or 'int4', got 'int3'"):
        LLM("unused", quantization="int3")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A layerstream cache of each test's own (the quantization cache lives there)."""
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _counting_quantizer(monkeypatch) -> list:
    import engine.weights.packed.quant_cache as qc

    calls, real = [], qc.quantize_weight
    monkeypatch.setattr(qc, "quantize_weight", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _load(model, mode="int4"):
    llm = LLM(str(model), max_model_len=64, max_num_seqs=1, quantization=mode)
    try:
        return prompt_logits(llm, PROMPT)
    finally:
        llm.close()


def test_quantization_cache_is_reused_and_never_beside_the_model(bf16_llama, cache, monkeypatch):
    """The first load quantizes every projection once into one entry under the layerstream cache; the
    second maps that entry and quantizes nothing, with identical logits; the model folder is untouched."""
    before = sorted((p.name, p.stat().st_mtime_ns) for p in bf16_llama.iterdir())
    calls = _counting_quantizer(monkeypatch)
    first = _load(bf16_llama)
    n_first = len(calls)
    entries = list(cache.glob("quantized-v*/*/model.safetensors"))
    assert len(entries) == 1
    calls.clear()
    second = _load(bf16_llama)
    assert calls == [], "the second load reuses the cache entry"
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in bf16_llama.iterdir()) == before
    assert n_first > 0 and n_first % 7 == 0  # each of the 7 projections of every block, once
    _load(bf16_llama, "int8")  # another mode is another entry
    assert len(list(cache.glob("quantized-v*/*/model.safetensors"))) == 2


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_damaged_cache_entry_is_rebuilt(bf16_llama, cache, monkeypatch, caplog, damage):
    """An entry whose file no longer matches its recorded sha256 (bytes flipped, or cut short) is
    removed and built again, with a warning; the logits are those of a clean load."""
    first = _load(bf16_llama)
    (entry,) = cache.glob("quantized-v*/*/model.safetensors")
    data = bytearray(entry.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    else:
        entry.write_bytes(bytes(data[: len(data) // 3]))
    calls = _counting_quantizer(monkeypatch)
    with caplog.at_level("WARNING", logger="layerstream"):
        again = _load(bf16_llama)
    assert calls, "the damaged entry was built again"
    assert "damaged" in caplog.text and "building it again" in caplog.text
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_a_changed_checkpoint_gets_a_new_cache_entry(bf16_llama, cache, tmp_path, monkeypatch):
    """The key follows the checkpoint's identity, not its folder: an exact copy elsewhere (same bytes,
    sizes and times) reuses the entry; a modified file gets an entry of its own."""
    import shutil

    _load(bf16_llama)
    copy = tmp_path / "copy"
    shutil.copytree(bf16_llama, copy)  # copy2: bytes and modification times kept
    calls = _counting_quantizer(monkeypatch)
    _load(copy)
    assert calls == [] and len(list(cache.glob("quantized-v*/*/model.safetensors"))) == 1
    f = copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-64:] = bytes(64)  # the last weights of the file change
    f.write_bytes(bytes(data))
    _load(copy)
    assert len(list(cache.glob("quantized-v*/*/model.safetensors"))) == 2
