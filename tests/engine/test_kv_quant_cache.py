"""The quantized KV cache through the real engine (tiny fp32 Llama): its bookkeeping is exact (a prefix found
in the cache, or swapped to the host tier and back, gives what recomputing it with quantized blocks gives),
the C++ decode path and the torch path agree, and the pool holds the tokens the plan promises."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_attention import kv_attention
from engine.kv_quant import QuantizedKV
from engine.llm import LLM
from tests.support.batching import MAX_LEN, assert_same, drive, greedy, one_at_a_time

PREFIX = [(i * 17 + 5) % 500 + 6 for i in range(40)]  # 2.5 blocks of 16


def checked(engine):
    def on_step(_step, e):
        e.scheduler.blocks.check()
    return on_step


@pytest.fixture(scope="module", params=["int8", "int4"])
def kv(request):
    return request.param


@pytest.fixture(scope="module")
def reference(llama_dir, kv):
    """Each request alone, prefix caching off, the whole prompt in one chunk: every block recomputed."""
    llm = LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=1,
              max_num_batched_tokens=MAX_LEN, enable_prefix_caching=False)
    yield one_at_a_time(llm)
    llm.close()


def test_the_cache_holds_codes_and_scales(llama_dir, kv):
    llm = LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=2)
    try:
        k, v = llm.engine.model.kv_cache.layer(0)
        assert isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV)
        assert k.codes.dtype == (torch.int8 if kv == "int8" else torch.uint8) and k.scales.dtype == torch.float16
        assert llm.plan.kv_cache_bytes == llm.plan.num_kv_blocks * llm.engine.model.kv_cache.bytes_per_block
    finally:
        llm.close()


def test_prefix_cache_with_quantized_blocks_equals_recomputing_them(llama_dir, reference, kv):
    x = PREFIX + [1, 2, 3]
    arrivals = {0: [("x", x, greedy(10))],
                3: [("y", PREFIX + [4, 5], greedy(8))],
                6: [("z", x + [7] * 20, greedy(12))]}
    llm = LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        got = drive(llm.engine, arrivals, on_step=checked(llm.engine))
        for reqs in arrivals.values():
            for rid, prompt, params in reqs:
                assert_same(got[rid], reference(prompt, params))
        assert llm.engine.scheduler.blocks.stats.hit_tokens >= 32 * 2
    finally:
        llm.close()


def test_host_tier_swaps_quantized_blocks_without_changing_outputs(llama_dir, reference, kv):
    probe = LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=4)
    block = probe.plan.kv_cache_bytes // probe.plan.num_kv_blocks
    probe.close()
    llm = LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory=8 * block, kv_host_memory=24 * block)
    try:
        assert llm.plan.num_kv_blocks == 8 and llm.plan.num_host_kv_blocks == 24
        arrivals = {0: [(f"s{i}", PREFIX[: 20 + 6 * i] + [i + 1] * 5, greedy(24 - 3 * i)) for i in range(3)]
                    + [("t", PREFIX + [8], greedy(20))],
                    30: [("late", PREFIX[:33] + [2], greedy(10))]}
        got = drive(llm.engine, arrivals, on_step=checked(llm.engine))
        for reqs in arrivals.values():
            for rid, prompt, params in reqs:
                assert_same(got[rid], reference(prompt, params))
        stats = llm.engine.scheduler.blocks.stats
        assert stats.blocks_swapped_out > 0 and stats.blocks_swapped_in > 0
        t = llm.engine.telemetry().kv
        assert t.bytes_swapped_in == stats.blocks_swapped_in * block  # the quantized block's bytes, no more
    finally:
        llm.close()


@pytest.mark.skipif(kv_attention() is None, reason="the kv_attention kernel could not be built here")
def test_the_decode_kernel_and_the_torch_path_agree(llama_dir, kv, monkeypatch):
    prompts = [PREFIX + [3], PREFIX[:17]]

    def run():
        llm = LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=2)
        try:
            return [drive(llm.engine, {0: [("r", p, greedy(8))]})["r"] for p in prompts]
        finally:
            llm.close()

    with_kernel = run()
    monkeypatch.setenv("LAYERSTREAM_KV_ATTENTION", "torch")
    kv_attention.cache_clear()
    try:
        without = run()
    finally:
        monkeypatch.delenv("LAYERSTREAM_KV_ATTENTION")
        kv_attention.cache_clear()
    for a, b in zip(with_kernel, without):
        assert_same(a, b)


@pytest.fixture(scope="module")
def hd64_dir(tmp_path_factory):
    """A tiny bf16 Llama with real heads' width (head_dim 64), as the capacity figures assume."""
    from transformers import LlamaConfig

    from engine.demo import build_random_model

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"])
    return build_random_model(tmp_path_factory.mktemp("hd64"), cfg, dtype=torch.bfloat16)


def test_capacity_at_a_fixed_pool_is_checked_by_running(hd64_dir):
    """At one --kv-cache-memory the plan's pool holds >= 1.9x (int8) and >= 3.5x (int4) bf16's tokens, and
    that many tokens of concurrent sequences really run together, without a preemption."""
    pools = {}
    for kv in ("auto", "int8", "int4"):
        llm = LLM(str(hd64_dir), kv_cache_dtype=kv, kv_cache_memory="256KiB", max_model_len=64,
                  max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
        try:
            fits = {f.dtype: f.pool_tokens for f in llm.plan.kv_fits}
            pools[kv] = llm.plan.num_kv_blocks * llm.plan.kv_block_size
            assert fits["int8" if kv == "int8" else "int4" if kv == "int4" else "bfloat16"] == pools[kv]
            n = min(64, pools[kv] // 48)  # sequences of 32 prompt + 16 generated tokens
            prompts = [[(i * 7 + j) % 500 + 6 for j in range(32)] for i in range(n)]
            peak = 0

            def on_step(_step, e):
                nonlocal peak
                peak = max(peak, len(e.scheduler.running))

            drive(llm.engine, {0: [(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)]}, on_step=on_step)
            assert peak == n and llm.engine.scheduler.num_preemptions == 0
        finally:
            llm.close()
    assert pools["int8"] >= 1.9 * pools["auto"]
    assert pools["int4"] >= 3.5 * pools["auto"]


def test_the_plan_prints_each_kv_dtypes_fit(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_num_seqs=2, max_device_memory="64MiB")
    try:
        fits = {f.dtype: f for f in llm.plan.kv_fits}
        assert set(fits) == {"float32", "int8", "int4"}
        assert fits["int4"].max_context > fits["int8"].max_context > fits["float32"].max_context > 0
        assert "KV fits by --kv-cache-dtype" in llm.plan.describe()
    finally:
        llm.close()


def test_a_head_dim_int4_cannot_split_is_refused_at_load(tmp_path):
    from transformers import LlamaConfig

    from engine.demo import build_random_model
    from engine.errors import UnsupportedModelError

    cfg = LlamaConfig(vocab_size=512, hidden_size=80, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, architectures=["LlamaForCausalLM"])
    folder = build_random_model(tmp_path / "hd40", cfg)  # head_dim 40: no int4 groups of 16 or 32
    with pytest.raises(UnsupportedModelError, match="--kv-cache-dtype int4: .*multiple of 16, got 40"):
        LLM(str(folder), kv_cache_dtype="int4", max_model_len=64)
